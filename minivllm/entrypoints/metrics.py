"""Prometheus metrics (SPEC §6): the seed's three names and vLLM-style `minivllm:` gauges, counters and
histograms, on a registry of their own (one per server)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from minivllm.engine.stats import IterationStats, SchedulerSnapshot
from minivllm.slo import CLASS_NAMES

_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0)  # the seed's 0.1…50 s
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)
_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
FINISH_REASONS = ("stop", "length", "abort")
PREEMPTION_MODES = ("recompute", "swap")  # how a preemption went (auto picks one of the two each time)
HTTP_ENDPOINTS = ("/generate", "/batch_generate", "/ws/generate", "/v1/completions", "/v1/chat/completions",
                  "/v1/messages", "/v1/responses", "/v1/embeddings")
# gRPC calls are labelled with their method path (grpc_server.ENDPOINTS; a test keeps the two in step).
GRPC_ENDPOINTS = ("/minivllm.v1.InferenceService/Generate", "/minivllm.v1.InferenceService/BatchGenerate",
                  "/minivllm.v1.InferenceService/GenerateStream", "/minivllm.v1.InferenceService/Tokenize",
                  "/minivllm.v1.InferenceService/Embed")
ENDPOINTS = HTTP_ENDPOINTS + GRPC_ENDPOINTS
OUTCOMES = ("success", "client_error", "server_error", "aborted")
# Families a front counts itself (HTTP requests, its event loop); every other family is the engine's.
FRONT_FAMILIES = frozenset({"inference_requests", "inference_request_latency_seconds",
                            "minivllm:event_loop_lag_seconds", "minivllm:event_loop_lag_max_seconds"})


class ServerMetrics:
    """Every metric of one server, plus the StatLogger that feeds the engine's ones."""

    def __init__(self, model_name: str, num_speculative_tokens: int = 0, engine_metrics: bool = True) -> None:
        """engine_metrics=False (a front before Ray Serve replicas): the engine's families are not exported
        here, since every replica reports its own (distributed/ray/metrics.py: ReplicaCollector labels them by
        replica)."""
        # No `*_created` series (vLLM turns them off too): each would be one more series per labelled child.
        disable_created_metrics()
        self.registry = r = CollectorRegistry()
        er = r if engine_metrics else CollectorRegistry()  # the engine's families (unexported when off)
        self._er = er
        ProcessCollector(registry=r)  # process_cpu_seconds_total, memory, fds: what the server process costs
        labels = {"model_name": model_name}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=er)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=er)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, [*names, *extra], buckets=buckets, registry=er)

        # Seed names, kept for the seed's dashboards.
        self.requests_total = Counter("inference_requests",
                                      "Generation requests (HTTP and gRPC), by endpoint and outcome",
                                      ["endpoint", "status"], registry=r)
        self.tokens_generated = Counter("inference_tokens_generated", "Generated tokens", registry=er)
        self.request_latency = Histogram("inference_request_latency_seconds",
                                         "Generation request latency (arrival to last byte), by endpoint",
                                         ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        # vLLM-style names.
        self.running = gauge("minivllm:num_requests_running", "Requests with a sequence in the running batch")
        self.waiting = gauge("minivllm:num_requests_waiting", "Requests queued for admission")
        self.kv_usage = gauge("minivllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)")
        self.prompt_tokens = counter("minivllm:prompt_tokens", "Prompt tokens of requests that started generating")
        self.generation_tokens = counter("minivllm:generation_tokens", "Generated tokens")
        self.preemptions = counter("minivllm:num_preemptions", "Preemptions of running sequences (either mode)")
        # The host tier of preemption_mode swap/auto (vLLM's names where vLLM has one); zero with recompute.
        self.preemptions_by_mode = counter("minivllm:num_preemptions_by_mode", "Preemptions of running sequences by "
                                           "mode: recompute (KV dropped) or swap (KV copied to the host tier)",
                                           ("mode",))
        self.swapped = gauge("minivllm:num_requests_swapped", "Requests preempted by swap (KV in the host tier)")
        self.cpu_usage = gauge("minivllm:cpu_cache_usage_perc", "Fraction of the host (swap) tier's KV blocks in use")
        self.swapped_blocks = gauge("minivllm:num_swapped_blocks", "KV blocks held in the host (swap) tier")
        self.swap_out_bytes = counter("minivllm:kv_swap_out_bytes", "KV bytes copied to the host tier")
        self.swap_in_bytes = counter("minivllm:kv_swap_in_bytes", "KV bytes copied back from the host tier")
        self.evicted_blocks = counter("minivllm:kv_evicted_blocks", "KV blocks released by sink-window eviction "
                                      "(--kv-eviction sink-window) from sequences still running")
        self.request_success = counter("minivllm:request_success", "Finished requests by finish reason",
                                       ("finished_reason",))
        self.prefix_queries = counter("minivllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("minivllm:prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.ttft = histogram("minivllm:time_to_first_token_seconds", "Arrival to first token", _TTFT_BUCKETS)
        self.itl = histogram("minivllm:inter_token_latency_seconds", "Time between a request's tokens", _ITL_BUCKETS)
        self.e2e = histogram("minivllm:e2e_request_latency_seconds", "Arrival to finish", _E2E_BUCKETS)
        self.queue_time = histogram("minivllm:request_queue_time_seconds", "Arrival to first scheduled",
                                    _E2E_BUCKETS)
        self.iteration_tokens = histogram("minivllm:iteration_tokens_total", "Tokens in one engine step",
                                          _TOKENS_BUCKETS)
        # SLO classes (slo.py: priority <= 0 interactive, 1 batch, >= 2 background). New families rather than a
        # label on the ones above, whose series and the dashboards that sum them stay as they were.
        self.deadline_misses = counter("minivllm:request_deadline_miss", "Requests whose first token came after "
                                       "their TTFT deadline (or that ended past it without one), by priority class",
                                       ("class",))
        self.ttft_by_class = histogram("minivllm:time_to_first_token_by_class_seconds",
                                       "Arrival to first token, by priority class", _TTFT_BUCKETS, ("class",))
        self.queue_time_by_class = histogram("minivllm:request_queue_time_by_class_seconds",
                                             "Arrival to first scheduled, by priority class", _E2E_BUCKETS, ("class",))
        self.loop_lag = Histogram("minivllm:event_loop_lag_seconds", "Asyncio event-loop lag (timer probe)",
                                  buckets=_LAG_BUCKETS, registry=r)
        self.loop_lag_max = Gauge("minivllm:event_loop_lag_max_seconds", "Largest event-loop lag seen",
                                  registry=r)
        # Speculative decoding's counters (vLLM's names), only on a server that speculates.
        self.spec = None
        if num_speculative_tokens:
            self.spec = (counter("minivllm:spec_decode_num_drafts", "Sequences verified with proposals, per step"),
                         counter("minivllm:spec_decode_num_draft_tokens", "Proposed tokens verified"),
                         counter("minivllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted"),
                         counter("minivllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted proposals by position in the draft (0 = first)", ("position",)))
            for c in self.spec[:3]:
                c.labels(**labels)
            for i in range(num_speculative_tokens):
                self.spec[3].labels(**labels, position=str(i))
        self._lbl = labels
        self._lag_max = 0.0
        # Every series exists from the start (value 0), so dashboards and rate() work before any request.
        for reason in FINISH_REASONS:
            self.request_success.labels(**labels, finished_reason=reason)
        for mode in PREEMPTION_MODES:
            self.preemptions_by_mode.labels(**labels, mode=mode)
        for cls in CLASS_NAMES:
            for m in (self.deadline_misses, self.ttft_by_class, self.queue_time_by_class):
                m.labels(**labels, **{"class": cls})
        for endpoint in ENDPOINTS:
            self.request_latency.labels(endpoint=endpoint)
            for outcome in OUTCOMES:
                self.requests_total.labels(endpoint=endpoint, status=outcome)
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.preemptions, self.prefix_queries, self.prefix_hits, self.ttft, self.itl, self.e2e,
                       self.queue_time, self.iteration_tokens, self.swapped, self.cpu_usage, self.swapped_blocks,
                       self.swap_out_bytes, self.swap_in_bytes, self.evicted_blocks):
            metric.labels(**labels)

    def record(self, stats: IterationStats | None, snapshot: SchedulerSnapshot) -> None:
        """StatLogger: engine step stats → metrics (called on the engine thread; prometheus_client locks)."""
        lbl = self._lbl
        if stats is not None:
            self._record_stats(stats)
        # Gauges last: a scrape that sees the server idle also sees the counters of what just finished.
        self.running.labels(**lbl).set(snapshot.num_running)
        self.waiting.labels(**lbl).set(snapshot.num_waiting)
        self.kv_usage.labels(**lbl).set(snapshot.kv_cache_usage)
        self.swapped.labels(**lbl).set(snapshot.num_swapped)
        self.cpu_usage.labels(**lbl).set(snapshot.cpu_cache_usage)
        self.swapped_blocks.labels(**lbl).set(snapshot.num_swapped_blocks)

    def _record_stats(self, stats: IterationStats) -> None:
        lbl = self._lbl
        self.prompt_tokens.labels(**lbl).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(**lbl).inc(stats.num_generation_tokens)
        self.tokens_generated.inc(stats.num_generation_tokens)
        self.preemptions.labels(**lbl).inc(stats.num_preemptions)
        self.preemptions_by_mode.labels(**lbl, mode="swap").inc(stats.num_swap_preemptions)
        self.preemptions_by_mode.labels(**lbl, mode="recompute").inc(stats.num_preemptions - stats.num_swap_preemptions)
        self.swap_out_bytes.labels(**lbl).inc(stats.kv_swap_out_bytes)
        self.swap_in_bytes.labels(**lbl).inc(stats.kv_swap_in_bytes)
        self.evicted_blocks.labels(**lbl).inc(stats.num_evicted_blocks)
        self.prefix_queries.labels(**lbl).inc(stats.prefix_cache_queries)
        self.prefix_hits.labels(**lbl).inc(stats.prefix_cache_hits)
        for n in stats.num_iteration_tokens:
            self.iteration_tokens.labels(**lbl).observe(n)
        ttft, itl = self.ttft.labels(**lbl), self.itl.labels(**lbl)
        for t in stats.time_to_first_tokens:
            ttft.observe(t)
        for t in stats.inter_token_latencies:
            itl.observe(t)
        for t, cls in zip(stats.time_to_first_tokens, stats.first_token_classes, strict=True):
            self.ttft_by_class.labels(**lbl, **{"class": cls}).observe(t)
        for cls in stats.deadline_misses:
            self.deadline_misses.labels(**lbl, **{"class": cls}).inc()
        if self.spec is not None:
            drafts, draft_tokens, accepted, per_pos = self.spec
            drafts.labels(**lbl).inc(stats.spec_num_drafts)
            draft_tokens.labels(**lbl).inc(stats.spec_num_draft_tokens)
            accepted.labels(**lbl).inc(stats.spec_num_accepted_tokens)
            for i, n in enumerate(stats.spec_accepted_per_position):
                per_pos.labels(**lbl, position=str(i)).inc(n)
        for f in stats.finished:
            self.request_success.labels(**lbl, finished_reason=f.finish_reason).inc()
            self.e2e.labels(**lbl).observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue_time.labels(**lbl).observe(f.queue_time)
                self.queue_time_by_class.labels(**lbl, **{"class": f.priority_class}).observe(f.queue_time)

    def observe_loop_lag(self, lag_s: float) -> None:
        """One event-loop timer-probe sample."""
        self.loop_lag.observe(lag_s)
        if lag_s > self._lag_max:
            self._lag_max = lag_s
            self.loop_lag_max.set(lag_s)

    def watch_experts(self, source: Callable[[], dict[int, list[int]]]) -> None:
        """Export a mixture of experts' load, read from the model's own counters at scrape time (no per-step work):
        minivllm:moe_expert_tokens_total{layer, expert}, tokens routed to each expert since start-up."""
        self._er.register(_ExpertLoad(self._lbl["model_name"], source))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class _ExpertLoad(Collector):
    """minivllm:moe_expert_tokens_total per MoE layer and expert; nothing for a dense model."""

    def __init__(self, model_name: str, source: Callable[[], dict[int, list[int]]]) -> None:
        self.model_name, self.source = model_name, source

    def collect(self) -> Iterator[CounterMetricFamily]:
        load = self.source()
        if not load:
            return
        family = CounterMetricFamily("minivllm:moe_expert_tokens", "Tokens routed to each expert since start-up, "
                                     "per mixture-of-experts layer", labels=["model_name", "layer", "expert"])
        for layer, counts in load.items():
            for e, n in enumerate(counts):
                family.add_metric([self.model_name, str(layer), str(e)], n)
        yield family
