"""Shared pieces of the benchmark scripts: ceilings measured in the same run, timing, and the results header."""

from __future__ import annotations

import datetime
import time

import jax
import jax.numpy as jnp


def layers_per_iteration(opts) -> str:
    """How a decode step's layer loops run under opts (Options.unroll_decode), for a results header."""
    n = opts.decode_unroll()
    return "all (unrolled)" if n is True else str(n)


def timed(fn, *args, reps: int = 10) -> float:
    """Median seconds of fn(*args) after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def repeats_exactly(fn, args, first, runs: int = 2) -> bool:
    """Whether `runs` more calls of fn(*args) return bit for bit `first` (an earlier call's outputs). A kernel whose
    result changes from run to run has a race, which a check against a tolerance can miss: on the H200 a w4a8
    kernel read a pipeline slot after its refill and gave rows off by 10% in one run and right in the next
    (docs/kernels.md)."""
    import numpy as np

    def bits(tree):  # (structure, per leaf: shape, dtype, bytes): NaNs and signed zeros compare as the bits they are
        leaves, structure = jax.tree.flatten(tree)
        return structure, [(x.shape, x.dtype, np.asarray(x).tobytes()) for x in leaves]

    want = bits(first)
    return all(bits(fn(*args)) == want for _ in range(runs))


def device_time(fn, *args, reps: int = 20) -> float:
    """Seconds per call of fn(*args) on the device alone: `reps` calls chained in one jitted loop, less a loop of
    one call, divided by reps - 1. Each call's inputs pass an optimization barrier with the loop's carry (which sums
    one element of each output), so XLA can neither hoist the call out of the loop nor drop it. Back-to-back timing
    of separate calls cannot go below the host's dispatch cost per call (about 60 us on the H200 machine), which
    hides small kernels; this can."""
    return device_timer(fn, *args, reps=reps)()


def device_timer(fn, *args, reps: int = 20):
    """`device_time` as a function of no arguments that measures again on each call (its two loops compile once)."""
    from jax import lax

    def looped(n: int):
        def run(*inputs):
            def body(i, carry):
                a, _ = lax.optimization_barrier((inputs, carry))
                out = fn(*a)
                return carry + sum(leaf.reshape(-1)[0].astype(jnp.float32) for leaf in jax.tree.leaves(out))

            return lax.fori_loop(0, n, body, jnp.float32(0))

        return jax.jit(run)

    one, many = looped(1), looped(reps)

    def measure() -> float:
        return max(timed(many, *args) - timed(one, *args), 0.0) / (reps - 1)

    return measure


def kernel_times(fn, *args, reps: int = 20, wait=None) -> dict[str, float]:
    """Seconds per call that the GPU spent in each kernel of fn(*args), by kernel name: CUPTI's kernel records from a
    jax.profiler trace of `reps` calls (after a warm-up). Unlike `device_time`, no launch gaps, host work or timing
    loop count, only the kernels themselves (as torch's CUDA events around a large copy_ time the copy ceiling);
    the per-iteration cost of device_time's loop (about 18 us on the H200) made 40-80 us kernels look 15-30% slower.
    Empty where the trace has no GPU kernels (a CPU backend). `wait(outputs)` waits for the calls
    (jax.block_until_ready by default; torch.cuda.synchronize for a torch peer, whose kernels the same CUPTI trace
    records: a torch profiler beside it would fail, as CUPTI takes one subscriber per process)."""
    return kernel_seconds(traced_planes(fn, *args, reps=reps, wait=wait), reps)


def traced_planes(fn, *args, reps: int = 20, wait=None) -> list:
    """The planes of a jax.profiler trace of `reps` calls of fn(*args) after a warm-up call (see kernel_times)."""
    import tempfile

    wait = wait or jax.block_until_ready
    wait(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            wait([fn(*args) for _ in range(reps)])
        finally:
            jax.profiler.stop_trace()
        return read_planes(d)


def read_planes(directory: str) -> list:
    """The planes of the jax.profiler trace written under `directory`."""
    import glob

    from jax.profiler import ProfileData

    return list(ProfileData.from_file(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0]).planes)


def kernel_time(fn, *args, reps: int = 20, wait=None, show=None) -> float:
    """Seconds per call of all the GPU kernels of fn(*args) together (`kernel_times` summed); an error where the
    trace holds none (no GPU), rather than a time of 0. `show(line)`, if given, gets the longest kernels' times
    ("name 38.1 us, name 5.2 us, ...")."""
    per = kernel_times(fn, *args, reps=reps, wait=wait)
    if not per:
        raise RuntimeError("the profiler trace holds no GPU kernels")
    if show is not None:
        top = sorted(per.items(), key=lambda kv: -kv[1])[:4]
        show(", ".join(f"{name[:48]} {t * 1e6:.1f} us" for name, t in top) + (", ..." if len(per) > 4 else ""))
    return sum(per.values())


def kernel_seconds(planes, reps: int = 1) -> dict[str, float]:
    """Seconds per call by kernel name from a trace's planes (jax.profiler.ProfileData's: .name, .lines, .events
    with .name and .duration_ns): the kernel records of the GPU plane that holds the most kernel time (the device the
    calls ran on; a sum over several devices would not be one call's time), copies and memsets left out. Kernel
    records are on the "Stream #N(...)" lines, each on one; the other lines ("XLA Ops", "Framework Ops", ...) repeat
    the same time under other names and are never counted."""
    per: dict[str, float] = {}
    for ev in busiest_gpu_events(planes):
        if not _is_copy(ev.name):
            per[ev.name] = per.get(ev.name, 0.0) + ev.duration_ns * 1e-9 / reps
    return per


def _is_copy(name: str) -> bool:
    return any(w in name.lower() for w in ("memcpy", "memset"))


def record_counts(planes, reps: int = 1) -> dict[str, float]:
    """Per call, from the busiest GPU plane: how many kernels ran ("kernels"), how many copies and memsets
    ("copies") and the seconds those took ("copy_s"); copies are GPU time that `kernel_seconds` leaves out."""
    events = busiest_gpu_events(planes)
    copies = [ev for ev in events if _is_copy(ev.name)]
    return {
        "kernels": (len(events) - len(copies)) / reps,
        "copies": len(copies) / reps,
        "copy_s": sum(ev.duration_ns for ev in copies) * 1e-9 / reps,
    }


def busiest_gpu_events(planes) -> list:
    """The stream lines' records (kernels, copies, memsets) of the GPU plane with the most kernel time."""
    best, most = [], 0.0
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events = [ev for line in plane.lines if line.name.startswith("Stream") for ev in line.events]
        busy = sum(ev.duration_ns for ev in events if not _is_copy(ev.name))
        if busy > most:
            best, most = events, busy
    return best


def gpu_gaps(planes, reps: int = 1, min_us: float = 5.0) -> tuple[float, dict[tuple[str, str], float]]:
    """Where the GPU stood idle in a trace of `reps` calls: seconds per call between its first record and its last
    with no kernel, copy or memset running (on any stream), and the gaps of at least `min_us` summed per call by
    the records either side of them ((last before, first after) -> seconds): a launch gap inside a program sits
    between two of its kernels, a wait for the host between one call's last kernel and the next call's first."""
    spans = [(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for ev in busiest_gpu_events(planes)]
    idle, by_pair = 0.0, {}
    for gap_ns, last, name in idle_gaps(spans):
        gap = gap_ns * 1e-9
        idle += gap
        if gap >= min_us * 1e-6:
            by_pair[(last, name)] = by_pair.get((last, name), 0.0) + gap / reps
    return idle / reps, by_pair


def host_seconds(planes, reps: int = 1) -> dict[str, tuple[float, float]]:
    """The host's records of a trace by name, per call: name -> (count, seconds). They are the "/host:CPU" plane's:
    the Python tracer's frames (`$file:line function`) and the runtime's own (PJRT's executes and transfers, XLA's
    command buffer updates and launches). Records nest, so a name's seconds include those of the records inside
    it."""
    per: dict[str, list[float]] = {}
    for plane in planes:
        if plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for ev in line.events:
                    n_s = per.setdefault(ev.name, [0.0, 0.0])
                    n_s[0] += 1 / reps
                    n_s[1] += ev.duration_ns * 1e-9 / reps
    return {name: (n, s) for name, (n, s) in per.items()}


def busiest_host(host: dict[str, tuple[float, float]], n: int = 10, always: str = "command_buffer") -> str:
    """The n host records with the most time per call, and every record whose name holds `always` (XLA's command
    buffer updates and launches: whether a step re-records its CUDA graphs), as "name count x ms"."""
    top = sorted(host.items(), key=lambda kv: -kv[1][1])
    shown = top[:n] + [kv for kv in top[n:] if always in kv[0]]
    return ", ".join(f"{name[:48]} {c:.1f} x {s * 1e3:.3f}" for name, (c, s) in shown) or "none"


def write_records(path: str, planes) -> None:
    """Every record of the busiest GPU plane in start order, as tab-separated name, start (us from the first) and
    duration (us): the sequence of a step's launches, to see which small kernels and copies it runs."""
    events = sorted(busiest_gpu_events(planes), key=lambda ev: ev.start_ns)
    t0 = events[0].start_ns if events else 0
    with open(path, "w") as f:
        for ev in events:
            f.write(f"{ev.name}\t{(ev.start_ns - t0) / 1e3:.1f}\t{ev.duration_ns / 1e3:.1f}\n")


def idle_gaps(spans):
    """(start, stop, name) records (any order, any one time unit) -> (gap, the record that ended last before it,
    the record after it) for each stretch in which none of them runs, in time order."""
    spans = sorted(spans)
    if not spans:
        return
    end, last = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            yield start - end, last, name
        if stop >= end:
            end, last = stop, name


def longest(kernels: dict[str, float], n: int = 8) -> str:
    """The n kernels with the most time per step, with their share of the step's kernel time."""
    total = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name[:40]} {t * 1e3:.2f} ({t / total:.0%})" for name, t in top)


def widest(pairs: dict[tuple[str, str], float], n: int = 6) -> str:
    """The n pairs of records (before -> after) with the most idle GPU time between them per step."""
    top = sorted(pairs.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{a[:32]} -> {b[:32]} {t * 1e3:.2f}" for (a, b), t in top) or "none"


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of an XLA elementwise pass over a large buffer, counting read + write (XLA's own copy ceiling)."""
    n = int(gib * 2**30) // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 2)
    return 2 * x.nbytes / timed(f, x)


def torch_copy_bandwidth(gib: float = 2.0) -> float | None:
    """Bytes/s of torch's device-to-device copy_ (the card's practical copy ceiling), if torch with CUDA is here."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / sorted(times)[5]


def matmul_flops(n: int = 8192) -> float:
    """FLOP/s of a bf16 n x n x n matmul through XLA."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 / timed(f, a, b)


def count(n: int) -> str:
    """A parameter count in the unit that shows it: 1.23B, 45.6M, 7.8K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def header() -> str:
    dev = jax.devices()[0]
    return f"date {datetime.date.today().isoformat()}, device {dev.device_kind} ({dev.platform}), jax {jax.__version__}"
