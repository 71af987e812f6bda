"""Today's families (Qwen3, Gemma 2, Gemma 3, Phi-3/4-mini, SmolLM3, OLMo 2, Granite) on every engine path, and
the mixtures of experts (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) on those that do not look inside the MLP.

Per family, tiny models with random weights: greedy output equal to HF transformers' (sharded checkpoints and the
other tie too); each fast path runs and agrees with the plain path (native decode stack, bf16, the four weight
quantizations, int8 KV, prefix caching, chunked prefill, preemption by recompute and by swap, n-gram speculation,
LoRA against peft's merged model, tensor parallelism, guided decoding) or refuses naming the family and the
feature. Real-size configs: our parameters equal transformers' in count and shape, and a real-width checkpoint
(fewer layers) loads and matches HF's logits. Layer-by-layer parity is in test_parity.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PROMPTS, corpus_token_ids, hf_greedy, hf_model

from minivllm import LLM, GuidedDecodingParams, LoRARequest, SamplingParams
from minivllm.config import EngineArgs, ModelConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model import cpu_kernels
from minivllm.model.decode_stack import DecodeStack
from minivllm.model.runner import SequenceInput
from minivllm.modelgen.make_lora import make_lora
from minivllm.modelgen.presets import MOE_FAMILIES, NEW_FAMILIES, PRESETS
from tests.conftest import make_runner

FAMILIES = list(NEW_FAMILIES)
N = 24  # greedy tokens per prompt
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, min_tokens=N)  # EOS masked, as HF min_new_tokens does
_hf_cache: dict[str, list[list[int]]] = {}


def _hf_reference(path: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    """HF transformers' greedy continuations (once per model directory)."""
    if path not in _hf_cache:
        hf = hf_model(path)
        _hf_cache[path] = [hf_greedy(hf, ids, N) for ids in prompt_ids]
    return _hf_cache[path]


def _prompt_ids(path: str) -> list[list[int]]:
    tok = get_tokenizer(path)
    return [tok.encode(p) for p in PROMPTS[:5]]


def _greedy(llm: LLM, prompt_ids: list[list[int]], params: SamplingParams = GREEDY, **kw) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False, **kw)
    assert llm.llm_engine.block_manager.num_used == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("preset", FAMILIES)
def test_sharded_checkpoint_with_the_other_tie_matches_hf(model_factory, preset):
    tied = bool(PRESETS[preset].config.get("tie_word_embeddings"))
    path = model_factory(preset, max_shard_size="48KB", overrides=(("tie_word_embeddings", not tied),))
    with open(f"{path}/model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) >= 3
    ids = _prompt_ids(path)
    llm = LLM(path, num_kv_blocks=128, check_invariants=True)
    assert llm.llm_engine.runner.model.tie_word_embeddings == (not tied)
    assert _greedy(llm, ids) == _hf_reference(path, ids)


def _hf_meta(cfg: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**{"pad_token_id": None, **cfg}))


@pytest.mark.parametrize("tiny", FAMILIES)
def test_real_size_parameters_equal_transformers(tiny):
    """The full real config, on the meta device: the same parameter count and, per HF tensor, our tensor of the
    same shape (or its rows of our fused q/k/v and gate/up projections)."""
    from minivllm.model.models import get_model_class

    preset = PRESETS[NEW_FAMILIES[tiny]]
    mc = ModelConfig(path="-", hf_config=preset.config, architecture=preset.config["architectures"][0],
                     num_layers=preset.config["num_hidden_layers"], num_heads=preset.config["num_attention_heads"],
                     num_kv_heads=preset.config["num_key_value_heads"],
                     head_dim=preset.config.get("head_dim") or preset.config["hidden_size"]
                     // preset.config["num_attention_heads"], hidden_size=preset.config["hidden_size"],
                     vocab_size=preset.config["vocab_size"], max_position_embeddings=64, checkpoint_dtype=None,
                     eos_token_ids=())
    with torch.device("meta"):
        ours = get_model_class(mc)(mc, 64)
    if ours.tie_word_embeddings:
        ours.lm_head.weight = ours.embed_tokens.weight
    hf = _hf_meta(preset.config)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters()), preset.config["architectures"]
    assert count > 5e8  # a real size: 0.6B to 3.8B
    mine = dict(ours.named_parameters())
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    for name, p in hf.named_parameters():
        parts = ours.checkpoint_name(name).split(".")
        if len(parts) > 2 and parts[-2] in fused:
            target = mine[".".join(parts[:-2] + [fused[parts[-2]], parts[-1]])]
            assert target.shape[1:] == p.shape[1:] and target.shape[0] > p.shape[0], name
        else:
            assert mine[".".join(parts)].shape == p.shape, name


