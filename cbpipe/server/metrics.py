"""Prometheus metrics of the HTTP front end, named as vLLM's ``vllm:`` metrics are, under
``cbpipe:``.

Latencies and token counts are measured here, per HTTP request, as the server saw them; the
gauges (running and waiting requests, KV-cache use) are the engine's, read at scrape time.
With several server processes (``--api-server-count``) prometheus_client's multiprocess
mode adds their counters and histograms up: the launcher's children set
``PROMETHEUS_MULTIPROC_DIR`` before this module is imported.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from cbpipe.protocol.messages import Stats

MULTIPROC_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, so dashboards made for it read these too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    """The metrics of one server process, each labelled with the served model's name."""

    def __init__(self, model_name: str) -> None:
        self.multiprocess = MULTIPROC_DIR_VARIABLE in os.environ
        # Our own registry: in multiprocess mode it is never read (the collector reads the
        # files every process writes), otherwise it is what /metrics shows.
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, names, buckets=buckets, registry=self.registry)
            return metric.labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            metric = Gauge(name, doc, names, registry=self.registry, multiprocess_mode="mostrecent")
            return metric.labels(**labels)

        self.time_to_first_token = histogram(
            "cbpipe:time_to_first_token_seconds",
            "From a request's arrival to its first token, per sample.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "cbpipe:inter_token_latency_seconds",
            "Between two successive outputs of a sample, as the server received them.",
            ITL_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "cbpipe:request_time_per_output_token_seconds",
            "A sample's time after its first token, over its tokens after the first.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "cbpipe:e2e_request_latency_seconds",
            "From a request's arrival to a sample's last token.",
            REQUEST_BUCKETS,
        )
        self.request_queue_time = histogram(
            "cbpipe:request_queue_time_seconds",
            "From a request's arrival at the engine to its first step.",
            REQUEST_BUCKETS,
        )
        self.num_requests_running = gauge(
            "cbpipe:num_requests_running", "Sequences in the engine's running set."
        )
        self.num_requests_waiting = gauge(
            "cbpipe:num_requests_waiting", "Sequences waiting for the engine to admit them."
        )
        self.kv_cache_usage = gauge(
            "cbpipe:kv_cache_usage_perc", "Share of the KV-cache blocks in use, 0 to 1."
        )
        # Engine totals, read from its Stats: gauges, since every server process sees the same
        # totals and counters would add them up across processes.
        self.prefix_cache_queries = gauge(
            "cbpipe:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache since the engine started.",
        )
        self.prefix_cache_hits = gauge(
            "cbpipe:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not computed) since the engine started.",
        )
        self.prompt_tokens = Counter(
            "cbpipe:prompt_tokens", "Prompt tokens of the requests served.", names,
            registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.generation_tokens = Counter(
            "cbpipe:generation_tokens", "Tokens generated for the requests served.", names,
            registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self._request_success = Counter(
            "cbpipe:request_success",
            "Samples finished, by finish reason (stop, length; cancelled when the client left).",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self._labels = labels
        self._http_errors = Counter(
            "cbpipe:http_request_errors",
            "Requests answered with an error, by HTTP status.",
            [*names, "status"],
            registry=self.registry,
        )

    def request_finished(self, reason: str) -> None:
        self._request_success.labels(**self._labels, finished_reason=reason).inc()

    def request_failed(self, status: int) -> None:
        self._http_errors.labels(**self._labels, status=str(status)).inc()

    def set_engine_stats(self, stats: Stats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_queries.set(stats.num_prefix_query_tokens)
        self.prefix_cache_hits.set(stats.num_prefix_hit_tokens)

    def exposition(self) -> bytes:
        """The text format of every metric: this process's, or all processes' added up."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)
