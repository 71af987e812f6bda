"""LoRA adapters (model/lora.py, engine/lora_registry.py): greedy outputs with an adapter equal HF peft's merged model
on the same adapter; a batch mixing three adapters and the base model equals each run alone (prefix caching on,
the same prompt: KV is never shared across adapters); adapters that do not fit are ValueErrors naming why."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import PROMPTS

from minivllm import LLM, LoRARequest, SamplingParams
from minivllm.modelgen.make_lora import make_lora

N = 16
ADAPTERS = {  # name → (rank, targets, seed)
    "qv": (4, ("q_proj", "v_proj"), 1),
    "all": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 2),
    "mlp": (2, ("o_proj", "gate_proj", "down_proj"), 3),
}


@pytest.fixture(scope="module")
def base(model_factory):
    return model_factory("tiny-llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {name: make_lora(base, str(root / name), rank=r, targets=t, seed=s, std=0.1)
            for name, (r, t, s) in ADAPTERS.items()}


def _hf_greedy(base: str, adapter: str | None, prompt_ids: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                                    do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def _requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def test_adapters_equal_peft_merged_models(base, adapters):
    llm = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=256, check_invariants=True)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    base_out = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert base_out == _hf_greedy(base, None, ids)
    for name, req in _requests(adapters).items():
        got = llm.generate({"prompt_token_ids": ids}, greedy, lora_request=req, use_tqdm=False)[0].outputs[0].token_ids
        want = _hf_greedy(base, adapters[name], ids)
        assert got == want, name
        assert got != base_out, name  # the adapter does change the model


def test_mixed_batch_of_three_adapters_and_base_equals_each_alone(base, adapters):
    """Every prompt four times (base, then each adapter) in one batch, prefix caching on: a shared prompt's KV must
    not cross adapters (hashes are salted per adapter), and the projections add each token's own adapter only."""
    reqs = [None, *_requests(adapters).values()]
    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    alone = {}
    for r in reqs:
        llm = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=256, enable_prefix_caching=False)
        outs = llm.generate(PROMPTS[:3], greedy, lora_request=r, use_tqdm=False)
        alone[r] = [o.outputs[0].token_ids for o in outs]
    mixed = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=256, check_invariants=True)
    prompts = [p for p in PROMPTS[:3] for _ in reqs]
    outs = mixed.generate(prompts, greedy, lora_request=[r for _ in PROMPTS[:3] for r in reqs], use_tqdm=False)
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == alone[reqs[i % len(reqs)]][i // len(reqs)], i
    eng = mixed.llm_engine
    assert eng.block_manager.num_used == 0
    # A second round hits the prefix cache, each request within its own adapter's blocks, with the same outputs.
    again = mixed.generate(prompts, greedy, lora_request=[r for _ in PROMPTS[:3] for r in reqs], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert eng.scheduler.stats.prefix_cache_hits > 0


def test_sampled_and_speculative_requests_run_under_adapters(base, adapters):
    """n > 1 samples and n-gram speculation (verification rows carry the adapter): greedy equals plain decoding."""
    req = _requests(adapters)["all"]
    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    want = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=256).generate(
        PROMPTS[:2], greedy, lora_request=req, use_tqdm=False)
    spec = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=256, speculative_model="ngram",
               num_speculative_tokens=3, speculative_adaptive=False)
    got = spec.generate(PROMPTS[:2], greedy, lora_request=req, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    n4 = spec.generate(PROMPTS[0], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8), lora_request=req,
                       use_tqdm=False)[0]
    assert len(n4.outputs) == 4 and spec.llm_engine.block_manager.num_used == 0


def _write_adapter(path: str, rank: int, layer: int, a_shape: tuple[int, int], b_shape: tuple[int, int],
                   module: str = "q_proj") -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": [module], "bias": "none"}, f)
    prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(a_shape), f"{prefix}.lora_B.weight": torch.zeros(b_shape)},
              os.path.join(path, "adapter_model.safetensors"))
    return path


