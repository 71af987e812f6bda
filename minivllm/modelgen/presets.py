"""Architecture presets for test models: real checkpoints' config.json shapes, plus tiny variants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GPT2_SPECIALS = ["<|endoftext|>"]
# Plain-text added tokens (special=false in the real tokenizers, so they survive skip_special_tokens).
THINK_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PHI_SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>",
                "<|tool_call|>", "<|/tool_call|>"]
SMOLLM3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
OLMO_SPECIALS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
GRANITE_SPECIALS = ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"]


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
    chat_format: str | None = None  # modelgen/chat_templates.py's name (None: ChatML when the specials have it)
    added_tokens: list[str] = field(default_factory=list)  # non-special added tokens (Qwen3's <think>, ...)
    tokenizer_class: str = "PreTrainedTokenizerFast"  # as tokenizer_config.json names it (Phi-4-mini: GPT2Tokenizer)


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


def _family(arch: str, model_type: str, defaults: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    cfg = {"architectures": [arch], "model_type": model_type, "attention_bias": False, "attention_dropout": 0.0,
           "hidden_act": "silu", "torch_dtype": "bfloat16", "use_cache": True}
    cfg.update(defaults)
    cfg.update(kw)
    return cfg


def _qwen3(**kw: Any) -> dict[str, Any]:
    return _family("Qwen3ForCausalLM", "qwen3", dict(
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False, sliding_window=None,
        max_window_layers=28, tie_word_embeddings=True), kw)


def _gemma(arch: str, model_type: str, **kw: Any) -> dict[str, Any]:
    cfg = _family(arch, model_type, dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, pad_token_id=0,
                                         query_pre_attn_scalar=256), kw)
    del cfg["hidden_act"]
    return cfg


def _gemma2(**kw: Any) -> dict[str, Any]:
    return _gemma("Gemma2ForCausalLM", "gemma2", **{**dict(
        rope_theta=10000.0, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, cache_implementation="hybrid"),
        **kw})


def _gemma3(**kw: Any) -> dict[str, Any]:
    # As gemma-3-1b's config.json ships it (no tie_word_embeddings: Gemma3TextConfig's default True applies).
    return _gemma("Gemma3ForCausalLM", "gemma3_text", **{**dict(
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None, attn_logit_softcapping=None,
        final_logit_softcapping=None, cache_implementation="hybrid"), **kw})


def _phi3(**kw: Any) -> dict[str, Any]:
    return _family("Phi3ForCausalLM", "phi3", dict(
        rms_norm_eps=1e-5, rope_theta=10000.0, resid_pdrop=0.0, embd_pdrop=0.0, sliding_window=None), kw)


def _longrope(n: int, orig: int) -> dict[str, Any]:
    """LongRoPE scaling of the shape Phi-4-mini ships (the factor values are made up: random weights anyway)."""
    return {"type": "longrope", "short_factor": [1.0 + 0.02 * i for i in range(n)],
            "long_factor": [1.0 + 1.5 * i for i in range(n)], "original_max_position_embeddings": orig}


def _smollm3(**kw: Any) -> dict[str, Any]:
    return _family("SmolLM3ForCausalLM", "smollm3", dict(
        rms_norm_eps=1e-6, rope_theta=5000000.0, rope_scaling=None, mlp_bias=False, use_sliding_window=False,
        sliding_window=None, no_rope_layer_interval=4, tie_word_embeddings=True), kw)


def _olmo2(**kw: Any) -> dict[str, Any]:
    return _family("Olmo2ForCausalLM", "olmo2", dict(
        rms_norm_eps=1e-6, rope_theta=500000.0, rope_scaling=None, tie_word_embeddings=False), kw)


def _granite(**kw: Any) -> dict[str, Any]:
    return _family("GraniteForCausalLM", "granite", dict(
        rms_norm_eps=1e-5, rope_theta=5000000.0, rope_scaling=None, mlp_bias=False, tie_word_embeddings=True,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0), kw)


def _moe(arch: str, model_type: str, **kw: Any) -> dict[str, Any]:
    return _family(arch, model_type, dict(rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                                          tie_word_embeddings=False, router_aux_loss_coef=0.001), kw)


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
    # Today's small models (shapes of Qwen/Qwen3-0.6B, google/gemma-2-2b, google/gemma-3-1b-pt,
    # microsoft/Phi-4-mini-instruct, HuggingFaceTB/SmolLM3-3B, allenai/OLMo-2-0425-1B,
    # ibm-granite/granite-3.1-2b-instruct), random weights.
    "qwen3-0.6b": Preset(_qwen3(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        initializer_range=0.02), CHATML_SPECIALS, None, "<|endoftext|>", 8192, extra_eos=["<|im_end|>"],
        chat_format="qwen3", added_tokens=THINK_TOOL_TOKENS),
    # Qwen/Qwen3-1.7B's shape (issue 34 item 3's second Qwen3 size): 1.72B parameters, 0.31B of them the tied embedding.
    "qwen3-1.7b": Preset(_qwen3(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        initializer_range=0.02), CHATML_SPECIALS, None, "<|endoftext|>", 8192, extra_eos=["<|im_end|>"],
        chat_format="qwen3", added_tokens=THINK_TOOL_TOKENS),
    # A Qwen3-MoE of ~1B parameters (16 experts of 768, top-2: ~250M active; Qwen3-30B-A3B's layer at a quarter
    # of its width and experts), for the bench against the dense model of the same active parameters.
    "qwen3-moe-1b": Preset(_moe(
        "Qwen3MoeForCausalLM", "qwen3_moe", hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000, max_position_embeddings=40960,
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1, initializer_range=0.02), CHATML_SPECIALS, None, "<|endoftext|>", 8192,
        extra_eos=["<|im_end|>"]),
    "gemma2-2b": Preset(_gemma2(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
        tie_word_embeddings=True, initializer_range=0.02), GEMMA_SPECIALS, "<bos>", "<eos>", 8192,
        extra_eos=["<end_of_turn>"], chat_format="gemma"),
    "gemma3-1b": Preset(_gemma3(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
        sliding_window_pattern=6, initializer_range=0.02), GEMMA_SPECIALS, "<bos>", "<eos>", 8192,
        extra_eos=["<end_of_turn>"], chat_format="gemma"),
    "phi4-mini": Preset(_phi3(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
        original_max_position_embeddings=4096, partial_rotary_factor=0.75, rope_scaling=_longrope(48, 4096),
        tie_word_embeddings=True, initializer_range=0.02), PHI_SPECIALS, None, "<|endoftext|>", 8192,
        extra_eos=["<|end|>"], chat_format="phi4",
        tokenizer_class="GPT2Tokenizer"),
    "smollm3-3b": Preset(_smollm3(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=128256, max_position_embeddings=65536, initializer_range=0.02),
        SMOLLM3_SPECIALS, None, "<|im_end|>", 8192, extra_eos=["<|end_of_text|>"], chat_format="smollm3",
        added_tokens=THINK_TOOL_TOKENS),
    "olmo2-1b": Preset(_olmo2(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=100352, max_position_embeddings=4096, initializer_range=0.02),
        OLMO_SPECIALS, None, "<|endoftext|>", 8192, chat_format="olmo2"),
    "granite-3-2b": Preset(_granite(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=49155, max_position_embeddings=131072, initializer_range=0.02),
        GRANITE_SPECIALS, None, "<|end_of_text|>", 8192, chat_format="granite"),
    # Tiny variants of each: the same code paths in milliseconds, with the features that set a family apart
    # made to matter at tiny sizes (small windows and caps, a head_dim unlike hidden / heads, NoPE and
    # local/global layers within four layers).
    "tiny-qwen3": Preset(_qwen3(**{**_TINY, "head_dim": 32}, initializer_range=0.1, tie_word_embeddings=False),
                         CHATML_SPECIALS, None, "<|endoftext|>", 1024, init_std=0.1, extra_eos=["<|im_end|>"],
                         chat_format="qwen3", added_tokens=THINK_TOOL_TOKENS),
    "tiny-gemma2": Preset(_gemma2(**{**_TINY, "head_dim": 32, "num_hidden_layers": 4}, sliding_window=8,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                  tie_word_embeddings=True, initializer_range=0.1),
                          GEMMA_SPECIALS, "<bos>", "<eos>", 1024, init_std=0.1, extra_eos=["<end_of_turn>"],
                          chat_format="gemma"),
    "tiny-gemma3": Preset(_gemma3(**{**_TINY, "head_dim": 32, "num_hidden_layers": 4}, sliding_window=8,
                                  sliding_window_pattern=3, query_pre_attn_scalar=24, initializer_range=0.1),
                          GEMMA_SPECIALS, "<bos>", "<eos>", 1024, init_std=0.1, extra_eos=["<end_of_turn>"],
                          chat_format="gemma"),
    "tiny-phi3": Preset(_phi3(**_TINY, original_max_position_embeddings=256, partial_rotary_factor=0.5,
                              rope_scaling=_longrope(4, 256), tie_word_embeddings=False, initializer_range=0.1),
                        PHI_SPECIALS, None, "<|endoftext|>", 1024, init_std=0.1, extra_eos=["<|end|>"],
                        chat_format="phi4", tokenizer_class="GPT2Tokenizer"),
    "tiny-smollm3": Preset(_smollm3(**{**_TINY, "num_hidden_layers": 4}, tie_word_embeddings=False,
                                    initializer_range=0.1),
                           SMOLLM3_SPECIALS, None, "<|im_end|>", 1024, init_std=0.1, extra_eos=["<|end_of_text|>"],
                           chat_format="smollm3", added_tokens=THINK_TOOL_TOKENS),
    "tiny-olmo2": Preset(_olmo2(**_TINY, initializer_range=0.1), OLMO_SPECIALS, None, "<|endoftext|>", 1024,
                         init_std=0.1, chat_format="olmo2"),
    # Mixtures of experts: 8 experts, top-2 (Qwen3-MoE with a dense layer among sparse ones; OLMoE unnormalised
    # routing and whole-projection q/k norms; Qwen2-MoE's shared expert; Mixtral's renormalised routing).
    "tiny-qwen3-moe": Preset(_moe("Qwen3MoeForCausalLM", "qwen3_moe", **{**_TINY, "head_dim": 32}, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                                  mlp_only_layers=[1], decoder_sparse_step=1, initializer_range=0.1),
                             CHATML_SPECIALS, None, "<|endoftext|>", 1024, init_std=0.1, extra_eos=["<|im_end|>"]),
    "tiny-mixtral": Preset(_moe("MixtralForCausalLM", "mixtral", **_TINY, num_local_experts=8, num_experts_per_tok=2,
                                rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=None, initializer_range=0.1),
                           LLAMA_SPECIALS, "<s>", "</s>", 1024, init_std=0.1),
    "tiny-olmoe": Preset(_moe("OlmoeForCausalLM", "olmoe", **_TINY, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=False, clip_qkv=None, rms_norm_eps=1e-5, initializer_range=0.1),
                         OLMO_SPECIALS, None, "<|endoftext|>", 1024, init_std=0.1),
    "tiny-qwen2-moe": Preset(_moe("Qwen2MoeForCausalLM", "qwen2_moe", **_TINY, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                  norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                                  use_sliding_window=False, initializer_range=0.1),
                             CHATML_SPECIALS, None, "<|endoftext|>", 1024, init_std=0.1, extra_eos=["<|im_end|>"]),
    "tiny-granite": Preset(_granite(**_TINY, attention_multiplier=0.0625, initializer_range=0.1),
                           GRANITE_SPECIALS, None, "<|end_of_text|>", 1024, init_std=0.1, chat_format="granite"),
}



def llama_twin(name: str) -> Preset:
    """A Llama with the shapes of preset `name` (hidden, MLP, layers, heads, head_dim, vocabulary, tie): the same
    parameter count but for the family's extra norms, for "within 10% of the same-size Llama"."""
    cfg = PRESETS[name].config
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "initializer_range")
    shape = {k: cfg[k] for k in keys if k in cfg}
    if cfg.get("num_experts_per_tok"):  # a mixture of experts: the dense Llama with its active parameters
        shape["intermediate_size"] = cfg["num_experts_per_tok"] * cfg.get("moe_intermediate_size",
                                                                           cfg["intermediate_size"])
    shape["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return Preset(_llama(**shape, rope_theta=cfg.get("rope_theta", 10000.0),
                         tie_word_embeddings=bool(cfg.get("tie_word_embeddings", name.startswith("gemma")))),
                  LLAMA_SPECIALS, "<s>", "</s>", 8192)


# The mixtures of experts (tiny variants; model/moe.py).
MOE_FAMILIES = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe"]
# The families of issue 31, tiny and real-size preset of each.
NEW_FAMILIES = {"tiny-qwen3": "qwen3-0.6b", "tiny-gemma2": "gemma2-2b", "tiny-gemma3": "gemma3-1b",
                "tiny-phi3": "phi4-mini", "tiny-smollm3": "smollm3-3b", "tiny-olmo2": "olmo2-1b",
                "tiny-granite": "granite-3-2b"}
