"""Mixtures of experts (model/moe.py): the grouped expert layer equals a per-token reference, checkpoints that store
each expert apart (as transformers saves them, Mixtral's `block_sparse_moe.experts.N.w1` too) load as the merged
tensors, experts split across tensor-parallel ranks, and what cannot be built is refused by name. Per-layer,
logits and greedy parity with transformers for each family are in test_parity.py."""

from __future__ import annotations

import pytest
import torch
from conftest import make_runner, write_experts_apart

from minivllm import LLM
from minivllm.config import ModelConfig
from minivllm.model.moe import MoESpec, SparseMoE
from minivllm.model.runner import SequenceInput
from minivllm.modelgen.presets import MOE_FAMILIES


def _moe(shared: int, norm: bool, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(32, MoESpec(8, 3, 24, norm, (True,), shared), "silu")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _per_token(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one at a time, in the plain math of transformers' routers."""
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, ids = torch.topk(probs[t], moe.top_k)
        if moe.norm_topk_prob:
            w = w / w.sum()
        for weight, e in zip(w, ids.tolist(), strict=True):
            gate, up = (moe.experts.gate_up[e].weight @ x[t]).chunk(2)
            out[t] += weight * (moe.experts.down[e].weight @ (torch.nn.functional.silu(gate) * up))
        if moe.shared_expert is not None:
            assert moe.shared_expert_gate is not None
            out[t] += torch.sigmoid(moe.shared_expert_gate.weight @ x[t]) * moe.shared_expert(x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("shared,norm", [(0, True), (0, False), (40, False)])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_equal_each_token_through_its_experts(shared, norm, tokens):
    """Grouping by expert, one GEMM per active expert, weighting and scattering back (and the shared expert) give
    each token the sum of its experts' outputs; the per-expert load counters count every routed (token, slot)."""
    moe = _moe(shared, norm)
    x = torch.randn(tokens, 32)
    with torch.no_grad():
        got = moe(x)
        torch.testing.assert_close(got, _per_token(moe, x), atol=1e-5, rtol=1e-5)
        _, ids = moe.route(x)
    assert torch.equal(moe.expert_tokens, torch.bincount(ids.reshape(-1), minlength=8))
    assert int(moe.expert_tokens.sum()) == tokens * 3


def _logits(path: str) -> torch.Tensor:
    runner = make_runner(ModelConfig.from_pretrained(path), 16)
    return runner.execute([SequenceInput(list(range(5, 40)), 0, list(range(16)), True)])[0]


@pytest.mark.parametrize("preset", MOE_FAMILIES)
def test_a_checkpoint_storing_each_expert_apart_loads_as_merged(model_factory, tmp_path, preset):
    """Released checkpoints store experts one by one (Mixtral's under block_sparse_moe, as w1 / w3 / w2): such a
    checkpoint serves the merged one's logits, and transformers reads it as we do."""
    from conftest import hf_model

    merged, apart = model_factory(preset), str(tmp_path / "apart")
    write_experts_apart(merged, apart, preset == "tiny-mixtral")
    ours = _logits(apart)
    # (each runner times its own kernel plan: float rounding may differ, a misplaced weight would not be 1e-5)
    torch.testing.assert_close(ours, _logits(merged), atol=1e-5, rtol=0)
    with torch.no_grad():
        ref = hf_model(apart)(torch.tensor([list(range(5, 40))])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_a_missing_expert_is_named(model_factory, tmp_path):
    """A checkpoint without one expert's projection is an error naming the merged tensor it leaves incomplete."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "m")
    write_experts_apart(model_factory("tiny-qwen3-moe"), path, False)
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights: layers.2.mlp.experts.down.5.weight"):
        LLM(path, num_kv_blocks=32)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("shared", [0, 40])
def test_expert_shards_sum_to_the_whole_layer(shared, tokens):
    """Expert parallelism (distributed/parallel.py): two ranks' shares of one layer (experts 0-3 and 4-7, each
    with half of the shared expert) give partial outputs whose sum, what the all-reduce forms, is the layer's."""
    import copy

    from minivllm.distributed.parallel import _shard_experts

    whole = _moe(shared, norm=False, seed=3)
    x = torch.randn(tokens, 32)
    shards = [copy.deepcopy(whole) for _ in range(2)]
    for rank, moe in enumerate(shards):
        _shard_experts(moe, rank, 2)
        assert len(moe.experts.gate_up) == 4 and moe.experts.start == 4 * rank
    with torch.no_grad():
        want = whole(x)
        parts = [moe(x) for moe in shards]
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)
    if tokens > 1:  # (one token's two experts may both be one rank's)
        assert all(not torch.allclose(p, want) for p in parts)  # each rank alone has only part of it
    assert all(torch.equal(moe.expert_tokens, whole.expert_tokens) for moe in shards)  # every rank counts all


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-qwen2-moe"])  # (a dense layer; a shared expert)
def test_tensor_parallel_splits_the_experts_and_equals_one_process(model_factory, preset):
    """--tensor-parallel-size 2: each rank holds half of every layer's experts (and half of Qwen2-MoE's shared
    expert); the greedy tokens equal one process's, and rank 0's per-expert counts (/metrics) equal them too."""
    from minivllm import SamplingParams
    from minivllm.model.moe import expert_load

    path = model_factory(preset)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 130 + 9 * i))} for i in range(4)]
    one = LLM(path, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    split = LLM(path, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)]
        model = split.llm_engine.runner.model
        held = {len(layer.mlp.experts.gate_up) for layer in model.layers if isinstance(layer.mlp, SparseMoE)}
        load = expert_load(model)
    finally:
        group = split.llm_engine.runner.group
        assert group is not None
        group.shutdown()
    assert got == want
    assert held == {4}  # of 8
    assert load == expert_load(one.llm_engine.runner.model)
    forwarded = sum(len(p["prompt_token_ids"]) + 20 - 1 for p in prompts)
    assert load and all(sum(counts) == 2 * forwarded for counts in load.values())  # counted from zero: top-2


