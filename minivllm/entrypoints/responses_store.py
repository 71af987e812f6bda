"""The Responses API's store: what `previous_response_id` continues and GET /v1/responses/{id} returns, in memory
and bounded (the oldest entries go first), each entry visible only to the client (named key) that made it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024  # responses kept; each is bounded by the model's context (its conversation had to fit)


@dataclass(slots=True)
class StoredResponse:
    """A finished response and the conversation a next turn continues (without its instructions, which OpenAI does
    not carry over)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    client: str | None  # the named key that made it (None: the server's single key, or none)


class ResponseStore:
    """Responses by id, least recently used dropped past `capacity`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep a response (dropping the least recently used one past capacity)."""
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, client: str | None) -> StoredResponse | None:
        """The response, if it is kept and this client made it."""
        entry = self._entries.get(response_id)
        if entry is None or entry.client != client:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, client: str | None) -> bool:
        """Forget a response; whether this client had it."""
        if self.get(response_id, client) is None:
            return False
        del self._entries[response_id]
        return True
