"""GGUF's 4-bit and 8-bit blocks run as they are: Q4_0 (a float16 d and 32 codes, w = d * (q - 8)) and Q4_1 (d and
m, w = d * q + m) are the engine's int4 groups of 32 with float16 scale d and min -8d or m (both exact in float16),
and a block's 16 code bytes are laid out as ours (byte j: code j in the low nibble, code j + 16 in the high); Q8_0
(d and 32 int8 codes, w = d * q) is the engine's int8 blocks (QuantConfig.int8_blocks, csrc/gemv_q8.c). The codes
are copied, never re-quantized. A file whose projections mix in the 5- and 6-bit types and the K-quants
(prequant_config.GGUF_CONVERTED_TYPES: Q4_K_M, Q5_K_M, Q6_K files) runs each module whose every part is Q4_K, or
every part Q6_K, as the file's own superblocks (model/q4k_linear.py, model/q6k_linear.py: in a Q4_K_M file all but
the attention of the layers whose v is Q6_K; its head; every projection of a Q6_K file), and one whose parts mix the
two (Q4_K q and k beside a Q6_K v) as parts of each (model/split_linear.py). It converts the other modules at load:
those whose parts are Q4_K beside Q4_0 / Q4_1 to int4 groups of 32 (Q4_K's sub-blocks are such groups: its codes,
scales d * sc rounded to float16, mins -dmin * m), every other one (the 5-bit types, and what sits beside them) to
int8 blocks of 32 (dequantized by the gguf package, then quantized to the nearest int8 codes);
the error that adds is measured on a probe and logged (model/gguf_conversion.py). Other files are dequantized at load
(model/gguf_checkpoint.py).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from minivllm.model.gguf_header import GGUFHeader, read_header
from minivllm.model.q4k_linear import Q4KLinear
from minivllm.model.q6k_linear import Q6KLinear
from minivllm.model.quantization import QuantizedLinear, pack_int4, quantize_int8_blocks
from minivllm.model.split_linear import SplitLinear
from minivllm.model.superblock_linear import SUPERBLOCK, SuperblockLinear
from minivllm.prequant_config import GGUF_INT4_TYPES, GGUF_INT8_TYPES
from minivllm.quant_config import QuantConfig

logger = logging.getLogger(__name__)

NATIVE_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per 32-weight block
# Matrices that are not projections: embeddings stay in the float dtype; the head is a projection of its own.
_EMBEDDINGS = ("token_embd.weight", "position_embd.weight", "token_types.weight")
# In a file of int8 blocks, the types whose 32-weight (sub-)blocks are int4 groups with a scale and a min: a module
# all of whose parts are these runs on the int4 kernels (Q4_K: scale d * sc rounded to float16, min -dmin * m
# exact in float32), the others on int8 blocks; but one all Q4_K runs as the file's own superblocks (4.5 bits, not
# 5.5: SUPERBLOCK_LAYERS).
INT4_GROUPS = frozenset({"Q4_0", "Q4_1", "Q4_K"})
# GGUF projection names -> the module of the engine's decoder layer (models/decoder.py) each runs in.
_MODULES = {"attn_q": "self_attn.qkv_proj", "attn_k": "self_attn.qkv_proj", "attn_v": "self_attn.qkv_proj",
            "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_up_proj",
            "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}


def module_of(name: str) -> str | None:
    """The engine module a GGUF projection tensor loads into (q, k, v share qkv_proj), or None if unknown."""
    if name == "output.weight":
        return "lm_head"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _MODULES:
        return f"layers.{parts[1]}.{_MODULES[parts[2]]}"
    return None


def int4_layers(mats: dict[str, str]) -> list[str]:
    """The modules (of a file of int8 blocks) whose every part is of INT4_GROUPS: they run as int4 groups."""
    parts: dict[str, set[str]] = {}
    for name, ty in mats.items():
        module = module_of(name)
        if module is not None:
            parts.setdefault(module, set()).add(ty)
    return sorted(m for m, types in parts.items() if types <= INT4_GROUPS)


# The K-quants that run as the file's own superblocks, and the config key naming each one's modules.
SUPERBLOCK_LAYERS: dict[str, tuple[str, type[SuperblockLinear]]] = {
    "Q6_K": ("q6k_layers", Q6KLinear), "Q4_K": ("q4k_layers", Q4KLinear)}


def superblock_layers(mats: dict[str, str], names: set[str], ggml_type: str) -> list[str]:
    """The modules whose every part (of `names`, a file's served projections) is `ggml_type` of whole superblocks
    (`mats`: those): they run as the file holds them (model/superblock_linear.py)."""
    parts: dict[str, set[str]] = {}
    for name in names:
        module = module_of(name)
        if module is not None:
            parts.setdefault(module, set()).add(mats.get(name, ""))
    return sorted(m for m, types in parts.items() if types == {ggml_type})


# A fused module's parts in its row order (q, k, v; gate, up): a module mixing superblock types is split there.
_PART_ORDER = {"attn_q": 0, "attn_k": 1, "attn_v": 2, "ffn_gate": 0, "ffn_up": 1}


def split_layers(mats: dict[str, str], rows: dict[str, int], names: set[str]) -> dict[str, list[list[Any]]]:
    """The fused modules whose parts (of `names`) are all whole superblocks (`mats`: those) of more than one type
    (a Q4_K_M file's qkv_proj: q and k Q4_K, v Q6_K): module -> [[type, rows], ...], consecutive parts of one type
    joined. Each part runs as the file holds it (model/split_linear.py)."""
    parts: dict[str, list[tuple[int, str, int]]] = {}
    for name in names:
        module, kind = module_of(name), name.split(".")[2] if name.count(".") == 3 else ""
        if module is not None and kind in _PART_ORDER:
            parts.setdefault(module, []).append((_PART_ORDER[kind], mats.get(name, ""), rows[name]))
    out: dict[str, list[list[Any]]] = {}
    for module, found in parts.items():
        types = {t for _, t, _ in found}
        if len(types) < 2 or not types <= set(SUPERBLOCK_LAYERS):
            continue
        runs: list[list[Any]] = []
        for _, ty, n in sorted(found):
            if runs and runs[-1][0] == ty:
                runs[-1][1] += n
            else:
                runs.append([ty, n])
        out[module] = runs
    return out


def place_superblock_layers(model: torch.nn.Module, qc: dict[str, Any], quant: QuantConfig) -> None:
    """Swap the (empty, to-be-loaded) layers `qc` names in `q6k_layers` / `q4k_layers` for Q6_K / Q4_K ones, and
    those in `split_layers` for parts of them: weight-only beside int8 layers, against x in blocks beside w8a8
    ones."""
    act_blocks = quant.method == "w8a8"
    placed: dict[str, int] = {}
    layers: list[tuple[str, list[list[Any]]]] = [
        (name, [[ty, None]]) for ty, (key, _) in SUPERBLOCK_LAYERS.items() for name in qc.get(key) or ()]
    split: dict[str, list[list[Any]]] = qc.get("split_layers") or {}
    for name, runs in [*layers, *split.items()]:
        parent, _, child = name.rpartition(".")
        old = model.get_submodule(name)
        assert isinstance(old, QuantizedLinear)  # (quantize_model's, empty)
        rows = [old.out_features if n is None else n for _, n in runs]
        if sum(rows) != old.out_features:
            raise ValueError(f"GGUF: the parts of {name} hold {sum(rows)} rows, the model's {old.out_features}")
        parts = [SUPERBLOCK_LAYERS[ty][1](old.in_features, n, act_blocks, old.bias is not None)
                 for (ty, _), n in zip(runs, rows, strict=True)]
        for p in parts:
            p.routed = getattr(old, "routed", False)
        setattr(model.get_submodule(parent) if parent else model, child, SplitLinear(parts) if name in split
                else parts[0])
        if name not in split:
            placed[runs[0][0]] = placed.get(runs[0][0], 0) + 1
    if layers or split:
        kinds = sorted({" + ".join(ty for ty, _ in runs) for runs in split.values()})
        logger.info("GGUF projections run as the file holds them: %s%s", ", ".join(
            f"{n} as their {ty} superblocks" for ty, n in sorted(placed.items())) or "none whole",
            f"; {len(split)} in parts ({', '.join(kinds)})" if split else "")


def superblock_rows(data: np.ndarray, rows: np.ndarray | None) -> torch.Tensor:
    """A K-quant tensor's rows as the layer holds them (uint8 [N, K / 256 * superblock bytes], reordered by
    `rows`)."""
    t = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(data.shape[0], -1))
    return t if rows is None else t[torch.from_numpy(rows)]


def int4_overrides(qc: dict[str, Any], quant: QuantConfig) -> dict[str, QuantConfig]:
    """Module name -> the int4 configuration of those modules in a file of int8 blocks (`quant` is the file's:
    int8 -> int4, w8a8 -> w4a8, as the int8 layers quantize activations or not)."""
    int4 = QuantConfig("w4a8" if quant.method == "w8a8" else "int4", 32, quant.quantize_lm_head, "float16",
                       "float32", act_blocks=True)
    return {name: int4 for name in qc.get("int4_layers") or ()}


def native_config(header: GGUFHeader, arch: str) -> dict[str, Any] | None:
    """The `quantization_config` of a file whose every projection is Q4_0 / Q4_1, or every one of the int8 blocks'
    types (the head of the same family too, or not: `lm_head`; `converted`: the types re-quantized at load;
    `int4_layers`, `q6k_layers` and `q4k_layers`: the modules that run as int4 groups and as the file's Q6_K and Q4_K
    superblocks; `split_layers`: those that run as parts of both, by row); None when any is another type (then every
    tensor is dequantized)."""
    mats = {t.name: t.ggml_type.name for t in header.tensors if len(t.dims) == 2}
    proj = {ty for name, ty in mats.items() if name not in _EMBEDDINGS and name != "output.weight"}
    family = next((f for f in (GGUF_INT4_TYPES, GGUF_INT8_TYPES) if proj and proj <= f), None)
    if family is None:
        return None
    head = mats.get("output.weight") in family
    types = sorted(proj | ({mats["output.weight"]} if head else set()))
    converted = [t for t in types if t != "Q8_0"] if family is GGUF_INT8_TYPES else []
    served = {k: v for k, v in mats.items() if k != "output.weight" or head}
    rows_whole = {t.name for t in header.tensors if len(t.dims) == 2 and t.dims[0] % SUPERBLOCK == 0}
    whole = {k: v for k, v in served.items() if k in rows_whole}
    blocks: dict[str, Any] = {key: superblock_layers(whole, set(served), ty) if converted else []
                              for ty, (key, _) in SUPERBLOCK_LAYERS.items()}
    rows = {t.name: int(t.dims[1]) for t in header.tensors if len(t.dims) == 2}
    blocks["split_layers"] = split_layers(whole, rows, set(served)) if converted else {}
    own = {m for layers in blocks.values() for m in layers}
    int4 = [m for m in int4_layers(served) if m not in own] if converted else []
    converted = [t for t in converted if any(ty == t and module_of(k) not in own for k, ty in served.items()
                                             if k not in _EMBEDDINGS)]
    return {"quant_method": "gguf", "types": types, "lm_head": head, "converted": converted, "int4_layers": int4,
            **blocks}


def is_native(name: str, ggml_type: str, lm_head: bool) -> bool:
    """Whether this tensor loads as blocks (int4, or int8: Q8_0's own or converted), not dequantized: a projection,
    or the head when the config says so."""
    if ggml_type not in GGUF_INT8_TYPES or name in _EMBEDDINGS:
        return False
    return lm_head or name != "output.weight"


def decode(name: str, data: np.ndarray, ggml_type: str, rows: np.ndarray | None, symmetric: bool = False,
           int8: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(packed codes [N, K/2] uint8, scales [N, K/32] float16, mins [N, K/32] float16) of one tensor's 4-bit
    blocks (mins None for Q4_0 with `symmetric`: a file of Q4_0 only, whose layers store none), or (codes [N, K]
    int8, scales, None) of Q8_0's, or with `int8` of any other type converted to int8 blocks, or Q4_K's as int4
    groups (float32 mins; _q4_k) (data: uint8 [N, blocks * block bytes]), its rows reordered by `rows` (the HF
    layout's order, or None)."""
    if ggml_type == "Q4_K" and not int8:
        return _q4_k(name, data, rows)
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


def _q4_k(name: str, data: np.ndarray, rows: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K's 256-weight blocks as int4 groups of 32: packed codes, float16 scales d * sc, float32 mins -dmin * m.
    A block: float16 d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 code bytes whose 32-byte chunk c
    holds sub-block 2c in its low nibbles and 2c + 1 in its high ones (ggml's get_scale_min_k4 and dequantizer)."""
    n = data.shape[0]
    b = np.ascontiguousarray(data).reshape(n, -1, 144)
    nb = b.shape[1]
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    dmin = b[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
    q = b[:, :, 4:16]
    sc = np.concatenate([q[:, :, 0:4] & 63, (q[:, :, 8:12] & 15) | ((q[:, :, 0:4] >> 6) << 4)], axis=2)
    mn = np.concatenate([q[:, :, 4:8] & 63, (q[:, :, 8:12] >> 4) | ((q[:, :, 4:8] >> 6) << 4)], axis=2)
    qs = b[:, :, 16:].reshape(n, nb, 4, 1, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, nb * 256)  # chunk, half, position
    with np.errstate(over="ignore"):
        scales = (d[:, :, None] * sc).astype(np.float16).reshape(n, nb * 8)
    if not np.isfinite(scales).all():
        raise ValueError(f"GGUF tensor {name!r}: a Q4_K sub-block scale (d * sc) too large for float16")
    out = [pack_int4(torch.from_numpy(codes)), torch.from_numpy(scales),
           torch.from_numpy(-(dmin[:, :, None] * mn).reshape(n, nb * 8))]
    if rows is not None:
        idx = torch.from_numpy(rows)
        out = [t[idx] for t in out]
    return out[0], out[1], out[2]


def row_order(processor: Any, name: str, n: int, names: dict[str, str]) -> tuple[str | None, np.ndarray | None]:
    """(the name transformers' tensor processor gives this tensor, the permutation of rows it applies: llama.cpp
    stores Llama's q / k rows in its rope's order), found by processing the row numbers; rows None: kept."""
    probe = np.arange(n, dtype=np.float64).reshape(n, 1)
    result = processor.process(weights=probe, name=name, tensor_key_mapping=names, parsed_parameters={"tensors": {}})
    got = np.asarray(result.weights)
    if got.shape == (1, n):
        # GPT-2's: transposed back to its checkpoints' Conv1D [in, out], which the model's loader transposes again
        # to [out, in] (models/gpt2.py): the file's own rows, blocks along the inputs as our kernels run them.
        got = got.T
    if got.shape != (n, 1) or not np.array_equal(np.sort(got[:, 0]), probe[:, 0]):
        raise ValueError(f"GGUF tensor {name!r}: its conversion to the HF layout is not a reordering of rows, so its "
                         "blocks cannot run as they are")
    rows = got[:, 0].astype(np.int64)
    return result.name, None if np.array_equal(rows, np.arange(n)) else rows


def head_blocks(files: list[str], ggml_type: str) -> np.ndarray | None:
    """The rows [V, bytes a row] (uint8, a copy) of the tensor a GGUF file's head computes with (`output.weight`,
    else the tied `token_embd.weight`) where it is of `ggml_type`, read at the checked header's offsets (files: the
    file, or a split file's parts); None where it is another type."""
    infos = {t.name: (f, t) for f in files for t in read_header(f).tensors}
    found = infos.get("output.weight") or infos.get("token_embd.weight")
    if found is None or found[1].ggml_type.name != ggml_type or len(found[1].dims) != 2:
        return None
    path, info = found
    with open(path, "rb") as f:
        f.seek(info.start)
        data = np.frombuffer(f.read(info.nbytes), dtype=np.uint8)
    if data.size != info.nbytes or info.nbytes % info.dims[1]:
        raise ValueError(f"GGUF {path}: tensor {info.name!r} could not be read whole")
    return data.reshape(info.dims[1], -1).copy()
