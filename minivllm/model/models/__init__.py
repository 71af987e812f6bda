"""Model registry: HF architecture name → our implementation."""

from __future__ import annotations

from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.models.gpt2 import GPT2LMHeadModel
from minivllm.model.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def get_model_class(mc: ModelConfig) -> type[nn.Module]:
    """The class implementing mc.architecture, or a ValueError naming the supported ones."""
    cls = MODEL_REGISTRY.get(mc.architecture)
    if cls is None:
        raise ValueError(f"Unsupported architecture {mc.architecture!r} in {mc.path}/config.json; "
                         f"supported: {', '.join(MODEL_REGISTRY)}")
    return cls
