"""`hcfjax serve`'s front ends (gRPC, the OpenAI-compatible HTTP API, the metrics scrape) in a process of their own,
over the engine in this one.

    front = FrontProcess(engine, Listen(grpc_port=0, http_port=8000))
    front.spawn()               # the child imports and binds its ports while the engine compiles
    engine.warmup(); engine.start()
    up = front.start()          # the child listens: up.lines to print, up.where, up.ports
    ...
    front.shutdown(grace=3.0)   # the servers shut down (the engine aborts what is in flight), the child exits
    engine.shutdown()

The child (spawned: no inherited jax or CUDA state; it keeps jax on the CPU and never computes) serves
hcfjax.serving.server.Server / hcfjax.serving.http.HTTPServer (a PD decode worker: its gRPC server,
hcfjax.pd.service.DecodeListen) over a LinkedEngine (hcfjax.serving.engine_link), so a stream's thread, the HTTP
event loop, tokenizing and building responses never take the GIL from the engine's loop. It ignores SIGINT and
SIGTERM (a terminal's Ctrl-C, or a service manager's stop, reaches the whole process group: the parent decides) and
stops when told or when the parent's end of the pipe closes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import signal
from multiprocessing import resource_tracker

from hcfjax.serving.engine_link import EngineHost, LinkedEngine
from hcfjax.serving.guards import DEFAULT_MAX_BODY_BYTES
from hcfjax.serving.remote import ModelFront, RemoteLimits

STOPS = {signal.SIGINT, signal.SIGTERM}  # the child leaves them to this process


@dataclasses.dataclass(frozen=True)
class Listen:
    """Which servers to run and how: grpc_port / http_port None: that server is off (0: a free port); metrics_port
    0 or None: no scrape; chat_template: (source, bos, eos) of a ChatTemplate (None: the checkpoint's)."""

    host: str = "127.0.0.1"
    grpc_port: int | None = 0
    http_port: int | None = None
    metrics_port: int | None = None
    model_name: str | None = None
    chat_template: tuple[str, str, str] | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def servers(self, engine) -> Servers:
        return Servers(engine, self)


@dataclasses.dataclass(frozen=True)
class Up:
    """What the front ends said once listening: lines to announce, where they listen (for the ready line), ports."""

    lines: list[str]
    where: list[str]
    ports: dict[str, int]


@dataclasses.dataclass(frozen=True)
class _Front:
    """What the child needs of the engine to check and stream requests: no weights, no device."""

    model: ModelFront
    max_model_len: int
    limits: RemoteLimits
    listen: Listen  # (or hcfjax.pd.service.DecodeListen: anything whose servers(engine) gives start and shutdown)


class Servers:
    """The servers `listen` asks for over one engine (an Engine, or a LinkedEngine in the front-end process)."""

    def __init__(self, engine, listen: Listen):
        from hcfjax.serving.chat_template import ChatTemplate
        from hcfjax.serving.http import HTTPServer
        from hcfjax.serving.metrics import Metrics
        from hcfjax.serving.server import Server

        self.listen = s = listen
        self.metrics = Metrics(engine)
        limits = dict(metrics=self.metrics, api_key=s.api_key, max_body_bytes=s.max_body_bytes)
        self.grpc = self.http = None
        # the scrape's port is bound here with the others, and serves from here on (what it reports is no health)
        self.metrics_port = None
        if s.metrics_port:
            try:
                self.metrics_port = self.metrics.serve(s.metrics_port, s.host, api_key=s.api_key)
            except OSError as e:
                raise OSError(f"cannot listen on {s.host}:{s.metrics_port} (metrics): {e}") from None
        if s.grpc_port is not None:
            self.grpc = Server(engine, s.host, s.grpc_port, **limits)
        if s.http_port is not None:
            template = ChatTemplate(*s.chat_template) if s.chat_template else None
            self.http = HTTPServer(
                engine, s.host, s.http_port, model_name=s.model_name, chat_template=template, **limits
            )

    def start(self) -> Up:
        host, lines, where, ports = self.listen.host, [], [], {}
        if self.grpc is not None:
            self.grpc.start()
            ports["grpc"] = self.grpc.port
            lines.append(f"hcfjax serve: listening on {host}:{self.grpc.port}")
            where.append(f"gRPC {host}:{self.grpc.port}")
        if self.http is not None:
            self.http.start()
            ports["http"] = self.http.port
            name = self.http.service.model_name
            lines.append(f"hcfjax serve: OpenAI-compatible HTTP on http://{host}:{self.http.port}/v1 (model {name!r})")
            where.append(f"HTTP http://{host}:{self.http.port}/v1")
        if self.metrics_port:
            ports["metrics"] = self.metrics_port
            lines.append(f"hcfjax serve: metrics on http://{host}:{self.metrics_port}/metrics")
        return Up(lines, where, ports)

    def shutdown(self, grace: float = 3.0) -> None:
        """New requests refused; the engine aborts what is in flight, so every open stream, gRPC or HTTP, gets its
        end; what is still open after `grace` seconds is closed."""
        if self.http is not None:
            self.http.service.stopping = True  # refuse new HTTP requests while gRPC drains
        if self.grpc is not None:
            self.grpc.shutdown(grace)
        if self.http is not None:
            self.http.shutdown(grace)
        self.metrics.close()


class FrontProcess:
    """The servers of `listen` in a child process over `engine`. spawn() starts the child, which imports what it
    needs and binds its ports while this process compiles; start() (once the engine runs) has it listen."""

    def __init__(self, engine, listen: Listen):
        context = multiprocessing.get_context("spawn")
        self._control, control = context.Pipe()
        link, child_link = context.Pipe()
        self.host = EngineHost(engine, link)
        front = _Front(*self.host.front(), listen)
        self.process = context.Process(
            target=_front_main, args=(control, child_link, front), name="hcfjax-front", daemon=True
        )
        self._child_ends = (control, child_link)
        self._bound = self._stopped = False

    def spawn(self) -> None:
        if self.process.pid is None:
            self.host.start()
            # the child starts with these blocked (a mask survives fork and exec) until it ignores them: a Ctrl-C
            # while it imports would otherwise end it with a traceback; here they wait, and arrive once unblocked.
            # (multiprocessing's resource tracker, started by a process's first start(), unblocks them in this
            # thread as it starts: it runs first.)
            resource_tracker.ensure_running()
            held = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
            try:
                self.process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
            for end in self._child_ends:  # the child's copies: its exit then closes the pipes
                end.close()

    def check(self, timeout: float = 0.0) -> bool:
        """Whether the child has bound its ports (waiting up to `timeout` seconds); OSError if it could not (a port
        in use, say), or if it ended."""
        if not self._bound and self._control.poll(timeout):
            self._bound = self._expect("bound") is None
        return self._bound

    def start(self, timeout: float = 120.0) -> Up:
        """Has the child listen (spawning it first if need be); returns once it does. OSError if it cannot."""
        self.spawn()
        if not self.check(timeout):
            self.shutdown(0)
            raise OSError(f"the front-end process did not bind its ports within {timeout:g} s")
        self._control.send(("start",))
        if not self._control.poll(timeout):
            self.shutdown(0)
            raise OSError(f"the front-end process did not start its servers within {timeout:g} s")
        return self._expect("up")

    def _expect(self, kind: str):
        try:
            got, value = self._control.recv()
        except (EOFError, OSError):
            self.process.join(5)
            got, value = "error", f"the front-end process ended (exit status {self.process.exitcode})"
        if got != kind:
            self.shutdown(0)
            raise OSError(value)
        return value

    def alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self, grace: float = 3.0) -> None:
        """Shuts the servers down (each open stream gets its end) and waits for the child to exit."""
        if self._stopped:
            return
        self._stopped = True
        if self.process.is_alive():
            try:
                self._control.send(("stop", grace))
            except OSError:
                pass
            self.process.join(2 * grace + 10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        if self.process.pid is not None:
            self.host.join(5)  # it sees the child's end close and aborts what the child left
        self._control.close()
        self.host.conn.close()


def _front_main(control, link, front: _Front) -> None:
    for sig in STOPS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    import jax

    jax.config.update("jax_platforms", "cpu")  # (nothing here computes; a GPU backend would take device memory)
    try:
        engine = LinkedEngine(link, front.model, front.max_model_len, front.limits)
        servers = front.listen.servers(engine)
    except Exception as e:  # noqa: BLE001 - the parent reports it and exits
        _tell(control, "error", _said(e))
        return
    order = _tell(control, "bound", None) and _heard(control)
    grace = 0.0
    if order and order[0] == "start":
        try:
            up = servers.start()
        except Exception as e:  # noqa: BLE001 - as above
            _tell(control, "error", _said(e))
        else:
            order = _tell(control, "up", up) and _heard(control)
            grace = order[1] if order else 0.0  # ("stop", grace), or the parent is gone
    servers.shutdown(grace)


def _said(e: Exception) -> str:
    return str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"


def _tell(control, kind: str, value) -> bool:
    """Sends the parent a message; False if it is gone."""
    try:
        control.send((kind, value))
        return True
    except OSError:
        return False


def _heard(control) -> tuple | None:
    """The parent's next order; None if it is gone."""
    try:
        return control.recv()
    except (EOFError, OSError):
        return None


def serve(
    engine,
    listen: Listen,
    *,
    grace: float = 3.0,
    warmup: bool = True,
    started: float | None = None,
    announce=lambda line: print(line, flush=True),
) -> None:
    """Runs `listen`'s servers (a Listen's, or a PD decode worker's: hcfjax.pd.service.DecodeListen) in a front-end
    process over `engine` until SIGINT or SIGTERM (call from the main thread), then shuts both down gracefully.
    OSError if the servers cannot listen or their process dies.

    warmup: compile the engine step shapes that hold all the others before listening, so no request waits for a
    compile (the smaller shapes compile in the background; hcfjax.serving.startup.warm_up).
    announce(line) is told the bound addresses once the servers listen (tests start them on port 0 and read them),
    then that the server is ready (with the seconds since `started`, a time.monotonic() of the command's start)."""
    from hcfjax.serving.server import until_signal
    from hcfjax.serving.startup import ready_line, warm_up

    front = FrontProcess(engine, listen)
    try:
        front.spawn()  # its imports and ports while the steps compile
        if warmup:
            warm_up(engine, announce, check=front.check)
        engine.start()
        up = front.start()  # (a Ctrl-C until here ends the command as not yet ready)
        with until_signal(announce, alive=front.alive):
            for line in up.lines:
                announce(line)
            announce(ready_line(started, up.where))
        if not front.alive():
            raise OSError(f"the front-end process ended (exit status {front.process.exitcode})")
    finally:
        front.shutdown(grace)
        engine.shutdown(timeout=grace)
