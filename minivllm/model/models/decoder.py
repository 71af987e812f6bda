"""The decoder every Llama-style family shares: one layer with the variants their configs ask for.

A family file (llama, qwen3, gemma, phi3, smollm3, olmo2, granite) reads its config into a DecoderSpec:
where its norms sit (before and/or after attention and the MLP), Gemma's (1 + w) norms, q/k norms per head
or over the whole projection, the MLP's activation, attention scale and soft-capping, each layer's window
and rope, and the scalars around the stack (embedding scale, residual multiplier, logit scaling and
soft-capping). The layers, the fused CPU kernels, the native decode stack, quantization, LoRA and tensor
parallelism then serve every family through the same modules: the projections are always the fused
`qkv_proj` and `gate_up_proj` and the plain `o_proj` and `down_proj`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.attention import Attention
from minivllm.model.decode_stack import DecodeStack
from minivllm.model.layers import GatedMLP, GroupRMSNorm, Linear, RMSNorm
from minivllm.model.models.weights import WeightLoader
from minivllm.model.moe import MoESpec, SparseMoE
from minivllm.model.rotary import RopeInput, RotaryEmbedding

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """What a family's decoder computes, read once from its config."""

    # Checkpoint names of the norms before attention, after attention, before the MLP, after the MLP (None:
    # absent). Llama: input_layernorm, -, post_attention_layernorm, -; Gemma: all four; OLMo 2: the two after.
    norms: tuple[str | None, str | None, str | None, str | None]
    layer_types: tuple[str, ...]  # per layer: FULL or SLIDING
    sliding_window: int | None = None  # the window of SLIDING layers
    rope_layers: tuple[bool, ...] | None = None  # per layer: rotary on (SmolLM3's NoPE layers: off); None: all on
    rope_per_layer_type: bool = False  # Gemma 3: local and global layers each have their own rope
    unit_offset_norms: bool = False  # Gemma: norms scale by (1 + w)
    qk_norm: str | None = None  # "head" (Qwen3, Gemma 3) | "proj" (OLMo 2: over the whole q / k projection)
    act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    residual_scale: float = 1.0  # Granite's residual_multiplier
    embed_scale: float = 1.0  # Gemma's sqrt(hidden), Granite's embedding_multiplier
    logits_divisor: float = 1.0  # Granite's logits_scaling
    final_softcap: float | None = None
    moe: MoESpec | None = None  # the expert layers of a mixture-of-experts family (model/moe.py)


def layer_types_from(cfg: dict[str, Any], n: int, default: list[str]) -> tuple[str, ...]:
    """The config's layer_types, or the family's default pattern; an unknown type is named."""
    types = cfg.get("layer_types") or default
    if len(types) != n:
        raise ValueError(f"layer_types lists {len(types)} layers; num_hidden_layers is {n}")
    bad = sorted(set(types) - {FULL, SLIDING})
    if bad:
        raise ValueError(f"layer_types: unsupported {bad}; supported: {FULL}, {SLIDING}")
    return tuple(types)


def require(mc: ModelConfig, field: str, allowed: tuple[Any, ...], default: Any = None) -> None:
    """Refuse a config value this implementation does not compute (never silently wrong output)."""
    value = mc.hf_config.get(field, default)
    if value not in allowed:
        raise ValueError(f"{mc.architecture}: config field {field}={value!r} is not supported; supported: "
                         f"{', '.join(map(repr, allowed))}")


