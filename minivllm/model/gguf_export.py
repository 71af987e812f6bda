"""`minivllm quantize --out model.gguf`: a model quantized here, as a GGUF file llama.cpp (and we) run.

llama.cpp's own converter (model/gguf_converter.py) writes the checkpoint as a float GGUF file: every family's
metadata, the tokenizer, llama.cpp's tensor names and layouts. That file is then rewritten with each projection
(and the head, unless --no-quantize-lm-head) quantized by this engine's quantizers into the GGUF block type whose
layout is theirs, byte for byte (model/gguf_blocks.py reads them back without re-quantizing):

- int8 / w8a8 -> Q8_0: quantize_int8_blocks (a float16 scale per 32 weights, the peak never clipped);
- int4 / w4a8 -> Q4_1 (scale and min, the engine's asymmetric groups of 32) or, asked, Q4_0 (symmetric, Q4_0's
  rule: 2 bytes fewer per 32 weights, served without stored mins).

Quantization is per row and per 32-weight block along it, so the rows llama.cpp reorders (Llama's q / k) or the
matrices it stores transposed (GPT-2's) hold the same codes the engine gives the HF weights. A tied head is the
token embedding: quantized to Q8_0 (as llama.cpp's quantizer writes a head one type up) when the head is.
Norms, biases and untied embeddings stay in the float type the converter wrote. The file says which mode wrote
it (`general.file_type`); whether activations are quantized too is a serving choice (--quantization w8a8 / w4a8).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from minivllm.model.gguf_blocks import module_of
from minivllm.model.gguf_converter import convert_hf
from minivllm.model.quantization import quantize_int4, quantize_int8_blocks
from minivllm.quant_config import GROUPED_METHODS, QuantConfig

INT4_TYPES = ("Q4_1", "Q4_0")
# The converter's float output type for the dtype kept in full precision.
_OUTTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* of a file whose projections are all of one type.
_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}
_QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION: the block layouts' version llama.cpp checks


@dataclass(slots=True)
class ExportReport:
    """What the written file holds: tensors per GGML type, and its size."""

    path: str
    types: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0


def gguf_type(cfg: QuantConfig, int4_type: str) -> str:
    """The GGUF block type of a quantization mode."""
    if cfg.method not in GROUPED_METHODS:
        return "Q8_0"
    if cfg.group_size != 32:
        raise ValueError(f"quantize: GGUF's 4-bit blocks hold 32 weights; --quantization-group-size "
                         f"{cfg.group_size} has no GGUF type (use 32)")
    if int4_type not in INT4_TYPES:
        raise ValueError(f"quantize: --gguf-int4-type {int4_type!r} is not one of {', '.join(INT4_TYPES)}")
    return int4_type


def block_bytes(w: torch.Tensor, kind: str) -> np.ndarray:
    """One matrix [N, K] (K a multiple of 32) as GGUF blocks: uint8 [N, K / 32 * block bytes]."""
    n, k = w.shape
    if kind == "Q8_0":
        q, scale = quantize_int8_blocks(w)
        parts = [scale.numpy().view(np.uint8), q.numpy().view(np.uint8)]
    else:
        packed, scale, mins = quantize_int4(w, 32, torch.float16, symmetric=kind == "Q4_0")
        parts = [scale.numpy().view(np.uint8)] + ([mins.numpy().view(np.uint8)] if kind == "Q4_1" else []) \
            + [packed.numpy()]
    blocks = k // 32
    return np.concatenate([p.reshape(n, blocks, -1) for p in parts], axis=2).reshape(n, -1)


def rewrite_gguf(src: str, dst: str, convert: Callable[[Any], tuple[np.ndarray, Any] | None],
                 values: dict[str, tuple[Any, Any]] | None = None) -> None:
    """Copy a GGUF file, its metadata as it was (but `values`: key -> (value, GGUFValueType), set or replaced),
    each tensor through convert(tensor) -> (data, GGML type), or None: kept as it was (the gguf package's own
    reader and writer)."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    values = dict(values or {})
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name in values:
            continue
        sub = f.types[-1] if f.types[0].name == "ARRAY" else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in values.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        new = convert(t)
        data, kind = new if new is not None else (np.asarray(t.data), t.tensor_type)
        writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_gguf(hf_dir: str, cfg: QuantConfig, out: str, dtype: torch.dtype, int4_type: str = "Q4_1"
                ) -> ExportReport:
    """Write the HF checkpoint at hf_dir, quantized as cfg says, to the GGUF file `out` (which must not exist)."""
    from gguf import GGMLQuantizationType, GGUFValueType
    from gguf.quants import dequantize

    kind = gguf_type(cfg, int4_type)
    if os.path.exists(out):
        raise ValueError(f"quantize: {out!r} exists; name a new .gguf file")
    if dtype not in _OUTTYPES:
        raise ValueError(f"quantize: GGUF holds float tensors as float32, bfloat16 or float16, not {dtype}")
    qtype = GGMLQuantizationType[kind]
    report = ExportReport(out)
    tmp = f"{out}.float-{os.getpid()}.tmp"
    try:
        convert_hf(hf_dir, tmp, _OUTTYPES[dtype])
        from gguf import GGUFReader

        names = {t.name for t in GGUFReader(tmp).tensors}
        tied = "output.weight" not in names

        def quantized(t: Any) -> tuple[np.ndarray, Any] | None:
            name = str(t.name)
            target = qtype if module_of(name) is not None else None
            if name == "output.weight" and not cfg.quantize_lm_head:
                target = None
            if name == "token_embd.weight" and tied and cfg.quantize_lm_head:
                target = GGMLQuantizationType.Q8_0  # the tied head: one type up beside 4-bit projections
            if target is None or len(t.shape) != 2:
                report.types[t.tensor_type.name] = report.types.get(t.tensor_type.name, 0) + 1
                return None
            w = torch.from_numpy(np.array(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32))
            if w.shape[1] % 32:
                raise ValueError(f"quantize: tensor {name!r} has rows of {w.shape[1]} weights; GGUF's blocks hold "
                                 f"32 each, so it has no {target.name} form")
            report.types[target.name] = report.types.get(target.name, 0) + 1
            return block_bytes(w, target.name), target

        values = {"general.file_type": (_FILE_TYPES[kind], GGUFValueType.UINT32),
                  "general.quantization_version": (_QUANTIZATION_VERSION, GGUFValueType.UINT32),
                  "general.quantized_by": (f"minivllm {cfg.method}", GGUFValueType.STRING)}
        rewrite_gguf(tmp, out + ".part", quantized, values)
        os.replace(out + ".part", out)
    finally:
        for path in (tmp, out + ".part"):
            if os.path.exists(path):
                os.remove(path)
    report.nbytes = os.path.getsize(out)
    return report