@pytest.mark.parametrize("tiny", FAMILIES)
def test_real_width_checkpoint_loads_and_matches_hf(model_factory, tiny):
    """Every tensor at the real model's width (head_dim 256, partial rotary, 200k vocabularies...), two layers
    deep to keep it seconds: a bf16 checkpoint loaded in float32, logits as HF's."""
    path = model_factory(NEW_FAMILIES[tiny], dtype="bfloat16", overrides=(("num_hidden_layers", 2),))
    mc = ModelConfig.from_pretrained(path)
    ids = corpus_token_ids(get_tokenizer(path), 40)
    runner = make_runner(mc, 8, max_model_len=64)
    got = runner.execute([SequenceInput(ids, 0, list(range(8)), True, all_logits=True)])
    del runner
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)


# ---- fast paths ---------------------------------------------------------------------------------------------
def _family(preset: str, model_factory) -> tuple[str, str, list[list[int]], list[list[int]]]:
    path = model_factory(preset)
    ids = _prompt_ids(path)
    return preset, path, ids, _hf_reference(path, ids)


# The engine's paths that do not look inside the MLP (KV cache, scheduling, speculation, LoRA on attention,
# guided decoding) run every family, mixtures of experts too; those that do (the native stack, bf16, the weight
# quantizations, tensor parallelism) are checked for the mixtures in test_moe.py / test_decode_stack.py.
@pytest.fixture(scope="module", params=FAMILIES + MOE_FAMILIES)
def family(request, model_factory):
    return _family(request.param, model_factory)


@pytest.fixture(scope="module", params=FAMILIES)
def dense_family(request, model_factory):
    return _family(request.param, model_factory)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
def test_native_decode_stack_runs_and_matches(dense_family, monkeypatch):
    _, path, ids, want = dense_family
    calls = []
    original = DecodeStack.__call__
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, h, pos: calls.append(1) or original(self, h, pos))
    llm = LLM(path, num_kv_blocks=128, linear_backend="native")
    assert llm.llm_engine.runner.decode_stack is not None
    assert _greedy(llm, ids) == want
    assert len(calls) >= N - 1  # every all-decode step


def test_bfloat16_close_to_float32(dense_family):
    _, path, ids, _ = dense_family
    mc = ModelConfig.from_pretrained(path)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = make_runner(mc, 16, dtype)
        logits[dtype] = runner.execute([SequenceInput(ids[1], 0, list(range(16)), True, all_logits=True)])
    ref, got = logits[torch.float32], logits[torch.bfloat16]
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05, rel
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.8
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=128)
    assert all(len(t) == N for t in _greedy(llm, ids))


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4", "w4a8"])
def test_quantized_modes_run_close_to_float32(dense_family, method):
    _, path, ids, _ = dense_family
    llm = LLM(path, quantization=method, num_kv_blocks=128)
    assert all(len(t) == N for t in _greedy(llm, ids))
    mc = ModelConfig.from_pretrained(path)
    logits = []
    for quant in ({}, {"quantization": method}):
        runner = make_runner(mc, 16, **quant)
        logits.append(runner.execute([SequenceInput(ids[1], 0, list(range(16)), True, all_logits=True)]))
    ref, got = logits
    rel = ((got - ref).norm() / ref.norm()).item()
    grouped = method in ("int4", "w4a8")
    assert 0 < rel < (0.45 if grouped else 0.06), rel


