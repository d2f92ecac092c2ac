"""The two deployments test_http runs the OpenAI HTTP API against, and its raw HTTP helpers.

Colocated: HTTPServer over an Engine in this process. PD: a prefill worker, a decode worker and the router with
--http-port as `hcfjax serve` processes on loopback, the decode worker sized as the colocated engine. Both answer
the same questions from outside: the HTTP port, a metrics counter, whether KV pages are in use, and an idle check
(no request held, every page free: the engine's snapshot, or each worker's Worker.Info)."""

import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
from prometheus_client.parser import text_string_to_metric_families

from hcfjax.engine import Engine, EngineConfig
from hcfjax.serving.http import HTTPServer
from hcfjax.serving.metrics import Metrics
from tests import engine_helpers, pd_procs

MAX_LEN = 256
# one prefill row and one chunk bucket: three step shapes to compile (prefill, prefill + decode, decode)
CONFIG = EngineConfig(
    max_slots=4, max_queue=8, max_model_len=MAX_LEN, token_budget=64, max_prefill_rows=1, min_prefill_bucket=64
)
# the decode worker's engine as CONFIG; the prefill worker takes one prompt at a time, as CONFIG's prefill does
COMMON = ["--dtype", "float32", "--no-warmup", "--max-model-len", str(MAX_LEN), "--max-prefill-rows", "1"]
PREFILL = ["--role", "prefill", *COMMON]
DECODE = ["--role", "decode", *COMMON, "--max-slots", "4", "--max-queue", "8", "--token-budget", "64"]
WAIT_S = 60.0  # pages to come back, workers to answer: far above what they take; only a fault reaches it


def client_for(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


class Colocated:
    """HTTPServer over an Engine (CONFIG) in this process, with its metrics."""

    kind = "colocated"

    def __init__(self, model):
        self.engine = Engine(model, CONFIG)
        self.metrics = Metrics(self.engine)
        self.server = HTTPServer(self.engine, metrics=self.metrics).start()
        self.port = self.server.port
        self.client = client_for(self.port)

    def counter(self, name: str, labels: dict) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0

    def pages_in_use(self) -> bool:
        s = self.engine.snapshot()
        return s["free_pages"] < s["total_pages"]

    def assert_idle(self, timeout: float = 10.0) -> None:
        engine_helpers.assert_idle(self.engine, timeout)

    def shut_down(self) -> None:
        self.server.shutdown()

    def close(self) -> None:
        self.client.close()
        self.server.shutdown()
        self.assert_idle(timeout=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class PDDeployment:
    """The router (--http-port, --metrics-port) started first, on the ports its workers will take: its /health
    answer before they are up is kept in `health_before_workers`; then the two workers, side by side."""

    kind = "pd"

    def __init__(self):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        self.procs = []
        pre_port, dec_port, metrics_port = free_port(), free_port(), free_port()
        self.pre_addr, self.dec_addr = f"127.0.0.1:{pre_port}", f"127.0.0.1:{dec_port}"
        try:
            router_args = ["--role", "router", "--prefill", self.pre_addr, "--decode", self.dec_addr, "--max-model-len",
                    str(MAX_LEN), "--http-port", "0", "--metrics-port", str(metrics_port)]  # fmt: skip
            self.router, _, said = pd_procs.start(router_args, "router", env, until="metrics on")
            self.procs.append(self.router)
            self.port = int(re.search(r"HTTP on http://\S+:(\d+)/v1", said).group(1))
            self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            self.health_before_workers = health(self.port)
            with ThreadPoolExecutor(2) as pool:
                starting = [pool.submit(pd_procs.start, [*args, "--port", str(port)], args[1], env)
                            for args, port in [(PREFILL, pre_port), (DECODE, dec_port)]]  # fmt: skip
            self.procs += [f.result()[0] for f in starting if f.exception() is None]
            for f in starting:
                f.result()  # a worker that did not start: its error
            wait_for("the router ready", lambda: health(self.port)[0] == 200)
        except BaseException:
            pd_procs.stop(self.procs)
            raise
        self.client = client_for(self.port)

    def counter(self, name: str, labels: dict) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return 0

    def pages_in_use(self) -> bool:
        decode = pd_procs.info(self.dec_addr)
        return decode.free_pages < decode.total_pages

    def assert_idle(self, timeout: float = 10.0) -> None:
        workers = lambda: [pd_procs.info(a) for a in (self.pre_addr, self.dec_addr)]
        wait_for(f"workers idle: {workers()}", lambda: all(map(pd_procs.idle, workers())), timeout)

    def shut_down(self) -> None:
        self.router.terminate()

    def close(self) -> None:
        self.client.close()
        try:
            self.assert_idle(timeout=0)
        finally:
            pd_procs.stop(self.procs)


def wait_for(what: str, check, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def post(port: int, path: str, body: dict | str) -> tuple[int, dict]:
    """POSTs a body (a dict as JSON, a str as it is); -> (status, the answer's JSON)."""
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def raw_post(port: int, head: str, body_parts: list[bytes]) -> tuple[int, dict]:
    """Sends a request's head and the given body bytes, never the rest of the body, then reads the answer: one that
    comes proves the server answered without reading the body whole (the socket's timeout fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        for part in body_parts:
            sock.sendall(part)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < content_length(answer):
            data = sock.recv(65536)
            assert data, answer
            answer += data
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.partition(b"\r\n\r\n")[2])


def content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0
