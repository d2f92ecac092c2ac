"""`hcfjax serve` as a process on the CPU: ready only once listening, a graceful stop on SIGTERM, a port in use, Ctrl-C
during the warm-up, a signal while shapes still compile in the background, a burst of signals, and the limits its
help states."""

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from hcfjax.serving import client
from hcfjax.serving import hcfjax_pb2 as pb

LONG = dict(max_new_tokens=240, ignore_eos=True)  # ~3 s of decoding on CPU: still running when we act on it
CLI = [sys.executable, "-m", "hcfjax.cli"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


@contextlib.contextmanager
def serve_process(*args):
    """`hcfjax serve ARGS` on the CPU, in a process group of its own as a terminal's job is (its servers' process
    with it): (the process, a queue of its output lines); the group is killed on leaving if still up."""
    proc = subprocess.Popen(
        [*CLI, "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def servers_process(pid: int, timeout: float = 30.0) -> int:
    """The pid of `hcfjax serve`'s servers' process, once it has been spawned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children(pid):
            if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text():
                return child
        time.sleep(0.02)
    raise AssertionError("no servers' process was spawned")


def lines_until(lines: queue.Queue, text: str) -> list[str]:
    """The output lines up to the first that holds `text`."""
    log = [lines.get(timeout=60)]
    while text not in log[-1]:
        log.append(lines.get(timeout=60))
    return log


def test_serve_shuts_down_gracefully_on_sigterm():
    small = ["--max-slots", "2", "--max-model-len", "256", "--token-budget", "16", "--max-prefill-rows", "1"]
    flags = ["--port", "0", *small, "--grace", "2", "--no-warmup", "--compile-cache", "off"]
    with serve_process(*flags) as (proc, lines):
        log = lines_until(lines, "ready in")
        port = int(next(line for line in log if "listening on" in line).rsplit(":", 1)[1])
        assert f"gRPC 127.0.0.1:{port}" in log[-1]
        channel, stub = client.connect("127.0.0.1", port, ready_timeout=10)
        call = client.generate_stream(stub, "def f(x):", **LONG)
        chunks = [next(call), next(call)]  # decoding
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        chunks += list(call)  # the stream ends with a terminal response, not an error
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
        assert chunks[-1].finish_reason == pb.FINISH_REASON_ABORT
        assert 2 <= chunks[-1].usage.output_tokens < LONG["max_new_tokens"]
        with pytest.raises(grpc.RpcError) as err:
            client.generate(stub, "x", max_new_tokens=2, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()


def test_a_port_in_use_fails_the_start(tmp_path):
    """The servers' process binds its ports while the steps compile: one in use ends the command with exit status 1
    and the address, never a ready line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with serve_process("--http-port", str(port), "--max-slots", "2", "--compile-cache", "off") as (proc, lines):
            assert proc.wait(timeout=60) == 1
            time.sleep(0.2)  # the reader thread takes the last lines
            log = [lines.get() for _ in range(lines.qsize())]
    assert any(f"error: cannot listen on 127.0.0.1:{port}" in line for line in log), log
    assert not any("hcfjax serve: ready" in line or "Traceback" in line for line in log), log


def test_ctrl_c_during_warmup_exits_quietly(tmp_path):
    """Ctrl-C (SIGINT to the process group, the servers' process too, as it imports) as the warm-up starts: one
    line, exit status 130, no traceback, nothing left listening."""
    with serve_process("--port", "0", "--max-slots", "2", "--compile-cache", str(tmp_path / "xla")) as (proc, lines):
        front = servers_process(proc.pid)  # spawned as the warm-up starts
        time.sleep(0.3)  # into its imports, past the interpreter's own start
        assert front in children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        log = []
        assert proc.wait(timeout=30) == 130
        time.sleep(0.2)  # the reader thread takes the last lines
        while not lines.empty():
            log.append(lines.get())
        text = "".join(log)
        assert "interrupted before it was ready" in text and "Traceback" not in text, text
        assert not any("listening on" in line for line in log)
        assert (tmp_path / "xla").is_dir()  # the cache directory is made before the first compile


def test_signal_after_ready_does_not_wait_for_background_compiles():
    """Ready with the smaller prefill shapes still compiling in the background (13 shapes, 4 before ready): a SIGINT
    then shuts the server down at once, exit status 0, without waiting for those compiles (the interpreter's exit
    would join their threads, about 15 s here, and then abort)."""
    flags = ["--port", "0", "--max-slots", "2", "--min-prefill-bucket", "16", "--grace", "1", "--compile-cache", "off"]
    with serve_process(*flags) as (proc, lines):
        log = lines_until(lines, "ready in")
        assert any("compiling in the background" in line for line in log), log
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=8) == 0


def test_until_signal_takes_a_burst_of_signals():
    """A burst of SIGTERMs ends the wait once, and the previous handler comes back. (The deadlock the handler's design
    avoids, a handler setting a threading.Event while it interrupts Event.wait in the same thread, is a race this
    test does not reliably hit.) The test's own handler stands in for the default one, which would kill the worker."""
    from hcfjax.serving.server import until_signal

    after = []
    outer = signal.signal(signal.SIGTERM, lambda *_: after.append(1))
    try:
        mine = signal.getsignal(signal.SIGTERM)

        def burst():
            time.sleep(0.3)
            for _ in range(200):
                os.kill(os.getpid(), signal.SIGTERM)

        sender = threading.Thread(target=burst, daemon=True)
        said = []
        t0 = time.monotonic()
        with until_signal(said.append):
            sender.start()
        sender.join(10)
        assert said == ["hcfjax serve: shutting down"] and time.monotonic() - t0 < 5
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, outer)


def test_serve_help_states_the_limits_it_enforces(capsys):
    """`hcfjax serve --help` states every request limit with the value the front door enforces."""
    from hcfjax import frontdoor
    from hcfjax.cli import main
    from hcfjax.serving.guards import DEFAULT_MAX_BODY_BYTES

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for limit in (frontdoor.MAX_STOP_STRINGS, frontdoor.MAX_STOP_CHARS, frontdoor.MAX_STOP_TOKEN_IDS):
        assert f"{limit} stop" in text or f"{limit} characters" in text, limit
    assert f"request id over {frontdoor.MAX_REQUEST_ID_CHARS} characters" in text
    assert "before tokenizing" in text and "[0, 2^32)" in text and "top_k beyond the vocabulary" in text
    assert "--max-body-bytes" in text and str(DEFAULT_MAX_BODY_BYTES) in text
    assert "HCFJAX_API_KEY" in text and "PD worker" in text
