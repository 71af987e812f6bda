"""LoRA adapters on the decoder families (model/models/decoder.py): PEFT checkpoints loaded into fixed slots,
applied to a mixed batch in one forward (punica's SGMV idea in plain torch: two matmuls per adapter run per projection).

Every projection a LoRA may target (q/k/v/o, gate/up/down) holds room for max_loras slots of rank up to
--max-lora-rank per module it computes: an adapter's A [in, r] and B [r, out] (pre-scaled by alpha / r) of each
module it targets are packed at its slot's start, q/k/v and gate/up into their column slices of our fused qkv_proj /
gate_up_proj. The runner orders a step's sequences so each adapter's tokens are contiguous (LoRAMapping, in the
attention metadata): each projection adds (x[run] @ A) @ B to the output rows of each run whose adapter targets it
— one forward for every adapter in the batch, the base rows untouched. The model sees slots and tensors, never
requests.
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

# PEFT module name → (our projection, which slice of it): q/k/v are slices of qkv_proj, gate/up of gate_up_proj;
# Phi-3's checkpoints (and so its adapters) have qkv_proj and gate_up_proj fused already.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(slots=True)
class LoRAMapping:
    """A step's adapter tokens as contiguous runs (slot, start, end): the runner orders sequences by slot within
    the decodes and within the prefills, so each adapter's tokens are one or two slices of the batch (base-model
    tokens belong to no run)."""

    runs: list[tuple[int, int, int]]


@dataclass(slots=True)
class LoRAAdapter:
    """A PEFT adapter read from disk: per (layer, module) its A [r, in] and B [out, r], and its scaling."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


_MAX_CONFIG_BYTES = 1 << 20


def read_adapter(path: str, max_bytes: int | None = None) -> LoRAAdapter:
    """adapter_config.json + adapter_model.safetensors (or .bin) of a PEFT LoRA; ValueError naming what is wrong.
    With max_bytes (LoRAModelManager.max_adapter_bytes), a weights file larger than any adapter the model's slots
    can hold is refused before it is read."""
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"lora_path: no adapter_config.json in {path!r} (expected a PEFT LoRA directory)")
    _check_size(cfg_path, _MAX_CONFIG_BYTES, "the largest adapter_config.json read")
    if max_bytes is not None:
        for name in ("adapter_model.safetensors", "adapter_model.bin"):
            _check_size(os.path.join(path, name), max_bytes, "the largest adapter this model's slots hold "
                        "(--max-lora-rank, fp32)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path: {path!r} is a {cfg.get('peft_type')} adapter; only LoRA is supported")
    for option in ("modules_to_save", "layers_to_transform"):
        if cfg.get(option):
            raise ValueError(f"lora_path: {option} is not supported (adapter {path!r})")
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


