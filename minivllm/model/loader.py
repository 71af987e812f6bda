"""HF model directory → our model with its weights (safetensors single or sharded, or .bin; or a GGUF file)."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from minivllm.config import ModelConfig
from minivllm.distributed.parallel import attach_collectives, shard_model
from minivllm.engine_config import ParallelConfig
from minivllm.model import gguf_blocks, gguf_checkpoint, prequantized
from minivllm.model.hugepages import place_in_hugepages, placed_bytes
from minivllm.model.models import get_model_class
from minivllm.model.quantization import quantize_model
from minivllm.model.quantized_checkpoint import load_quantized
from minivllm.prequant_config import PrequantScheme, parse_prequantized
from minivllm.quant_config import QuantConfig

logger = logging.getLogger(__name__)

# torch.nn.init's in-place initialisers, no-ops while a model is built on the meta device (_no_init).
_INITIALISERS = tuple(n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_"))


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Modules built in here skip their random init (nn.Embedding's normal_, nn.Linear's kaiming_uniform_, ...): on
    the meta device there is nothing to initialise (the checkpoint fills every tensor), and torch runs those calls
    on meta tensors through its reference implementations, whose first use imports torch._dynamo: 1.4 s of every
    process's start here (a server, a tensor-parallel rank, a bench worker), for nothing. transformers builds its
    models the same way (no_init_weights)."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def weight_files(path: str) -> list[str]:
    """The checkpoint files of a directory, preferring safetensors; sharded via the index file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"model: shards listed in {index} are missing: {', '.join(missing)}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"model: no weights in {path!r} (expected model.safetensors, sharded "
                                "safetensors with model.safetensors.index.json, or pytorch_model.bin)")
    return files


def checkpoint_names(path: str) -> list[str]:
    """Every tensor name of a checkpoint directory, from the files' headers (safetensors) or contents (.bin)."""
    names: list[str] = []
    for file in weight_files(path):
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                names += list(f.keys())
        else:
            names += list(torch.load(file, map_location="cpu", weights_only=True))
    return names


def iterate_weights(path: str, native: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one file at a time (a GGUF file: HF names,
    dequantized, or with native its projections as int4 or int8 blocks, K-quants converted; model/gguf_blocks.py)."""
    if path.endswith(".gguf"):
        yield from gguf_checkpoint.iterate_weights(path, native)
        return
    for file in weight_files(path):
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True).items()


def prequantized_scheme(mc: ModelConfig) -> PrequantScheme | None:
    """The GPTQ / AWQ / compressed-tensors scheme of the checkpoint's layers; None for any other checkpoint."""
    saved = mc.hf_config.get("quantization_config")
    scheme = parse_prequantized(saved, f"{mc.path}/config.json") if isinstance(saved, dict) else None
    if scheme is not None and (scheme.method == "gguf") != mc.path.endswith(".gguf"):
        raise ValueError(f"{mc.path}: a quantization_config of method 'gguf' belongs to a .gguf file only")
    return scheme


def load_model(mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int,
               quant: QuantConfig | None = None, parallel: ParallelConfig | None = None) -> nn.Module:
    """Build the model for mc.architecture and fill it from the checkpoint; with `quant`, its projections
    become quantized layers (quantized here, or copied as saved from a quantized checkpoint); with
    `parallel`, cut to that rank's shard (before quantizing: each rank quantizes only its own)."""
    cls = get_model_class(mc)
    # Built on the meta device in the target dtype: no random init to throw away (11 s per billion
    # parameters here) and no float32 detour for a bf16 model.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), _no_init():
            # load_weights (and its modules' reset_buffers) are the registry class's own, not nn.Module's
            model: Any = cls(mc, max_model_len)
            scheme = prequantized_scheme(mc)
            saved = quant is not None and scheme is None and "quantization_config" in mc.hf_config
            # A GPTQ / AWQ / compressed-tensors checkpoint whose layers map onto our kernels loads into them.
            native = quant is not None and scheme is not None and quant.method in scheme.kernels()
            if native:
                assert quant is not None and scheme is not None  # (native implies them)
                if scheme.method == "gguf":
                    head = bool(mc.hf_config["quantization_config"].get("lm_head"))
                else:
                    names = checkpoint_names(mc.path)
                    head = any(p.split(".")[-1] == "lm_head" for p in prequantized.quantized_layers(scheme, names))
                quant = dataclasses.replace(quant, quantize_lm_head=head)
            if saved or native:
                assert quant is not None  # (saved implies it)
                gguf = scheme is not None and scheme.method == "gguf"
                quantize_model(model, quant, materialize=False, overrides=gguf_blocks.int4_overrides(
                    mc.hf_config["quantization_config"], quant) if native and gguf else None)
                if native and gguf:
                    gguf_blocks.place_superblock_layers(model, mc.hf_config["quantization_config"], quant)
    finally:
        torch.set_default_dtype(prev)
    model.to_empty(device=device)
    if device.type == "cpu":
        place_in_hugepages(model, copy=False)  # read the checkpoint straight into huge pages (model/hugepages.py)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    tp = parallel is not None and parallel.size > 1
    if saved and tp:
        raise ValueError("tensor parallelism of a checkpoint saved quantized is not supported; load its "
                         "full-precision original with --quantization instead (each rank quantizes its shard)")
    if native and tp:
        assert scheme is not None
        raise ValueError(f"tensor parallelism of a {scheme.method} checkpoint whose layers run as they are stored is "
                         "not supported; serve it with tensor_parallel_size 1")
    if saved:
        load_quantized(model, mc)
    elif native and scheme is not None and scheme.method == "gguf":
        model.load_weights(iterate_weights(mc.path, native=True))
    elif native:
        assert quant is not None and scheme is not None
        model.load_weights(prequantized.convert(scheme, names, iterate_weights(mc.path), quant.torch_scale_dtype,
                                                quant.torch_min_dtype))
    else:
        weights = iterate_weights(mc.path)
        if scheme is not None and scheme.method != "gguf":  # layers no kernel of ours runs as they are: dequantized
            logger.info("%s checkpoint: layers dequantized to float at load (act-order groups, per-channel 4-bit, "
                        "an unsupported group size, or a float model asked for)", scheme.method)
            weights = prequantized.convert(scheme, checkpoint_names(mc.path), weights, None, dequantize=True)
        model.load_weights(weights)
        if tp:
            assert parallel is not None  # (tp implies it)
            shard_model(model, mc, parallel)
        if quant is not None:
            quantize_model(model, quant)
    if tp:
        assert parallel is not None  # (tp implies it)
        attach_collectives(model, mc, parallel)
    model.eval().requires_grad_(False)
    if device.type == "cpu":
        place_in_hugepages(model)  # what the load replaced (quantized, sharded); before any kernel takes an address
        placed = placed_bytes(model)
        if placed:
            logger.info("weights: %.2f GB in huge pages", placed / 1e9)
    return model
