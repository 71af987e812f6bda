"""The layers of a GPTQ / AWQ / compressed-tensors checkpoint (prequant_config.py) as the engine holds them.

Each quantized layer's tensors are decoded to one form, W[n, k] = scale[n, g] * (code[n, k] - zero[n, g]) with
unsigned codes, then either written in our int4 layout (packed codes, scale, min = -scale * zero), handed over as
our int8 (codes and per-channel scales, as they are), or dequantized to float32 (what maps onto no kernel of
ours). The packings, as their libraries write them:
  GPTQ   qweight int32 [K * bits / 32, N], codes along K, low bits first; qzeros int32 [groups, N * bits / 32]
         along N, stored minus one by the original format (checkpoint_format "gptq"), as they are by "gptq_v2";
         scales float16 [groups, N]; g_idx int32 [K]: the group of input k (desc_act: any order).
  AWQ    qweight int32 [K, N / 8], codes along N in the order 0 2 4 6 1 3 5 7 within each int32; qzeros int32
         [groups, N / 8] alike; scales float16 [groups, N].
  compressed-tensors pack-quantized: weight_packed int32 [N, K / 8], codes (signed, stored plus 8) along K, low
         bits first; weight_scale [N, groups]; weight_zero_point (asymmetric only) packed alike along N; weight_g_idx
         (actorder "group"). int-quantized / naive-quantized: weight int8 [N, K], weight_scale [N, 1].
A layer's tensors may sit in different shards: each is decoded once all of its tensors have been read.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from minivllm.model.quantization import pack_int4
from minivllm.prequant_config import PrequantScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's int32 nibble i holds output channel 8j + AWQ_ORDER[i]

# The tensors of one quantized layer, by format; the first marks a layer as quantized.
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "pack-quantized": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "int-quantized": ("weight_scale", "weight", "weight_zero_point"),
    "naive-quantized": ("weight_scale", "weight", "weight_zero_point"),
}


def _parts(scheme: PrequantScheme) -> tuple[str, ...]:
    return _PARTS[scheme.method if scheme.method in _PARTS else scheme.fmt]


def quantized_layers(scheme: PrequantScheme, names: list[str]) -> dict[str, set[str]]:
    """Checkpoint layer prefix → the names of its quantized tensors present."""
    parts = _parts(scheme)
    layers = {n[: -len(parts[0]) - 1] for n in names if n.endswith("." + parts[0])}
    out: dict[str, set[str]] = {p: set() for p in layers}
    for n in names:
        prefix, _, suffix = n.rpartition(".")
        if prefix in out and suffix in parts:
            out[prefix].add(n)
    return out


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits codes each along dim 0, low bits first → [R * 32 / bits, C]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0] * per, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits codes each along dim 1, low bits first → [R, C * 32 / bits]."""
    return _unpack_rows(packed.t(), bits).t()


class _Layer:
    """One quantized layer decoded: codes [N, K] (unsigned), zero [N, groups], scale [N, groups], group of each k."""

    __slots__ = ("codes", "zero", "scale", "group_of")

    def __init__(self, codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group_of: torch.Tensor) -> None:
        self.codes, self.zero, self.scale, self.group_of = codes, zero, scale, group_of

    def dequantize(self) -> torch.Tensor:
        g = self.group_of.long()
        return self.scale.float()[:, g] * (self.codes.float() - self.zero.float()[:, g])