def _check_size(path: str, limit: int, what: str) -> None:
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    if size > limit:
        raise ValueError(f"lora_path: {os.path.basename(path)} is {size} bytes, over {what}: {limit} bytes")


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
    """One projection's slots side by side: A [in, S * W] and B [S * W, out] (W = its rank width), zero where a
    slot does not adapt it. Per run of tokens on one adapter, two matmuls on views (punica's SGMV as plain torch):
    no gather, no scatter, no flops for other slots; the delta accumulates into the output by addmm."""

    def __init__(self, in_features: int, out_features: int, slots: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots, self.width = slots, width
        self.a = torch.zeros(in_features, slots * width, dtype=dtype, device=device)
        self.b = torch.zeros(slots * width, out_features, dtype=dtype, device=device)
        # Per slot, the views of the columns its adapter fills (its modules' rank blocks packed at the slot's
        # start), None when it does not adapt this projection: a run on such a slot costs nothing here.
        self.views: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * slots

    def fill(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        """Write a slot: per adapted module, A [in, r], scaled B [r, size] and its output columns (start, size)."""
        lo = col = slot * self.width
        for a, b, start, size in parts:
            r = a.shape[1]
            self.a[:, col:col + r] = a
            self.b[col:col + r, start:start + size] = b
            col += r
        self.views[slot] = (self.a[:, lo:col], self.b[lo:col]) if parts else None

    def clear(self, slot: int) -> None:
        """Zero a slot."""
        self.a[:, slot * self.width:(slot + 1) * self.width].zero_()
        self.b[slot * self.width:(slot + 1) * self.width].zero_()
        self.views[slot] = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + this step's LoRA deltas (out is the projection's fresh output: updated in place)."""
        mapping = current_mapping()
        if mapping is None:
            return out
        xs = x if x.dtype == self.a.dtype else x.to(self.a.dtype)
        for slot, start, end in mapping.runs:
            views = self.views[slot]
            if views is None:
                continue
            a, b = views
            h = xs[start:end] @ a
            if out.dtype == b.dtype:
                out[start:end].addmm_(h, b)
            else:
                out[start:end] += (h @ b).to(out.dtype)
        return out


def build_mapping(token_slots: np.ndarray) -> LoRAMapping | None:
    """A step's LoRAMapping from each token's slot in batch order (-1: the base model); None when no token uses an
    adapter."""
    if not (token_slots >= 0).any():
        return None
    edges = np.flatnonzero(np.diff(token_slots)) + 1
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [len(token_slots)]))
    return LoRAMapping([(int(token_slots[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)
                        if token_slots[s] >= 0])


def current_mapping() -> LoRAMapping | None:
    """The step's LoRA mapping, from the attention metadata the runner published (None: no adapter this step)."""
    from minivllm.model.attention import get_metadata

    return get_metadata().lora


class LoRAModelManager:
    """The model's adapter slots: which projections may be adapted, and loading an adapter into a slot."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
                 ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        layers: Any = model.layers  # walked by attribute name below (nn.Module types its children Tensor | Module)
        self.num_layers = len(layers)
        # (layer, PEFT module) → (our projection, first output column, columns)
        self.targets: dict[tuple[int, str], tuple[Any, int, int]] = {}
        self.weights: dict[int, LoRAWeights] = {}  # id(projection) → its slots
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            spans = {"q_proj": (attn.qkv_proj, 0, q), "k_proj": (attn.qkv_proj, q, kv),
                     "v_proj": (attn.qkv_proj, q + kv, kv), "o_proj": (attn.o_proj, 0, attn.o_proj.out_features),
                     "qkv_proj": (attn.qkv_proj, 0, q + 2 * kv)}
            # A fused projection gives each module it holds a rank block of its own: A [in, parts * R] side by side,
            # B block-diagonal (q's A must not meet v's B).
            parts = {id(attn.qkv_proj): 3}
            if hasattr(mlp, "gate_up_proj"):  # a dense MLP (a mixture's experts take no adapter: check() says so)
                inter = mlp.down_proj.in_features
                spans |= {"gate_proj": (mlp.gate_up_proj, 0, inter), "up_proj": (mlp.gate_up_proj, inter, inter),
                          "down_proj": (mlp.down_proj, 0, mlp.down_proj.out_features),
                          "gate_up_proj": (mlp.gate_up_proj, 0, 2 * inter)}
                parts[id(mlp.gate_up_proj)] = 2
            for name, (proj, start, size) in spans.items():
                self.targets[(i, name)] = (proj, start, size)
                if id(proj) not in self.weights:
                    rank = max_rank * parts.get(id(proj), 1)
                    w = LoRAWeights(proj.in_features, proj.out_features, max_loras, rank, torch.float32, device)
                    self.weights[id(proj)] = w
                    proj.lora = w
        self.free = list(range(max_loras - 1, -1, -1))

    @property
    def max_adapter_bytes(self) -> int:
        """The largest weights file an adapter these slots can hold needs: every adaptable module of every layer
        at --max-lora-rank in fp32, plus room for the file's header."""
        per_rank = 0
        for (_, module), (proj, _, size) in self.targets.items():
            if module not in ("qkv_proj", "gate_up_proj"):  # (the fused names cover the same weights again)
                per_rank += proj.in_features + size
        return per_rank * self.max_rank * 4 + (1 << 20)

    def check(self, adapter: LoRAAdapter, name: str) -> None:
        """ValueError naming the problem when the adapter does not fit this model or the server's limits."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"lora_path: adapter {name!r} has rank {adapter.rank}, above --max-lora-rank "
                             f"{self.max_rank}")
        for (layer, module), (a, b) in adapter.weights.items():
            if layer >= self.num_layers:
                raise ValueError(f"lora_path: adapter {name!r} adapts layer {layer} but the model has "
                                 f"{self.num_layers} layers (made for another model?)")
            if (layer, module) not in self.targets:
                raise ValueError(f"lora_path: adapter {name!r} adapts {module} of layer {layer}, a mixture-of-experts "
                                 "layer: adapters on experts are not supported (attention and dense MLPs only)")
            proj, _, size = self.targets[(layer, module)]
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
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, int, int]]] = {k: [] for k in self.weights}
        for (layer, module), (a, b) in sorted(adapter.weights.items()):
            proj, start, size = self.targets[(layer, module)]
            parts[id(proj)].append((a.t(), b.t() * adapter.scaling, start, size))
        for key, w in self.weights.items():
            w.fill(slot, parts[key])
        return slot

    def unload(self, slot: int) -> None:
        """Zero a slot and free it."""
        for w in self.weights.values():
            w.clear(slot)
        self.free.append(slot)
