"""Named API keys (`--api-keys-file`): one key per client, each with its own bounds, so that one client's backlog
cannot take the server from the others.

Per key: `max_concurrency` requests in the engine at once (waiting or running there); further requests of that key
wait here, in the key's own first-come queue, up to `max_queued` (beyond: 429 naming the key's limit). The engine
thus holds at most each key's concurrency, and a light client's request waits behind those few, not behind a
heavy client's whole backlog. A key may not raise its requests' priority (below 0, the default class's best) or
set its own TTFT SLO unless `may_prioritize` is true: either would let it jump the other keys' queues.

The keys file is JSON: {"clients": [{"name": "alice", "key": "sk-...", "max_concurrency": 32, "max_queued": 256,
"may_prioritize": false}, ...]}. Names show in logs and metrics; keys never do.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from minivllm.engine.async_stream import AsyncStream, QueueFullError

# The named client the request being served belongs to (set by the HTTP guard and the gRPC servicer).
current_client: contextvars.ContextVar[str | None] = contextvars.ContextVar("minivllm_client", default=None)
_FIELDS = {"name", "key", "max_concurrency", "max_queued", "may_prioritize"}


@dataclass(frozen=True, slots=True)
class ClientKey:
    """One client's key and bounds."""

    name: str
    key: str = field(repr=False)
    max_concurrency: int | None = None  # requests in the engine at once (None: no bound of its own)
    max_queued: int = 1024  # requests waiting here for one of its engine seats
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
        import logging

        logging.getLogger(__name__).warning("api_keys_file %s is readable by other users (chmod 600 it)", path)
    return tuple(clients)


class ClientGate:
    """One client's seats in the engine and its queue for them (event-loop thread only)."""

    def __init__(self, client: ClientKey) -> None:
        self.client = client
        self.in_flight = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.queued = 0  # requests waiting here (summed over the calls that wait)

    async def enter(self, n: int) -> None:
        """Wait for n seats (first come, first served); QueueFullError when the client's queue is full or one
        call asks for more than its concurrency."""
        c = self.client
        if c.max_concurrency is None:
            self.in_flight += n
            return
        if n > c.max_concurrency:
            raise QueueFullError(f"client {c.name!r}: {n} prompts in one call exceed its max_concurrency "
                                 f"({c.max_concurrency}); split the batch")
        if not self._waiters and self.in_flight + n <= c.max_concurrency:
            self.in_flight += n
            return
        if self.queued + n > c.max_queued:
            raise QueueFullError(f"client {c.name!r}: {self.queued} requests already wait for its "
                                 f"{c.max_concurrency} seats (max_queued={c.max_queued}); retry later")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, future))
        self.queued += n
        try:
            await future  # seats are counted for us when granted
        except BaseException:
            if future.done() and not future.cancelled():
                self.leave(n)  # granted, then cancelled before use
            else:
                self._waiters.remove((n, future))
                self.queued -= n
            raise

    def leave(self, n: int = 1) -> None:
        """Seats back (a request left the engine); grants the queue's head while it fits."""
        self.in_flight -= n
        c = self.client
        while self._waiters and c.max_concurrency is not None:
            n_next, future = self._waiters[0]
            if self.in_flight + n_next > c.max_concurrency:
                break
            self._waiters.popleft()
            self.queued -= n_next
            self.in_flight += n_next
            future.set_result(None)

    def track(self, streams: Sequence[AsyncStream]) -> None:
        """Give each stream's seat back when its request leaves the engine."""
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

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per client: requests in the engine and waiting here (metrics, tests)."""
        return {name: {"in_flight": g.in_flight, "queued": g.queued} for name, g in self.gates.items()}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """/metrics: each named client's requests in the engine and waiting for its seats (a Prometheus
        collector, read at scrape time)."""
        in_engine = GaugeMetricFamily("minivllm:client_requests_in_engine", "Requests of a named API key in the "
                                      "engine (running or waiting there)", labels=["client"])
        queued = GaugeMetricFamily("minivllm:client_requests_queued", "Requests of a named API key waiting for "
                                   "one of its seats (max_concurrency)", labels=["client"])
        for name, g in self.gates.items():
            in_engine.add_metric([name], g.in_flight)
            queued.add_metric([name], g.queued)
        yield in_engine
        yield queued