def test_int8_kv_cache_close_to_float_cache(family):
    _, path, ids, want = family
    llm = LLM(path, kv_cache_dtype="int8", num_kv_blocks=128)
    got = _greedy(llm, ids)
    agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)) / (len(ids) * N)
    assert agree >= 0.6, agree


def test_prefix_caching_hits_and_matches(family):
    _, path, ids, want = family
    llm = LLM(path, num_kv_blocks=128, block_size=4, check_invariants=True)
    assert _greedy(llm, ids) == want
    assert _greedy(llm, ids) == want  # again, now from cached prefixes
    assert llm.llm_engine.scheduler.stats.prefix_cache_hits > 0


def test_chunked_prefill_matches(family):
    _, path, ids, want = family
    llm = LLM(path, num_kv_blocks=128, max_num_batched_tokens=8, check_invariants=True)
    assert _greedy(llm, ids) == want


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(family, mode, tmp_path):
    preset, path, ids, want = family
    llm = LLM(path, num_kv_blocks=8, max_num_batched_tokens=32, preemption_mode=mode, swap_space="4MiB",
              swap_dir=str(tmp_path), check_invariants=True)
    assert _greedy(llm, ids) == want
    stats = llm.llm_engine.scheduler.stats
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swap_preemptions > 0  # Gemma's too: every KV group's blocks move out and back


def test_ngram_speculation_matches(family):
    _, path, ids, want = family
    repetitive = [p + p[:12] for p in ids]  # repeats the prompt lookup can propose from
    llm = LLM(path, num_kv_blocks=128, speculative_model="ngram", num_speculative_tokens=3,
              speculative_adaptive=False)
    base = LLM(path, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)  # (no min_tokens: it holds proposals)
    assert _greedy(llm, repetitive, params) == _greedy(base, repetitive, params)
    assert llm.llm_engine.speculator.stats.num_draft_tokens > 0


def test_lora_equals_peft_merged_model(family, tmp_path):
    preset, path, ids, want = family
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # Phi-3's checkpoints fuse q/k/v and gate/up: its adapters target the fused modules. A mixture's adapters
    # target its attention (LoRA on experts is not served).
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if preset == "tiny-phi3" \
        else ("q_proj", "v_proj", "o_proj") if preset in MOE_FAMILIES \
        else ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
    adapter = make_lora(path, str(tmp_path / "lora"), rank=4, targets=targets, seed=7, std=0.1)
    llm = LLM(path, enable_lora=True, max_lora_rank=4, num_kv_blocks=128)
    got = _greedy(llm, ids[:2], lora_request=LoRARequest("a", 1, adapter))
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                       adapter).merge_and_unload().eval()
    assert got == [hf_greedy(merged, p, N) for p in ids[:2]]
    # The adapter changes the model (compared as logprobs: tiny-granite's tokens barely move).
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    lp = [llm.generate({"prompt_token_ids": ids[0]}, one, use_tqdm=False, lora_request=r)[0].outputs[0].logprobs[0]
          for r in (None, LoRARequest("a", 1, adapter))]
    assert lp[0] != lp[1]


def test_tensor_parallel_matches_or_refuses(dense_family):
    preset, path, ids, want = dense_family
    if preset == "tiny-olmo2":
        with pytest.raises(ValueError, match="Olmo2ForCausalLM cannot be split across ranks: q_norm and k_norm"):
            LLMEngine(EngineArgs(model=path, num_kv_blocks=128, tensor_parallel_size=2))
        return
    engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=128, tensor_parallel_size=2))
    try:
        for i, p in enumerate(ids):
            engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert [done[str(i)] for i in range(len(ids))] == want
    finally:
        assert engine.runner.group is not None
        engine.runner.group.shutdown()


