"""GPT-2: learned positions, LayerNorm, fused c_attn, Conv1D ([in, out]) weight layout in checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import ModelConfig
from minivllm.model.attention import Attention
from minivllm.model.decode_stack import ACT_GELU_TANH, DecodeStack, StackParts
from minivllm.model.layers import LayerNorm, Linear, gelu_tanh
from minivllm.model.models.weights import WeightLoader

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
}
# Conv1D layers store [in, out]; our nn.Linear wants [out, in].
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    """Fused qkv projection, paged attention, output projection."""

    def __init__(self, mc: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        cfg, d = mc.hf_config, mc.hidden_size
        scale = mc.head_dim**-0.5 if cfg.get("scale_attn_weights", True) else 1.0
        if cfg.get("scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.c_attn = Linear(d, 3 * d)
        self.c_proj = Linear(d, d)
        self.attn = Attention(mc.num_heads, mc.head_dim, mc.num_heads, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)
        q, k, v = qkv.chunk(3, dim=-1)
        if self.attn.can_fuse_rope(qkv):  # no rotary here: one native pass stores every row's k and v in its slot
            self.attn.rope_and_cache(qkv, None, None)
            return self.c_proj(self.attn(q, k, v, kv_written=True))
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    """c_fc → activation → c_proj."""

    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        d = mc.hidden_size
        inner = mc.hf_config.get("n_inner") or 4 * d
        self.c_fc = Linear(d, inner)
        self.c_proj = Linear(inner, d)
        self.act = _ACTIVATIONS[mc.hf_config.get("activation_function", "gelu_new")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-LayerNorm block in vLLM's residual convention: takes the previous block's MLP output and the residual
    stream before it (None for the first block: the embeddings are the stream), returns its own MLP output and the
    stream, so each residual add is fused into the LayerNorm that follows it."""

    def __init__(self, mc: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps = mc.hidden_size, mc.hf_config.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = LayerNorm(d, eps)
        self.attn = GPT2Attention(mc, layer_idx)
        self.ln_2 = LayerNorm(d, eps)
        self.mlp = GPT2MLP(mc)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.ln_1(x)
        else:
            x, residual = self.ln_1(x, residual)
        x, residual = self.ln_2(self.attn(x), residual)
        return self.mlp(x), residual

    def stack_parts(self) -> StackParts:
        """This block in the native decode stack's roles (c_fc and c_proj as its MLP's two projections; an activation
        other than GELU-tanh has no code there, so the stack refuses the model)."""
        a, m = self.attn, self.mlp
        return StackParts((self.ln_1, None, self.ln_2, None), None, None, None, a.attn, a.c_attn, a.c_proj, None,
                          m.c_fc, m.c_proj, ACT_GELU_TANH if m.act is gelu_tanh else -1, 1.0)


class GPT2LMHeadModel(nn.Module):
    """GPT2LMHeadModel on the paged KV cache; the head is tied to the token embedding."""

    sliding_window = None

    def __init__(self, mc: ModelConfig, max_model_len: int) -> None:
        super().__init__()
        act = mc.hf_config.get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise ValueError(f"GPT2LMHeadModel: unsupported activation_function {act!r}; "
                             f"supported: {', '.join(_ACTIVATIONS)}")
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds GPT-2's learned positions "
                             f"(n_positions={mc.max_position_embeddings})")
        self.wte = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.wpe = nn.Embedding(mc.max_position_embeddings, mc.hidden_size)
        self.h = nn.ModuleList(GPT2Block(mc, i) for i in range(mc.num_layers))
        self.ln_f = LayerNorm(mc.hidden_size, mc.hf_config.get("layer_norm_epsilon", 1e-5))
        self.lm_head = Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.decode_stack: DecodeStack | None = None  # bound by the runner once kernels and KV pool are set

    def stack_parts(self) -> tuple[list[StackParts], LayerNorm]:
        """Every block's parts and the final norm, for model/decode_stack.py."""
        return [cast(GPT2Block, block).stack_parts() for block in self.h], self.ln_f

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat token ids [T] and positions [T] → final hidden states [T, hidden]."""
        h: torch.Tensor = self.wte(input_ids) + self.wpe(positions)
        if self.decode_stack is not None and self.decode_stack.accepts(h.shape[0]):
            return self.decode_stack(h, positions)
        residual: torch.Tensor | None = None
        for block in self.h:
            h, residual = block(h, residual)
        if residual is None:  # no layers
            return self.ln_f(h)
        return self.ln_f(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the sampled positions → float32 logits."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF checkpoint tensors (with or without the 'transformer.' prefix)."""
        # GPT-2's head is always tied (set after meta materialisation); a Parameter, which torch's stub types Tensor
        self.lm_head.weight = cast(nn.Parameter, self.wte.weight)
        loader = WeightLoader(self, ignore=(".attn.bias", ".attn.masked_bias", "lm_head.weight"))
        for source, tensor in weights:
            name = source.removeprefix("transformer.")
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            loader.load(name, tensor, source)
        loader.finish()