def test_adapters_that_do_not_fit_are_errors_naming_why(base, adapters, tmp_path):
    llm = LLM(base, enable_lora=True, max_lora_rank=4, max_loras=2, num_kv_blocks=64)
    eng = llm.llm_engine
    hidden = eng.model_config.hidden_size
    cases = [
        (adapters["all"], "rank 8, above --max-lora-rank 4"),
        (_write_adapter(str(tmp_path / "wide"), 4, 0, (4, hidden * 2), (hidden, 4)), "made for another model"),
        (_write_adapter(str(tmp_path / "deep"), 4, 99, (4, hidden), (hidden, 4)), "adapts layer 99"),
        (_write_adapter(str(tmp_path / "embed"), 4, 0, (4, hidden), (hidden, 4), module="embed_tokens"),
         "targets .embed_tokens.; supported: q_proj"),
        (str(tmp_path / "missing"), "no adapter_config.json"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate("x", SamplingParams(max_tokens=2), lora_request=LoRARequest("bad", 9, path), use_tqdm=False)
        assert not eng.has_unfinished_requests() and eng.loras.loaded == {}
    eng.add_lora("one", adapters["qv"])
    eng.add_lora("two", adapters["mlp"])
    with pytest.raises(ValueError, match="all 2 adapter slots are in use"):
        eng.add_lora("three", adapters["qv"])
    with pytest.raises(ValueError, match="already loaded"):
        eng.add_lora("one", adapters["qv"])
    eng.add_request("busy", "x", SamplingParams(max_tokens=4), lora_request=LoRARequest("one", 1, adapters["qv"]))
    with pytest.raises(ValueError, match="in use by 1 request"):
        eng.remove_lora("one")
    while eng.has_unfinished_requests():
        eng.step()
    eng.remove_lora("one")
    with pytest.raises(KeyError):
        eng.remove_lora("one")
    eng.add_lora("three", adapters["qv"])  # its slot was freed


def test_lora_needs_enable_lora(base, adapters):
    with pytest.raises(ValueError, match="enable-lora"):
        LLM(base, num_kv_blocks=16).generate("x", SamplingParams(max_tokens=2),
                                             lora_request=LoRARequest("a", 1, adapters["qv"]), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LLM(base, lora_modules=[f"a={adapters['qv']}"])
    with pytest.raises(ValueError, match="NAME=DIR"):
        LLM(base, enable_lora=True, lora_modules=["just-a-path"])


def test_adapter_files_over_the_bound_are_refused_before_reading(base, adapters, tmp_path):
    """Issue 33, item 6: an adapter file larger than any adapter the slots can hold (every module at
    --max-lora-rank in fp32) is refused by its size, without being read; a real adapter is far inside."""
    import os
    import shutil

    llm = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    bound = llm.llm_engine.loras.max_adapter_bytes
    real = os.path.getsize(os.path.join(adapters["all"], "adapter_model.safetensors"))
    assert real < bound < 4 * real + (1 << 20)  # rank 8 on every module is the largest adapter: the bound is near
    huge = tmp_path / "huge"
    shutil.copytree(adapters["qv"], huge)
    with open(huge / "adapter_model.safetensors", "r+b") as f:
        f.truncate(bound + 1)  # sparse: the test writes nothing, and a read would fail on the header anyway
    with pytest.raises(ValueError, match=f"adapter_model.safetensors is {bound + 1} bytes, over the largest adapter"):
        llm.generate("x", SamplingParams(max_tokens=2), lora_request=LoRARequest("huge", 1, str(huge)),
                     use_tqdm=False)
    (huge / "adapter_config.json").write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(ValueError, match="adapter_config.json is"):
        llm.llm_engine.add_lora("huge", str(huge))


def test_a_request_prepared_under_an_unloaded_adapter_is_refused(base, adapters):
    """Issue 33, item 6: the unload/load race. A request prepared under adapter a (the servers prepare off the
    engine thread) is queued after a was unloaded and b loaded into the same slot: it is refused, never run
    under b."""
    llm = LLM(base, enable_lora=True, max_lora_rank=8, max_loras=1, num_kv_blocks=64)
    eng = llm.llm_engine
    a = eng.add_lora("a", adapters["qv"])
    req = eng.process_request("r", "x", SamplingParams(max_tokens=2), lora=a)
    eng.remove_lora("a")
    b = eng.add_lora("b", adapters["mlp"])
    assert b.slot == a.slot
    with pytest.raises(ValueError, match="'a' was unloaded or reloaded while the request was being prepared"):
        eng.add_engine_request(req)
    assert not eng.has_unfinished_requests()
    eng.remove_lora("b")
    a2 = eng.add_lora("a", adapters["qv"])  # the same name loaded again is another load: still refused
    with pytest.raises(ValueError, match="unloaded or reloaded"):
        eng.add_engine_request(req)
    req2 = eng.process_request("r2", "x", SamplingParams(max_tokens=2), lora=a2)
    eng.add_engine_request(req2)
    while eng.has_unfinished_requests():
        eng.step()
