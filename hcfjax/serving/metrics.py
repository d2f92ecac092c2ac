"""Prometheus metrics of the server: latency histograms and counters from finished requests, gauges from the engine.

Each Metrics has its own registry (several servers can live in one process, as in the tests). The gauges are read
from engine.snapshot() at scrape time, so they are never stale and need no thread.

    hcfjax_time_to_first_token_seconds   histogram   arrival -> first token (the engine's clock)
    hcfjax_time_per_output_token_seconds histogram   (last token - first token) / (output tokens - 1)
    hcfjax_requests_total{finish_reason} counter     stop | length | abort | error
    hcfjax_rejected_requests_total{code} counter     INVALID_ARGUMENT | UNAUTHENTICATED | NOT_FOUND |
                                                     RESOURCE_EXHAUSTED | UNAVAILABLE (HTTP: under gRPC's names)
    hcfjax_prompt_tokens_total, hcfjax_output_tokens_total
    hcfjax_draft_tokens_total, hcfjax_accepted_draft_tokens_total, hcfjax_draft_acceptance_rate
    hcfjax_queue_length, hcfjax_running_requests, hcfjax_cache_usage_ratio, hcfjax_free_pages,
    hcfjax_engine_steps_total, hcfjax_compiles_total, hcfjax_should_grow, hcfjax_compiling   (from the engine)
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from hcfjax.serving.guards import key_matches

log = logging.getLogger("hcfjax.serving")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)


class Metrics:
    def __init__(self, engine=None, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram(
            "hcfjax_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "hcfjax_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.requests = Counter("hcfjax_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("hcfjax_rejected_requests", "Requests refused at submission", ["code"], registry=r)
        self.prompt_tokens = Counter("hcfjax_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.output_tokens = Counter("hcfjax_output_tokens", "Output tokens of finished requests", registry=r)
        self.draft_tokens = Counter("hcfjax_draft_tokens", "Speculative draft tokens verified", registry=r)
        self.accepted_draft_tokens = Counter(
            "hcfjax_accepted_draft_tokens", "Speculative draft tokens accepted", registry=r
        )
        if engine is not None:
            r.register(_EngineCollector(engine, self))
        self._http = None
        self._lock = threading.Lock()
        self._drafts = self._accepted = 0

    @property
    def drafts(self) -> tuple[int, int]:
        """(verified, accepted) draft tokens so far."""
        with self._lock:
            return self._drafts, self._accepted

    def observe_finish(self, out, req=None, first_token_time: float | None = None, finish_time: float | None = None):
        """Records a finished request from its terminal Output. TPOT uses the engine's token times when the request
        has them (req.first_token_time / last_token_time), else the given server-side times."""
        u = out.usage
        self.requests.labels(out.finish.value).inc()
        self.prompt_tokens.inc(u.prompt_tokens)
        self.output_tokens.inc(u.output_tokens)
        self.draft_tokens.inc(u.draft_tokens)
        self.accepted_draft_tokens.inc(u.accepted_draft_tokens)
        with self._lock:
            self._drafts += u.draft_tokens
            self._accepted += u.accepted_draft_tokens
        if u.ttft_s is not None:
            self.ttft.observe(u.ttft_s)
        if req is not None and req.first_token_time is not None and req.last_token_time is not None:
            first_token_time, finish_time = req.first_token_time, req.last_token_time
        if u.output_tokens > 1 and first_token_time is not None and finish_time is not None:
            self.tpot.observe((finish_time - first_token_time) / (u.output_tokens - 1))

    def serve(self, port: int, host: str = "127.0.0.1", api_key: str | None = None) -> int:
        """Serves /metrics over HTTP on host:port (0: a free port) on a thread; returns the bound port. api_key:
        scrapes must send `Authorization: Bearer KEY` (401 otherwise)."""
        app = make_wsgi_app(self.registry)
        if api_key is not None:
            app = _needing_key(app, api_key)

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._http = make_server(host, port, app, Server, handler_class=_QuietHandler)
        threading.Thread(target=self._http.serve_forever, name="hcfjax-metrics", daemon=True).start()
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass  # no line per scrape on stderr


def _needing_key(app, api_key: str):
    """The WSGI app behind a bearer-token check."""

    def guarded(environ, start_response):
        if key_matches(environ.get("HTTP_AUTHORIZATION"), api_key):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"a valid API key is needed (Authorization: Bearer KEY)\n"]

    return guarded


class _EngineCollector:
    """Gauges read from engine.snapshot() at each scrape."""

    def __init__(self, engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics

    def describe(self):
        return []  # the names come from collect(); an empty describe keeps registration from calling snapshot()

    def collect(self):
        try:
            s = self.engine.snapshot()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is stopping
            log.exception("engine snapshot failed")
            return
        gauges = [
            ("hcfjax_queue_length", "Requests waiting for a decode slot", s["queued"]),
            ("hcfjax_running_requests", "Requests prefilling or decoding", s["running"]),
            ("hcfjax_cache_usage_ratio", "Fraction of KV cache pages in use", s["cache_used"]),
            ("hcfjax_free_pages", "Free KV cache pages", s["free_pages"]),
            ("hcfjax_should_grow", "1 when the engine reports it needs more capacity", float(s["should_grow"])),
            ("hcfjax_compiling", "1 while step shapes still compile in the background", float(s["compiling"])),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("hcfjax_engine_steps", "Engine steps dispatched", value=s["steps"])
        yield CounterMetricFamily("hcfjax_compiles", "Compilations of the engine's step functions", value=s["compiles"])
        drafts, accepted = self.metrics.drafts
        rate = accepted / drafts if drafts else math.nan
        yield GaugeMetricFamily("hcfjax_draft_acceptance_rate", "Accepted / verified draft tokens", value=rate)
