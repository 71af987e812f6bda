"""Checkpoints quantized elsewhere: the `quantization_config` of GPTQ, AWQ and compressed-tensors checkpoints,
parsed strictly, and the engine quantization their layers map onto (model/prequantized.py converts the tensors).

Every layer of these formats is W[n, k] = scale[n, g(k)] * (code[n, k] - zero[n, g(k)]) with unsigned codes: the
engine's int4 layers hold exactly that (scale, and min = -scale * zero) when the groups are contiguous runs of
one of our group sizes; int8 channels (compressed-tensors W8A8 / W8A16) are our int8 / w8a8 as they are. What
maps onto neither (act-order groups, per-channel 4-bit, other group sizes) is dequantized at load into the model's
float dtype, exactly, and runs on the float kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minivllm.quant_config import GROUP_SIZES

# "gguf": a GGUF file whose projections are all Q4_0 / Q4_1, or all Q8_0, or of the types converted at load to int8
# blocks says so in the HF config it is read as (model/gguf_blocks.py).
PREQUANTIZED_METHODS = ("gptq", "awq", "compressed-tensors", "gguf")
GGUF_INT4_TYPES = frozenset({"Q4_0", "Q4_1"})  # run as they are on the int4 kernels
# Converted at load to int8 blocks of 32 (Q8_0's layout) beside Q8_0's own: every value of these 4-6-bit types lies
# within 1/254 of its block's peak of an int8 code, so the added error is small (and measured at load).
GGUF_CONVERTED_TYPES = frozenset({"Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})
GGUF_INT8_TYPES = frozenset({"Q8_0"}) | GGUF_CONVERTED_TYPES | GGUF_INT4_TYPES  # (Q4 beside those: converted too)
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class PrequantScheme:
    """How a checkpoint's layers are stored (one scheme for every quantized layer)."""

    method: str  # gptq | awq | compressed-tensors
    fmt: str  # gptq: gptq | gptq_v2; awq: gemm; compressed-tensors: its format
    bits: int
    group_size: int  # 0: one group per output channel (the whole row)
    symmetric: bool
    act_order: bool  # groups in an order of their own (GPTQ desc_act, compressed-tensors actorder)
    input_int8: bool  # activations quantized per token to int8 (compressed-tensors W8A8)
    ignore: tuple[str, ...]  # layers left in float (compressed-tensors `ignore`, names or re: patterns)

    def engine_method(self) -> tuple[str, int] | None:
        """(our method, group size) the layers run as, or None: dequantized to float at load."""
        if any(p not in ("lm_head", "re:.*lm_head", "re:lm_head") for p in self.ignore):
            return None  # float layers besides the head: every projection of ours is one kind
        if self.bits == 8 and self.group_size == 0 and self.method == "compressed-tensors":
            return ("w8a8" if self.input_int8 else "int8"), 0
        if self.bits == 8 and self.method == "gguf":  # Q8_0, or converted: int8 blocks of 32 (QuantConfig.int8_blocks)
            return "int8", 32
        if self.bits == 4 and self.group_size in GROUP_SIZES and not self.act_order:
            return "int4", self.group_size
        return None

    def kernels(self) -> tuple[str, ...]:
        """Our methods that compute with these layers' weights as they are (the first: what loads by default). A GGUF
        file's blocks run against int8 activations in blocks of 32 by default (QuantConfig.act_blocks), as llama.cpp
        and vLLM's GGUF kernels compute them (1.7x weight-only at one sequence for a 1B Q4_0 file; KL 3e-5 nats
        against the exact weight-only math, BENCHMARKS.md); weight-only on request (int4 / int8). Other checkpoints'
        own kind first (GPTQ / AWQ weight-only, compressed-tensors as its scheme says)."""
        target = self.engine_method()
        if target is None:
            return ()
        own = ("int4", "w4a8") if target[0] == "int4" else (target[0], "w8a8" if target[0] == "int8" else "int8")
        return own[::-1] if self.method == "gguf" else own


def _need(d: dict[str, Any], key: str, kinds: type | tuple[type, ...], where: str) -> Any:
    v = d.get(key)
    if not isinstance(v, kinds) or isinstance(v, bool) and kinds is int:
        names = " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise ValueError(f"{where}: quantization_config.{key} is {v!r}; expected {names}")
    return v


