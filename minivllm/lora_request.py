"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name (its id only tells adapters apart, as in vLLM) and its PEFT directory; the engine loads it
    on first use."""

    lora_name: str
    lora_int_id: int
    lora_path: str
