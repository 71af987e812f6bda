"""GGUF's 4-bit and 8-bit blocks run as they are: Q4_0 (a float16 d and 32 codes, w = d * (q - 8)) and Q4_1 (d and
m, w = d * q + m) are the engine's int4 groups of 32 with float16 scale d and min -8d or m (both exact in float16),
and a block's 16 code bytes are laid out as ours (byte j: code j in the low nibble, code j + 16 in the high); Q8_0
(d and 32 int8 codes, w = d * q) is the engine's int8 blocks (QuantConfig.int8_blocks, csrc/gemv_q8.c). The codes
are copied, never re-quantized. A file whose projections mix in the 5- and 6-bit types and the K-quants
(prequant_config.GGUF_CONVERTED_TYPES: Q4_K_M, Q5_K_M, Q6_K files) has every projection converted at load to int8
blocks of 32 (dequantized by the gguf package, then quantized as Q8_0 would), the error that adds measured on a probe
and logged (model/gguf_conversion.py). Other files are dequantized at load (model/gguf_checkpoint.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minivllm.model.gguf_header import GGUFHeader
from minivllm.model.quantization import quantize_int8_blocks
from minivllm.prequant_config import GGUF_INT4_TYPES, GGUF_INT8_TYPES

NATIVE_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per 32-weight block
# Matrices that are not projections: embeddings stay in the float dtype; the head is a projection of its own.
_EMBEDDINGS = ("token_embd.weight", "position_embd.weight", "token_types.weight")


def native_config(header: GGUFHeader, arch: str) -> dict[str, Any] | None:
    """The `quantization_config` of a file whose every projection is Q4_0 / Q4_1, or every one of the int8 blocks'
    types (the head of the same family too, or not: `lm_head`; `converted`: the types re-quantized at load); None
    when any is another type (then every tensor is dequantized)."""
    if arch == "gpt2":  # its projections are stored transposed (Conv1D): blocks run along the wrong axis
        return None
    mats = {t.name: t.ggml_type.name for t in header.tensors if len(t.dims) == 2}
    proj = {ty for name, ty in mats.items() if name not in _EMBEDDINGS and name != "output.weight"}
    family = next((f for f in (GGUF_INT4_TYPES, GGUF_INT8_TYPES) if proj and proj <= f), None)
    if family is None:
        return None
    head = mats.get("output.weight") in family
    types = sorted(proj | ({mats["output.weight"]} if head else set()))
    converted = [t for t in types if t != "Q8_0"] if family is GGUF_INT8_TYPES else []
    return {"quant_method": "gguf", "types": types, "lm_head": head, "converted": converted}


def is_native(name: str, ggml_type: str, lm_head: bool) -> bool:
    """Whether this tensor loads as int4 blocks (a projection, or the head when the config says so)."""
    if ggml_type not in GGUF_INT8_TYPES or name in _EMBEDDINGS:
        return False
    return lm_head or name != "output.weight"


def decode(name: str, data: np.ndarray, ggml_type: str, rows: np.ndarray | None, symmetric: bool = False,
           int8: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(packed codes [N, K/2] uint8, scales [N, K/32] float16, mins [N, K/32] float16) of one tensor's 4-bit
    blocks (mins None for Q4_0 with `symmetric`: a file of Q4_0 only, whose layers store none), or (codes [N, K]
    int8, scales, None) of Q8_0's, or with `int8` of any other type converted to int8 blocks (data: uint8
    [N, blocks * block bytes]), its rows reordered by `rows` (the HF layout's order, or None)."""
    if int8 and ggml_type != "Q8_0":
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = torch.from_numpy(np.asarray(dequantize(data, GGMLQuantizationType[ggml_type]), dtype=np.float32))
        q, s = quantize_int8_blocks(w if rows is None else w[torch.from_numpy(rows)])
        return q, s, None
    size = NATIVE_TYPES[ggml_type]
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    if ggml_type == "Q8_0":
        parts = [blocks[:, :, 2:].view(np.int8), d]
    elif ggml_type == "Q4_0" and symmetric:
        parts = [blocks[:, :, 2:], d]
    elif ggml_type == "Q4_0":
        with np.errstate(over="ignore"):
            m = (d.astype(np.float32) * -8).astype(np.float16)
        if not np.isfinite(m).all():
            raise ValueError(f"GGUF tensor {name!r}: a Q4_0 scale too large for its min (-8 d) in float16")
        parts = [blocks[:, :, 2:], d, m]
    else:
        parts = [blocks[:, :, 4:], d, blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]]
    out = [torch.from_numpy(np.ascontiguousarray(p).reshape(n, -1)) for p in parts]
    if rows is not None:
        idx = torch.from_numpy(rows)
        out = [t[idx] for t in out]
    return out[0], out[1], out[2] if len(out) == 3 else None


def row_order(processor: Any, name: str, n: int, names: dict[str, str]) -> tuple[str | None, np.ndarray | None]:
    """(the name transformers' tensor processor gives this tensor, the permutation of rows it applies: llama.cpp
    stores Llama's q / k rows in its rope's order), found by processing the row numbers; rows None: kept."""
    probe = np.arange(n, dtype=np.float64).reshape(n, 1)
    result = processor.process(weights=probe, name=name, tensor_key_mapping=names, parsed_parameters={"tensors": {}})
    got = np.asarray(result.weights)
    if got.shape != (n, 1) or not np.array_equal(np.sort(got[:, 0]), probe[:, 0]):
        raise ValueError(f"GGUF tensor {name!r}: its conversion to the HF layout is not a reordering of rows, so its "
                         "blocks cannot run as they are")
    rows = got[:, 0].astype(np.int64)
    return result.name, None if np.array_equal(rows, np.arange(n)) else rows
