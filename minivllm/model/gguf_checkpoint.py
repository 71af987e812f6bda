"""GGUF files (llama.cpp, Ollama, LM Studio) as checkpoints: `minivllm serve model.gguf`.

The header is checked first (model/gguf_header.py); then the `gguf` package reads the file and transformers'
GGUF support turns its metadata into a Hugging Face config and tokenizer (vocabulary, merges, special tokens,
pre-tokenizer, chat template, bos/eos; model/gguf_families.py completes the config as llama.cpp reads it, and
reads the config of the families transformers refuses) and gives each GGUF tensor its HF name and layout
(llama.cpp permutes Llama's q/k rows for its rope, stores GPT-2's projections transposed, Gemma's norms minus one:
transformers' tensor processors undo each). So the rest of the engine sees an HF checkpoint: the same model classes, the
same load_weights, one tensor at a time.

Weights are dequantized as they are read, to the dtype the engine runs (F32/F16/BF16 files load exactly;
quantized tensors through the `gguf` package's own dequantizer, the reference for parity), except in a file whose
every projection is Q4_0 / Q4_1 (or every one Q8_0): those run on the int4 (int8 block) kernels block for block,
and in a file whose projections hold K-quants or the 5-bit types, converted at load to int8 blocks
(model/gguf_blocks.py); the file describes itself by a `quantization_config` of method "gguf" in its HF config.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import glob
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from minivllm.model import gguf_blocks
from minivllm.model.gguf_families import OWN_ARCHITECTURES, PERMUTED_QK, complete_config, parse_config
from minivllm.model.gguf_header import GGUFHeader, read_header
from minivllm.prequant_config import GGUF_INT4_TYPES

logger = logging.getLogger(__name__)

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# End-of-generation tokens besides the file's eos: a GGUF file holds one eos id (and sometimes eot / eom ids), where
# an HF checkpoint's generation_config lists every token that ends a turn; llama.cpp closes the gap by treating
# these texts as end of generation wherever the vocabulary has them (llama-vocab.cpp), and so do we.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>")
# Per model type: a key of transformers' GGUF config mapping -> the key that family's HF config reads.
_RENAMES = {"gpt2": {"n_ctx": "n_positions", "feed_forward_length": "n_inner"}}
# File types whose tensors all load exactly in a float dtype; the checkpoint dtype of anything else is float32.
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def find_gguf(path: str) -> str | None:
    """The GGUF file a model path names (the file itself, or the only .gguf file of a directory that has no
    config.json; of a split file, its first part); None when the path is not a GGUF checkpoint."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        files = [path]
    elif os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        files = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if not files:
            return None
        firsts = [f for f in files if _part_number(f) == 1]
        if len(firsts) > 1:
            names = ", ".join(map(os.path.basename, firsts))
            raise ValueError(f"model: {path!r} holds {len(firsts)} GGUF models ({names}); name the one to serve")
        files = firsts or files
    else:
        return None
    split = _SPLIT.search(files[0])
    if split and split.group(1) != "00001":
        first = files[0][:split.start()] + f"-00001-of-{split.group(2)}.gguf"
        raise ValueError(f"model: {os.path.basename(files[0])} is part {int(split.group(1))} of a split GGUF file; "
                         f"name its first part, {os.path.basename(first)}")
    parts(files[0])  # every part present
    return files[0]


def _part_number(path: str) -> int:
    split = _SPLIT.search(path)
    return int(split.group(1)) if split else 1


def parts(path: str) -> list[str]:
    """The files of a GGUF checkpoint: the file, or every part of a split one (-00001-of-0000N.gguf ...)."""
    split = _SPLIT.search(path)
    if split is None:
        return [path]
    count = int(split.group(2))
    if count < 1:
        raise ValueError(f"model: {os.path.basename(path)}: a split GGUF file of {count} parts")
    names = [path[:split.start()] + f"-{i:05d}-of-{split.group(2)}.gguf" for i in range(1, count + 1)]
    missing = [os.path.basename(n) for n in names if not os.path.isfile(n)]
    if missing:
        raise ValueError(f"model: split GGUF file {os.path.basename(names[0])} is missing parts: {', '.join(missing)}")
    return names


