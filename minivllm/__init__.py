"""Mini-vLLM: a small, fast, observable LLM inference engine in the spirit of vLLM."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.config import EngineArgs
    from minivllm.llm import LLM
    from minivllm.lora_request import LoRARequest
    from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
    from minivllm.sampling_params import BeamSearchParams, GuidedDecodingParams, RequestOutputKind, SamplingParams

# The public names load on first use (PEP 562): `python -m minivllm` runs this file first, and importing the engine
# here (torch, transformers: ~5 s on 2 cores) made every CLI verb pay for it, even one that only refuses its flags.
_WHERE = {"LLM": "minivllm.llm", "EngineArgs": "minivllm.config", "SamplingParams": "minivllm.sampling_params",
          "BeamSearchParams": "minivllm.sampling_params", "GuidedDecodingParams": "minivllm.sampling_params",
          "RequestOutputKind": "minivllm.sampling_params", "RequestOutput": "minivllm.outputs",
          "CompletionOutput": "minivllm.outputs", "Logprob": "minivllm.outputs", "LoRARequest": "minivllm.lora_request"}

__all__ = ["LLM", "EngineArgs", "SamplingParams", "BeamSearchParams", "GuidedDecodingParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
