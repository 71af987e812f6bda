"""Quantized checkpoints: `minivllm quantize` saves a model's quantized state; loading copies it back as is.

The saved directory is the source model's directory (config, tokenizer, generation config) with the
weights replaced by our own module names and packed integer tensors, and `quantization_config` in
config.json saying how they were made. Loading builds the model, swaps in empty quantized layers and
copies every tensor: no quantization work, so it loads as fast as the original.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from minivllm.config import ModelConfig
from minivllm.quant_config import QuantConfig

WEIGHTS_FILE = "model.safetensors"


def save_quantized(model: nn.Module, mc: ModelConfig, cfg: QuantConfig, out: str) -> str:
    """Write the quantized model to `out` (a new or empty directory); returns its path."""
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"quantize: output directory {out!r} is not empty")
    if not os.path.isdir(mc.path):  # (a GGUF file: its tokenizer lives in its metadata, not in files to copy)
        raise ValueError(f"quantize: {mc.path!r} is not a Hugging Face model directory; quantizing a GGUF file "
                         "is not supported (serve it as it is)")
    os.makedirs(out, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, t in model.state_dict().items():
        owner = first_name.setdefault(t.data_ptr(), name)
        if owner != name:  # a tied weight (the LM head kept in full precision): saved once
            tied[name] = owner
        else:
            tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, os.path.join(out, WEIGHTS_FILE), metadata={"format": "pt", "minivllm": "quantized"})
    for entry in os.listdir(mc.path):
        src = os.path.join(mc.path, entry)
        # Not the weights, config.json (rewritten below) or the model card, which describes the original.
        if os.path.isfile(src) and not entry.endswith((".safetensors", ".bin", ".index.json", ".pt")) \
                and entry not in ("config.json", "README.md"):
            shutil.copy2(src, os.path.join(out, entry))
    config = dict(mc.hf_config)
    config["quantization_config"] = {**cfg.as_hf_dict(), "tied_weights": tied}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out


def load_quantized(model: nn.Module, mc: ModelConfig) -> None:
    """Fill a model whose layers are already QuantizedLinear from a saved quantized checkpoint."""
    from minivllm.model.loader import iterate_weights

    where = f"quantized checkpoint {mc.path}"
    state = model.state_dict()
    tied: dict[str, str] = dict(mc.hf_config["quantization_config"].get("tied_weights") or {})
    loaded: set[str] = set()
    try:
        for name, tensor in iterate_weights(mc.path):
            target = state.get(name)
            if target is None or name in tied:
                raise ValueError(f"{where}: unexpected tensor {name!r}; it was saved from a different model, "
                                 "mode or minivllm version")
            if tensor.shape != target.shape or (tensor.dtype != target.dtype and not target.dtype.is_floating_point):
                raise ValueError(f"{where}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                                 f"{target.dtype} {tuple(target.shape)} for "
                                 f"{mc.hf_config['quantization_config'].get('mode')} with these settings")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name)
    except SafetensorError as e:
        raise ValueError(f"{where}: cannot read its weights ({e}); the file is corrupt or truncated") from None
    for alias, source in tied.items():
        module_name, _, attr = alias.rpartition(".")
        src_module, _, src_attr = source.rpartition(".")
        setattr(model.get_submodule(module_name), attr, getattr(model.get_submodule(src_module), src_attr))
        loaded.add(alias)
    missing = sorted(set(state) - loaded)
    if missing:
        raise ValueError(f"{where}: missing tensors {', '.join(missing[:6])}"
                         + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
