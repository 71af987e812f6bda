"""Model registry: HF architecture name → our implementation."""

from __future__ import annotations

from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from minivllm.model.models.gpt2 import GPT2LMHeadModel
from minivllm.model.models.granite import GraniteForCausalLM
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.mixtral import MixtralForCausalLM
from minivllm.model.models.olmo2 import Olmo2ForCausalLM
from minivllm.model.models.olmoe import OlmoeForCausalLM
from minivllm.model.models.phi3 import Phi3ForCausalLM
from minivllm.model.models.qwen2_moe import Qwen2MoeForCausalLM
from minivllm.model.models.qwen3 import Qwen3ForCausalLM
from minivllm.model.models.qwen3_moe import Qwen3MoeForCausalLM
from minivllm.model.models.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    # Mixtures of experts (model/moe.py)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}


def attention_windows(mc: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full attention), from the config alone."""
    cls = get_model_class(mc)
    windows = getattr(cls, "attention_windows", None)
    return windows(mc) if windows is not None else (None,) * mc.num_layers


def kv_windows(windows: tuple[int | None, ...], max_model_len: int) -> tuple[int | None, ...]:
    """The layers' windows as the KV cache groups them: a window no shorter than the longest sequence the engine
    runs (max_model_len) never leaves a token behind, so its layers keep their KV with the full-attention ones (one
    pool and block table, sized for full sequences) rather than in a pool sized for window-long ones."""
    return tuple(None if w is None or w >= max_model_len else w for w in windows)


def get_model_class(mc: ModelConfig) -> type[nn.Module]:
    """The class implementing mc.architecture, or a ValueError naming the supported ones."""
    cls = MODEL_REGISTRY.get(mc.architecture)
    if cls is None:
        raise ValueError(f"Unsupported architecture {mc.architecture!r} in {mc.path}/config.json; "
                         f"supported: {', '.join(MODEL_REGISTRY)}")
    return cls
