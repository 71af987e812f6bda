"""What a GGUF file's load converts, and the error each conversion adds, measured and logged.

The LM head of a GGUF file whose projections run as int4 (int8) blocks (model/gguf_blocks.py) but whose head is
a type no kernel of ours runs as it is, or is the tied embedding (llama.cpp's quantizer writes the head one type
up: Q6_K or Q8_0 beside Q4_0). Dequantized, it would be a float32 matrix read whole at every decode step, often
the largest single read of a small model's step (SmolLM2-135M: 113 MB against 60 MB for every projection). A Q6_K
head of whole superblocks runs as the file holds it (model/q6k_linear.py: its exact weights, 6.56 bits a weight);
any other is converted at load to int8 in blocks of 32 (Q8_0's layout: against x in blocks of 32 beside w4a8 / w8a8
projections, weight-only beside int4 / int8 ones; one scale per output channel ran the one-token head at 0.6-0.7x the
blocks' speed on a Zen 4 EPYC, its short rows' fixed work unhidden), and the error that adds is measured on a probe
prompt, the file's
dequantized head as the reference (KL of the logits and top-1 agreement), and logged: the conversion is never
silent.

A file whose projections were converted at load (model/gguf_blocks.py: modules mixing Q4_K with Q4_0 / Q4_1 to int4
groups, those mixing K-quants and the 5-bit types to int8 blocks) has the whole model's error measured the same way:
the probe in each layer's exact math against the same model with every quantized layer computing with the file's
dequantized weights.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels, gguf_blocks
from minivllm.model.hugepages import place_in_hugepages
from minivllm.model.input_batch import SequenceInput
from minivllm.model.kernel_plan import KernelPlan, plan_kernels
from minivllm.model.layers import Linear
from minivllm.model.q6k_linear import SUPERBLOCK_BYTES, Q6KLinear
from minivllm.model.quantization import QuantizedLinear
from minivllm.model.superblock_linear import SUPERBLOCK, SuperblockLinear
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
    # The layers' math (a file's layers may all be its own superblocks: none of int8 blocks left to say w8a8).
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear | SuperblockLinear)]
    method = "w8a8" if {m.method for m in layers} & {"w4a8", "w8a8"} else "int8"
    probe = _probe(runner)
    with torch.inference_mode():
        ref = runner.execute(probe)
        six = _q6k_head(runner.mc.path, head, method)
        q: Q6KLinear | QuantizedLinear
        if six is not None:
            x = "x in blocks of 32" if six.act_blocks else "weight-only"
            q, done = six, f"run as its own Q6_K superblocks ({x})"
        else:
            # int8 blocks of 32: a Q8_0 head (or embedding, loaded in float32) converts back to its own codes and
            # scales (llama.cpp's peak code is 127, so amax / 127 is d again); finer than one scale a row otherwise.
            cfg = QuantConfig(method, int8_blocks=True, act_blocks=True)  # (a8: x in blocks, as llama.cpp's Q8_0 x)
            q = QuantizedLinear(head.in_features, head.out_features, head.bias is not None, cfg)
            q.quantize_from(head.weight.detach().float(), None if head.bias is None else head.bias.detach().float())
            done = f"converted to {method} in blocks of 32"
        # Built after the loader placed the model's weights in huge pages: the head is the step's largest read (a 1B
        # model's Q6_K head in 4 KiB pages streamed at 0.86x the Q6_K projections' rate beside it).
        place_in_hugepages(q)
        # Measured in the method's own math (the probe is a many-token step, where the auto plan may also quantize a
        # weight-only head's activations: not the conversion's error), then planned for serving.
        plan_kernels([q], "native" if "native" in q.candidates() else "reference", f"lm_head {method}", runner.dtype)
        model.lm_head = q
        runner.linear_plan.drop(head)
        new = runner.execute(probe)
        plan = plan_kernels([q], "auto", f"lm_head {method}", runner.dtype)
    kl, top1 = _divergence(ref, new)
    logger.info("GGUF head (%s, %d x %d) %s: KL %.2e nats, top-1 %.1f%% against the file's dequantized head on a "
                "%d-token probe", runner.mc.path.rsplit("/", 1)[-1], head.out_features, head.in_features, done, kl,
                100 * top1, PROBE_TOKENS)
    return HeadConversion(method, kl, top1, plan)


def _q6k_head(path: str, head: Linear, method: str) -> Q6KLinear | None:
    """The head as the file's own Q6_K rows (model/q6k_linear.py: weight-only beside int8 / int4 layers, against x
    in blocks beside w8a8 / w4a8 ones), where the file holds it so, it is whole superblocks, and a native kernel
    runs it; None otherwise (then int8 blocks)."""
    from minivllm.model import gguf_checkpoint  # (it imports the loader's modules, which import this one's)

    if head.bias is not None or head.in_features % SUPERBLOCK or not cpu_kernels.available():
        return None
    file = gguf_checkpoint.find_gguf(path)
    rows = None if file is None else gguf_blocks.head_blocks(gguf_checkpoint.parts(file), "Q6_K")
    if rows is None or rows.shape != (head.out_features, head.in_features // SUPERBLOCK * SUPERBLOCK_BYTES):
        return None
    return Q6KLinear.from_blocks(rows, head.in_features, method == "w8a8")


@dataclass(frozen=True, slots=True)
class LayerConversion:
    """The error of a file's projections converted at load (gguf_blocks: K-quants, Q5 types -> int8 blocks)."""

    types: tuple[str, ...]  # the file's types that were converted
    layers: int  # the model's quantized layers (the converted ones, and any Q8_0 ones beside them)
    kl: float  # mean KL(file's dequantized weights || as served) of the probe's next-token distributions, nats
    top1: float


