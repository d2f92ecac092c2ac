"""`hcfjax serve --role prefill|decode|router`: each role as its own process, until SIGINT or SIGTERM.

    hcfjax serve --role prefill --port 0 --transport socket --mesh prefill:tp=2 --cpu-devices 2
    hcfjax serve --role decode  --port 0 --transport socket --mesh decode:dp=2 --cpu-devices 2 --max-slots 4
    hcfjax serve --role router  --port 50051 --prefill HOST:PORT --decode HOST:PORT

Each prints `hcfjax serve: listening on HOST:PORT` once it serves (port 0 picks a free port); the router then
prints `hcfjax serve: ready (...)` once a prefill and a decode worker answer its health checks (its health says
NOT_SERVING until then, and again while either role has no worker up).
"""

from __future__ import annotations

from hcfjax.serving.server import until_signal


def _log_to_stderr() -> None:
    """The workers' and router's warnings (workers down, transfers failed, retries) go to stderr."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def run_prefill(model, args, plans, prefill_config, announce) -> None:
    from hcfjax.pd.prefill import PrefillWorker
    from hcfjax.pd.service import prefill_server
    from hcfjax.pd.transport import make_transport
    from sharding.plans import prefill_plan

    _log_to_stderr()
    transport = make_transport(args.transport, host=args.host, timeout=args.transfer_timeout)
    plan = prefill_plan(**plans["prefill"]) if "prefill" in plans else None
    worker = PrefillWorker(model, transport.sender(), prefill_config, plan)
    if args.warmup:
        limit = min(model.cfg.max_position_embeddings, args.max_model_len or 4096)
        announce(f"hcfjax serve: prefill shapes compiled in {worker.warmup(limit):.1f} s")
    with until_signal(announce):
        worker.start()
        server = prefill_server(worker, args.transport, args.host, args.port).start()
        announce(f"hcfjax serve: prefill worker listening on {server.address}")
    server.stop(args.grace)
    worker.shutdown()
    worker.sender.close()


def run_decode(model, args, plans, engine_config, announce) -> None:
    from hcfjax.engine import Engine
    from hcfjax.pd.decode import RemotePrefill
    from hcfjax.pd.service import GrpcPrefill, decode_server
    from hcfjax.pd.transport import make_transport
    from sharding.plans import decode_plan

    _log_to_stderr()
    receiver = make_transport(args.transport, host=args.host, timeout=args.transfer_timeout).receiver()
    remote = RemotePrefill(receiver, [GrpcPrefill(a) for a in args.prefill or []], timeout_s=args.transfer_timeout)
    remote.connect = GrpcPrefill
    plan = decode_plan(**plans["decode"]) if "decode" in plans else None
    engine = Engine(model, engine_config, decode_plan=plan, remote=remote)
    if args.warmup:
        announce(f"hcfjax serve: compiled in {engine.warmup():.1f} s")
    with until_signal(announce):
        engine.start()
        server = decode_server(engine, remote, args.transport, args.host, args.port).start()
        announce(f"hcfjax serve: decode worker listening on {server.address} (transport {receiver.address})")
    server.stop(args.grace)
    engine.shutdown(args.grace)
    remote.shutdown()
    receiver.close()


def run_router(args, announce) -> None:
    from hcfjax.pd.router import Router, RouterServer

    _log_to_stderr()
    if not args.prefill or not args.decode:
        raise ValueError("the router needs --prefill ADDR and --decode ADDR (each repeatable)")
    from hcfjax.serving.startup import ready_line

    def on_ready(ready: bool, address: str) -> None:
        if ready:
            announce(ready_line(None, [f"router {address}"]))
        else:
            announce("hcfjax serve: router not ready: waiting for a prefill and a decode worker to answer")

    router = Router(args.prefill, args.decode, balance=args.balance, request_timeout_s=args.request_timeout)
    with until_signal(announce):
        server = RouterServer(router, args.host, args.port, on_ready=on_ready, api_key=args.api_key)
        announce(f"hcfjax serve: router listening on {server.address}")
        server.start()
    server.stop(args.grace)