def test_guided_json_parses(family):
    _, path, _, _ = family
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "maximum": 999}},
              "required": ["name", "n"], "additionalProperties": False}
    llm = LLM(path, num_kv_blocks=128)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=120, n=4,
                            guided_decoding=GuidedDecodingParams(json=schema))
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        assert set(value) == {"name", "n"} and isinstance(value["n"], int)


@pytest.mark.parametrize(("preset", "overrides", "match"), [
    ("tiny-llama", (("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),), "unsupported rope type 'dynamic'"),
    ("tiny-llama", (("partial_rotary_factor", 0.5),), "partial_rotary_factor=0.5 is not supported"),
    ("tiny-qwen3", (("hidden_act", "gelu"),), "hidden_act='gelu' is not supported"),
    ("tiny-gemma3", (("attn_logit_softcapping", 30.0),), "attn_logit_softcapping=30.0 is not supported"),
    ("tiny-gemma2", (("use_bidirectional_attention", True),), "use_bidirectional_attention=True is not supported"),
    ("tiny-gemma2", (("layer_types", ["chunked_attention"] * 4),), "layer_types: unsupported"),
    ("tiny-phi3", (("rope_scaling", {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                                     "original_max_position_embeddings": 256}),), "short_factor"),
])
def test_config_fields_we_do_not_compute_are_named(model_factory, tmp_path, preset, overrides, match):
    """Never silently wrong output: a config value the engine does not implement is an error naming the field."""
    import shutil

    path = str(tmp_path / "m")
    shutil.copytree(model_factory(preset), path)
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**cfg, **dict(overrides)}, f)
    with pytest.raises(ValueError, match=match):
        LLM(path, num_kv_blocks=16)


def test_chat_template_from_chat_template_jinja(model_factory, tmp_path):
    """A checkpoint shipping its template as chat_template.jinja (not inside tokenizer_config.json) renders the
    same, thinking switch included."""
    import shutil

    src = model_factory("tiny-qwen3")
    dst = str(tmp_path / "jinja")
    shutil.copytree(src, dst)
    with open(f"{dst}/tokenizer_config.json") as f:
        cfg = json.load(f)
    with open(f"{dst}/chat_template.jinja", "w") as f:
        f.write(cfg.pop("chat_template"))
    with open(f"{dst}/tokenizer_config.json", "w") as f:
        json.dump(cfg, f)
    from minivllm.entrypoints.chat_utils import chat_prompt

    msgs = [{"role": "user", "content": "Hi"}]
    for kw in ({}, {"enable_thinking": False}):
        want = chat_prompt(get_tokenizer(src), msgs, template_kwargs=kw)
        assert chat_prompt(get_tokenizer(dst), msgs, template_kwargs=kw) == want
    assert chat_prompt(get_tokenizer(dst), msgs, template_kwargs={"enable_thinking": False})["prompt"].endswith(
        "<think>\n\n</think>\n\n")


def test_gemma3_multimodal_checkpoint_serves_its_language_model(model_factory, tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (as transformers saves one, vision tower included): its
    text_config and language-model weights are all a text request needs; greedy output equals HF's."""
    import shutil

    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = model_factory("tiny-gemma3")
    with open(f"{text}/config.json") as f:
        text_cfg = json.load(f)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    text_cfg.pop("architectures", None)
    config = Gemma3Config(text_config=text_cfg, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=text_cfg["vocab_size"] - 1, boi_token_index=text_cfg["vocab_size"] - 2,
                          eoi_token_index=text_cfg["vocab_size"] - 3)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than HF's init, so greedy tokens are well separated
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" not in name:
                p.normal_(0.0, 0.1)
    path = str(tmp_path / "gemma3-mm")
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{text}/{name}", path)
    with open(f"{path}/config.json") as f:
        assert json.load(f)["architectures"] == ["Gemma3ForConditionalGeneration"]
    ids = _prompt_ids(path)[:3]
    llm = LLM(path, num_kv_blocks=64)
    got = _greedy(llm, ids)
    want = []
    for p in ids:
        t = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=N, min_new_tokens=N,
                              do_sample=False)
        want.append(out[0, len(p):].tolist())
    assert got == want