def gguf_conversions(runner: ModelRunner) -> tuple[HeadConversion | None, LayerConversion | None]:
    """A GGUF file's conversions at load, each measured: its head (convert_gguf_head), then its projections."""
    return convert_gguf_head(runner), measure_layer_conversion(runner)


def measure_layer_conversion(runner: ModelRunner) -> LayerConversion | None:
    """Where the file's projections were converted at load: the probe's logits with every quantized layer in its
    method's exact math (the reference kernel: weight-only int8 in float32, w8a8 with int8 activations; the auto
    plan may also quantize a weight-only layer's activations in many-token steps, a choice of its own) against the
    same model with every quantized layer computing with the file's weights dequantized (a float copy of the model,
    loaded for this and dropped); KL and top-1 logged."""
    qc = runner.mc.hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "gguf" or not qc.get("converted"):
        return None
    if runner.parallel.size > 1 or runner.device.type != "cpu":
        return None

    model = runner.model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not layers:  # (a float load of the file: a draft model)
        return None
    # The float copy is the whole model in the engine's dtype: measured only where memory holds it twice over.
    need = sum(p.numel() for p in model.parameters()) * runner.dtype.itemsize + \
        sum(m.in_features * m.out_features for m in layers.values()) * runner.dtype.itemsize
    free = psutil.virtual_memory().available
    path = runner.mc.path.rsplit("/", 1)[-1]
    if need * 2 > free:
        logger.warning("GGUF %s: projections converted at load (%s); their error is not "
                       "measured: a float copy of the model needs %.1f GB, %.1f GB are free", path,
                       ", ".join(qc["converted"]), need / 1e9, free / 1e9)
        return None
    try:
        kl, top1 = _measure(runner, layers)
    except Exception as e:  # a diagnostic: the engine serves without it
        logger.warning("GGUF %s: the error of the projections converted at load could not be measured (%s: %s)",
                       path, type(e).__name__, e)
        return None
    types = tuple(str(t) for t in qc["converted"])
    int4 = sum(m.grouped for m in layers.values())
    own: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, SuperblockLinear):
            own[m.type_name] = own.get(m.type_name, 0) + 1
    kept = ", ".join(f"{n} as their {t} superblocks" for t, n in sorted(own.items())) or "none as their superblocks"
    logger.info("GGUF %s: its %s projections converted at load (%d layers as int4 groups of 32, %d as int8 blocks of "
                "32; %s), in %s math: KL %.2e nats, top-1 %.1f%% against the file's dequantized weights on a %d-token "
                "probe", path, ", ".join(types), int4, len(layers) - int4, kept,
                "/".join(sorted({m.method for m in layers.values()})), kl, 100 * top1, PROBE_TOKENS)
    return LayerConversion(types, len(layers), kl, top1)


def _measure(runner: ModelRunner, layers: dict[str, QuantizedLinear]) -> tuple[float, float]:
    """(KL, top-1) of the probe: each layer's reference kernel against the file's dequantized weights."""
    from minivllm.model.loader import load_model  # (the loader imports the layers this module builds on)

    probe = _probe(runner)
    served = {name: m.kernels for name, m in layers.items()}
    with torch.inference_mode():
        try:
            for m in layers.values():
                m.kernels = (QuantizedLinear.forward_reference,) * len(m.kernels)
            new = runner.execute(probe)
            shadow = load_model(runner.mc, runner.dtype, runner.device, PROBE_TOKENS)
            for name, m in layers.items():
                ref = shadow.get_submodule(name)
                assert isinstance(ref, Linear) and ref.weight is not None
                m.kernels = (functools.partial(_float_forward, weight=ref.weight, bias=ref.bias),) * len(m.kernels)
            ref_logits = runner.execute(probe)
            del shadow
        finally:
            for name, m in layers.items():
                m.kernels = served[name]
    return _divergence(ref_logits, new)


def _float_forward(layer: QuantizedLinear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def _probe(runner: ModelRunner) -> list[SequenceInput]:
    """PROBE_TOKENS random tokens as one prompt, every position's logits; its K/V in blocks no sequence holds yet."""
    ids = np.random.default_rng(0).integers(0, runner.mc.vocab_size, PROBE_TOKENS).tolist()
    blocks = list(range(-(-PROBE_TOKENS // runner.block_size)))
    return [SequenceInput(ids, 0, blocks, True, all_logits=True, group_tables=(blocks,) * (runner.num_kv_groups - 1))]


def _divergence(ref: torch.Tensor, new: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || new) of the rows' next-token distributions in nats, share of rows whose argmax agrees)."""
    logp, logq = torch.log_softmax(ref.double(), -1), torch.log_softmax(new.double(), -1)
    kl = float((logp.exp() * (logp - logq)).sum(-1).mean())
    return kl, float((ref.argmax(-1) == new.argmax(-1)).double().mean())
