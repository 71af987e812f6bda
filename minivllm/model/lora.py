"""LoRA adapters on the Llama family: PEFT checkpoints loaded into fixed slots, applied to a mixed batch in one
forward (vLLM's punica idea, as plain grouped matmuls).

Every projection a LoRA may target (q/k/v/o, gate/up/down) holds, per slot, A [in, R] and B [R, out] (R =
--max-lora-rank; a smaller rank is zero-padded, B pre-scaled by alpha / r). q/k/v and gate/up land in their slice
of our fused qkv_proj / gate_up_proj. A step's tokens carry their sequence's slot (LoRAMapping, in the attention
metadata): each projection adds, per slot present in the step, (x[tokens] @ A) @ B to its output — one forward
for every adapter in the batch, the base rows untouched. The model sees only slots and tensors, never requests.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

# PEFT module name → (our projection, which slice of it): q/k/v are slices of qkv_proj, gate/up of gate_up_proj.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(slots=True)
class LoRAMapping:
    """Which tokens of a step use which slot: (slot, token indices), or (slot, None) when every token does."""

    groups: list[tuple[int, torch.Tensor | None]]


@dataclass(slots=True)
class LoRAAdapter:
    """A PEFT adapter read from disk: per (layer, module) its A [r, in] and B [out, r], and its scaling."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str) -> LoRAAdapter:
    """adapter_config.json + adapter_model.safetensors (or .bin) of a PEFT LoRA; ValueError naming what is wrong."""
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"lora_path: no adapter_config.json in {path!r} (expected a PEFT LoRA directory)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path: {path!r} is a {cfg.get('peft_type')} adapter; only LoRA is supported")
    for key in ("modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise ValueError(f"lora_path: {key} is not supported (adapter {path!r})")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"lora_path: bias={cfg['bias']!r} is not supported (adapter {path!r}); only bias='none'")
    if cfg.get("use_dora"):
        raise ValueError(f"lora_path: DoRA adapters are not supported ({path!r})")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = _load_tensors(path)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _KEY.match(name)
        if m is None:
            raise ValueError(f"lora_path: adapter {path!r} has weights for {name!r}, a module this server cannot adapt "
                             f"(supported: {', '.join(TARGETS)})")
        layer, module = int(m.group(1)), m.group(3)
        if module not in TARGETS:
            raise ValueError(f"lora_path: adapter {path!r} targets {module!r}; supported: {', '.join(TARGETS)}")
        found.setdefault((layer, module), {})[m.group(4)] = t.float()
    weights = {}
    for key, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path: adapter {path!r} has lora_A without lora_B (or the reverse) at {key}")
        weights[key] = (ab["A"], ab["B"])
    if not weights:
        raise ValueError(f"lora_path: adapter {path!r} holds no LoRA weights")
    return LoRAAdapter(rank, scaling, weights)


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    binary = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ValueError(f"lora_path: no adapter_model.safetensors (or .bin) in {path!r}")


class LoRAWeights:
    """One projection's slots: A [S, in, R] and B [S, R, out], zero where a slot does not adapt it."""

    def __init__(self, in_features: int, out_features: int, slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.a = torch.zeros(slots, in_features, rank, dtype=dtype, device=device)
        self.b = torch.zeros(slots, rank, out_features, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + this step's LoRA deltas (out is the projection's fresh output: updated in place)."""
        mapping = current_mapping()
        if mapping is None:
            return out
        for slot, idx in mapping.groups:
            xs = x if idx is None else x.index_select(0, idx)
            delta = (xs.to(self.a.dtype) @ self.a[slot]) @ self.b[slot]
            if idx is None:
                out += delta.to(out.dtype)
            else:
                out.index_add_(0, idx, delta.to(out.dtype))
        return out


def build_mapping(token_slots: np.ndarray, device: torch.device) -> LoRAMapping | None:
    """A step's LoRAMapping from each token's slot (-1: the base model); None when no token uses an adapter."""
    used = np.unique(token_slots)
    used = used[used >= 0]
    if not len(used):
        return None
    if len(used) == 1 and token_slots[0] == used[0] and (token_slots == used[0]).all():
        return LoRAMapping([(int(used[0]), None)])
    return LoRAMapping([(int(s), torch.from_numpy(np.flatnonzero(token_slots == s)).to(device)) for s in used])


def current_mapping() -> LoRAMapping | None:
    """The step's LoRA mapping, from the attention metadata the runner published (None: no adapter this step)."""
    from minivllm.model.attention import get_metadata

    return get_metadata().lora


class LoRAModelManager:
    """The model's adapter slots: which projections may be adapted, and loading an adapter into a slot."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
                 ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.num_layers = len(model.layers)
        # (layer, PEFT module) → (our projection, first output column, columns, its rank block in the projection)
        self.targets: dict[tuple[int, str], tuple[Any, int, int, int]] = {}
        self.weights: dict[int, LoRAWeights] = {}  # id(projection) → its slots
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, kv, inter = attn.q_size, attn.kv_size, mlp.down_proj.in_features
            # A fused projection gives each of its modules its own rank block: A [in, parts * R] side by side, B
            # block-diagonal [parts * R, out] (q's A must not meet v's B).
            spans = {"q_proj": (attn.qkv_proj, 0, q, 0), "k_proj": (attn.qkv_proj, q, kv, 1),
                     "v_proj": (attn.qkv_proj, q + kv, kv, 2),
                     "o_proj": (attn.o_proj, 0, attn.o_proj.out_features, 0),
                     "gate_proj": (mlp.gate_up_proj, 0, inter, 0), "up_proj": (mlp.gate_up_proj, inter, inter, 1),
                     "down_proj": (mlp.down_proj, 0, mlp.down_proj.out_features, 0)}
            parts = {id(attn.qkv_proj): 3, id(mlp.gate_up_proj): 2}
            for name, (proj, start, size, block) in spans.items():
                self.targets[(i, name)] = (proj, start, size, block)
                if id(proj) not in self.weights:
                    rank = max_rank * parts.get(id(proj), 1)
                    w = LoRAWeights(proj.in_features, proj.out_features, max_loras, rank, torch.float32, device)
                    self.weights[id(proj)] = w
                    proj.lora = w
        self.free = list(range(max_loras - 1, -1, -1))

    def check(self, adapter: LoRAAdapter, name: str) -> None:
        """ValueError naming the problem when the adapter does not fit this model or the server's limits."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"lora_path: adapter {name!r} has rank {adapter.rank}, above --max-lora-rank "
                             f"{self.max_rank}")
        for (layer, module), (a, b) in adapter.weights.items():
            if layer >= self.num_layers:
                raise ValueError(f"lora_path: adapter {name!r} adapts layer {layer} but the model has "
                                 f"{self.num_layers} layers (made for another model?)")
            proj, _, size, _ = self.targets[(layer, module)]
            if a.shape != (adapter.rank, proj.in_features) or b.shape != (size, adapter.rank):
                raise ValueError(f"lora_path: adapter {name!r}: {module} of layer {layer} is A {tuple(a.shape)}, B "
                                 f"{tuple(b.shape)}, but this model needs A ({adapter.rank}, {proj.in_features}), B "
                                 f"({size}, {adapter.rank}) (made for another model?)")

    def load(self, adapter: LoRAAdapter, name: str) -> int:
        """Copy an adapter into a free slot; returns the slot. ValueError if it does not fit or no slot is free."""
        self.check(adapter, name)
        if not self.free:
            raise ValueError(f"lora_name: all {self.max_loras} adapter slots are in use (--max-loras); unload one "
                             "first")
        slot = self.free.pop()
        r, base = adapter.rank, self.max_rank
        for (layer, module), (a, b) in adapter.weights.items():
            proj, start, size, block = self.targets[(layer, module)]
            w = self.weights[id(proj)]
            lo = block * base
            w.a[slot, :, lo:lo + r] = a.t().to(w.a)
            w.b[slot, lo:lo + r, start:start + size] = (b.t() * adapter.scaling).to(w.b)
        return slot

    def unload(self, slot: int) -> None:
        """Zero a slot and free it."""
        for w in self.weights.values():
            w.a[slot].zero_()
            w.b[slot].zero_()
        self.free.append(slot)
