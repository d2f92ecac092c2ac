"""`hcfjax serve`: its arguments and its run, colocated (gRPC and/or the OpenAI-compatible HTTP API over one
engine) or one role of a prefill/decode deployment (hcfjax/pd/). hcfjax.cli adds the command; the arguments become
configs in serving/config.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from hcfjax import argtypes
from hcfjax.frontdoor import MAX_REQUEST_ID_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from hcfjax.serving.config import (
    SCHEMES,
    add_precision_flags,
    engine_config,
    parse_meshes,
    prefill_config,
    random_label,
    served_model,
    served_model_and_weights,
    served_model_name,
)
from hcfjax.serving.guards import DEFAULT_MAX_BODY_BYTES
from hcfjax.serving.startup import default_compile_cache

REQUEST_LIMITS = (
    "Requests are refused (INVALID_ARGUMENT, HTTP 400) before any work for: a text prompt longer than the context "
    "could hold (checked on its characters, before tokenizing), text that is not valid UTF-8, a prompt or prompt + "
    f"max tokens beyond --max-model-len, more than {MAX_STOP_STRINGS} stop strings or one over {MAX_STOP_CHARS} "
    f"characters, more than {MAX_STOP_TOKEN_IDS} stop token ids, top_k beyond the vocabulary, a seed outside "
    f"[0, 2^32), a request id over {MAX_REQUEST_ID_CHARS} characters (hcfjax/frontdoor.py). A request body (HTTP) "
    "or message (gRPC) over --max-body-bytes is refused (HTTP 413, RESOURCE_EXHAUSTED) before it is read whole. "
    "With an API key, HTTP (all but /health), the gRPC Generation service (metadata authorization: Bearer KEY; "
    "health and reflection stay open), the --metrics-port scrape and a PD worker's services (the router and the "
    "decode workers send the key they are given) all need it: a client without it gets 401 / UNAUTHENTICATED "
    "before its request is read. Pass the key as HCFJAX_API_KEY: a --api-key flag shows in the process list."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`hcfjax serve`'s options; every numeric one's type checks its range (hcfjax.argtypes)."""
    engine, prefill, within = argtypes.engine_field, argtypes.prefill_field, argtypes.within
    parser.add_argument("--model", help="checkpoint directory (HF layout); default: the embedded model")
    parser.add_argument(
        "--preset",
        help="serve a model with RANDOM weights of this shape instead (hcfjax.random_model.PRESETS: tiny-v3, v2-lite, "
        "...; for benchmarks; its lines and HTTP model name say random)",
    )
    parser.add_argument(
        "--scheme", choices=SCHEMES, help="quantise the model in memory first, as `hcfjax quantize` does"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=argtypes.PORT, help="gRPC port (0: a free one, printed at start)")
    parser.add_argument(
        "--http-port", type=argtypes.PORT, help="OpenAI-compatible HTTP port (0: a free one, printed at start)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("HCFJAX_API_KEY"),
        help="HTTP, gRPC and metrics clients must send Authorization: Bearer KEY (unset: no auth). Set "
        "HCFJAX_API_KEY instead of passing this flag: a flag shows in the process list (default: $HCFJAX_API_KEY)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=within(int, 1),
        default=DEFAULT_MAX_BODY_BYTES,
        help="the largest HTTP request body / gRPC request message; larger ones get 413 / RESOURCE_EXHAUSTED before "
        "they are read whole (default: %(default)s)",
    )
    parser.add_argument("--served-model-name", help="the HTTP API's model name (default: the checkpoint directory's)")
    parser.add_argument(
        "--chat-template", help="a Jinja chat template file (default: the checkpoint's, else a plain one)"
    )
    parser.add_argument("--metrics-port", type=argtypes.PORT, default=0, help="Prometheus /metrics port (0: off)")
    parser.add_argument("--max-slots", type=engine("max_slots"), default=8, help="decode slots per DP rank")
    parser.add_argument("--dp", type=engine("dp"), default=1, help="decode (attention-DP) ranks")
    parser.add_argument(
        "--num-pages",
        type=engine("num_pages"),
        help="KV cache pages per rank (default: from --max-slots, at most what the GPU's memory holds; fewer than one"
        " request at --max-model-len bound a request's context to what they hold)",
    )
    parser.add_argument(
        "--page-size",
        type=engine("page_size"),
        default=64,
        help="KV cache page (the MLA decode kernel takes multiples of 64)",
    )
    parser.add_argument(
        "--max-model-len",
        type=engine("max_model_len"),
        help="context length, at most the model's (default: min(the model's, 4096))",
    )
    parser.add_argument("--token-budget", type=engine("token_budget"), default=256, help="tokens per engine step")
    parser.add_argument(
        "--mixed-token-budget",
        type=engine("mixed_token_budget"),
        help="tokens in a step that also decodes (at most, and by default, --token-budget); smaller bounds the time "
        "per output token of decoding requests while prompts prefill",
    )
    parser.add_argument(
        "--max-prefill-rows", type=engine("max_prefill_rows"), default=4, help="prompts prefilled together in one step"
    )
    parser.add_argument(
        "--max-queue", type=engine("max_queue"), default=256, help="waiting requests beyond this get RESOURCE_EXHAUSTED"
    )
    parser.add_argument("--balance", default="round_robin", choices=["round_robin", "fewest_requests", "least_pages"])
    parser.add_argument(
        "--speculative", type=argtypes.draft_tokens, default=0, metavar="K", help="K MTP draft tokens per step (0: off)"
    )
    parser.add_argument("--spec-method", default="exact", choices=["exact", "rejection", "typical", "tuned"])
    add_precision_flags(parser)
    parser.add_argument("--grace", type=within(float, 0), default=3.0, help="seconds open streams get at shutdown")
    parser.add_argument(
        "--min-prefill-bucket",
        type=engine("min_prefill_bucket"),
        default=64,
        help="the smallest prefill chunk shape (chunks pad to powers of two from here; larger: fewer to compile)",
    )
    parser.add_argument(
        "--compile-cache",
        default=str(default_compile_cache()),
        metavar="DIR|off",
        help="jax's persistent compilation cache: a restart reads the compiled step shapes back (default: %(default)s)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip compiling every step shape before listening (faster start; first requests wait for compiles)",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation (hcfjax/pd/)")
    pd.add_argument("--role", default="colocated", choices=["colocated", "prefill", "decode", "router"])
    pd.add_argument("--transport", default="socket", choices=["socket", "jax"], help="KV transfer between workers")
    pd.add_argument("--prefill", action="append", metavar="ADDR", help="prefill worker host:port (repeatable)")
    pd.add_argument("--decode", action="append", metavar="ADDR", help="decode worker host:port (router; repeatable)")
    pd.add_argument("--mesh", action="append", help="prefill:tp=N,ep=M (prefill role) or decode:dp=N,ep=N (decode)")
    pd.add_argument("--cpu-devices", type=within(int, 1), help="fake this many CPU devices (to try plans without GPUs)")
    pd.add_argument(
        "--prefill-pages", type=prefill("num_pages"), default=1024, help="a prefill worker's scratch KV pages"
    )
    pd.add_argument("--prefill-chunk", type=prefill("chunk"), default=2048, help="tokens per prefill forward chunk")
    pd.add_argument(
        "--layerwise-threshold",
        type=prefill("layerwise_threshold"),
        default=8192,
        help="prompts this long are sent layer by layer",
    )
    pd.add_argument("--layer-group", type=prefill("layer_group"), default=1, help="layers per piece in layerwise mode")
    pd.add_argument(
        "--transfer-timeout",
        type=prefill("transfer_timeout_s", float),
        default=60.0,
        help="seconds a prefill and its transfer may take",
    )
    pd.add_argument(
        "--request-timeout", type=within(float, above=0), default=600.0, help="router: seconds a request may take"
    )


def run(args) -> int:
    """Ctrl-C before the server is up (loading, compiling) ends the command quietly, exit status 130; once it
    serves, a signal shuts it down without waiting for the smaller shapes still compiling in the background."""
    started = time.monotonic()
    # as after ready (until_signal), even where the parent had SIGINT ignored (a shell's background job)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = _serve_until_signal(args, started)
    except KeyboardInterrupt:
        print("hcfjax serve: interrupted before it was ready", file=sys.stderr, flush=True)
        code = 130
    if any(t.name.startswith(("hcfjax-compile", "hcfjax-weights")) for t in threading.enumerate()):
        # a compile in flight (the warm-up's, or the smaller shapes' in the background after ready) cannot be
        # interrupted, and the interpreter's exit would wait for it and for the kernels being lowered (or for
        # a random model's weights being made)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _serve_until_signal(args, started: float) -> int:
    from hcfjax.serving.startup import use_compile_cache

    if args.port is None and args.http_port is None:
        print("error: give --port (gRPC), --http-port (OpenAI-compatible HTTP) or both", file=sys.stderr)
        return 2
    try:
        use_compile_cache(args.compile_cache)
    except OSError as e:
        print(f"error: --compile-cache {args.compile_cache}: {e}", file=sys.stderr)
        return 2
    if args.role != "colocated":
        return _serve_role(args)
    from hcfjax.engine import Engine
    from hcfjax.kernels import engine_summary
    from hcfjax.serving.chat_template import ChatTemplate
    from hcfjax.serving.front_process import Listen, serve

    try:
        model, weights = served_model_and_weights(args)  # the weights load while the steps compile
        engine = Engine(model, engine_config(args), weights=weights)
        template = None
        if args.http_port is not None:
            t = ChatTemplate.for_checkpoint(engine.model.path, args.chat_template)
            template = (t.source, t.bos_token, t.eos_token)
    except (ValueError, NotImplementedError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    announce = announcer(random_label(args.preset, args.scheme))
    announce(f"hcfjax serve: {engine_summary(engine)}")
    engine_notices_to_stderr()
    listen = Listen(
        host=args.host,
        grpc_port=args.port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        model_name=served_model_name(args) if args.http_port is not None else None,
        chat_template=template,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
    )
    try:
        serve(engine, listen, grace=args.grace, warmup=args.warmup, started=started, announce=announce)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, NotImplementedError) as e:  # the weights, loading while the steps compiled, failed
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def engine_notices_to_stderr() -> None:
    """The engine's notices (a step shape compiled on first use, the background compiles done, a failed step) on
    stderr, once per process."""
    import logging

    log = logging.getLogger("hcfjax.engine")
    if not any(getattr(h, "hcfjax_notices", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("hcfjax serve: %(message)s"))
        handler.hcfjax_notices = True
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def announcer(label: str | None):
    """Prints a server's lines; with a label (a random model's, serving.config.random_label) every line carries it:
    "hcfjax serve [random tiny-v3 weights, w4a8c8]: listening on ...". The address stays the line's last word."""
    tag = "hcfjax serve:" if label is None else f"hcfjax serve [{label}]:"

    def announce(line: str) -> None:
        rest = line.removeprefix("hcfjax serve:")
        print(f"{tag}{rest}" if rest != line else f"{tag} {line}", flush=True)

    return announce


def _serve_role(args) -> int:
    from hcfjax.pd import roles

    announce = announcer(random_label(args.preset, args.scheme))
    try:
        plans = parse_meshes(args.mesh or [], need_decode=False)
        if args.role == "router":
            roles.run_router(args, announce)
            return 0
        model = served_model(args)
        if args.role == "prefill":
            roles.run_prefill(model, args, plans, prefill_config(args), announce)
        else:
            if "decode" in plans:
                args.dp = plans["decode"]["dp"]
            roles.run_decode(model, args, plans, engine_config(args), announce)
    except (ValueError, NotImplementedError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
