"""The simulated and benchmarked workload: Poisson arrivals with log-normal request lengths after the reference
deployment's (input mean 3.5k tokens, max 16k; output mean 1.2k, max 32k), and the SLO requests are judged by.
The serving benchmark (hcfjax.bench.serve) draws its requests here too, so a simulation and a benchmark run of the
same seed serve the same requests.
"""

from __future__ import annotations

import csv
import dataclasses
import math

import numpy as np

REFERENCE = {"input_mean": 3500, "input_max": 16384, "output_mean": 1200, "output_max": 32768}
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.050


def draw_lengths(rng, n: int, mean: float, cap: int, scale: float, lo: int = 1) -> np.ndarray:
    sigma = 0.8
    mu = math.log(mean) - sigma**2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
    x = np.minimum(rng.lognormal(mu, sigma, n), cap) * scale
    return np.maximum(np.round(x), lo).astype(int)


def workload(
    seed: int,
    n: int,
    rate: float,
    scale: float,
    limit: int,
    vocab: int | None,
    output_scale: float | None = None,
    max_input: int | None = None,
):
    """The requests for a seed: (input lengths, output lengths, prompts, arrival times in s).

    Lengths follow REFERENCE, inputs scaled by `scale` and outputs by `output_scale` (default `scale`), inputs clipped
    at `max_input` (default limit // 2) and outputs to fit the context of `limit` tokens. The scales change no draw,
    so runs of one seed serve the same requests at other lengths. With vocab None the prompts are not drawn (None),
    which changes the arrival times; the simulator passes the model's vocabulary to get exactly the serving
    benchmark's workload (hcfjax.bench.serve draws its prompts here)."""
    rng = np.random.default_rng(seed)
    ins = draw_lengths(rng, n, REFERENCE["input_mean"], REFERENCE["input_max"], scale)
    outs = draw_lengths(
        rng, n, REFERENCE["output_mean"], REFERENCE["output_max"], scale if output_scale is None else output_scale
    )
    ins = np.minimum(ins, limit // 2 if max_input is None else max_input)
    outs = np.minimum(outs, limit - ins)
    prompts = None if vocab is None else [rng.integers(1, vocab, size=k) for k in ins]  # numpy arrays
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return ins, outs, prompts, arrivals


@dataclasses.dataclass(frozen=True)
class Workload:
    """Poisson arrivals with log-normal lengths (workload(): the serving benchmark's requests for the same seed
    when `vocab` is the bench model's), or a CSV trace (arrival_s, input, output)."""

    requests: int = 1000
    rate: float = 2.0  # per second
    seed: int = 0
    scale: float = 1.0
    max_model_len: int = REFERENCE["input_max"] + REFERENCE["output_max"]
    vocab: int | None = None
    trace: str | None = None
    # True: run until every request finished and measure as the bench does (over the whole run). False: stop once
    # the last request has its first token and measure throughput over the arrival window (after the first 20% of
    # arrivals, a warm-up); long-tailed outputs (32k tokens) otherwise leave a tail of a few requests decoding alone.
    drain: bool = True

    def replace(self, **kw) -> Workload:
        return dataclasses.replace(self, **kw)

    def requests_list(self) -> list[tuple[float, int, int]]:
        """[(arrival s, input tokens, output tokens)] sorted by arrival."""
        if self.trace:
            with open(self.trace) as f:
                rows = [(float(r["arrival_s"]), int(r["input"]), int(r["output"])) for r in csv.DictReader(f)]
            return sorted(rows)[: self.requests] if self.requests else sorted(rows)
        ins, outs, _, arrivals = workload(
            self.seed, self.requests, self.rate, self.scale, self.max_model_len, self.vocab
        )
        return [(float(a), int(i), int(o)) for a, i, o in zip(arrivals, ins, outs, strict=True)]


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_s: float = SLO_TTFT_S
    tpot_s: float = SLO_TPOT_S
    attainment: float = 0.9  # the share of requests that must meet both
