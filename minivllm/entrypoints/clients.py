"""Named API keys (`--api-keys-file`): one key per client, each with its own bounds, so that one client's backlog
cannot take the server from the others.

Per key: `max_concurrency` of its sequences run at once (its seats: the scheduler passes over its waiting ones
while it holds them all, engine/client_seats.py), and at most `max_queued` more of its requests wait (beyond: 429
naming the key's limit). A heavy client's backlog thus never fills the engine's seats or its steps, and a light
client's request finds a free seat at once. A key may not raise its requests' priority (below 0, the default
class's best) or set its own TTFT SLO unless `may_prioritize` is true: either would let it jump the others' queues.

The keys file is JSON: {"clients": [{"name": "alice", "key": "sk-...", "max_concurrency": 32, "max_queued": 256,
"may_prioritize": false}, ...]}. Names show in logs and metrics; keys never do.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from minivllm.engine.async_stream import AsyncStream, QueueFullError
from minivllm.engine.client_seats import ClientSeats

logger = logging.getLogger(__name__)
# The named client the request being served belongs to (set by the HTTP guard and the gRPC servicer).
current_client: contextvars.ContextVar[str | None] = contextvars.ContextVar("minivllm_client", default=None)
_FIELDS = {"name", "key", "max_concurrency", "max_queued", "may_prioritize"}


@dataclass(frozen=True, slots=True)
class ClientKey:
    """One client's key and bounds."""

    name: str
    key: str = field(repr=False)
    max_concurrency: int | None = None  # its sequences running at once (None: no bound of its own)
    max_queued: int = 1024  # its requests waiting for one of its seats
    may_prioritize: bool = False  # may set priority below 0 or its own ttft_slo_ms


def load_keys_file(path: str) -> tuple[ClientKey, ...]:
    """The clients of a keys file; ValueError naming the file and the entry at fault."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"api_keys_file: cannot read {path!r}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"api_keys_file: {path!r} is not JSON: {e}") from None
    entries = doc.get("clients") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'api_keys_file: {path!r} needs {{"clients": [{{"name": ..., "key": ...}}, ...]}}')
    clients: list[ClientKey] = []
    for i, entry in enumerate(entries):
        where = f"api_keys_file: {path!r}, client {i}"
        item: dict[str, Any] = entry if isinstance(entry, dict) else {}
        if not isinstance(entry, dict) or not _FIELDS >= set(item) or not {"name", "key"} <= set(item):
            raise ValueError(f"{where}: expected name and key, and only {', '.join(sorted(_FIELDS))}")
        name, key = item["name"], item["key"]
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{where}: name must be an identifier (it labels metrics), got {name!r}")
        if not isinstance(key, str) or len(key) < 16 or not key.isprintable() or " " in key:
            raise ValueError(f"{where} ({name}): key must be at least 16 printable characters without spaces")
        for bound, least in (("max_concurrency", 1), ("max_queued", 0)):
            v = item.get(bound)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
                raise ValueError(f"{where} ({name}): {bound} must be an integer >= {least}, got {v!r}")
        if not isinstance(item.get("may_prioritize", False), bool):
            raise ValueError(f"{where} ({name}): may_prioritize must be true or false")
        clients.append(ClientKey(name, key, item.get("max_concurrency"), item.get("max_queued", 1024),
                                 item.get("may_prioritize", False)))
    for attr in ("name", "key"):
        values = [getattr(c, attr) for c in clients]
        if len(set(values)) != len(values):
            raise ValueError(f"api_keys_file: {path!r}: two clients share a {attr}")
    if os.name == "posix" and os.stat(path).st_mode & 0o077:
        logger.warning("api_keys_file %s is readable by other users (chmod 600 it)", path)
    return tuple(clients)


class ClientGate:
    """One client's requests in the engine (event-loop thread only)."""

    def __init__(self, client: ClientKey) -> None:
        self.client = client
        self.in_flight = 0
        # Its seats (running) and its queue (waiting for them), both in the engine.
        c = client
        self.limit = None if c.max_concurrency is None else c.max_concurrency + c.max_queued

    def enter(self, n: int) -> None:
        """Count n more requests in; QueueFullError (429) when the client's seats and queue are full."""
        c = self.client
        if self.limit is not None and self.in_flight + n > self.limit:
            raise QueueFullError(f"client {c.name!r}: {self.in_flight} requests in flight fill its "
                                 f"{c.max_concurrency} seats and its queue (max_queued={c.max_queued}); retry later")
        self.in_flight += n

    def leave(self, n: int = 1) -> None:
        """n requests left the engine."""
        self.in_flight -= n

    def track(self, streams: Sequence[AsyncStream]) -> None:
        """Count each stream's request out when it leaves the engine."""
        for s in streams:
            s.on_end(lambda _s: self.leave(1))


class ClientRegistry:
    """The named clients and their gates; what a request of a client may ask for."""

    def __init__(self, clients: Sequence[ClientKey]) -> None:
        self.clients = {c.name: c for c in clients}
        self.gates = {c.name: ClientGate(c) for c in clients}

    def gate(self) -> ClientGate | None:
        """The gate of the client being served (None: an unnamed key, or no keys)."""
        name = current_client.get()
        return self.gates.get(name) if name is not None else None

    def clamp(self, priority: int | str, ttft_slo_ms: float | None) -> tuple[int | str, float | None]:
        """The priority and TTFT SLO the current client may have: no better than the default class's best (0)
        and no SLO of its own, unless its key may prioritize."""
        name = current_client.get()
        client = self.clients.get(name) if name is not None else None
        if client is None or client.may_prioritize:
            return priority, ttft_slo_ms
        from minivllm.slo import resolve_priority  # (ValueError naming priority for a bad value, as unclamped)

        return max(resolve_priority(priority), 0), None

    def seats(self) -> ClientSeats | None:
        """The current client's share of the engine's seats (None: no bound of its own)."""
        name = current_client.get()
        client = self.clients.get(name) if name is not None else None
        if client is None or client.max_concurrency is None:
            return None
        return ClientSeats(client.name, client.max_concurrency)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """/metrics: each named client's requests in the engine (a Prometheus collector, read at scrape time)."""
        in_engine = GaugeMetricFamily("minivllm:client_requests_in_flight", "Requests of a named API key in the "
                                      "engine (running, or waiting for one of its seats)", labels=["client"])
        for name, g in self.gates.items():
            in_engine.add_metric([name], g.in_flight)
        yield in_engine
