"""Clients' shares of the engine's seats (named API keys, entrypoints/clients.py).

A request may carry its client's name and the most sequences that client may run at once. Admission then passes
over a waiting sequence whose client holds all its seats and admits the next one (the passed-over keep their
place): a client with a backlog of hundreds cannot fill every seat, so the steps stay as small as the clients'
seats add up to, and another client's request finds a free seat at once, whatever the backlog. Nothing is counted
while no request with seats has been seen.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ClientSeats:
    """A client's name and the most of its sequences that may run at once."""

    name: str
    max_running: int


class SeatCounter:
    """Running sequences per client during one admission pass (scheduler thread)."""

    def __init__(self) -> None:
        self.active = False  # set once a request with seats arrives
        self._running: Counter[str] = Counter()

    def start(self, running: list[Sequence]) -> SeatCounter | None:
        """Count the running sequences' clients; None (nothing to check) until a request with seats arrived."""
        if not self.active:
            return None
        counts = self._running
        counts.clear()
        for seq in running:
            seats = seq.group.seats if seq.group is not None else None
            if seats is not None:
                counts[seats.name] += 1
        return self

    def admits(self, seq: Sequence) -> bool:
        """Whether seq's client has a free seat (then counted as taken)."""
        seats = seq.group.seats if seq.group is not None else None
        if seats is None:
            return True
        if self._running[seats.name] >= seats.max_running:
            return False
        self._running[seats.name] += 1
        return True
