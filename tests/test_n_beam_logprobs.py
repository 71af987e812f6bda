"""n > 1 on shared blocks, beam search against HF transformers, logprobs against HF's logits, chat."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import PROMPTS, corpus_token_ids, hf_model

from minivllm import LLM, BeamSearchParams, SamplingParams
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import RequestOutputKind


def test_n4_allocates_the_prompt_once_and_diverges_by_copy_on_write(model_factory):
    engine = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), num_kv_blocks=64, check_invariants=True))
    bm = engine.block_manager
    prompt = corpus_token_ids(engine.tokenizer, 40)  # blocks of 16: two full, one holding 8 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    engine.step()  # prefill once, sample 4 tokens from the same logits, fork
    group = engine.groups["r"]
    assert len(group.seqs) == 4 and bm.num_used == 3
    assert all(s.block_table == group.seqs[0].block_table for s in group.seqs)
    assert all(bm.ref_counts[b] == 4 for b in group.seqs[0].block_table)
    engine.step()  # every sample writes position 40 into the shared third block: 3 copies, 1 in place
    assert bm.num_used == 3 + 3  # 4 separate requests would hold 12
    assert len({s.block_table[2] for s in group.seqs}) == 4 and len({s.block_table[0] for s in group.seqs}) == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    completions = outs[-1].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) > 1  # the samples differ
    assert bm.num_used == 0
    engine.check_invariants()


def test_n2_delta_outputs_concatenate_per_completion(model_factory):
    llm = LLM(model_factory("tiny-llama"), num_kv_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    engine.add_request("d", PROMPTS[0], params.clone(output_kind=RequestOutputKind.DELTA))
    texts, ids = ["", ""], [[], []]
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] += c.text
                ids[c.index] += c.token_ids
    final = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in final] == ids and [c.text for c in final] == texts


def _with_eos(src: str, dst: str, extra_eos: int) -> str:
    """A copy of a model whose generation_config adds a frequent token as EOS, so beams do finish early."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [gen["eos_token_id"], extra_eos]
    with open(path, "w") as f:
        json.dump(gen, f)
    return dst


@pytest.fixture(scope="module")
def beam_model(model_factory, tmp_path_factory):
    base = model_factory("tiny-llama")
    greedy = LLM(base, num_kv_blocks=64).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)
    return _with_eos(base, str(tmp_path_factory.mktemp("beam") / "m"), greedy[0].outputs[0].token_ids[3])


@pytest.mark.parametrize(("length_penalty", "early_stopping"), [(1.0, False), (2.0, True), (0.5, "never"),
                                                                (-1.0, False)])
def test_beam_search_matches_hf(beam_model, length_penalty, early_stopping):
    llm = LLM(beam_model, num_kv_blocks=256, check_invariants=True)
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search(PROMPTS[:4], params)
    hf = hf_model(beam_model)
    finished_early = 0
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, max_new_tokens=12,
                              length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
        best = out.outputs[0]
        ref_ids = ref.sequences[0, ids.shape[1]:].tolist()
        assert best.token_ids == ref_ids
        score = best.cumulative_logprob / len(best.token_ids) ** length_penalty
        assert score == pytest.approx(ref.sequences_scores[0].item(), abs=1e-4)
        assert len(out.outputs) == 4 and all(len(c.token_ids) <= 12 for c in out.outputs)
        finished_early += best.finish_reason == "stop"
    assert llm.llm_engine.block_manager.num_used == 0
    if length_penalty < 1.0:  # shorter hypotheses are favoured: an EOS-finished beam wins somewhere
        assert finished_early > 0


def test_beam_search_frees_pruned_beams_at_once(beam_model):
    engine = LLMEngine(EngineArgs(model=beam_model, num_kv_blocks=256, check_invariants=True))
    engine.add_request("b", PROMPTS[1], BeamSearchParams(beam_width=4, max_tokens=10).to_sampling_params())
    max_live = 0
    while engine.has_unfinished_requests():
        engine.step()
        group = engine.groups.get("b")
        if group is not None:
            live = group.beam.live
            max_live = max(max_live, len(live))
            # Only live beams hold blocks: pruned ones were released in the step that pruned them.
            held = {b for s in engine.scheduler.running + engine.scheduler.waiting for b in s.block_table}
            assert held == {b for s in live for b in s.block_table}
    assert max_live == 4 and engine.block_manager.num_used == 0


