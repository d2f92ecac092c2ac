"""The `hcfjax` command line.

hcfjax generate --model PATH --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                [--min-p P] [--seed S] [--stop TEXT] [--dtype bfloat16|float32|auto] [--fp8 native|dequantize]
                [--kv-cache auto|bf16|int8]
hcfjax serve [--model PATH | --preset NAME] [--scheme S] [--host 127.0.0.1] [--port P] [--http-port H]
             [--metrics-port M] [--max-slots N] [...]
             (gRPC and/or the OpenAI-compatible HTTP API over one engine, hcfjax/serving/; SIGINT/SIGTERM shut it
             down gracefully; --preset: random weights of a real shape, labelled random wherever the server names
             its model; --scheme: quantised in memory)
hcfjax serve --role prefill|decode|router [--transport socket|jax] [--prefill ADDR] [--decode ADDR] [...]
             (prefill/decode disaggregation, hcfjax/pd/: one process per role; the router takes --http-port too)
hcfjax client --port P [--host H] --prompt TEXT [--max-new-tokens N] [--temperature T] [...] [--seed S] [--stop TEXT]
             (streams the text to stdout; an error status goes to stderr as CODE: message, exit 1)
hcfjax bench generate [...]      (the decode/prefill benchmark; see hcfjax/bench/generate.py)
hcfjax quantize [--model IN] --out OUT --scheme w4a8c8|w4a16|w4a8|w8a8|fp8   (hcfjax/quantize.py)
hcfjax sim --config deployment.yaml [--search | --sweep] [--plot PNG]   (the capacity simulator, hcfjax/sim/)
hcfjax info [MODEL | --preset NAME] [--scheme S] [--mesh PLAN ...] [--gpu G] [--context N]   (hcfjax/info.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from hcfjax import argtypes, trace
from hcfjax.frontdoor import MAX_REQUEST_ID_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from hcfjax.serving.config import (
    DTYPES,
    KV_CACHE,
    SCHEMES,
    engine_config,
    generate_plans,
    load_dtype,
    parse_meshes,
    prefill_config,
    random_label,
    run_options,
    served_model,
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


def _generate(args) -> int:

    import hcfjax
    from hcfjax.quantize import cache_dtype_for

    path = Path(args.model or hcfjax.DEFAULT_MODEL)
    if not (path / "config.json").is_file():
        print(f"error: {str(path)!r} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    try:
        sampling = hcfjax.SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        plans = generate_plans(parse_meshes(args.mesh or []))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # streamed straight onto the decode plan's devices (each rank reads its own experts); prefill reshards
    model = hcfjax.load(path, dtype=load_dtype(args.dtype), plan=plans.get("decode_plan"), fp8=args.fp8)
    prompts = args.prompt
    run = lambda: hcfjax.generate(  # noqa: E731
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        stop=args.stop,
        cache_dtype=cache_dtype_for(model, KV_CACHE[args.kv_cache]),
        options=run_options(),
        **plans,
    )
    try:
        if args.stats:  # the timed run is the second of two identical ones: the first compiles
            t0 = time.perf_counter()
            run()
            warmup_s = time.perf_counter() - t0
        out = run()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, prompt in enumerate(prompts):
        text = out.text[i] if out.text is not None else " ".join(map(str, out.tokens[i]))
        print(f"{prompt}{text}")
        if i + 1 < len(prompts):
            print("-" * 40)
    if args.stats:
        print(json.dumps({**out.stats, "warmup_s": warmup_s}, indent=1), file=sys.stderr)
    return 0


def _serve(args) -> int:
    """Ctrl-C before the server is up (loading, compiling) ends the command quietly, exit status 130."""
    started = time.monotonic()
    try:
        return _serve_until_signal(args, started)
    except KeyboardInterrupt:
        print("hcfjax serve: interrupted before it was ready", file=sys.stderr, flush=True)
        if any(t.name.startswith("hcfjax-compile") for t in threading.enumerate()):
            os._exit(130)  # a compile in flight cannot be interrupted: do not wait for it
        return 130


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
    from hcfjax.serving.http import serve as serve_http
    from hcfjax.serving.server import serve

    try:
        engine = Engine(served_model(args), engine_config(args))
        path = engine.model.path
        template = ChatTemplate.for_checkpoint(path, args.chat_template) if args.http_port is not None else None
    except (ValueError, NotImplementedError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    announce = announcer(random_label(args.preset, args.scheme))
    announce(f"hcfjax serve: {engine_summary(engine)}")
    common = dict(
        metrics_port=args.metrics_port,
        grace=args.grace,
        warmup=args.warmup,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        started=started,
        announce=announce,
    )
    try:
        if args.http_port is None:
            serve(engine, args.host, args.port, **common)
        else:
            serve_http(
                engine,
                args.host,
                args.http_port,
                args.port,
                model_name=served_model_name(args),
                chat_template=template,
                **common,
            )
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


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


def _client(args) -> int:
    import grpc

    from hcfjax.serving import client
    from hcfjax.serving import hcfjax_pb2 as pb

    try:
        request = client.make_request(
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
        )
    except (ValueError, TypeError) as e:  # a value the request message cannot hold
        print(f"error: {e}", file=sys.stderr)
        return 2
    channel, stub = client.connect(args.host, args.port)
    last = None
    try:
        for chunk in stub.Generate(request, timeout=args.timeout, metadata=client.auth_metadata(args.api_key)):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
    except grpc.RpcError as e:
        if last is not None:
            print()  # end the partial text's line
        print(f"{e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    print()
    if args.usage and last is not None:
        u = last.usage
        usage = {f: getattr(u, f) for f in ("prompt_tokens", "output_tokens", "draft_tokens", "accepted_draft_tokens")}
        usage["ttft_s"] = u.ttft_s if u.HasField("ttft_s") else None
        print(json.dumps(usage), file=sys.stderr)
    if last is None or last.finish_reason == pb.FINISH_REASON_ABORT:
        print("the server aborted the request (shutting down)", file=sys.stderr)
        return 1
    return 0


def _precision_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype, --fp8 and --kv-cache, alike for `generate` and `serve`."""
    parser.add_argument(
        "--dtype", default="bfloat16", choices=[*sorted(DTYPES), "auto"], help="model dtype (auto: the checkpoint's)"
    )
    parser.add_argument(
        "--fp8",
        default="native",
        choices=["native", "dequantize"],
        help="DeepSeek fp8 checkpoints: run the weights as fp8 (native) or dequantise them to --dtype on load",
    )
    parser.add_argument(
        "--kv-cache",
        default="auto",
        choices=sorted(KV_CACHE),
        help="latent KV cache precision (auto: the checkpoint's scheme's, int8 for w4a8c8; bf16: the model's dtype)",
    )