def parse_prequantized(d: dict[str, Any], where: str) -> PrequantScheme | None:
    """The scheme of a GPTQ / AWQ / compressed-tensors `quantization_config`; None for anything else (a
    minivllm checkpoint's own). A config of these methods that we cannot run is a clear error naming the key."""
    method = d.get("quant_method")
    if method not in PREQUANTIZED_METHODS:
        return None
    if method == "gguf":
        types = d.get("types")
        if not isinstance(types, list) or not types or not set(types) <= GGUF_INT8_TYPES:
            raise ValueError(f"{where}: a gguf quantization_config with types {types!r}")
        bits = 4 if set(types) <= GGUF_INT4_TYPES else 8
        return PrequantScheme("gguf", "+".join(types), bits, 32, "Q4_1" not in types, False, False, ())
    if method == "gptq":
        bits = _need(d, "bits", int, where)
        fmt = str(d.get("checkpoint_format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        group = _need(d, "group_size", int, where)
        scheme = PrequantScheme("gptq", fmt, bits, 0 if group == -1 else group, bool(d.get("sym", True)),
                                bool(d.get("desc_act", False)), False, ())
    elif method == "awq":
        bits = _need(d, "bits", int, where) if "bits" in d else _need(d, "w_bit", int, where)
        version = str(d.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version {version!r} is not supported; only the GEMM packing (the "
                             "default of AutoAWQ and of transformers) is")
        group = _need(d, "group_size", int, where) if "group_size" in d else _need(d, "q_group_size", int, where)
        scheme = PrequantScheme("awq", "gemm", bits, 0 if group == -1 else group,
                                not bool(d.get("zero_point", True)), False, False, ())
    else:
        scheme = _parse_compressed_tensors(d, where)
    if scheme.bits not in (4, 8) or scheme.bits == 8 and method == "awq":
        raise ValueError(f"{where}: {method} with {scheme.bits}-bit weights is not supported (4-bit; 8-bit for "
                         "GPTQ and compressed-tensors)")
    if scheme.group_size < 0 or scheme.group_size and scheme.group_size % 8:
        raise ValueError(f"{where}: {method} group_size {scheme.group_size} is not a positive multiple of 8 (or -1)")
    return scheme


def _parse_compressed_tensors(d: dict[str, Any], where: str) -> PrequantScheme:
    fmt = _need(d, "format", str, where)
    if fmt not in CT_FORMATS:
        raise ValueError(f"{where}: compressed-tensors format {fmt!r} is not supported; supported: "
                         f"{', '.join(CT_FORMATS)}")
    groups = _need(d, "config_groups", dict, where)
    if len(groups) != 1:
        raise ValueError(f"{where}: compressed-tensors with {len(groups)} config_groups; one scheme for every "
                         "layer is supported")
    (name, group), = groups.items()
    gw = f"{where}: config_groups.{name}"
    if not isinstance(group, dict):
        raise ValueError(f"{gw} is {group!r}, not a scheme")
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise ValueError(f"{gw}.targets is {targets!r}; only [\"Linear\"] is supported")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"{gw}.weights is {w!r}; a weight-quantized scheme is expected")
    if w.get("type", "int") != "int" or w.get("dynamic", False):
        raise ValueError(f"{gw}.weights: type {w.get('type')!r} (dynamic {w.get('dynamic')!r}) is not supported; "
                         "static int weights are")
    bits = _need(w, "num_bits", int, gw + ".weights")
    strategy = w.get("strategy")
    if strategy == "group":
        size = _need(w, "group_size", int, gw + ".weights")
    elif strategy == "channel":
        size = 0
    else:
        raise ValueError(f"{gw}.weights.strategy {strategy!r} is not supported (group, channel)")
    acts = group.get("input_activations")
    input_int8 = False
    if acts is not None:
        ok = (isinstance(acts, dict) and acts.get("type", "int") == "int" and acts.get("num_bits") == 8
              and acts.get("dynamic") is True and acts.get("strategy") == "token" and acts.get("symmetric", True))
        if not ok:
            raise ValueError(f"{gw}.input_activations {acts!r} is not supported; only dynamic symmetric per-token "
                             "int8 (W8A8) is")
        input_int8 = True
    if input_int8 and (bits != 8 or size):
        raise ValueError(f"{gw}: int8 activations with {bits}-bit {strategy} weights are not supported (W8A8 is "
                         "8-bit channel weights)")
    if fmt == "pack-quantized" and bits != 4 or fmt != "pack-quantized" and bits != 8:
        raise ValueError(f"{gw}: format {fmt} with {bits}-bit weights is not supported")
    if fmt != "pack-quantized" and not w.get("symmetric", True):
        raise ValueError(f"{gw}.weights: asymmetric {bits}-bit {fmt} weights are not supported (symmetric are)")
    actorder = w.get("actorder")
    ignore = d.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise ValueError(f"{where}: quantization_config.ignore is {ignore!r}; expected a list of layer names")
    # actorder "group" stores a g_idx (groups in an order of their own); "weight" and "static" keep them in runs.
    return PrequantScheme("compressed-tensors", fmt, bits, size, bool(w.get("symmetric", True)),
                          actorder == "group", input_int8, tuple(ignore))
