"""The serving benchmark's clients: one thread per request streaming its tokens over gRPC and timing them
(run_one, run_clients), those threads in a process of their own (ClientProcess), and a PD deployment's warm-up
requests (warm_pd)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from hcfjax import trace


def run_one(stub, prompt, max_new, t_arrival, record, request_id: str = ""):
    from hcfjax.serving import hcfjax_pb2 as pb
    from hcfjax.serving.client import generate_stream

    t_first = t_last = None
    n, finish = 0, None
    trace.mark("send", request_id)
    try:
        stream = generate_stream(
            stub, prompt, max_new_tokens=int(max_new), ignore_eos=True, timeout=600, request_id=request_id
        )
        for chunk in stream:
            now = time.perf_counter()
            if chunk.token_ids:
                if t_first is None:
                    trace.mark("client_first", request_id)
                t_first = t_first or now
                t_last, n = now, n + len(chunk.token_ids)
            if chunk.finish_reason:
                finish = pb.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()
    except Exception as e:  # noqa: BLE001 - counted, reported
        finish = f"error: {e.code().name if hasattr(e, 'code') else type(e).__name__}"
    record.append(
        {
            "ttft": None if t_first is None else t_first - t_arrival,
            "tpot": (t_last - t_first) / (n - 1) if n > 1 else None,
            "out": n,
            "finish": finish,
            "end": time.perf_counter(),
        }
    )


def warm_pd(stub, ins, limit: int, rows: int) -> float:
    """A PD deployment's first requests of each prompt-length bucket, `rows` at a time, before timing (the prefill
    worker compiled its shapes at start; this warms the rest of the path). -> seconds."""
    from hcfjax.serving.client import generate

    t0 = time.perf_counter()
    for k in sorted({min(1 << i, limit // 2) for i in range(4, int(ins.max()).bit_length() + 1)}):
        with ThreadPoolExecutor(rows) as pool:  # batches of every row count, too
            list(pool.map(lambda _, k=k: generate(stub, [1] * k, max_new_tokens=2, ignore_eos=True), range(2)))
    return time.perf_counter() - t0


def run_clients(stub, prompts, outs, arrivals, tag: str = "bench-") -> tuple[list[dict], float]:
    """The workload's requests at their arrival times, one client thread each, with request ids tag0, tag1, ...;
    -> (a record per request, seconds from the first arrival to the last response)."""
    n = len(prompts)
    record: list[dict] = []
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        for i in range(n):
            delay = start + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(run_one, stub, prompts[i].tolist(), outs[i], start + arrivals[i], record, f"{tag}{i}")
    return record, max(r["end"] for r in record) - start


class ClientProcess:
    """run_clients in a process of its own, connected to the server's port: a client thread per request, each
    streaming its tokens, would otherwise take turns with the server's engine loop for this process's interpreter
    lock, which no real client does. One process serves every rate (spawned once: it imports the client alone)."""

    def __init__(self, port: int):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(1, mp_context=context, initializer=_client_connect, initargs=(port,))

    def run(self, prompts, outs, arrivals, tag: str) -> tuple[list[dict], float]:
        return self._pool.submit(_client_run, prompts, outs, arrivals, tag).result()

    def close(self) -> None:
        self._pool.shutdown()


_client_stub = None


def _client_connect(port: int) -> None:
    global _client_stub
    from hcfjax.serving.client import connect

    if trace_dir := os.environ.get(trace.DIR_VARIABLE):
        trace.enable(trace_dir)
    _, _client_stub = connect("127.0.0.1", port, ready_timeout=30)


def _client_run(prompts, outs, arrivals, tag: str) -> tuple[list[dict], float]:
    return run_clients(_client_stub, prompts, outs, arrivals, tag)
