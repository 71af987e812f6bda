"""Quality of each weight format: held-out perplexity, and the next-token distributions against float32
(KL divergence, top-1 agreement), computed from full logits of the engine's model runner."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minivllm.config import ModelConfig
from minivllm.engine_config import EngineConfig
from minivllm.model.runner import ModelRunner, SequenceInput

MODES = ("fp32", "bf16", "int8", "int4", "w8a8", "w4a8")
# int4 weights under a bfloat16 model (vLLM's W4A16: how GPTQ and AWQ checkpoints run as they ship); asked for by
# name, not in the default lists
W4A16 = "w4a16"


def mode_engine_kwargs(mode: str, group_size: int = 32) -> dict[str, Any]:
    """EngineArgs fields for a mode name: a dtype, or float32 activations with quantized weights."""
    if mode not in (*MODES, W4A16):
        raise ValueError(f"--modes: unknown mode {mode!r}; choose among {', '.join((*MODES, W4A16))}")
    if mode == W4A16:
        return {"dtype": "bfloat16", "quantization": "int4", "quantization_group_size": group_size}
    if mode == "bf16":
        return {"dtype": "bfloat16"}
    if mode == "fp32":
        return {"dtype": "float32"}
    return {"dtype": "float32", "quantization": mode, "quantization_group_size": group_size}


def runner_for(path: str, mode: str, max_len: int, group_size: int = 32) -> ModelRunner:
    """The engine's model runner for one mode, with a KV pool for one window."""
    config = EngineConfig.of_model(ModelConfig.from_pretrained(path), device="cpu", max_model_len=max_len,
                                   block_size=16, **mode_engine_kwargs(mode, group_size))
    return ModelRunner(config, -(-max_len // 16))


def window_logprobs(runner: ModelRunner, wins: list[list[int]]) -> list[torch.Tensor]:
    """log-softmax of the next-token logits at every position but the last of each window."""
    out = []
    for w in wins:
        logits = runner.execute([SequenceInput(w, 0, list(range(-(-len(w) // 16))), False, all_logits=True)])
        out.append(torch.log_softmax(logits[:-1].float(), dim=-1))
    return out


def compare(ref: list[torch.Tensor], got: list[torch.Tensor], wins: list[list[int]]) -> dict[str, float]:
    """Perplexity of `got` on the windows' next tokens, and KL(ref || got) and top-1 agreement with ref."""
    nll, kl, top1, n = 0.0, 0.0, 0, 0
    for r, g, w in zip(ref, got, wins, strict=True):
        targets = torch.tensor(w[1:])
        nll -= g.gather(-1, targets[:, None]).sum().item()
        kl += (r.exp() * (r - g)).sum().item()
        top1 += int((r.argmax(-1) == g.argmax(-1)).sum())
        n += len(targets)
    return {"perplexity": float(np.exp(nll / n)), "kl": kl / n, "top1": top1 / n, "tokens": n}


def measure_quality(path: str, wins: list[list[int]], modes: list[str], group_size: int,
                    hf_logprobs: np.ndarray | None) -> dict[str, Any]:
    """Every mode against our float32 on the same windows (and HF float32's perplexity when given)."""
    max_len = max(len(w) for w in wins)
    ref = window_logprobs(runner_for(path, "fp32", max_len), wins)
    rows = {}
    for mode in modes:
        got = ref if mode == "fp32" else window_logprobs(runner_for(path, mode, max_len, group_size), wins)
        rows[mode] = compare(ref, got, wins)
    result: dict[str, Any] = {"rows": rows}
    if hf_logprobs is not None:
        result["hf_fp32_perplexity"] = float(np.exp(-hf_logprobs.mean()))
    return result
