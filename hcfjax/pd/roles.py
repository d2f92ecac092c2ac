"""`hcfjax serve --role prefill|decode|router`: each role as its own process, until SIGINT or SIGTERM.

    hcfjax serve --role prefill --port 0 --transport socket --mesh prefill:tp=2 --cpu-devices 2
    hcfjax serve --role decode  --port 0 --transport socket --mesh decode:dp=2 --cpu-devices 2 --max-slots 4
    hcfjax serve --role router  --port 50051 --prefill HOST:PORT --decode HOST:PORT [--http-port 8000]

Each prints `hcfjax serve: listening on HOST:PORT` once it serves (port 0 picks a free port); the router then
prints `hcfjax serve: ready (...)` once a prefill and a decode worker answer its health checks (its health says
NOT_SERVING until then, and again while either role has no worker up). With --http-port the router serves the
OpenAI-compatible HTTP API too (hcfjax.serving.http over hcfjax.serving.remote: its requests go through the router's
gRPC service), checked against --model/--preset's config and tokenizer and --max-model-len, as the workers' are;
--metrics-port serves that front end's request and refusal counters (hcfjax.serving.metrics).
"""

from __future__ import annotations

import functools

from hcfjax.serving.server import until_signal


def _log_to_stderr() -> None:
    """The workers' and router's warnings (workers down, transfers failed, retries) go to stderr."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def run_prefill(model, args, plans, prefill_config, announce) -> None:
    from hcfjax.engine.config import context_length
    from hcfjax.pd.prefill import PrefillWorker
    from hcfjax.pd.service import prefill_server
    from hcfjax.pd.transport import make_transport
    from hcfjax.serving.startup import CompileProgress
    from sharding.plans import prefill_plan

    _log_to_stderr()
    transport = make_transport(args.transport, host=args.host, timeout=args.transfer_timeout)
    plan = prefill_plan(**plans["prefill"]) if "prefill" in plans else None
    worker = PrefillWorker(model, transport.sender(), prefill_config, plan)
    if args.warmup:
        limit = context_length(model.cfg.max_position_embeddings, args.max_model_len)
        progress = CompileProgress("hcfjax serve: compiling prefill programs")
        announce(f"hcfjax serve: prefill programs compiled in {worker.warmup(limit, progress):.1f} s")
    with until_signal(announce):
        worker.start()
        server = prefill_server(worker, args.transport, args.host, args.port, api_key=args.api_key).start()
        announce(f"hcfjax serve: prefill worker listening on {server.address}")
    server.stop(args.grace)
    worker.shutdown()
    worker.sender.close()


def run_decode(model, args, plans, engine_config, announce) -> None:
    """The engine and its remote prefill here; its gRPC server in a process of its own (hcfjax.serving.front_process,
    as `hcfjax serve`'s), so the streams' threads never take the interpreter lock from the engine's loop."""
    from hcfjax.engine import Engine
    from hcfjax.pd.decode import RemotePrefill
    from hcfjax.pd.service import DecodeListen, GrpcPrefill, decode_info
    from hcfjax.pd.transport import make_transport
    from hcfjax.serving.front_process import serve
    from sharding.plans import decode_plan

    _log_to_stderr()
    receiver = make_transport(args.transport, host=args.host, timeout=args.transfer_timeout).receiver()
    connect = functools.partial(GrpcPrefill, api_key=args.api_key)
    remote = RemotePrefill(receiver, [connect(a) for a in args.prefill or []], timeout_s=args.transfer_timeout)
    remote.connect = connect
    plan = decode_plan(**plans["decode"]) if "decode" in plans else None
    engine = Engine(model, engine_config, decode_plan=plan, remote=remote)
    info = decode_info(engine, args.transport)
    listen = DecodeListen(args.host, args.port, info, receiver.address, args.api_key)
    try:  # the all-slot decode step compiled before listening, the decode steps of fewer rows in the background
        serve(engine, listen, grace=args.grace, warmup=args.warmup, announce=announce)
    finally:
        remote.shutdown()
        receiver.close()


def run_router(args, announce) -> None:
    from hcfjax.pd.router import Router, RouterServer
    from hcfjax.serving.metrics import Metrics

    _log_to_stderr()
    if not args.prefill or not args.decode:
        raise ValueError("the router needs --prefill ADDR and --decode ADDR (each repeatable)")
    from hcfjax.serving.startup import ready_line

    start_http = router_http(args, announce) if args.http_port is not None else None
    http, where = None, []
    metrics = Metrics()

    def on_ready(ready: bool, address: str) -> None:
        if ready:
            announce(ready_line(None, [f"router {address}", *where]))
        else:
            announce("hcfjax serve: router not ready: waiting for a prefill and a decode worker to answer")

    router = Router(
        args.prefill, args.decode, balance=args.balance, request_timeout_s=args.request_timeout, api_key=args.api_key
    )
    # without --port the gRPC service listens on loopback only, for the HTTP front end
    host, port = (args.host, args.port) if args.port is not None else ("127.0.0.1", 0)
    with until_signal(announce):
        server = RouterServer(router, host, port, on_ready=on_ready, api_key=args.api_key, metrics=metrics)
        announce(f"hcfjax serve: router listening on {server.address}")
        if start_http is not None:
            http = start_http(server, metrics)
            where.append(f"HTTP http://{args.host}:{http.port}/v1")
        if args.metrics_port:
            metrics_at = metrics.serve(args.metrics_port, args.host, api_key=args.api_key)
            announce(f"hcfjax serve: metrics on http://{args.host}:{metrics_at}/metrics")
        server.start()
    if http is not None:
        http.shutdown(args.grace)
    server.stop(args.grace)
    metrics.close()


def router_http(args, announce):
    """--http-port: the OpenAI API through the router (hcfjax.serving.remote), checked against --model/--preset's
    config and tokenizer (no weights) and --max-model-len, which should be the decode workers'. Loaded before the
    router listens; returns a function that starts the HTTP server over a RouterServer, recording into a Metrics."""
    from hcfjax.serving.chat_template import ChatTemplate
    from hcfjax.serving.config import served_model_name
    from hcfjax.serving.http import HTTPServer
    from hcfjax.serving.remote import RemoteEngine, load_front

    front = load_front(args.model, args.preset)
    template = ChatTemplate.for_checkpoint(front.path, args.chat_template)

    def start(server, metrics):
        dial = "127.0.0.1" if server.address.rsplit(":", 1)[0] in ("0.0.0.0", "[::]", "::") else None
        address = f"{dial}:{server.port}" if dial else server.address
        engine = RemoteEngine(address, front, args.max_model_len or 4096, api_key=args.api_key,
                              timeout_s=args.request_timeout + 10, ready=server.router.ready)  # fmt: skip
        http = HTTPServer(engine, args.host, args.http_port, model_name=served_model_name(args),
                          chat_template=template, metrics=metrics, api_key=args.api_key,
                          max_body_bytes=args.max_body_bytes)  # fmt: skip
        http.start()
        announce(f"hcfjax serve: OpenAI-compatible HTTP on http://{args.host}:{http.port}/v1 "
                 f"(model {http.service.model_name!r}, through the router)")  # fmt: skip
        return http

    return start
