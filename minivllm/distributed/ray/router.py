"""The routing policy of `minivllm serve --replicas N`: the least loaded healthy replica.

Ray Serve's default policy probes two random replicas and takes the shorter queue ("power of two
choices"), which with more than two replicas can pass over the least loaded one. This ranks every
replica in one group, so Serve's own probe-and-pick takes the one with the fewest calls in flight
(its queue-length cache, refreshed as calls start and end) among all of them. Replicas whose engine
the board reports dead are left out until Ray replaces them: an empty replica whose engine died
would otherwise look the least loaded and attract every call.

The router runs in the front's process (it belongs to the front's DeploymentHandle), so the client
shares what it learns from the board through `set_unhealthy`.
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

_unhealthy: frozenset[str] = frozenset()  # replica ids (Serve's unique ids) reported dead by the board


def set_unhealthy(replica_ids: frozenset[str]) -> None:
    """Replicas to avoid (swapped whole: the router reads it from another thread)."""
    global _unhealthy
    _unhealthy = replica_ids


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    """Every healthy replica in one rank: Serve picks the lowest queue length among them."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        bad = _unhealthy
        healthy = [r for r in candidate_replicas if r.replica_id.unique_id not in bad] or candidate_replicas
        # Serve keeps the first of equally loaded replicas: shuffle, so that ties (an idle deployment) spread.
        return [random.sample(healthy, len(healthy))]  # all dead-looking: try anyway, the answer names why
