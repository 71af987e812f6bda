"""Mini-vLLM: a small, fast, observable LLM inference engine in the spirit of vLLM."""

from minivllm.config import EngineArgs
from minivllm.llm import LLM
from minivllm.lora_request import LoRARequest
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import BeamSearchParams, GuidedDecodingParams, RequestOutputKind, SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams", "BeamSearchParams", "GuidedDecodingParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest"]
__version__ = "0.1.0"
