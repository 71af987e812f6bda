"""Bad input gets an exception whose message names the problem; nothing else is lost."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.config import EngineArgs


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("tiny-llama"), num_kv_blocks=64, max_model_len=256, check_invariants=True)


@pytest.fixture
def broken_copy(model_factory, tmp_path):
    def copy() -> str:
        dst = tmp_path / "model"
        shutil.copytree(model_factory("tiny-llama"), dst)
        return str(dst)
    return copy


@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="prompt.*empty"):
        llm.generate([prompt], use_tqdm=False)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len 256"):
        llm.generate([{"prompt_token_ids": [5] * 300}], use_tqdm=False)


def test_prompt_of_exactly_max_model_len_gets_one_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5] * 256}], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_prompt_token_out_of_vocab(llm):
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 1024\)"):
        llm.generate([{"prompt_token_ids": [5, 99999]}], use_tqdm=False)


@pytest.mark.parametrize("value", [0, -3, 2.5, "8"])
def test_max_tokens_below_one(value):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=value)


def test_negative_temperature():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_request_that_can_never_fit_is_rejected_and_others_still_run(model_factory):
    llm = LLM(model_factory("tiny-llama"), num_kv_blocks=8, max_model_len=256, check_invariants=True)
    # 8 blocks x 16 tokens = 128 slots; a prompt + 200 new tokens cannot fit even alone.
    with pytest.raises(ValueError, match="needs 13 KV blocks .* whole pool has 8"):
        llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert llm.llm_engine.block_manager.num_used == 0


def test_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", "also fine", ""], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_unknown_architecture(broken_copy):
    path = broken_copy()
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FalconForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="Unsupported architecture 'FalconForCausalLM'.*LlamaForCausalLM"):
        LLM(path)


def test_missing_weight(broken_copy):
    path = broken_copy()
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, f)
    with pytest.raises(ValueError, match=r"missing weights: .*layers\.1\.self_attn\.qkv_proj\.weight "
                                         r"\(only .*q_proj.weight, .*v_proj.weight present\).*norm\.weight"):
        LLM(path)


def test_mismatched_weight_shape(broken_copy):
    path = broken_copy()
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :100].contiguous()
    save_file(tensors, f)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 100\)"):
        LLM(path)


def test_no_weights_and_no_config(broken_copy, tmp_path, monkeypatch):
    path = broken_copy()
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no weights"):
        LLM(path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path))
    import minivllm.default_model as dm

    monkeypatch.setattr(dm, "_ROOT", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="embedded default model is missing"):
        LLM()


def test_bad_engine_args():
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineArgs(model="x", kv_cache_memory="lots")
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model="x", block_size=0)


def test_stop_token_id_beyond_vocab_is_rejected_and_nothing_breaks(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids: \[5000\] are not below the vocabulary size 1024"):
        llm.generate(["x"], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5000]), use_tqdm=False)
    assert llm.generate(["x"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"use_beam_search": True, "beam_width": 2, "stop": ["x"]}, "stop"),
    ({"use_beam_search": True, "beam_width": 2, "logprobs": 2}, "logprobs"),
    ({"early_stopping": 1}, "early_stopping"),
    ({"output_kind": "delta"}, "output_kind"),
    ({"seed": 2**64}, "seed"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": [""]}, "stop"),
])
def test_sampling_params_reject_with_the_field_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_size_settings_name_themselves_in_errors():
    from minivllm.entrypoints.server_args import ServerArgs

    with pytest.raises(ValueError, match="kv_cache_memory: cannot parse size 'lots'"):
        EngineArgs(kv_cache_memory="lots")
    with pytest.raises(ValueError, match="max_body_size: cannot parse size '4 parsecs'"):
        ServerArgs(max_body_size="4 parsecs")
