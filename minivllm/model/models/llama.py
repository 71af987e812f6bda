"""Llama family: Llama, Mistral and Qwen2 (qkv bias), with GQA, tied or untied embeddings, rope scaling."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.attention import Attention
from minivllm.model.decode_stack import DecodeStack
from minivllm.model.layers import Linear, RMSNorm, RopeInput, RotaryEmbedding, SiluAndMul
from minivllm.model.models.weights import WeightLoader


class LlamaAttention(nn.Module):
    """Self-attention with one fused qkv projection (one matmul instead of three)."""

    def __init__(self, mc: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool) -> None:
        super().__init__()
        self.q_size = mc.num_heads * mc.head_dim
        self.kv_size = mc.num_kv_heads * mc.head_dim
        self.qkv_proj = Linear(mc.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        # Llama's attention_bias covers o_proj too; Qwen2's qkv bias does not.
        o_bias = bool(mc.hf_config.get("attention_bias", False))
        self.o_proj = Linear(self.q_size, mc.hidden_size, bias=o_bias)
        self.rotary = rotary
        self.attn = Attention(mc.num_heads, mc.head_dim, mc.num_kv_heads, mc.head_dim**-0.5)

    def forward(self, rope: RopeInput, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if rope.cos is None and self.attn.can_fuse_rope(qkv):
            # One pass: q and k rotated in place, k and v stored in the cache.
            self.attn.rope_and_cache(qkv, rope.positions, self.rotary.cos_sin_cache)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return self.o_proj(self.attn(q, k, v, kv_written=True))
        qk = self.rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.attn.head_dim), rope)
        q, k = qk.view(t, -1).split([self.q_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, qkv[:, self.q_size + self.kv_size:]))


class LlamaMLP(nn.Module):
    """SwiGLU MLP with a fused gate/up projection."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block in vLLM's form: takes and returns (output, residual), the hidden state
    after the layer being their sum, so each norm adds its residual in the same fused pass."""

    def __init__(self, mc: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool) -> None:
        super().__init__()
        cfg = mc.hf_config
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(mc.hidden_size, eps)
        self.self_attn = LlamaAttention(mc, rotary, qkv_bias)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, eps)
        self.mlp = LlamaMLP(mc.hidden_size, cfg["intermediate_size"], cfg.get("mlp_bias", False))

    def forward(self, rope: RopeInput, h: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(rope, h), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM on the paged KV cache."""

    def __init__(self, mc: ModelConfig, max_model_len: int) -> None:
        super().__init__()
        cfg = mc.hf_config
        _check_supported(mc)
        qkv_bias = bool(cfg.get("attention_bias", False)) or mc.architecture == "Qwen2ForCausalLM"
        self.sliding_window: int | None = _sliding_window(mc)
        self.rotary = RotaryEmbedding(cfg, mc.head_dim, max_model_len)
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(mc, self.rotary, qkv_bias) for _ in range(mc.num_layers))
        self.norm = RMSNorm(mc.hidden_size, cfg.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.decode_stack: DecodeStack | None = None  # bound by the runner once kernels and KV pool are set

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat token ids [T] and positions [T] → final hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)
        if self.decode_stack is not None and self.decode_stack.accepts(h.shape[0]):
            return self.decode_stack(h, positions)
        rope = self.rotary.lookup(positions)
        residual = None
        for layer in self.layers:
            h, residual = layer(rope, h, residual)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the sampled positions → float32 logits."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF checkpoint tensors, fusing q/k/v and gate/up into our stacked projections."""
        if self.tie_word_embeddings:
            # Tie here, not in __init__: the model is built on the meta device and materialised after.
            self.lm_head.weight = self.embed_tokens.weight
        loader = WeightLoader(self, ignore=("rotary_emb.inv_freq",))
        q, kv = self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size
        inter = self.layers[0].mlp.down_proj.in_features
        stacked = {
            "q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter),
        }
        for source, tensor in weights:
            name = source.removeprefix("model.")
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints also store the (identical) head
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in stacked:
                target, offset, size = stacked[parts[-2]]
                loader.load_slice(".".join(parts[:-2] + [target, parts[-1]]), tensor, offset, size, source)
            else:
                loader.load(name, tensor, source)
        loader.finish()


def _check_supported(mc: ModelConfig) -> None:
    cfg = mc.hf_config
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{mc.architecture}: unsupported hidden_act {cfg['hidden_act']!r}; supported: silu")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{mc.architecture}: partial_rotary_factor != 1 is not supported")
    if mc.num_heads % mc.num_kv_heads:
        raise ValueError(f"{mc.architecture}: num_attention_heads {mc.num_heads} is not a multiple of "
                         f"num_key_value_heads {mc.num_kv_heads}")


def _sliding_window(mc: ModelConfig) -> int | None:
    cfg: dict[str, Any] = mc.hf_config
    if mc.architecture == "Qwen2ForCausalLM":
        if cfg.get("use_sliding_window"):
            raise ValueError("Qwen2ForCausalLM: use_sliding_window=true is not supported (per-layer windows)")
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None
