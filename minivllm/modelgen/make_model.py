"""`minivllm make-model`: an HF-format directory with random weights and a locally trained tokenizer."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import sysconfig
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from minivllm.config import parse_size
from minivllm.modelgen.chat_templates import CHAT_TEMPLATES
from minivllm.modelgen.presets import PRESETS, Preset

# ChatML, with tools in the Hermes / Qwen2.5 format when a request has them (a system block listing the functions;
# calls as <tool_call>{"name", "arguments"}</tool_call>, results as <tool_response> turns): the format
# `--tool-call-parser hermes` reads. Without tools it renders exactly plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] + '\n' if message['content'] else '') }}"
    "{%- for call in message['tool_calls'] %}{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + "
    "'\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- if not loop.last %}{{ '\n' }}{%- endif %}{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def corpus_files() -> list[str]:
    """Text every machine with this Python has: the standard library's top-level modules, sorted."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise RuntimeError("make-model: no standard-library sources found to train the tokenizer on")
    return files


def train_tokenizer(preset: Preset) -> Tokenizer:
    """Byte-level BPE trained on the stdlib sources; deterministic for a given Python install."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Room left for the added tokens: every id must stay inside the model's vocabulary.
    trainer = trainers.BpeTrainer(vocab_size=preset.tokenizer_vocab - len(preset.added_tokens),
                                  special_tokens=preset.specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(corpus_files(), trainer)
    if preset.added_tokens:
        tok.add_tokens(preset.added_tokens)  # plain text to the tokenizer, special to no one
    if preset.bos is not None:
        bos_id = tok.token_to_id(preset.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{preset.bos} $A", pair=f"{preset.bos} $A {preset.bos} $B",
            special_tokens=[(preset.bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _llama_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    qkv_bias = cfg.get("attention_bias", False) or cfg["architectures"][0] == "Qwen2ForCausalLM"
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{name}.weight", (rows, h)
            if qkv_bias:
                yield p + f"self_attn.{name}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, q)
        if cfg.get("attention_bias", False):
            yield p + "self_attn.o_proj.bias", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, h)


def _gpt2_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    d, v = cfg["n_embd"], cfg["vocab_size"]
    inner = cfg.get("n_inner") or 4 * d
    yield "wte.weight", (v, d)
    yield "wpe.weight", (cfg["n_positions"], d)
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            yield p + f"{ln}.weight", (d,)
            yield p + f"{ln}.bias", (d,)
        # Conv1D layout: [in, out].
        for name, (n_in, n_out) in (("attn.c_attn", (d, 3 * d)), ("attn.c_proj", (d, d)),
                                    ("mlp.c_fc", (d, inner)), ("mlp.c_proj", (inner, d))):
            yield p + f"{name}.weight", (n_in, n_out)
            yield p + f"{name}.bias", (n_out,)
    yield "ln_f.weight", (d,)
    yield "ln_f.bias", (d,)


def _hf_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The checkpoint names and shapes of transformers' own implementation of the architecture (built on the
    meta device: no memory, no init), so every family's files are exactly what HF would save."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{"pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **cfg})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for name, p in model.named_parameters():  # a tied head appears once, as the embedding
        yield name, tuple(p.shape)


_HAND_WRITTEN = {"GPT2LMHeadModel": _gpt2_shapes, "LlamaForCausalLM": _llama_shapes,
                 "MistralForCausalLM": _llama_shapes, "Qwen2ForCausalLM": _llama_shapes}


# Normal draws cost 7 ns a value here (8 s for a 1.2B-parameter model, most of a real-width test's making): a tensor
# larger than this prime repeats its first DRAW_PERIOD draws. Prime, so no row length divides it: a real-width
# matrix's rows are distinct stretches of the sequence, never one row twice; every tensor of the tiny test models is
# smaller, so those are drawn whole, as before.
DRAW_PERIOD = 8_388_593


def _normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Standard normal values of `shape`, the first DRAW_PERIOD of them drawn and repeated beyond that."""
    n = math.prod(shape)
    if n <= DRAW_PERIOD:
        return torch.randn(shape, generator=gen)
    return torch.randn(DRAW_PERIOD, generator=gen).repeat(-(-n // DRAW_PERIOD))[:n].view(shape)


def random_weights(preset: Preset, seed: int, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Normal(0, std) matrices and biases; norm weights near 1 so a dropped norm is caught by tests (Gemma's
    norms scale by 1 + w: their w near 0)."""
    cfg = preset.config
    gen = torch.Generator().manual_seed(seed)
    shapes = _HAND_WRITTEN.get(cfg["architectures"][0], _hf_shapes)(cfg)
    offset_norms = cfg.get("model_type", "").startswith("gemma")
    for name, shape in shapes:
        # In place: a real-width embedding is 0.6B floats, and a fresh 2.4 GB result costs seconds of first-touch
        # page faults on a VM (3.5 s against 0.1 s for the multiply itself).
        t = _normal(shape, gen)
        if "norm" in name or name.split(".")[-2] in ("ln_1", "ln_2", "ln_f"):
            t.mul_(0.1)
            if name.endswith("weight"):
                t.add_(0.0 if offset_norms else 1.0)
        else:
            t.mul_(preset.init_std)
        yield name, t.to(dtype)


def make_model(preset_name: str | Preset, out: str, dtype: str = "float32", seed: int = 0,
               max_shard_size: str | None = None, overrides: tuple[tuple[str, Any], ...] = ()) -> str:
    """Write an HF-format model directory for a preset (by name, or a Preset made on the fly: a bench's
    Llama twin), config fields replaced by `overrides` (tests flip a tie or cut a real shape to fewer layers);
    returns its path."""
    if isinstance(preset_name, str) and preset_name not in PRESETS:
        raise ValueError(f"make-model: unknown preset {preset_name!r}; available: {', '.join(PRESETS)}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"make-model: dtype {dtype!r} not one of float32, bfloat16, float16")
    preset = PRESETS[preset_name] if isinstance(preset_name, str) else preset_name
    if overrides:
        preset = dataclasses.replace(preset, config={**preset.config, **dict(overrides)})
    os.makedirs(out, exist_ok=True)
    tok = train_tokenizer(preset)
    tok.save(os.path.join(out, "tokenizer.json"))
    eos_id = tok.token_to_id(preset.eos)
    bos_id = tok.token_to_id(preset.bos) if preset.bos else eos_id
    extra = [tok.token_to_id(t) for t in preset.extra_eos]
    cfg = dict(preset.config, bos_token_id=bos_id, eos_token_id=eos_id, torch_dtype=dtype)
    if "pad_token_id" in cfg or cfg["architectures"][0] not in _HAND_WRITTEN:
        # The family's default pad id belongs to its real vocabulary: point it at our pad token (or none).
        pad = next((t for t in ("<pad>", "<|pad|>") if t in preset.specials), None)
        cfg["pad_token_id"] = tok.token_to_id(pad) if pad else None
    _write_json(out, "config.json", cfg)
    _write_json(out, "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": [eos_id, *extra]
                                                if extra else eos_id})
    chat = CHAT_TEMPLATES[preset.chat_format] if preset.chat_format else \
        CHATML_TEMPLATE if "<|im_start|>" in preset.specials else PLAIN_TEMPLATE
    tok_cfg = {"tokenizer_class": preset.tokenizer_class, "eos_token": preset.eos,
               "bos_token": preset.bos or preset.eos, "model_max_length": _max_len(cfg),
               "clean_up_tokenization_spaces": False, "chat_template": chat}
    if "<unk>" in preset.specials:
        tok_cfg["unk_token"] = "<unk>"
    _write_json(out, "tokenizer_config.json", tok_cfg)
    _write_weights(out, dict(random_weights(preset, seed, torch_dtype)), max_shard_size)
    return out


def _max_len(cfg: dict) -> int:
    return cfg.get("max_position_embeddings") or cfg["n_positions"]


def _write_json(out: str, name: str, obj: dict) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _write_weights(out: str, tensors: dict[str, torch.Tensor], max_shard_size: str | None) -> None:
    """One model.safetensors, or shards plus model.safetensors.index.json as HF writes them."""
    meta = {"format": "pt"}
    if max_shard_size is None:
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata=meta)
        return
    limit = parse_size(max_shard_size, "max_shard_size")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out, "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
