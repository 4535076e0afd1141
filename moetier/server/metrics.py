"""Prometheus metrics at ``/metrics``, named like vLLM's (``vllm:`` becomes ``moetier:``).

Latencies are measured by the server per request (``time_to_first_token_seconds`` from arrival to
the first generated token, queueing included; ``inter_token_latency_seconds`` between successive
token-carrying updates; ``e2e_request_latency_seconds``). Engine state (running and waiting
requests, KV-cache use, token, prefill and prefix-cache counters, the elastic expert cache's size) is read from
the engine's ``stats()`` at scrape time, so the numbers cannot drift from the engine's own. Each app owns
its registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "moetier:"
_TTFT_BUCKETS = (
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
    160.0,
    640.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
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
_E2E_BUCKETS = (
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
    1920.0,
    7680.0,
)


class _EngineStatsCollector(Collector):
    """Gauges and counters taken from ``stats()`` of the engine (nothing while the model loads)."""

    def __init__(self, stats: Callable[[], Any | None], model_name: Callable[[], str]) -> None:
        self._stats, self._model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        label = [self._model_name()]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        capacity = getattr(stats, "kv_tokens_capacity", 0) or 0
        used = getattr(stats, "kv_tokens_used", 0) or 0
        if getattr(stats, "kv_pool_blocks", None):  # paged KV: the pools' blocks held (sized at start-up)
            capacity, used = stats.kv_pool_blocks, stats.kv_pool_blocks_used
        yield gauge("num_requests_running", "Requests decoding in the engine.", stats.running)
        yield gauge("num_requests_waiting", "Requests queued for the engine.", stats.waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache use, 0 to 1 (1 = full).", used / capacity if capacity else 0.0)
        pool_used = getattr(stats, "kv_pool_bytes_used", None)
        if pool_used is not None:  # paged KV: what the blocks really hold (shared prefixes counted once)
            yield gauge("kv_pool_used_bytes", "Bytes of paged-KV blocks held by sequences and snapshots.", pool_used)
            yield gauge(
                "kv_pool_allocated_bytes", "Bytes of the paged-KV pools.", getattr(stats, "kv_pool_bytes_allocated", 0)
            )
        yield counter("prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter(
            "preemptions",
            "Running requests preempted to free KV (recomputed when re-admitted).",
            getattr(stats, "preemptions_total", 0),
        )
        yield counter(
            "prefix_shared_deferrals",
            "Requests held back to reuse a prefix another running request was prefilling.",
            getattr(stats, "prefix_shared_deferrals_total", 0),
        )
        yield counter(
            "prefix_shared_tokens_saved",
            "Prompt tokens such requests took from the prefix cache instead of computing.",
            getattr(stats, "prefix_shared_tokens_saved_total", 0),
        )
        yield counter(
            "prefill_seconds", "Wall seconds of engine steps that computed prompt tokens.", stats.prefill_seconds_total
        )
        yield counter(
            "prefill_computed_tokens",
            "Prompt tokens computed by the model (prefix-cache hits excluded).",
            stats.prefill_computed_tokens_total,
        )
        yield gauge(
            "prefill_tokens_per_second",
            "Prefill throughput over the last ~30 s of prefill work (kept while idle).",
            stats.prefill_tokens_per_second,
        )
        yield gauge(
            "prefill_in_progress_tokens",
            "Prompt tokens the running requests have still to prefill.",
            stats.prefill_remaining_tokens,
        )
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        if getattr(stats, "decode_graph_captures_total", None) is not None:
            yield counter(
                "decode_graph_captures", "Decode CUDA graphs captured (each new batch of caches, bucket or variant).",
                stats.decode_graph_captures_total,
            )  # fmt: skip
        if getattr(stats, "spare_caches", None) is not None:
            yield gauge("spare_caches", "Finished sequences' caches waiting for new sequences.", stats.spare_caches)
            yield counter(
                "spare_cache_reuses", "Sequences started in a finished sequence's cache (its decode graphs replay).",
                stats.spare_cache_reuses_total,
            )  # fmt: skip
        if getattr(stats, "expert_cache_slots", None) is not None:  # tiered experts: the elastic cache
            yield gauge("tier_expert_cache_slots", "Expert slots in the VRAM cache now.", stats.expert_cache_slots)
            yield gauge("tier_expert_cache_bytes", "Bytes of the VRAM expert cache now.", stats.expert_cache_bytes)
            yield gauge("tier_expert_cache_max_slots", "The plan's expert-cache size.", stats.expert_cache_max_slots)
            yield counter(
                "tier_expert_cache_resizes", "Elastic resizes of the expert cache for KV.", stats.expert_cache_resizes
            )
            yield gauge("kv_cache_bytes", "Bytes the running sequences' KV caches hold.", stats.kv_cache_bytes)


def dispatcher_metrics(engine: Any) -> Any | None:
    """The :class:`~moetier.tiers.metrics.TierMetrics` behind a serving engine, or None (all resident).

    Unwraps ``AsyncEngine.engine`` and test wrappers' ``inner`` down to the engine's model dispatcher.
    """
    for _ in range(4):
        model = getattr(engine, "model", None)
        dispatcher = getattr(model, "dispatcher", None)
        if dispatcher is not None:
            return getattr(dispatcher, "metrics", None)
        engine = getattr(engine, "engine", None) or getattr(engine, "inner", None)
        if engine is None:
            return None
    return None


class _TierCollector(Collector):
    """The tiered expert path's counters (:class:`~moetier.tiers.metrics.TierMetrics`), when it has them.

    Hit rates are gauges of the whole run; per-layer series carry a ``layer`` label. Counters are
    read at scrape time from the dispatcher's own (reset-able) counters.
    """

    def __init__(self, tier_metrics: Callable[[], Any | None], model_name: Callable[[], str]) -> None:
        self._metrics, self._model_name = tier_metrics, model_name

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics()
        if metrics is None:
            return
        name = self._model_name()
        for attempt in range(3):
            try:  # the engine thread may add a layer's counters while we read them: read again
                snap, total = metrics.snapshot(), metrics.total()
                break
            except RuntimeError:
                if attempt == 2:
                    return
        families = [
            (
                GaugeMetricFamily,
                "tier_hit_rate",
                "Share of (token, expert) uses served from the VRAM expert cache.",
                snap["hit_rate"],
            ),
            (
                GaugeMetricFamily,
                "tier_misses_per_token",
                "Missed (token, expert) pairs per token, over all layers.",
                snap["misses_per_token"],
            ),
            (
                CounterMetricFamily,
                "tier_expert_uses_hit",
                "(token, expert) uses served from the VRAM cache.",
                total.uses_hit,
            ),
            (
                CounterMetricFamily,
                "tier_expert_uses_miss",
                "(token, expert) uses that missed the VRAM cache.",
                total.uses_miss,
            ),
            (CounterMetricFamily, "tier_tokens", "Tokens that went through the tiered expert path.", metrics.tokens),
            (CounterMetricFamily, "tier_cpu_seconds", "Seconds the CPU expert tier computed.", total.cpu_seconds),
            (CounterMetricFamily, "tier_cpu_jobs_marked", "Native CPU-tier jobs with marks.", total.cpu_jobs_marked),
            (
                CounterMetricFamily,
                "tier_cpu_team_start_seconds",
                "Seconds native CPU-tier jobs waited for their last thread to join.",
                total.cpu_team_start_seconds,
            ),
            (
                CounterMetricFamily,
                "tier_cpu_threads_joined",
                "Threads that joined native CPU-tier jobs (divide by tier_cpu_jobs_marked).",
                total.cpu_threads_joined,
            ),
            (
                CounterMetricFamily,
                "tier_copy_bytes",
                "Bytes copied host->device to compute missed experts.",
                total.copy_bytes,
            ),
            (
                CounterMetricFamily,
                "tier_admit_bytes",
                "Bytes copied host->device only to fill the expert cache.",
                total.admit_bytes,
            ),
        ]
        for kind, metric, doc, value in families:
            family = kind(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        per_layer = [
            (GaugeMetricFamily, "tier_layer_hit_rate", "VRAM expert-cache hit rate of one MoE layer.", "hit_rate"),
            (
                CounterMetricFamily,
                "tier_layer_cpu_seconds",
                "Seconds the CPU expert tier computed for one layer.",
                "cpu_seconds",
            ),
            (
                CounterMetricFamily,
                "tier_layer_copy_bytes",
                "Bytes copied host->device for one layer's misses.",
                "copy_bytes",
            ),
        ]
        for kind, metric, doc, key in per_layer:
            family = kind(PREFIX + metric, doc, labels=["model_name", "layer"])
            for layer, counters in snap["per_layer"].items():
                family.add_metric([name, str(layer)], counters[key])
            yield family
        scales = dict(getattr(metrics, "route_cost_scales", {}))
        if scales:  # the miss split adapting: seconds measured per second the start-up costs predicted
            family = GaugeMetricFamily(
                PREFIX + "tier_route_cost_scale",
                "Measured / start-up cost of a miss route (cpu, copy) while decoding.",
                labels=["model_name", "route"],
            )
            for route, scale in sorted(scales.items()):
                family.add_metric([name, route], scale)
            yield family
        choices = getattr(metrics, "split_choices", dict)()
        if choices:  # the decode split chosen per batch size by measured step time
            family = GaugeMetricFamily(
                PREFIX + "tier_split_copies_only",
                "1 when decode steps of this many tokens copy every miss (faster measured), 0 when they split.",
                labels=["model_name", "tokens"],
            )
            for tokens, choice in choices.items():
                family.add_metric([name, str(tokens)], float(choice["route"] == "copy"))
            yield family
            family = GaugeMetricFamily(
                PREFIX + "tier_decode_route",
                "1 for the miss route decode steps of this many tokens chose by measured step time "
                "(auto: the split, copy: copies only, mapped: the GPU reads misses from pinned host memory).",
                labels=["model_name", "tokens", "route"],
            )
            for tokens, choice in choices.items():
                family.add_metric([name, str(tokens), str(choice["route"])], 1.0)
            yield family


class ServerMetrics:
    """The server's Prometheus registry and the request-level series it records.

    ``tier_metrics`` (optional) returns the tiered dispatcher's counters (or None): exported as
    ``moetier:tier_*`` series.
    """

    def __init__(
        self,
        stats: Callable[[], Any | None],
        model_name: Callable[[], str],
        tier_metrics: Callable[[], Any | None] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between successive generated tokens of a request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Finished generations (one per choice), by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(stats, model_name))
        if tier_metrics is not None:
            self.registry.register(_TierCollector(tier_metrics, model_name))

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(self._model_name()).observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.labels(self._model_name()).observe(seconds)

    def observe_finished(self, finish_reason: str, e2e_seconds: float) -> None:
        self.finished.labels(self._model_name(), finish_reason).inc()
        self.e2e.labels(self._model_name()).observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-generation latency bookkeeping: call :meth:`tokens` on each token-carrying update."""

    def __init__(self, metrics: ServerMetrics | None, arrival: float) -> None:
        self.metrics, self.arrival = metrics, arrival
        self.last: float | None = None

    def tokens(self, now: float) -> None:
        if self.metrics is None:
            return
        if self.last is None:
            self.metrics.observe_ttft(now - self.arrival)
        else:
            self.metrics.observe_itl(now - self.last)
        self.last = now

    def finished(self, finish_reason: str, now: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_finished(finish_reason, now - self.arrival)
