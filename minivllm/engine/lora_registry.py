"""The engine's LoRA adapters by name: loaded into the model's slots (model/lora.py), resolved per request, kept
from being unloaded while a request runs with them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from minivllm.lora_request import LoRARequest
from minivllm.model.lora import LoRAAdapter, LoRAModelManager, read_adapter

_loads = itertools.count(1)


@dataclass(frozen=True, slots=True)
class LoadedLoRA:
    """An adapter in a slot. `cache_salt` seeds its sequences' prefix-cache hashes: KV computed under one adapter
    (or one load of it) is never reused by another."""

    name: str
    path: str
    slot: int
    rank: int
    cache_salt: bytes


class LoRARegistry:
    """name → LoadedLoRA over the model's slots."""

    def __init__(self, manager: LoRAModelManager | None) -> None:
        self.manager = manager  # None: LoRA not enabled
        self.loaded: dict[str, LoadedLoRA] = {}

    def _need(self) -> LoRAModelManager:
        if self.manager is None:
            raise ValueError("lora: this engine was started without LoRA (--enable-lora)")
        return self.manager

    def add(self, name: str, path: str, adapter: LoRAAdapter | None = None) -> LoadedLoRA:
        """Load an adapter (read from path unless given) into a free slot; ValueError naming the problem."""
        manager = self._need()
        if not name or not isinstance(name, str):
            raise ValueError(f"lora_name: expected a non-empty name, got {name!r}")
        if name in self.loaded:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
        adapter = adapter or read_adapter(path, manager.max_adapter_bytes)
        slot = manager.load(adapter, name)
        loaded = self.loaded[name] = LoadedLoRA(name, path, slot, adapter.rank, f"lora:{next(_loads)}:".encode())
        return loaded

    def remove(self, name: str, in_use: int) -> None:
        """Unload an adapter no request is running with; KeyError if unknown, ValueError if in use."""
        if name not in self.loaded:
            raise KeyError(name)
        if in_use:
            raise ValueError(f"lora_name: adapter {name!r} is in use by {in_use} request(s); unload it when they "
                             "finish")
        self._need().unload(self.loaded.pop(name).slot)

    def check_current(self, lora: LoadedLoRA | None) -> None:
        """ValueError when a request prepared under an adapter would run under another: it was unloaded (and its
        slot perhaps given to another adapter) between the request's preparation and its queueing."""
        if lora is not None and self.loaded.get(lora.name) != lora:
            raise ValueError(f"model: LoRA adapter {lora.name!r} was unloaded or reloaded while the request was "
                             "being prepared; send it again")

    @property
    def max_adapter_bytes(self) -> int | None:
        """The largest adapter weights file accepted (None: LoRA off)."""
        return self.manager.max_adapter_bytes if self.manager is not None else None

    def resolve(self, request: LoRARequest | None) -> LoadedLoRA | None:
        """The loaded adapter of a request (loading it on first use, as vLLM's offline API does)."""
        if request is None:
            return None
        found = self.loaded.get(request.lora_name)
        if found is None:
            return self.add(request.lora_name, request.lora_path)
        return found
