"""The LM head of a GGUF file whose projections run as int4 (int8) blocks (model/gguf_blocks.py) but whose head is
a type no kernel of ours runs as it is, or is the tied embedding (llama.cpp's quantizer writes the head one type
up: Q6_K or Q8_0 beside Q4_0). Dequantized, it would be a float32 matrix read whole at every decode step, often
the largest single read of a small model's step (SmolLM2-135M: 113 MB against 60 MB for every projection). So it
is converted at load to int8 per output channel (the w8a8 kernels beside w4a8 projections, int8 beside int4;
beside Q8_0 projections, to their int8 blocks), and the error that adds is measured on a probe prompt, the file's
dequantized head as the reference (KL of the logits and top-1 agreement), and logged: the conversion is never
silent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm.model.input_batch import SequenceInput
from minivllm.model.kernel_plan import KernelPlan, plan_kernels
from minivllm.model.layers import Linear
from minivllm.model.quantization import QuantizedLinear
from minivllm.quant_config import QuantConfig

if TYPE_CHECKING:
    from minivllm.model.runner import ModelRunner

logger = logging.getLogger(__name__)

PROBE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class HeadConversion:
    """What the head became and the error it added on the probe."""

    method: str
    kl: float  # mean KL(file's head || converted head) of the probe's next-token distributions, nats
    top1: float  # share of the probe's positions whose most likely token is unchanged
    plan: KernelPlan


def convert_gguf_head(runner: ModelRunner) -> HeadConversion | None:
    """Convert the head as the module docstring says; None where there is nothing to convert."""
    qc = runner.mc.hf_config.get("quantization_config")
    model = runner.model
    head = getattr(model, "lm_head", None)
    if not isinstance(qc, dict) or qc.get("quant_method") != "gguf" or qc.get("lm_head"):
        return None
    if not isinstance(head, Linear) or head.weight is None or runner.parallel.size > 1:
        return None
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    method = "w8a8" if {m.method for m in layers} & {"w4a8", "w8a8"} else "int8"
    # Beside Q8_0 projections the head takes their int8 blocks (a Q8_0 embedding converts back to its own codes).
    blocked = any(m.blocked for m in layers)
    vocab = runner.mc.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, PROBE_TOKENS).tolist()
    blocks = list(range(-(-PROBE_TOKENS // runner.block_size)))  # the probe's K/V: blocks no sequence holds yet
    probe = [SequenceInput(ids, 0, blocks, True, all_logits=True,
                           group_tables=(blocks,) * (runner.num_kv_groups - 1))]
    with torch.inference_mode():
        ref = runner.execute(probe)
        cfg = QuantConfig(method, int8_blocks=blocked)
        q = QuantizedLinear(head.in_features, head.out_features, head.bias is not None, cfg)
        q.quantize_from(head.weight.detach().float(), None if head.bias is None else head.bias.detach().float())
        plan = plan_kernels([q], "auto", f"lm_head {method}", runner.dtype)
        model.lm_head = q
        new = runner.execute(probe)
    logp, logq = torch.log_softmax(ref.double(), -1), torch.log_softmax(new.double(), -1)
    kl = float((logp.exp() * (logp - logq)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == new.argmax(-1)).double().mean())
    logger.info("GGUF head (%s, %d x %d) converted to %s %s: KL %.2e nats, top-1 %.1f%% against the file's "
                "dequantized head on a %d-token probe", runner.mc.path.rsplit("/", 1)[-1], head.out_features,
                head.in_features, method, "in blocks of 32" if blocked else "per output channel", kl, 100 * top1,
                PROBE_TOKENS)
    return HeadConversion(method, kl, top1, plan)
