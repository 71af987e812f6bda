"""/metrics of a front before Ray Serve replicas (SPEC §6, §8): the router's own counters, and every
replica's engine families (as each replica last reported them to the board) with a `replica` label."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

_ROUTE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RETRY_REASONS = ("replica_died", "replica_rejected")
FAILURE_REASONS = ("replica_died", "no_replica")


class ReplicaCollector:
    """Yields the replicas' families, merged by name, each sample labelled with its replica."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}

    def update(self, reports: dict[str, dict[str, Any]]) -> None:
        """The board's latest reports (replica id → report with "families")."""
        self._reports = reports

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for rid, report in sorted(self._reports.items()):
            for name, doc, typ, unit, samples in report.get("families", ()):
                fam = merged.get(name)
                if fam is None:
                    fam = merged[name] = Metric(name, doc, typ, unit)
                for sample_name, labels, value in samples:
                    fam.add_sample(sample_name, {**labels, "replica": rid}, value)
        yield from merged.values()


class RouterMetrics:
    """The router's counters, on the front's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_replicas: int) -> None:
        lbl = ["model_name"]
        self._lbl = {"model_name": model_name}
        self.routed = Counter("minivllm:router_requests", "Calls routed, by the replica that accepted them",
                              [*lbl, "replica"], registry=registry)
        self.retries = Counter("minivllm:router_retries", "Calls routed again after their replica failed them "
                               "before any output was sent", [*lbl, "reason"], registry=registry)
        self.failures = Counter("minivllm:router_failures", "Calls failed by the router (503): their replica died "
                                "after output was sent, or no replica could take them", [*lbl, "reason"],
                                registry=registry)
        self.route_time = Histogram("minivllm:router_route_seconds", "Submit to the replica's acceptance (routing, "
                                    "Ray transfer and queueing in the engine)", lbl, buckets=_ROUTE_BUCKETS,
                                    registry=registry)
        self.healthy = Gauge("minivllm:router_healthy_replicas", "Replicas reporting a running engine", lbl,
                             registry=registry)
        self.target = Gauge("minivllm:router_target_replicas", "Replicas asked for (--replicas)", lbl,
                            registry=registry)
        self.replica_info = Gauge("minivllm:replica_info", "1 per live replica: its process and node",
                                  [*lbl, "replica", "pid", "node"], registry=registry)
        self.target.labels(**self._lbl).set(num_replicas)
        for reason in RETRY_REASONS:
            self.retries.labels(**self._lbl, reason=reason)
        for reason in FAILURE_REASONS:
            self.failures.labels(**self._lbl, reason=reason)
        self.route_time.labels(**self._lbl)

    def on_routed(self, replica: str, seconds: float) -> None:
        """A call accepted by a replica after `seconds`."""
        self.routed.labels(**self._lbl, replica=replica).inc()
        self.route_time.labels(**self._lbl).observe(seconds)

    def on_retry(self, reason: str) -> None:
        self.retries.labels(**self._lbl, reason=reason).inc()

    def on_failure(self, reason: str) -> None:
        self.failures.labels(**self._lbl, reason=reason).inc()

    def on_reports(self, reports: dict[str, dict[str, Any]]) -> None:
        """Health and identity gauges from the board's reports."""
        self.healthy.labels(**self._lbl).set(sum(1 for r in reports.values() if r.get("running")))
        self.replica_info.clear()
        for rid, r in reports.items():
            self.replica_info.labels(**self._lbl, replica=rid, pid=str(r.get("pid")), node=str(r.get("node"))).set(1)
