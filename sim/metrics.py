"""vLLM-named Prometheus metrics on a per-simulator registry (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket edges copied from vLLM's v1 metrics, so dashboards and alerts carry over.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on


class SimMetrics:
    def __init__(
        self,
        model: str,
        cache_info: dict[str, str],
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        base = ["model_name", "engine"]
        lv = {"model_name": model, "engine": "0"}

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            # Read live on scrape: nothing to keep in sync.
            Gauge(name, doc, base, registry=r).labels(**lv).set_function(fn)

        gauge("vllm:num_requests_running", "Requests in model execution batches.", running)
        gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage)

        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*base, *cache_info],
            registry=r,
        )
        info.labels(**lv, **cache_info).set(1)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, base, registry=r)

        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(**lv)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**lv)
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(**lv)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**lv)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(**lv)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*base, "finished_reason"],
            registry=r,
        )
        self._lv = lv

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, base, buckets=buckets, registry=r).labels(**lv)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            E2E_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            E2E_BUCKETS,
        )

    def success(self, finished_reason: str) -> None:
        self._success.labels(**self._lv, finished_reason=finished_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