def _sampling_flags(parser: argparse.ArgumentParser, checked: bool) -> None:
    """--max-new-tokens and the sampling parameters, alike for `generate` and `client`; checked as the engine checks
    them, or (unchecked, the client's) left to the server, whose refusal is then the answer."""
    sampling = argtypes.sampling_field if checked else lambda name, kind: kind
    parser.add_argument("--max-new-tokens", type=argtypes.max_new_tokens, default=64)
    parser.add_argument("--temperature", type=sampling("temperature", float), default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=sampling("top_k", int), default=0)
    parser.add_argument("--top-p", type=sampling("top_p", float), default=1.0)
    parser.add_argument("--min-p", type=sampling("min_p", float), default=0.0)
    parser.add_argument("--seed", type=argtypes.seed if checked else int, default=0)


def build_parser() -> argparse.ArgumentParser:
    """Every numeric option's type checks its range (hcfjax.argtypes): a value out of it is argparse's error."""
    engine, prefill, within = argtypes.engine_field, argtypes.prefill_field, argtypes.within
    ap = argtypes.Parser(prog="hcfjax", description="DeepSeek-V3/R1-class inference in JAX")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from one or more prompts")
    g.add_argument("--model", help="checkpoint directory (HF layout); default: the embedded model")
    g.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    _sampling_flags(g, checked=True)
    g.add_argument("--stop", action="append", help="a string that ends a prompt's generation (repeatable)")
    _precision_flags(g)
    g.add_argument(
        "--stats",
        action="store_true",
        help="print timing statistics (JSON) to stderr: of a second identical run, after one that compiles (warmup_s)",
    )
    g.add_argument(
        "--mesh",
        action="append",
        metavar="PLAN",
        help="run under sharding plans, e.g. --mesh prefill:tp=4,ep=2 --mesh decode:dp=4,ep=4",
    )
    g.add_argument("--cpu-devices", type=within(int, 1), help="fake this many CPU devices (to try plans without GPUs)")
    g.set_defaults(func=_generate)

    s = sub.add_parser(
        "serve", help="serve the model over gRPC and/or an OpenAI-compatible HTTP API", epilog=REQUEST_LIMITS
    )
    s.add_argument("--model", help="checkpoint directory (HF layout); default: the embedded model")
    s.add_argument(
        "--preset",
        help="serve a model with RANDOM weights of this shape instead (hcfjax.random_model.PRESETS: tiny-v3, v2-lite, "
        "...; for benchmarks; its lines and HTTP model name say random)",
    )
    s.add_argument("--scheme", choices=SCHEMES, help="quantise the model in memory first, as `hcfjax quantize` does")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    s.add_argument("--port", type=argtypes.PORT, help="gRPC port (0: a free one, printed at start)")
    s.add_argument(
        "--http-port", type=argtypes.PORT, help="OpenAI-compatible HTTP port (0: a free one, printed at start)"
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("HCFJAX_API_KEY"),
        help="HTTP, gRPC and metrics clients must send Authorization: Bearer KEY (unset: no auth). Set "
        "HCFJAX_API_KEY instead of passing this flag: a flag shows in the process list (default: $HCFJAX_API_KEY)",
    )
    s.add_argument(
        "--max-body-bytes",
        type=within(int, 1),
        default=DEFAULT_MAX_BODY_BYTES,
        help="the largest HTTP request body / gRPC request message; larger ones get 413 / RESOURCE_EXHAUSTED before "
        "they are read whole (default: %(default)s)",
    )
    s.add_argument("--served-model-name", help="the HTTP API's model name (default: the checkpoint directory's)")
    s.add_argument("--chat-template", help="a Jinja chat template file (default: the checkpoint's, else a plain one)")
    s.add_argument("--metrics-port", type=argtypes.PORT, default=0, help="Prometheus /metrics port (0: off)")
    s.add_argument("--max-slots", type=engine("max_slots"), default=8, help="decode slots per DP rank")
    s.add_argument("--dp", type=engine("dp"), default=1, help="decode (attention-DP) ranks")
    s.add_argument("--num-pages", type=engine("num_pages"), help="KV cache pages per rank (default: from --max-slots)")
    s.add_argument(
        "--page-size",
        type=engine("page_size"),
        default=64,
        help="KV cache page (the MLA decode kernel takes multiples of 64)",
    )
    s.add_argument(
        "--max-model-len", type=engine("max_model_len"), help="context length (default: min(the model's, 4096))"
    )
    s.add_argument("--token-budget", type=engine("token_budget"), default=256, help="tokens per engine step")
    s.add_argument(
        "--max-prefill-rows", type=engine("max_prefill_rows"), default=4, help="prompts prefilled together in one step"
    )
    s.add_argument(
        "--max-queue", type=engine("max_queue"), default=256, help="waiting requests beyond this get RESOURCE_EXHAUSTED"
    )
    s.add_argument("--balance", default="round_robin", choices=["round_robin", "fewest_requests", "least_pages"])
    s.add_argument(
        "--speculative", type=argtypes.draft_tokens, default=0, metavar="K", help="K MTP draft tokens per step (0: off)"
    )
    s.add_argument("--spec-method", default="exact", choices=["exact", "rejection", "typical", "tuned"])
    _precision_flags(s)
    s.add_argument("--grace", type=within(float, 0), default=3.0, help="seconds open streams get at shutdown")
    s.add_argument(
        "--min-prefill-bucket",
        type=engine("min_prefill_bucket"),
        default=64,
        help="the smallest prefill chunk shape (chunks pad to powers of two from here; larger: fewer to compile)",
    )
    s.add_argument(
        "--compile-cache",
        default=str(default_compile_cache()),
        metavar="DIR|off",
        help="jax's persistent compilation cache: a restart reads the compiled step shapes back (default: %(default)s)",
    )
    s.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip compiling every step shape before listening (faster start; first requests wait for compiles)",
    )
    pd = s.add_argument_group("prefill/decode disaggregation (hcfjax/pd/)")
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
    s.set_defaults(func=_serve)

    c = sub.add_parser("client", help="stream a generation from a running `hcfjax serve`")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=within(int, 1, 65535), required=True)
    c.add_argument("--prompt", required=True)
    _sampling_flags(c, checked=False)
    c.add_argument("--stop", action="append", help="a string that ends the generation (repeatable)")
    c.add_argument("--timeout", type=within(float, above=0), help="deadline in seconds")
    c.add_argument("--usage", action="store_true", help="print the final usage (JSON) to stderr")
    c.add_argument(
        "--api-key",
        default=os.environ.get("HCFJAX_API_KEY"),
        help="the server's API key (default: $HCFJAX_API_KEY, the way to pass it: a flag shows in the process list)",
    )
    c.set_defaults(func=_client)

    bench_help = (
        "benchmarks: they run on any backend; the copy and matmul ceilings, the floors derived from them and "
        "--profile's kernel times need a GPU (n/a on a CPU)"
    )
    b = sub.add_parser(
        "bench", help=bench_help, description=bench_help + ". `hcfjax bench generate --help` lists its options."
    )
    b.add_argument(
        "which", choices=["generate"], help="generate: decode and prefill tokens/s (hcfjax/bench/generate.py)"
    )
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)

    q = sub.add_parser("quantize", help="write a quantised copy of a checkpoint (hcfjax/quantize.py)")
    q.add_argument("--model", help="checkpoint directory (HF layout); default: the embedded model")
    q.add_argument("--out", required=True, help="directory to write the quantised checkpoint to")
    q.add_argument("--scheme", required=True, choices=["w4a8c8", "w4a16", "w4a8", "w8a8", "fp8"])
    q.add_argument("--group-size", type=within(int, 1), default=128, help="int4 scale group along K")
    q.set_defaults(func=_quantize)

    from hcfjax.sim.cli import add_arguments as sim_arguments

    m = sub.add_parser("sim", help="simulate a deployment's throughput and latency (hcfjax/sim/)")
    sim_arguments(m)
    m.set_defaults(func=_sim)

    from hcfjax.info import DESCRIPTION as INFO_DESCRIPTION
    from hcfjax.info import add_arguments as info_arguments

    i = sub.add_parser(
        "info", help="parameters, weight bytes and what fits per GPU (hcfjax/info.py)", description=INFO_DESCRIPTION
    )
    info_arguments(i)
    i.set_defaults(func=_info)
    return ap


def _info(args) -> int:
    from hcfjax.info import run

    return run(args)


def _sim(args) -> int:
    from hcfjax.sim.cli import run

    return run(args)


def _quantize(args) -> int:
    from hcfjax.quantize import quantize_checkpoint

    try:
        cfg = quantize_checkpoint(args.model, args.out, args.scheme, args.group_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.scheme} checkpoint to {args.out} ({cfg.quantization})")
    return 0


def _bench(args) -> int:
    from hcfjax.bench import generate as bench_generate

    bench_generate.main(args.rest)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if trace_dir := os.environ.get(trace.DIR_VARIABLE):  # per-request marks (hcfjax.trace), e.g. of a PD worker
        trace.enable(trace_dir)
    if getattr(args, "cpu_devices", None):
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