def test_tensor_parallelism_refusals_name_the_reason(model_factory):
    """OLMoE's q/k norms span the whole projections (as OLMo 2's); experts must split evenly."""
    with pytest.raises(ValueError, match="OlmoeForCausalLM cannot be split across ranks: q_norm and k_norm"):
        LLM(model_factory("tiny-olmoe"), num_kv_blocks=32, tensor_parallel_size=2)
    path = model_factory("tiny-qwen3-moe", overrides=(("num_experts", 6),))
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide the model's 6 experts"):
        LLM(path, num_kv_blocks=32, tensor_parallel_size=4)


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4", "w4a8"])
def test_quantized_experts_run_close_to_float(model_factory, method):
    """--quantization quantizes every expert (they hold most of an MoE model's bytes), each expert's projections
    QuantizedLinear layers planned with the other layers; logits stay within the mode's bound of the float model's
    (a bit looser than dense models': a routing choice near a tie may flip)."""
    from minivllm.model.moe import Experts
    from minivllm.model.quantization import QuantizedLinear

    mc = ModelConfig.from_pretrained(model_factory("tiny-qwen2-moe"))
    ids = list(range(5, 45))
    ref = make_runner(mc, 16).execute([SequenceInput(ids, 0, list(range(16)), True, all_logits=True)])
    runner = make_runner(mc, 16, quantization=method)
    experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
    assert len(experts) == mc.num_layers
    assert all(isinstance(q, QuantizedLinear) and q.method == method for e in experts for q in [*e.gate_up, *e.down])
    got = runner.execute([SequenceInput(ids, 0, list(range(16)), True, all_logits=True)])
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < (0.3 if method in ("int4", "w4a8") else 0.06), rel
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= (0.6 if method in ("int4", "w4a8") else 0.85)


def test_a_saved_quantized_moe_loads_its_experts_as_saved(model_factory, tmp_path):
    """`minivllm quantize` saves the quantized experts; loading fills empty quantized experts with them."""
    from minivllm.cli import main

    src = model_factory("tiny-olmoe")
    out = str(tmp_path / "q")
    assert main(["quantize", src, "--quantization", "w8a8", "--out", out]) == 0
    want = make_runner(ModelConfig.from_pretrained(src), 16, quantization="w8a8")
    got = make_runner(ModelConfig.from_pretrained(out), 16)
    seq = [SequenceInput(list(range(5, 40)), 0, list(range(16)), True)]
    torch.testing.assert_close(got.execute(seq)[0], want.execute(seq)[0], atol=0, rtol=0)


