"""Architecture presets for test models: real checkpoints' config.json shapes, plus tiny variants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GPT2_SPECIALS = ["<|endoftext|>"]


@dataclass(frozen=True)
class Preset:
    """A config.json (as the real checkpoint ships it) and how its tokenizer looks."""

    config: dict[str, Any]
    specials: list[str]
    bos: str | None  # prepended by the tokenizer's post-processor when set
    eos: str
    tokenizer_vocab: int  # BPE vocabulary trained locally (<= the model's vocab_size)
    init_std: float = 0.02
    extra_eos: list[str] = field(default_factory=list)


def _llama(**kw: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1,
        "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True,
    }
    cfg.update(kw)
    return cfg


def _qwen2(**kw: Any) -> dict[str, Any]:
    cfg = _llama(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rms_norm_eps=1e-6,
                 rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)
    del cfg["attention_bias"], cfg["mlp_bias"], cfg["pretraining_tp"]
    cfg.update(kw)
    return cfg


def _gpt2(**kw: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
        "n_inner": None, "scale_attn_weights": True, "torch_dtype": "float32", "use_cache": True,
    }
    cfg.update(kw)
    return cfg


_TINY = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 1024}

PRESETS: dict[str, Preset] = {
    # Shapes of HuggingFaceTB/SmolLM2-135M, Qwen/Qwen2.5-0.5B, TinyLlama-1.1B, meta-llama/Llama-3.2-1B,
    # openai-community/gpt2.
    "smollm2-135m": Preset(_llama(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, initializer_range=0.041666666666666664), CHATML_SPECIALS, None,
        "<|endoftext|>", 8192, init_std=0.0417, extra_eos=["<|im_end|>"]),
    "qwen2.5-0.5b": Preset(_qwen2(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, max_window_layers=24,
        sliding_window=32768, initializer_range=0.02), CHATML_SPECIALS, None, "<|endoftext|>", 8192,
        extra_eos=["<|im_end|>"]),
    "tinyllama-1.1b": Preset(_llama(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, initializer_range=0.02),
        LLAMA_SPECIALS, "<s>", "</s>", 8192),
    "llama-3.2-1b": Preset(_llama(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, initializer_range=0.02,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
        LLAMA_SPECIALS, "<s>", "</s>", 8192, extra_eos=["<|im_end|>"]),
    "gpt2": Preset(_gpt2(
        n_embd=768, n_layer=12, n_head=12, n_positions=1024, n_ctx=1024, vocab_size=50257,
        initializer_range=0.02), GPT2_SPECIALS, None, "<|endoftext|>", 8192),
    # Tiny variants for tests: the same code paths in milliseconds. Larger init std than the real
    # configs so random logits are well separated (greedy comparisons need no near-ties).
    "tiny-llama": Preset(_llama(**_TINY, initializer_range=0.1), LLAMA_SPECIALS, "<s>", "</s>", 1024,
                         init_std=0.1),
    "tiny-llama3": Preset(_llama(**_TINY, initializer_range=0.1, rope_theta=500000.0, tie_word_embeddings=True,
                                 rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                               "original_max_position_embeddings": 64, "rope_type": "llama3"}),
                          LLAMA_SPECIALS, "<s>", "</s>", 1024, init_std=0.1, extra_eos=["<|im_end|>"]),
    "tiny-qwen2": Preset(_qwen2(**{**_TINY, "num_key_value_heads": 1}, initializer_range=0.1,
                                max_window_layers=3, sliding_window=1024),
                         CHATML_SPECIALS, None, "<|endoftext|>", 1024, init_std=0.1, extra_eos=["<|im_end|>"]),
    "tiny-qwen2-yarn": Preset(_qwen2(**{**_TINY, "max_position_embeddings": 256}, initializer_range=0.1,
                                     max_window_layers=3, sliding_window=256,
                                     rope_scaling={"type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}),
                              CHATML_SPECIALS, None, "<|endoftext|>", 1024, init_std=0.1),
    # A small sliding window (8) so the window actually masks in short tests.
    "tiny-mistral": Preset(_llama(**_TINY, architectures=["MistralForCausalLM"], model_type="mistral",
                                  sliding_window=8, initializer_range=0.1),
                           LLAMA_SPECIALS, "<s>", "</s>", 1024, init_std=0.1),
    "tiny-gpt2": Preset(_gpt2(n_embd=64, n_layer=3, n_head=4, n_positions=1024, n_ctx=1024, vocab_size=1024,
                              initializer_range=0.1), GPT2_SPECIALS, None, "<|endoftext|>", 1024, init_std=0.1),
}
