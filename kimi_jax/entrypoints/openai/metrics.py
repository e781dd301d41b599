"""The server's Prometheus metrics: vLLM's names under the `kimi_jax:` prefix, one registry per
server; the gauges and prefix-cache counters are read from the engine at scrape time."""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)
from prometheus_client.core import CounterMetricFamily

from kimi_jax.engine import compiles

_TTFT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class ServerMetrics:
    def __init__(self, async_llm, model_name: str):
        disable_created_metrics()              # no *_created series (as vLLM)
        self.registry = CollectorRegistry()
        lab = {"model_name": model_name}
        P = "kimi_jax:"

        def gauge(name, doc, fn):
            g = Gauge(P + name, doc, list(lab), registry=self.registry)
            g.labels(**lab).set_function(fn)

        gauge(
            "num_requests_running", "Requests in the running batch.", lambda: async_llm.num_running
        )
        gauge("num_requests_waiting", "Requests waiting for a slot.", lambda: async_llm.num_waiting)
        gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache pages in use (1 = all).",
            lambda: async_llm.kv_cache_usage,
        )
        self.registry.register(
            _EngineCounters(
                async_llm,
                lab,
                {
                    "prefix_cache_queries": (
                        "Prompt tokens looked up in the prefix cache.",
                        "prefix_cache_queries",
                    ),
                    "prefix_cache_hits": (
                        "Prompt tokens found in the prefix cache.",
                        "prefix_cache_hits",
                    ),
                },
            )
        )
        compiles.install()
        self.registry.register(_Compiles(lab))
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", list(lab),
                                     registry=self.registry).labels(**lab)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", list(lab),
                                         registry=self.registry).labels(**lab)
        self._success = Counter(P + "request_success", "Requests finished, by finish reason.",
                                [*lab, "finished_reason"], registry=self.registry)
        self._lab = lab
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Seconds from arrival to the first token.",
            list(lab),
            buckets=_TTFT,
            registry=self.registry,
        ).labels(**lab)
        self.tpot = Histogram(
            P + "time_per_output_token_seconds",
            "Mean seconds between a request's later " "tokens.",
            list(lab),
            buckets=_TPOT,
            registry=self.registry,
        ).labels(**lab)
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Seconds from arrival to the last token.",
            list(lab),
            buckets=_E2E,
            registry=self.registry,
        ).labels(**lab)

    def finished(self, r) -> None:
        """A request the engine finished (not aborted): its latencies and finish reason."""
        self._success.labels(**self._lab, finished_reason=r.finish_reason).inc()
        n = len(r.output_ids)
        if r.first_token_time is not None and r.arrival_time is not None:
            self.ttft.observe(r.first_token_time - r.arrival_time)
        if n > 1 and r.finished_time is not None and r.first_token_time is not None:
            self.tpot.observe((r.finished_time - r.first_token_time) / (n - 1))
        if r.finished_time is not None and r.arrival_time is not None:
            self.e2e.observe(r.finished_time - r.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters:
    """Counters holding the engine's running totals (EngineCore.stats), read at scrape time."""

    def __init__(self, async_llm, labels: dict, counters: dict):
        self._llm, self._labels, self._counters = async_llm, labels, counters

    def collect(self):
        stats = self._llm.core.stats
        for name, (doc, key) in self._counters.items():
            c = CounterMetricFamily("kimi_jax:" + name, doc, labels=list(self._labels))
            c.add_metric(list(self._labels.values()), float(stats.get(key, 0)))
            yield c


class _Compiles:
    """The programs this process has built (kimi_jax.engine.compiles): flat after start-up when the
    precompiled set covers the workload."""

    def __init__(self, labels: dict):
        self._labels = labels

    def collect(self):
        c = CounterMetricFamily("kimi_jax:compiled_programs", "Programs jax built in this process.",
                                labels=list(self._labels))
        c.add_metric(list(self._labels.values()), float(compiles.compile_count()))
        yield c