def _decode(scheme: PrequantScheme, prefix: str, t: dict[str, torch.Tensor]) -> _Layer:
    where = f"{scheme.method} layer {prefix!r}"
    bits = scheme.bits
    try:
        if scheme.method == "gptq":
            codes = _unpack_rows(t["qweight"], bits).t()
            zero = _unpack_cols(t["qzeros"], bits).t()
            if scheme.fmt == "gptq":
                zero = zero + 1  # the original format stores each zero minus one
            scale = t["scales"].t()
        elif scheme.method == "awq":
            order = torch.tensor(AWQ_ORDER)
            inv = torch.argsort(order)  # channel 8j + c sits in nibble inv[c]

            def channels(packed: torch.Tensor) -> torch.Tensor:
                u = _unpack_cols(packed, 4).view(packed.shape[0], -1, 8)
                return u[:, :, inv].reshape(packed.shape[0], -1)

            codes, zero, scale = channels(t["qweight"]).t(), channels(t["qzeros"]).t(), t["scales"].t()
        elif scheme.fmt == "pack-quantized":
            n, k = (int(v) for v in t["weight_shape"].tolist())
            codes = _unpack_cols(t["weight_packed"], bits)[:, :k]
            scale = t["weight_scale"]
            if scheme.symmetric:  # (a zero tensor some writers still ship is all zeros: code 8, stored)
                zero = torch.full_like(scale, 8, dtype=torch.int32)
            else:
                zero = _unpack_rows(t["weight_zero_point"], bits)[:n]
        else:  # int-quantized / naive-quantized int8: signed codes, symmetric
            codes, scale = t["weight"], t["weight_scale"]
            zero = torch.zeros_like(scale, dtype=torch.int32)
        n, k = codes.shape
        groups = scale.shape[1]
        g_idx = t.get("g_idx", t.get("weight_g_idx"))
        if g_idx is None:
            group_of = torch.arange(k, dtype=torch.int32) // (scheme.group_size or k)
        else:
            group_of = g_idx.to(torch.int32)
        if (scale.shape[0] != n or zero.shape != (n, groups) or group_of.shape != (k,)
                or int(group_of.min()) < 0 or int(group_of.max()) >= groups):
            raise ValueError(f"shapes disagree: codes {tuple(codes.shape)}, scales {tuple(scale.shape)}, zeros "
                             f"{tuple(zero.shape)}, group index {tuple(group_of.shape)} (groups 0..{groups - 1})")
    except KeyError as e:
        raise ValueError(f"{where}: tensor {e.args[0]!r} is missing") from None
    except (RuntimeError, IndexError, TypeError) as e:  # a packed tensor of the wrong shape, rank or dtype
        raise ValueError(f"{where}: its tensors do not fit the format ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return _Layer(codes, zero, scale, group_of)


def convert(scheme: PrequantScheme, names: list[str], weights: Iterator[tuple[str, torch.Tensor]],
            scale_dtype: torch.dtype | None, min_dtype: torch.dtype | None = None, dequantize: bool = False
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every quantized layer in the engine's form: for the int4 engine method,
    `prefix.qweight` (packed codes) / `.scales` / `.mins` in scale_dtype / min_dtype; for int8 / w8a8, `.qweight` and
    per-channel `.scales`; with none (engine_method() is None) or `dequantize` (a float model: a draft, tensor
    parallelism) `prefix.weight`, dequantized to float32. Other tensors pass through."""
    layers = quantized_layers(scheme, names)
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    target = None if dequantize else scheme.engine_method()
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if prefix not in layers or name not in layers[prefix]:
            yield name, tensor
            continue
        got = waiting.setdefault(prefix, {})
        got[suffix] = tensor
        if len(got) < len(layers[prefix]):
            continue
        layer = _decode(scheme, prefix, waiting.pop(prefix))
        if target is None:
            yield prefix + ".weight", layer.dequantize()
        elif target[0] == "int4":
            yield from _as_int4(scheme, prefix, layer, target[1], scale_dtype or torch.float16,
                                min_dtype or scale_dtype or torch.float16)
        else:
            yield prefix + ".qweight", layer.codes.to(torch.int8)
            yield prefix + ".scales", layer.scale.float().reshape(-1)
    if waiting:
        prefix, got = next(iter(waiting.items()))
        raise ValueError(f"{scheme.method} layer {prefix!r}: only {', '.join(sorted(got))} of its tensors were read")


def _as_int4(scheme: PrequantScheme, prefix: str, layer: _Layer, group: int, scale_dtype: torch.dtype,
             min_dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    n, k = layer.codes.shape
    if not torch.equal(layer.group_of, torch.arange(k, dtype=torch.int32) // group):
        raise ValueError(f"{scheme.method} layer {prefix!r}: its g_idx puts inputs in groups out of order, which "
                         "its quantization_config does not declare (desc_act / actorder)")
    if k % group or int(layer.codes.max()) > 15 or int(layer.codes.min()) < 0:
        raise ValueError(f"{scheme.method} layer {prefix!r}: {k} inputs in groups of {group}, codes "
                         f"{int(layer.codes.min())}..{int(layer.codes.max())}: not 4-bit groups")
    scales = layer.scale.to(scale_dtype)
    if not torch.equal(scales.to(layer.scale.dtype), layer.scale):  # e.g. float32 scales: never rounded silently
        raise ValueError(f"{scheme.method} layer {prefix!r}: its {layer.scale.dtype} scales do not fit {scale_dtype} "
                         "exactly (the checkpoint's torch_dtype names the other one)")
    yield prefix + ".qweight", pack_int4(layer.codes)
    yield prefix + ".scales", scales
    # W = scale * code + min: the zero folds into the min, exact in float32 (and in the scales' dtype for a
    # symmetric zero, 8 * scale).
    yield prefix + ".mins", (-(layer.scale.float() * layer.zero.float())).to(min_dtype)
