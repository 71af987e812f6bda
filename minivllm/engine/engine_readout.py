"""What the front ends read of a served engine (engine/protocol.py documents each): read-through properties of the
LLMEngine an AsyncLLMEngine serves. The front ends never reach into the engine itself; these are the only windows,
and none changes it."""

from __future__ import annotations

from typing import Any

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.lora_registry import LoadedLoRA
from minivllm.model.moe import expert_load
from minivllm.pooler_config import PoolerConfig


class EngineReadout:
    """The served engine's settings and counters, as the EngineClient protocol names them."""

    engine: LLMEngine

    @property
    def model_path(self) -> str:
        return self.engine.config.model.path

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.engine.speculator
        return spec.k if spec is not None else 0

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler_config.max_num_seqs

    @property
    def reasoning_parser(self) -> str | None:
        return self.engine.config.serving.reasoning_parser

    @property
    def pooler(self) -> PoolerConfig | None:
        return self.engine.config.model.pooler

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def expert_load(self) -> dict[int, list[int]]:
        return expert_load(self.engine.runner.model)  # (at scrape time: monotonic counts, at most a step behind)

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves adapters (--enable-lora)."""
        return self.engine.loras.manager is not None

    @property
    def max_lora_bytes(self) -> int | None:
        return self.engine.loras.max_adapter_bytes

    @property
    def loras(self) -> dict[str, LoadedLoRA]:
        """The adapters served, by name."""
        return self.engine.loras.loaded