def test_metrics_count_the_tokens_routed_to_each_expert(model_factory, serve):
    """A served MoE's /metrics has minivllm:moe_expert_tokens_total{layer, expert} for its sparse layers only (not
    tiny-qwen3-moe's dense layer 1), read from the model's counters: each forwarded token adds top-k (2) to its
    layer, so a request of P prompt tokens and N outputs (N - 1 forwarded after the prompt) adds 2 (P + N - 1)."""
    import httpx
    from server_utils import metrics, wait_idle

    url = serve(model_factory("tiny-qwen3-moe"))
    wait_idle(url)
    before = metrics(url)
    prompt = list(range(300, 337))
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    after = wait_idle(url)
    per_layer: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith("minivllm:moe_expert_tokens_total{"):
            layer = key.split('layer="')[1].split('"')[0]
            per_layer[layer] = per_layer.get(layer, 0.0) + value - before.get(key, 0.0)
    assert sorted(per_layer) == ["0", "2"]
    assert set(per_layer.values()) == {2 * (len(prompt) + 6 - 1)}


def test_a_steps_lower_bound_counts_only_what_every_token_runs(model_factory):
    """Experts run only for their tokens: the plan's bound on a step (PlanCheck re-times kernels when steps beat it)
    leaves them out, or every MoE step would look too fast and kernels be re-timed inside steps."""
    runner = make_runner(ModelConfig.from_pretrained(model_factory("tiny-qwen3-moe")), 16)
    plan = runner.linear_plan
    routed = [q for q in plan.layers if q.routed]
    assert len(routed) == 2 * 8 * 2  # gate_up and down of 8 experts in each of the 2 sparse layers
    every = sum(q.in_features * q.out_features for q in plan.layers if not q.routed)
    assert plan.scale == every / sum(q.in_features * q.out_features for q in plan.timed)


def test_bfloat16_runs_close_to_float32(model_factory):
    """A mixture in bfloat16 (router, experts and shared expert in the model's dtype) stays near its float32 logits."""
    mc = ModelConfig.from_pretrained(model_factory("tiny-qwen2-moe"))
    seq = [SequenceInput(list(range(5, 45)), 0, list(range(16)), True, all_logits=True)]
    ref = make_runner(mc, 16).execute(seq)
    got = make_runner(mc, 16, torch.bfloat16).execute(seq)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05, rel
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_lora_adapts_a_mixtures_attention_and_names_an_expert_layer(model_factory, tmp_path):
    """LoRA on a mixture: an adapter of its attention equals peft's merged model; one adapting a sparse layer's MLP
    is refused naming the layer (experts take no adapter), and the server goes on with the first. Before, enabling
    LoRA on any mixture raised AttributeError."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from minivllm import SamplingParams
    from minivllm.lora_request import LoRARequest
    from minivllm.modelgen.make_lora import make_lora
    from tests.conftest import hf_greedy

    path = model_factory("tiny-qwen3-moe")
    adapter = make_lora(path, str(tmp_path / "lora"), rank=4, targets=("q_proj", "o_proj"), seed=5, std=0.1)
    llm = LLM(path, enable_lora=True, max_lora_rank=4, num_kv_blocks=64)
    prompt = list(range(7, 27))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                       lora_request=LoRARequest("a", 1, adapter))[0].outputs[0].token_ids
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                       adapter).merge_and_unload().eval()
    assert got == hf_greedy(merged, prompt, 16)
    assert got != llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    bad = tmp_path / "bad"  # + a gate_proj of layer 0's mixture
    bad.mkdir()
    (bad / "adapter_config.json").write_text((tmp_path / "lora" / "adapter_config.json").read_text())
    tensors = load_file(f"{adapter}/adapter_model.safetensors")
    mlp = "base_model.model.model.layers.0.mlp.gate_proj"
    tensors |= {f"{mlp}.lora_A.weight": torch.zeros(4, 64), f"{mlp}.lora_B.weight": torch.zeros(48, 4)}
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="gate_proj of layer 0, a mixture-of-experts layer"):
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=LoRARequest("b", 2, str(bad)))
    assert llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, adapter))[0].outputs[0].token_ids == got