class DecoderAttention(nn.Module):
    """Self-attention with one fused qkv projection, optional q/k norms, the layer's rope (or none) and window."""

    def __init__(self, mc: ModelConfig, spec: DecoderSpec, window: int | None, rotary: RotaryEmbedding | None,
                 rope_key: str | None, eps: float) -> None:
        super().__init__()
        d = mc.head_dim
        self.q_size, self.kv_size = mc.num_heads * d, mc.num_kv_heads * d
        self.qkv_proj = Linear(mc.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, mc.hidden_size, bias=spec.o_bias)
        self.q_norm: GroupRMSNorm | None = None
        self.k_norm: GroupRMSNorm | None = None
        if spec.qk_norm is not None:
            per_head = spec.qk_norm == "head"
            self.q_norm = GroupRMSNorm(d if per_head else self.q_size, eps, spec.unit_offset_norms)
            self.k_norm = GroupRMSNorm(d if per_head else self.kv_size, eps, spec.unit_offset_norms)
        self.rotary, self.rope_key = rotary, rope_key
        scale = spec.attn_scale if spec.attn_scale is not None else d**-0.5
        self.attn = Attention(mc.num_heads, d, mc.num_kv_heads, scale, window, spec.attn_softcap)

    def forward(self, ropes: dict[str | None, RopeInput], x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qs, kvs = self.q_size, self.kv_size
        if self.q_norm is not None:
            assert self.k_norm is not None
            self.q_norm(qkv[:, :qs])
            self.k_norm(qkv[:, qs:qs + kvs])
        rope = ropes[self.rope_key]
        if rope.cos is None and self.attn.can_fuse_rope(qkv):
            # One pass: q and k rotated in place, k and v stored in the cache.
            self.attn.rope_and_cache(qkv, rope.positions, None if self.rotary is None else self.rotary.cos_sin_cache)
            q, k, v = qkv.split([qs, kvs, kvs], dim=-1)
            return self.o_proj(self.attn(q, k, v, kv_written=True))
        if self.rotary is None:
            q, k = qkv[:, :qs], qkv[:, qs:qs + kvs]
        else:
            qk = self.rotary(qkv[:, :qs + kvs].view(t, -1, self.attn.head_dim), rope)
            q, k = qk.view(t, -1).split([qs, kvs], dim=-1)
        return self.o_proj(self.attn(q, k, qkv[:, qs + kvs:]))


class DecoderLayer(nn.Module):
    """One residual block in vLLM's form: takes and returns (output, residual), the hidden state after the
    layer being their sum, so each norm before a sublayer adds its residual in the same fused pass."""

    def __init__(self, mc: ModelConfig, spec: DecoderSpec, window: int | None, rotary: RotaryEmbedding | None,
                 rope_key: str | None, eps: float, sparse: bool = False) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(mc, spec, window, rotary, rope_key, eps)
        self.mlp: nn.Module
        if sparse:
            assert spec.moe is not None
            self.mlp = SparseMoE(mc.hidden_size, spec.moe, spec.act, spec.mlp_bias)
        else:
            self.mlp = GatedMLP(mc.hidden_size, mc.hf_config["intermediate_size"], spec.mlp_bias, spec.act)
        for name in spec.norms:
            if name is not None:
                self.add_module(name, RMSNorm(mc.hidden_size, eps, spec.unit_offset_norms))
        # Roles, in the order of spec.norms (a plain tuple: the modules are registered once, by name, above).
        self.norms: tuple[RMSNorm | None, ...] = tuple(None if n is None else getattr(self, n) for n in spec.norms)
        self.residual_scale = spec.residual_scale

    def forward(self, ropes: dict[str | None, RopeInput], h: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_in, attn_out, mlp_in, mlp_out = self.norms
        if attn_in is not None:
            if residual is None:
                residual, h = h, attn_in(h)
            else:
                h, residual = attn_in(h, residual)
        else:  # OLMo 2: attention reads the residual stream itself
            residual = h if residual is None else residual + h
            h = residual
        a = self.self_attn(ropes, h)
        if attn_out is not None:
            a = attn_out(a)
        if self.residual_scale != 1.0:
            a = a * self.residual_scale
        if mlp_in is not None:
            h, residual = mlp_in(a, residual)
        else:
            residual = residual + a
            h = residual
        m = self.mlp(h)
        if mlp_out is not None:
            m = mlp_out(m)
        if self.residual_scale != 1.0:
            m = m * self.residual_scale
        return m, residual


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM on the paged KV cache. A family subclasses it with `decoder_spec` (and, where its
    checkpoint names differ, `checkpoint_name`)."""

    # The family's defaults for config fields a checkpoint may leave out (HF's config classes' defaults).
    config_defaults: ClassVar[dict[str, Any]] = {"tie_word_embeddings": False, "rms_norm_eps": 1e-6}

    def __init__(self, mc: ModelConfig, max_model_len: int) -> None:
        super().__init__()
        mc = dataclasses.replace(mc, hf_config={**self.config_defaults, **mc.hf_config})
        cfg = mc.hf_config
        if mc.num_heads % mc.num_kv_heads:
            raise ValueError(f"{mc.architecture}: num_attention_heads {mc.num_heads} is not a multiple of "
                             f"num_key_value_heads {mc.num_kv_heads}")
        self.spec = spec = self.decoder_spec(mc)
        n = mc.num_layers
        assert len(spec.layer_types) == n
        eps = float(cfg["rms_norm_eps"])
        rope_layers = spec.rope_layers or (True,) * n
        # One table per distinct rope (Gemma 3: local and global), shared by the layers that use it.
        self.rotaries = nn.ModuleDict()
        rotaries: dict[str, RotaryEmbedding] = {}  # the same modules, typed (a ModuleDict's are nn.Module)
        rope_keys: list[str | None] = []
        for i in range(n):
            key = None
            if rope_layers[i]:
                key = spec.layer_types[i] if spec.rope_per_layer_type else "default"
                if key not in rotaries:
                    rotaries[key] = self.rotaries[key] = RotaryEmbedding(cfg, mc.head_dim, max_model_len,
                                                                         key if spec.rope_per_layer_type else None)
            rope_keys.append(key)
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        sparse = spec.moe.sparse_layers if spec.moe is not None else (False,) * n
        self.layers = nn.ModuleList(
            DecoderLayer(mc, spec, spec.sliding_window if spec.layer_types[i] == SLIDING else None,
                         None if key is None else rotaries[key], key, eps, sparse[i])
            for i, key in enumerate(rope_keys))
        self.norm = RMSNorm(mc.hidden_size, eps, spec.unit_offset_norms)
        self.tie_word_embeddings = bool(cfg["tie_word_embeddings"])
        self.lm_head = Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.decode_stack: DecodeStack | None = None  # bound by the runner once kernels and KV pool are set

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        """The family's DecoderSpec (raising on config values it cannot compute)."""
        raise NotImplementedError

    @classmethod
    def attention_windows(cls, mc: ModelConfig) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full attention), known before the model is built: the engine
        sizes its KV groups from them."""
        spec = cls.decoder_spec(dataclasses.replace(mc, hf_config={**cls.config_defaults, **mc.hf_config}))
        return tuple(spec.sliding_window if t == SLIDING else None for t in spec.layer_types)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name relative to this module (None: not a weight of the language model)."""
        return name.removeprefix("model.")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, scaled as the family does (the scale rounded to the model's dtype, as HF does)."""
        h = self.embed_tokens(input_ids)
        if self.spec.embed_scale != 1.0:
            h = h * torch.tensor(self.spec.embed_scale, dtype=h.dtype)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat token ids [T] and positions [T] → final hidden states [T, hidden]."""
        h = self.embed(input_ids)
        if self.decode_stack is not None and self.decode_stack.accepts(h.shape[0]):
            return self.decode_stack(h, positions)
        ropes: dict[str | None, RopeInput] = {key: cast(RotaryEmbedding, r).lookup(positions)
                                              for key, r in self.rotaries.items()}
        ropes[None] = RopeInput(positions, None, None)  # NoPE layers
        residual = None
        for layer in self.layers:
            h, residual = layer(ropes, h, residual)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the sampled positions → float32 logits (scaled and soft-capped as the family does)."""
        logits = self.lm_head(hidden).float()
        if self.spec.logits_divisor != 1.0:
            logits = logits / self.spec.logits_divisor
        if self.spec.final_softcap:
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF checkpoint tensors, fusing q/k/v and gate/up into our stacked projections (checkpoints that
        ship them fused, as Phi-3's, load as they are) and adding Gemma's norm offset."""
        if self.tie_word_embeddings:
            # Tie here, not in __init__: the model is built on the meta device and materialised after.
            # (a Parameter: torch's stub types nn.Embedding.weight Tensor)
            self.lm_head.weight = cast(nn.Parameter, self.embed_tokens.weight)
        loader = WeightLoader(self, ignore=("rotary_emb.inv_freq",))
        first: Any = self.layers[0]  # walked by attribute name (a ModuleList's items are typed nn.Module)
        q, kv = first.self_attn.q_size, first.self_attn.kv_size
        stacked = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv)}
        # Gated MLPs' gate / up halves, each of its own MLP's size (a dense layer's, or Qwen2-MoE's shared expert's).
        inter = {name: m.down_proj.in_features for name, m in self.named_modules() if isinstance(m, GatedMLP)}
        experts = {name: m.intermediate for name, m in self.named_modules() if isinstance(m, SparseMoE)}
        offset = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, RMSNorm) and m.unit_offset}
        for source, tensor in weights:
            name = self.checkpoint_name(source)
            if name is None:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints also store the (identical) head
            if name in offset:
                tensor = tensor.float() + 1.0
            parts = name.split(".")
            owner = ".".join(parts[:-2])
            if len(parts) >= 2 and parts[-2] in stacked:
                target, start, size = stacked[parts[-2]]
                loader.load_slice(".".join(parts[:-2] + [target, parts[-1]]), tensor, start, size, source)
            elif len(parts) >= 2 and parts[-2] in ("gate_proj", "up_proj") and owner in inter:
                size = inter[owner]
                loader.load_slice(f"{owner}.gate_up_proj.{parts[-1]}", tensor, 0 if parts[-2] == "gate_proj" else size,
                                  size, source)
            elif len(parts) >= 5 and parts[-4] == "experts" and parts[-3].isdigit() and ".".join(parts[:-4]) in experts:
                # One expert of a checkpoint that stores them apart: its own projections.
                moe, e, proj = ".".join(parts[:-4]), parts[-3], parts[-2]
                size = experts[moe]
                if proj == "down_proj":
                    loader.load(f"{moe}.experts.down.{e}.{parts[-1]}", tensor, source)
                else:
                    loader.load_slice(f"{moe}.experts.gate_up.{e}.{parts[-1]}", tensor,
                                      0 if proj == "gate_proj" else size, size, source)
            elif len(parts) >= 3 and parts[-2] == "experts" and ".".join(parts[:-2]) in experts:
                # A checkpoint that stores each layer's experts merged: [E, 2I, H] gate_up_proj, [E, H, I] down_proj.
                moe, target = ".".join(parts[:-2]), "gate_up" if parts[-1] == "gate_up_proj" else "down"
                for i, part in enumerate(tensor.unbind(0)):
                    loader.load(f"{moe}.experts.{target}.{i}.weight", part, f"{source}[{i}]")
            else:
                loader.load(name, tensor, source)
        loader.finish()