def test_logprobs_and_prompt_logprobs_equal_hf(model_factory):
    path = model_factory("tiny-qwen2")
    llm = LLM(path, num_kv_blocks=64)
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5,
                                                    prompt_logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    full = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(path)(torch.tensor([full])).logits[0].float(), dim=-1)
    p = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == p
    for j in range(1, p):  # prompt token j given tokens < j
        entry = out.prompt_logprobs[j]
        assert entry[full[j]].logprob == pytest.approx(ref[j - 1, full[j]].item(), abs=1e-4)
        assert entry[full[j]].rank == int((ref[j - 1] > ref[j - 1, full[j]]).sum()) + 1
    for i, entry in enumerate(comp.logprobs):
        row = ref[p - 1 + i]
        chosen = comp.token_ids[i]
        assert entry[chosen].logprob == pytest.approx(row[chosen].item(), abs=1e-4) and entry[chosen].rank == 1
        top = row.topk(5)
        for lp, tid in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
        assert entry[chosen].decoded_token == llm.get_tokenizer().decode([chosen])
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(comp.logprobs, comp.token_ids,
                                                                                    strict=True)), abs=1e-4)


def test_prompt_logprobs_survive_chunked_prefill(model_factory):
    path = model_factory("tiny-qwen2")
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    whole = LLM(path, num_kv_blocks=64).generate([PROMPTS[1]], params, use_tqdm=False)[0]
    chunked = LLM(path, num_kv_blocks=64, max_num_batched_tokens=7).generate([PROMPTS[1]], params,
                                                                            use_tqdm=False)[0]
    assert len(whole.prompt_logprobs) == len(whole.prompt_token_ids)
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:], strict=True):
        (ta, la), (tb, lb) = next(iter(a.items())), next(iter(b.items()))
        assert ta == tb and la.logprob == pytest.approx(lb.logprob, abs=1e-4)


def test_chat_applies_the_template(model_factory):
    llm = LLM(model_factory("tiny-qwen2"), num_kv_blocks=64)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered and rendered.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 6
    two = llm.chat([messages, messages[1:]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(two) == 2


def test_abort_reports_abort_and_frees_blocks(model_factory):
    engine = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), num_kv_blocks=64, check_invariants=True))
    engine.add_request("a", PROMPTS[0], SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True,
                                                       output_kind=RequestOutputKind.DELTA))
    for _ in range(3):
        engine.step()
    out = engine.abort_request("a")
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    assert engine.block_manager.num_used == 0 and not engine.has_unfinished_requests()
    assert engine.abort_request("a") is None  # unknown ids are ignored


def test_prompt_logprobs_survive_preemption(model_factory):
    path = model_factory("tiny-qwen2")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[5], PROMPTS[2]]
    ref = LLM(path, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    tight = LLM(path, num_kv_blocks=9, max_num_batched_tokens=12, check_invariants=True)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert ea.keys() == eb.keys()
            assert all(ea[t].logprob == pytest.approx(eb[t].logprob, abs=1e-4) for t in ea)


def test_beam_search_survives_a_tiny_pool(beam_model):
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    ref = LLM(beam_model, num_kv_blocks=256).beam_search(PROMPTS[:3], params)
    tight = LLM(beam_model, num_kv_blocks=8, max_num_batched_tokens=16, check_invariants=True)
    got = tight.beam_search(PROMPTS[:3], params)
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert tight.llm_engine.block_manager.num_used == 0


def test_request_ids_that_look_like_sample_ids_do_not_collide(model_factory):
    engine = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), num_kv_blocks=64, check_invariants=True))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("a#1", PROMPTS[0], params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    assert set(done) == {"a", "a#1"} and all(len(o.outputs) == 2 for o in done.values())