def _metadata(path: str) -> tuple[GGUFHeader, dict[str, Any]]:
    """The checked header and transformers' parse of the metadata (config and tokenizer keys), cached by the
    file's identity: the config, the tokenizer and the weights of one engine all read it."""
    st = os.stat(path)
    return _read_metadata(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _read_metadata(path: str, mtime_ns: int, size: int) -> tuple[GGUFHeader, dict[str, Any]]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    headers = [read_header(p) for p in parts(path)]  # before the gguf package reads anything
    header = headers[0]
    if len(headers) > 1:
        count = header.values.get("split.count")
        if count != len(headers):
            raise ValueError(f"GGUF {path}: metadata 'split.count' is {count!r}, but the file name says "
                             f"{len(headers)} parts")
        header = dataclasses.replace(header, tensors=tuple(t for h in headers for t in h.tensors))
        names = [t.name for t in header.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"GGUF {path}: a tensor appears in two parts of the split file")
    for t in header.tensors:
        if not _loadable(t.ggml_type):
            raise ValueError(f"GGUF {path}: tensor {t.name!r} has type {t.ggml_type.name}, which cannot be loaded "
                             f"(the gguf package has no dequantizer for it)")
    arch = str(header.values.get("general.architecture", ""))
    try:
        if arch in OWN_ARCHITECTURES:  # transformers' reader refuses these: their config is read by ours
            tokens = _tokenizer_parts(path)[1]["tokens"]
            tensor_names = {t.name for t in header.tensors}
            parsed = {"config": parse_config(header.values, arch, tensor_names, len(tokens)),
                      "tokenizer": {"tokens": tokens}}
        else:
            parsed = load_gguf_checkpoint(path, return_tensors=False)
    except (ValueError, KeyError, IndexError, TypeError, NotImplementedError) as e:
        raise ValueError(f"GGUF {path}: cannot read its metadata: {e}") from None
    # transformers looks for the output head in the first part only; it may sit in any.
    if len(headers) > 1 and parsed["config"].get("model_type") not in ("falcon", "bloom"):
        parsed["config"]["tie_word_embeddings"] = all(t.name != "output.weight" for t in header.tensors)
    return header, parsed


@functools.cache
def _loadable(ggml_type: Any) -> bool:
    """Whether the gguf package dequantizes this type (tried on one zero block)."""
    from gguf import GGML_QUANT_SIZES, dequantize

    _, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def hf_config(path: str) -> dict[str, Any]:
    """The Hugging Face config.json equivalent of a GGUF file's metadata, with `architectures` set from its
    model type and `torch_dtype` from its tensor types (a copy: callers may change theirs)."""
    st = os.stat(path)
    return copy.deepcopy(_hf_config(path, st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=4)
def _hf_config(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """hf_config, built once per file identity (the engine's config, weights and tokenizer each ask; completing it
    reads the rope factor tensors)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    header, parsed = _metadata(path)
    cfg = dict(parsed["config"])
    model_type = cfg.get("model_type")
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(model_type))
    if arch is None:
        raise ValueError(f"GGUF {path}: model type {model_type!r} has no causal-LM architecture in transformers")
    cfg["architectures"] = [arch]
    # Keys transformers' GGUF mapping names as no HF config of that family reads them.
    for old_key, key in _RENAMES.get(str(model_type), {}).items():
        if old_key in cfg:
            cfg.setdefault(key, cfg.pop(old_key))
    meta = header.values
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if isinstance(meta.get(k), int)]
    tokens = parsed["tokenizer"].get("tokens") or []
    eos += [i for i, text in enumerate(tokens) if text in EOG_TEXTS]
    if eos:
        cfg["eos_token_id"] = list(dict.fromkeys(int(i) for i in eos))
    try:
        complete_config(cfg, meta, str(meta.get("general.architecture", "")), functools.partial(_small_tensor, path))
    except (ValueError, TypeError, KeyError, ZeroDivisionError) as e:
        raise ValueError(f"GGUF {path}: {e}") from None
    if cfg.get("model_type") != model_type:  # (a `llama` file with experts is a Mixtral)
        cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[str(cfg["model_type"])]]
    _transformers_config(path, cfg)  # transformers checks every value's type: a wrong one fails here, named
    matrix_types = {t.ggml_type.name for t in header.tensors if len(t.dims) > 1}
    cfg["torch_dtype"] = _FLOAT_TYPES.get(matrix_types.pop() if len(matrix_types) == 1 else "", "float32")
    native = gguf_blocks.native_config(header, str(header.values.get("general.architecture", "")))
    if native is not None:
        cfg["quantization_config"] = native
    return cfg


def _small_tensor(path: str, name: str) -> np.ndarray | None:
    """A small tensor of the file (rope factors), dequantized to float32; None if the file has none so named."""
    from gguf import GGUFReader, dequantize

    header, _ = _metadata(path)
    info = next((t for t in header.tensors if t.name == name), None)
    if info is None:
        return None
    if info.nbytes > 1 << 20:
        raise ValueError(f"GGUF {path}: tensor {name!r} holds {info.nbytes} bytes; rope factors are a vector")
    for part in parts(path):
        for t in GGUFReader(part).tensors:
            if t.name == name:
                return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
    return None


def _transformers_config(path: str, cfg: dict[str, Any]) -> Any:
    """transformers' config object for the parsed metadata; its validation errors (a float where an int
    belongs, say) become a ValueError naming the file."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        raise ValueError(f"GGUF {path}: its metadata is not a valid {cfg.get('model_type')} config: {e}") from None


def tensor_types(path: str) -> dict[str, int]:
    """How many of the file's tensors have each ggml type (for the load log)."""
    header, _ = _metadata(path)
    counts: dict[str, int] = {}
    for t in header.tensors:
        counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + 1
    return counts


def _tokenizer_parts(path: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """transformers' reading of the file's tokenizer metadata: (architecture, tokenizer dict, tokenizer config)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer

    return get_gguf_tokenizer(path)


def load_tokenizer(path: str) -> Any:
    """The fast tokenizer built from the file's tokenizer metadata (transformers' GGUF converter)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    header, _ = _metadata(path)  # the header check comes first
    tok: Any
    try:
        if header.values.get("general.architecture") in OWN_ARCHITECTURES:  # (AutoTokenizer reads the config too)
            arch, tokenizer, tokenizer_config = _tokenizer_parts(path)
            backend, extra = convert_gguf_tokenizer(arch, tokenizer)
            tok = PreTrainedTokenizerFast(tokenizer_object=backend, **{**tokenizer_config, **extra})
        else:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                gguf_file=os.path.basename(path))
    except Exception as e:  # tokenizers raises a plain Exception for a vocabulary its merges do not fit
        raise ValueError(f"GGUF {path}: cannot build its tokenizer: {e}") from None
    meta = header.values
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") == "gpt-2":
        # transformers splits by the architecture's own regex unless the file names another it knows; "gpt-2"
        # is GPT-2's byte-level split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2), whatever the architecture.
        from tokenizers import pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tok


def _mixtral_processor(config: dict[str, Any]) -> Any:
    """transformers' tensor processors know a Mixtral GGUF file (a `llama` one with ffn_*_exps) by halves: Llama's
    un-permutes q / k, Qwen2-MoE's maps the merged experts (gate and up into one gate_up tensor); one of both."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, Qwen2MoeTensorProcessor

    class MixtralTensorProcessor(Qwen2MoeTensorProcessor):
        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__(config=config)
            self.llama = LlamaTensorProcessor(config=config)

        def process(self, weights: Any, name: str, **kwargs: Any) -> Any:
            if ".attn_q." in name or ".attn_k." in name:
                weights = self.llama.process(weights, name).weights
            return super().process(weights, name, **kwargs)

    return MixtralTensorProcessor(config)


def iterate_weights(path: str, native: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file that the HF model has, one at a time; with native,
    a Q4_0 / Q4_1 projection as its int4 `.qweight`, `.scales` and `.mins` instead, a Q8_0 one (or a K-quant one,
    converted) as int8 blocks' `.qweight` and `.scales` (model/gguf_blocks.py)."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    header, parsed = _metadata(path)
    logger.info("GGUF %s: %d tensors (%s)", os.path.basename(path), len(header.tensors),
                ", ".join(f"{n} {t}" for t, n in tensor_types(path).items()))
    # The completed config (gguf_families): transformers' own parse may not even build its model (Phi-3's pad id).
    config = {k: v for k, v in hf_config(path).items() if k not in ("architectures", "quantization_config")}
    arch = str(header.values.get("general.architecture", ""))
    default = LlamaTensorProcessor if arch in PERMUTED_QK else TensorProcessor
    # (OLMoE's experts are merged ffn_*_exps tensors as Qwen2-MoE's: transformers, refusing the architecture, has
    # no processor of its name)
    processor = TENSOR_PROCESSORS.get("qwen2moe" if arch == "olmoe" else arch, default)(config=config)
    if config.get("model_type") == "mixtral":  # a `llama` file with experts
        processor = _mixtral_processor(config)
    # The HF names: from the HF model's own parameter names, mapped by the gguf package's name table.
    hf_cfg = _transformers_config(path, config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_cfg)
    # (gguf-py's name table knows a Mixtral as the `llama` architecture its files are written as)
    names = get_gguf_hf_weights_map(skeleton, processor, model_type="llama" if arch == "llama" else None)
    del skeleton
    checked = {t.name: t for t in header.tensors}
    native_cfg = gguf_blocks.native_config(header, arch) or {}
    head = bool(native_cfg.get("lm_head"))
    symmetric = native_cfg.get("types") == ["Q4_0"]  # its layers store no mins (QuantConfig min_dtype "none")
    int8 = bool(native_cfg) and not set(native_cfg["types"]) <= GGUF_INT4_TYPES  # int8 blocks, some converted
    int4_layers = set(native_cfg.get("int4_layers") or ())  # (in such a file: modules of int4 groups, float32 mins)
    # (and modules of Q6_K and Q4_K superblocks as the file holds them)
    superblocks = {m for key, _ in gguf_blocks.SUPERBLOCK_LAYERS.values() for m in native_cfg.get(key) or ()} | \
        set(native_cfg.get("split_layers") or ())
    extra: dict[str, Any] = {"tensors": {}}  # processors that rename a tensor put it here (GPT-2's output)
    # A mixture's merged gate/up experts: the processor fills one tensor from two of the file's (ffn_gate_exps,
    # ffn_up_exps), so it is yielded once both halves are in (yielded at the first, the up half stayed zeros).
    halves: dict[str, int] = {}
    for tensor in (t for part in parts(path) for t in GGUFReader(part).tensors):
        info = checked.get(tensor.name)
        if info is None or tensor.data_offset != info.start or int(tensor.n_bytes) != info.nbytes:
            raise ValueError(f"GGUF {path}: tensor {tensor.name!r} read differently from its checked header")
        kind = info.ggml_type.name
        if native and len(info.dims) == 2 and gguf_blocks.is_native(tensor.name, kind, head):
            key, rows = gguf_blocks.row_order(processor, tensor.name, int(info.dims[1]), names)
            hf_name = names.get(key or "")
            if hf_name is None or not hf_name.endswith(".weight"):
                raise ValueError(f"GGUF {path}: {kind} tensor {tensor.name!r} has no projection of the model to run in")
            prefix = hf_name.removesuffix(".weight")
            if gguf_blocks.module_of(tensor.name) in superblocks:
                yield prefix + ".qweight", gguf_blocks.superblock_rows(tensor.data, rows)
                continue
            int4 = gguf_blocks.module_of(tensor.name) in int4_layers
            qweight, scales, mins = gguf_blocks.decode(tensor.name, tensor.data, kind, rows, symmetric,
                                                       int8 and not int4)
            yield from ((prefix + ".qweight", qweight), (prefix + ".scales", scales))
            if mins is not None:
                yield prefix + ".mins", mins.float() if int4 else mins
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters=extra)
        if ".ffn_gate_exps." in tensor.name or ".ffn_up_exps." in tensor.name:
            target = names.get(tensor.name.rsplit(".", 1)[0], "")
            halves[target] = halves.get(target, 0) + 1
        for name, value in list(extra["tensors"].items()):
            if name.endswith("experts.gate_up_proj") and halves.get(name, 0) < 2:
                continue  # (its other half is still to come)
            yield name, value
            del extra["tensors"][name]
        if result.name is None or result.name not in names:
            continue
        # A copy: an F32 tensor is a read-only view of the file's mapping.
        value = torch.from_numpy(np.array(result.weights, dtype=np.float32))
        if value.dim() > 2 and all(d == 1 for d in value.shape[:-2]):
            value = value.reshape(value.shape[-2:])  # Qwen2-MoE's shared-expert gate comes as [1, 1, H]
        yield names[result.name], value
    if extra["tensors"]:
        raise ValueError(f"GGUF {path}: {', '.join(extra['tensors'])} read from half of the file's tensors "
                         "(an ffn_gate_exps without its ffn_up_exps, or the reverse)")

