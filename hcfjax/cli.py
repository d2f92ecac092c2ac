"""The `hcfjax` command line.

hcfjax generate --model PATH --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                [--min-p P] [--seed S] [--stop TEXT] [--dtype bfloat16|float32|auto] [--fp8 native|dequantize]
                [--kv-cache auto|bf16|int8]
hcfjax serve [--model PATH | --preset NAME] [--scheme S] [--host 127.0.0.1] [--port P] [--http-port H]
             [--metrics-port M] [--max-slots N] [...]
             (gRPC and/or the OpenAI-compatible HTTP API over one engine, hcfjax/serving/command.py; SIGINT/SIGTERM
             shut it down gracefully; --preset: random weights of a real shape, labelled random wherever the server
             names its model; --scheme: quantised in memory)
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
import time

from hcfjax import argtypes, trace
from hcfjax.serving import command as serve_command
from hcfjax.serving.config import (
    KV_CACHE,
    add_precision_flags,
    checkpoint_dir,
    generate_plans,
    load_dtype,
    parse_meshes,
    run_options,
)


def _generate(args) -> int:

    import hcfjax
    from hcfjax.quantize import cache_dtype_for

    try:
        path = checkpoint_dir(args.model)
        sampling = hcfjax.SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
        plans = generate_plans(parse_meshes(args.mesh or []))
        # streamed straight onto the decode plan's devices (each rank reads its own experts); prefill reshards
        model = hcfjax.load(path, dtype=load_dtype(args.dtype), plan=plans.get("decode_plan"), fp8=args.fp8)
    except (OSError, ValueError) as e:  # ConfigError and CheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
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
    within = argtypes.within
    ap = argtypes.Parser(prog="hcfjax", description="DeepSeek-V3/R1-class inference in JAX")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from one or more prompts")
    g.add_argument("--model", help="checkpoint directory (HF layout); default: the embedded model")
    g.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    _sampling_flags(g, checked=True)
    g.add_argument("--stop", action="append", help="a string that ends a prompt's generation (repeatable)")
    add_precision_flags(g)
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
        "serve",
        help="serve the model over gRPC and/or an OpenAI-compatible HTTP API",
        epilog=serve_command.REQUEST_LIMITS,
    )
    serve_command.add_arguments(s)
    s.set_defaults(func=serve_command.run)

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
    except (OSError, ValueError) as e:  # an --out that cannot be written, a broken checkpoint
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
