"""The PD router on its own, with no model behind it: its checks before placing a request, its readiness (a
worker of each role must answer), and its API key and call limit."""

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from hcfjax.serving import pd_pb2 as pdpb
from hcfjax.serving import pd_pb2_grpc as pd_grpc


def test_router_refuses_what_needs_no_model_before_placing():
    """The router's own checks (request id, stop strings) answer INVALID_ARGUMENT before it looks for a worker:
    here none is up, which a good request gets told."""
    from hcfjax.pd.router import Router
    from hcfjax.serving import client

    class Aborted(Exception):
        pass

    class Context:
        def abort(self, code, details):
            raise Aborted(code, details)

        def time_remaining(self):
            return None

    router = Router(["127.0.0.1:1"], ["127.0.0.1:2"])
    try:
        for params, words in [(dict(request_id="r" * 257), "request_id"), (dict(stop=["s"] * 17), "stop strings")]:
            with pytest.raises(Aborted) as e:
                next(router.Generate(client.make_request("x", **params), Context()))
            assert e.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.args[1]
        with pytest.raises(Aborted) as e:
            next(router.Generate(client.make_request("x", request_id="req-15", stop=["\n"]), Context()))
        assert e.value.args == (grpc.StatusCode.UNAVAILABLE, "no decode worker is up")
    finally:
        router.stop()


def test_router_is_not_ready_until_a_worker_of_each_role_answers():
    """The router's health says NOT_SERVING, and its start-up line waits, until a prefill and a decode worker both
    answer their health checks (stand-in workers: a worker server with Worker.Info, no model, behind the
    deployment's API key, which the router sends); a client's `wait_serving` waits for both."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hcfjax.pd.router import Router, RouterServer
    from hcfjax.pd.service import WorkerServer
    from hcfjax.serving import client

    class Info(pd_grpc.WorkerServicer):
        def Info(self, request, context):
            return pdpb.WorkerInfo(dp=1, max_slots=1)

    def worker():
        server = WorkerServer(lambda s: pd_grpc.add_WorkerServicer_to_server(Info(), s), api_key="sesame")
        return server, server.address

    def router_health(address):
        with grpc.insecure_channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status

    def wait_serving(address, timeout):  # as a client (bench.serve --pd) waits before its first request
        with grpc.insecure_channel(address) as ch:
            client.wait_serving(ch, timeout)

    (pre, pre_addr), (dec, dec_addr) = worker(), worker()
    pre.start()  # the decode worker is not up yet
    heard = []
    router = Router([pre_addr], [dec_addr], health_interval_s=3600, health_timeout_s=10.0, api_key="sesame")
    server = RouterServer(router, on_ready=lambda ready, address: heard.append((ready, address))).start()
    try:
        assert router_health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert heard == [(False, server.address)]
        with pytest.raises(TimeoutError, match="SERVING"):
            wait_serving(server.address, 0.3)
        dec.start()
        router.check_all()
        assert router_health(server.address) == health_pb2.HealthCheckResponse.SERVING
        wait_serving(server.address, 10.0)
        assert heard[-1] == (True, server.address)
        pre.stop(0)
        for _ in range(router.down_after):
            router.check_all()
        assert router_health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert heard[-1] == (False, server.address)
    finally:
        server.stop(0)
        pre.stop(0)
        dec.stop(0)


def test_router_api_key_and_call_limit():
    """The router takes --api-key as a colocated server does: without it UNAUTHENTICATED, with it the call reaches
    the router (here UNAVAILABLE: its workers' addresses have nothing listening); calls past its limit are refused
    RESOURCE_EXHAUSTED; its metrics count each refusal by code."""
    from hcfjax.pd.router import Router, RouterServer
    from hcfjax.serving import client
    from hcfjax.serving.metrics import Metrics

    metrics = Metrics()
    router = Router(["127.0.0.1:1"], ["127.0.0.1:2"])
    hold, held, release = threading.Event(), threading.Event(), threading.Event()
    generate = router.Generate

    def generate_or_hold(request, context):  # holding: the call keeps its thread until released
        if not hold.is_set():
            return generate(request, context)
        held.set()
        release.wait(30)
        return iter(())

    router.Generate = generate_or_hold
    server = RouterServer(router, api_key="sesame", max_workers=1, metrics=metrics).start()
    channel, stub = client.connect("127.0.0.1", server.port, ready_timeout=10)
    refused = lambda code: metrics.rejected.labels(code)._value.get()  # noqa: E731
    try:
        for key, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("sesame", grpc.StatusCode.UNAVAILABLE)):
            with pytest.raises(grpc.RpcError) as e:
                client.generate(stub, "x", max_new_tokens=2, api_key=key, timeout=30)
            assert e.value.code() == code, e.value.details()
        assert refused("UNAUTHENTICATED") == 1
        hold.set()
        key = client.auth_metadata("sesame")
        first = ThreadPoolExecutor(1).submit(lambda: list(stub.Generate(client.make_request("x"), metadata=key)))
        assert held.wait(30)
        with pytest.raises(grpc.RpcError) as e:
            client.generate(stub, "x", max_new_tokens=2, api_key="sesame", timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and refused("RESOURCE_EXHAUSTED") == 1
        release.set()
        first.result(30)
    finally:
        channel.close()
        server.stop(0)
