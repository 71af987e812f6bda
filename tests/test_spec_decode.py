"""Speculative decoding with the n-gram, suffix and draft-model proposers: lossless for greedy requests inside a
busy mixed batch (chunked prefill, prefix caching and preemption all happening), block accounting intact
in both pools, clear errors. Sampled requests: tests/test_spec_sampling.py."""

from __future__ import annotations

import pytest

from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.cost import LookupCost, ProposerCostModel, StepCostTable
from minivllm.spec_decode.draft_proposer import DraftModelProposer
from minivllm.spec_decode.exploration import Exploration
from minivllm.spec_decode.ngram_proposer import NgramProposer, ngram_propose
from minivllm.spec_decode.records import SpecRecord
from minivllm.spec_decode.speculator import Speculator
from tests.conftest import PROMPTS, corpus_token_ids, noisy_copy


def test_ngram_proposes_what_followed_the_latest_match():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_propose(toks, 2, 1, 3) == [7, 8]  # latest earlier "1 2 3" is followed by 7 8
    assert ngram_propose(toks, 5, 1, 3) == [7, 8, 1, 2, 3]
    assert ngram_propose(toks, 7, 1, 3) == [7, 8, 1, 2, 3, 7, 8]  # past the end: the same lag continues
    assert ngram_propose([5, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]  # a loop of period 2
    assert ngram_propose([5, 6, 7], 3, 1, 2) == []  # nothing repeats
    assert ngram_propose([4, 1, 4], 3, 1, 2) == [1, 4, 1]  # falls back to n = 1
    assert ngram_propose([4, 1, 4], 3, 2, 2) == []  # ... unless n_min forbids it
    assert ngram_propose([3], 2, 1, 4) == []


def test_draft_skips_a_sequence_the_last_step_left_untouched(model_factory, tmp_path):
    """Proposals made, then a step that adds nothing to the sequence (here: none at all): the draft has seen
    its last token and has no logits for it, so it proposes nothing this time, and decoding goes on."""
    path = model_factory("tiny-llama")
    engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=64, check_invariants=True, num_speculative_tokens=3,
                                  speculative_model=noisy_copy(path, str(tmp_path / "d"), 0.0),
                                  speculative_adaptive=False))
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(temperature=0.0, max_tokens=12))
    engine.step()
    seq = engine.scheduler.running[0]
    assert engine.speculator.propose([seq]) == [seq] and len(seq.spec_token_ids) == 3
    assert engine.speculator.propose([seq]) == []  # the first proposals were never verified
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.speculator.stats.num_accepted_tokens > 0  # an exact copy as draft: accepted from then on
    assert engine.speculator.proposer.block_manager.num_used == 0


def _params(i: int) -> SamplingParams:
    """Greedy requests of several lengths, some with stop strings; every fourth is sampled with a seed
    (rejection sampling), one in seven greedy with a repetition penalty (row i of a verification counts
    the proposals before it as outputs)."""
    if i % 4 == 3:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=10 + i % 7)
    if i % 7 == 5:
        return SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.2)
    return SamplingParams(temperature=0.0, max_tokens=8 + 3 * (i % 9), stop=["\n\n"] if i % 3 == 0 else None)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, tuple[list[int], str, str | None]]:
    """Two requests arrive per step; returns each request's tokens, text and finish reason."""
    done, step, added = {}, 0, 0
    while added < len(prompts) or engine.has_unfinished_requests():
        for _ in range(2):
            if added < len(prompts):
                engine.add_request(str(added), {"prompt_token_ids": prompts[added]}, _params(added))
                added += 1
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.text, c.finish_reason)
        step += 1
        assert step < 5000
    return done


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft"])
def test_greedy_outputs_identical_with_and_without_speculation(model_factory, tmp_path, proposer):
    path = model_factory("tiny-llama")
    spec_model = proposer if proposer != "draft" else noisy_copy(path, str(tmp_path / "draft"), 0.03)
    base = LLMEngine(EngineArgs(model=path, num_kv_blocks=512, check_invariants=True))
    text = corpus_token_ids(base.tokenizer, 600)
    # 32 prompts: code text with repeats inside (so proposals get accepted) and shared prefixes (prefix hits).
    prompts = [text[:40] + text[5 * i: 5 * i + 8 + 3 * (i % 11)] + text[:20] for i in range(32)]
    want = _run(base, prompts)
    # Small step budget (chunked prefill), prefix caching on, a pool small enough to preempt.
    engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=48, block_size=4, max_num_batched_tokens=24,
                                  check_invariants=True, speculative_model=spec_model, num_speculative_tokens=3,
                                  speculative_adaptive=False))  # verify on every step that can propose
    got = _run(engine, prompts)
    greedy = [str(i) for i in range(32) if _params(i).greedy]
    assert {r: got[r] for r in greedy} == {r: want[r] for r in greedy}
    for i in range(32):  # sampled ones (rejection sampling) finish by their own rules
        toks, _, reason = got[str(i)]
        assert reason in ("stop", "length") and len(toks) <= _params(i).max_tokens
    st = engine.speculator.stats
    assert st.num_accepted_tokens > 0 and 0 < st.num_drafts <= st.num_draft_tokens
    assert engine.scheduler.stats.num_preemptions > 0 and engine.scheduler.stats.prefix_cache_hits > 0
    assert engine.block_manager.num_used == 0 and engine.input_batch.num_active == 0
    engine.check_invariants()  # the draft's pool too (after every step as well: check_invariants=True)
    if proposer == "draft":
        draft = engine.speculator.proposer
        assert draft.block_manager.num_used == 0 and not draft.shadows
        assert draft.block_manager.hash_to_block  # the draft's pool cached prefixes too
    # Fewer steps for the same tokens is the point: accepted proposals are tokens no step had to produce.
    assert sum(st.accepted_per_position) == st.num_accepted_tokens


def test_a_detached_speculator_proposes_nothing_and_reattaches(model_factory):
    """set_speculator(None) turns speculation off between requests (the speculative bench's A/B on one engine);
    the outputs stay the greedy ones and the speculator, attached again, proposes again."""
    path = model_factory("tiny-llama")
    engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=128, check_invariants=True, speculative_model="ngram",
                                  num_speculative_tokens=3, speculative_adaptive=False))
    text = corpus_token_ids(engine.tokenizer, 200)
    prompts = [text[:30] + text[:12] for _ in range(2)]
    sp = engine.speculator
    assert sp is not None
    with_spec = _run(engine, prompts)
    drafts = sp.stats.num_draft_tokens
    assert drafts > 0
    engine.set_speculator(None)
    assert _run(engine, prompts) == with_spec and sp.stats.num_draft_tokens == drafts
    engine.set_speculator(sp)
    assert _run(engine, prompts) == with_spec and sp.stats.num_draft_tokens > drafts
    engine.add_request("busy", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.set_speculator(None)


def test_a_lookup_that_finds_nothing_counts_in_its_sequences_record_as_a_draft_that_failed(model_factory):
    """The rule prices a lookup round by the sequences looked up but gains by the acceptance of what was proposed: a
    lookup that finds nothing (suffix decoding on fresh code at 8 streams, hitting a few times a run) goes into the
    sequence's record as a draft none of whose tokens held, so a sequence whose lookups keep missing pauses them."""
    engine = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), num_kv_blocks=128, speculative_model="ngram",
                                  num_speculative_tokens=3, speculative_adaptive=False))
    sp = engine.speculator
    assert sp is not None
    looked: list[int] = []
    sp.proposer.propose = lambda batch: looked.extend(s.seq_id for s, _ in batch) or []  # type: ignore[method-assign]
    engine.add_request("r", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # prefill
    engine.step()  # a decode whose lookup finds nothing
    rec = sp.records[looked[0]]
    assert sp.stats.num_drafts == 0 and rec.drafts == 1 and rec.accepted == 0 and rec.expected > 0


@pytest.mark.parametrize(("kw", "match"), [
    (dict(speculative_model="ngram", num_speculative_tokens=0), "num_speculative_tokens must be >= 1"),
    (dict(num_speculative_tokens=3), "needs speculative_model"),
    (dict(speculative_model="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2),
     "1 <= min <= max"),
    (dict(speculative_model="ngram", num_speculative_tokens=2, kv_cache_mode="none"), "kv_cache_mode=paged"),
    (dict(speculative_config="{method: ngram}"), "speculative_config: not valid JSON"),
    (dict(speculative_config="[1, 2]"), "expected a JSON object"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}'),
     "unknown key.*'lookahead'"),
    (dict(speculative_config='{"method": "eagle", "model": "x", "num_speculative_tokens": 2}'),
     "method 'eagle' is not supported"),
    (dict(speculative_config='{"method": "draft_model", "num_speculative_tokens": 2}'), "needs 'model'"),
    (dict(speculative_config='{"method": "ngram"}'), "num_speculative_tokens must be an integer >= 1"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1}'),
     "adaptive must be bool"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}'),
     "1 <= min <= max"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}', speculative_model="ngram"),
     "not both"),
])
def test_bad_speculative_settings_are_clear_errors(model_factory, kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=model_factory("tiny-llama"), **kw)


def test_speculative_config_json_sets_the_same_fields_as_the_flags(model_factory):
    """vLLM's --speculative-config: method/model, k and the n-gram bounds, from the CLI and from LLM()."""
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model", model_factory("tiny-llama"), "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                            '"prompt_lookup_min": 2, "adaptive": false}'])
    args = EngineArgs.from_cli_args(ns)
    assert (args.speculative_model, args.num_speculative_tokens, args.prompt_lookup_max, args.prompt_lookup_min,
            args.speculative_adaptive) == ("ngram", 4, 3, 2, False)
    engine = LLMEngine(args)
    assert engine.speculator is not None and engine.speculator.k == 4 and not engine.speculator.adaptive
    draft = EngineArgs(speculative_config={"model": "default-draft", "num_speculative_tokens": 2})
    assert draft.speculative_model.endswith("minivllm-py-1m-draft") and draft.num_speculative_tokens == 2


def test_served_with_ngram_speculation_gives_the_greedy_text(model_factory, serve):
    """`minivllm serve --speculative-model ngram`: the OpenAI route returns what the engine without
    speculation computes, streamed deltas included."""
    import json
    import os

    import httpx

    from minivllm import LLM

    path = model_factory("tiny-llama")
    url = serve(path, "--speculative-model", "ngram", "--num-speculative-tokens", "3", "--no-speculative-adaptive")
    prompt = "import os\nimport sys\nimport os\nimport"
    want = LLM(path, num_kv_blocks=64).generate([prompt], SamplingParams(temperature=0.0, max_tokens=64),
                                                  use_tqdm=False)[0].outputs[0].text
    body = {"model": os.path.basename(path), "prompt": prompt, "max_tokens": 64, "temperature": 0.0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks if json.loads(c)["choices"]) == want
    # vLLM's spec_decode counters, fed from the engine's stats (this model falls into loops within 64
    # tokens, where the proposals get accepted).
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for line in metrics.splitlines():
        if line.startswith("minivllm:spec_decode_") and "_total" in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0] + ("" if "position" not in name else name[name.index("position"):])
            values[key] = float(value)
    drafted = values["minivllm:spec_decode_num_draft_tokens_total"]
    accepted = values["minivllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted and values["minivllm:spec_decode_num_drafts_total"] > 0
    per_pos = [v for k, v in values.items() if "position" in k]
    assert len(per_pos) == 3 and sum(per_pos) == accepted


def test_proposer_cost_model_recovers_the_fixed_per_forward_and_per_row_cost():
    cost = ProposerCostModel()
    assert cost.fit() is None and cost.estimate(3, 3) == 0.0
    for forwards, rows in [(1, 1), (2, 2), (3, 3), (4, 4), (1, 8), (2, 16), (3, 24), (4, 32), (2, 5), (5, 9)]:
        cost.observe(forwards, rows, 0.0005 + 0.00015 * forwards + 0.00001 * rows)
    assert cost.fit() == pytest.approx((0.0005, 0.00015, 0.00001))
    batch1 = ProposerCostModel()  # rows move with forwards: one term carries both, predictions still right
    for forwards in [1, 2, 3, 4, 5, 6, 1, 2]:
        batch1.observe(forwards, forwards, 0.0005 + 0.00016 * forwards)
    assert batch1.estimate(6, 6) == pytest.approx(0.0005 + 0.00016 * 6)
    same = ProposerCostModel()
    for _ in range(8):
        same.observe(3, 3, 0.002)
    assert same.fit() == pytest.approx((0.002, 0.0, 0.0))  # one kind of round: its cost as the fixed part


def test_rounds_of_one_sequence_price_a_row_beyond_one_a_forward_at_a_forwards_price():
    """Rounds of one sequence (rows == forwards, a draft at one stream) cannot tell a row's price from a forward's:
    fitted on them, an 8-sequence round came out at one sequence's price (the draft: 0.64 ms for a round that took
    1.5-1.7) and its proposals at 8 streams ran 0.89x plain. Until several sequences' rounds are seen, each row past one
    a forward costs a forward; then the fit prices rows by what they cost."""
    cost = ProposerCostModel()
    for forwards in [1, 2, 3, 4, 1, 2, 3, 4]:
        cost.observe(forwards, forwards, 0.0004 + 0.00005 * forwards)
    assert cost.estimate(4, 4) == pytest.approx(0.0006)
    assert cost.estimate(4, 32) == pytest.approx(0.0004 + 0.00005 * 32)  # the bound, not 0.6 ms
    for _ in range(ProposerCostModel.REFIT_EVERY):
        cost.observe(4, 32, 0.0006 + 0.00003 * 28)  # real 8-sequence rounds: 1.44 ms
    assert cost.estimate(4, 32) == pytest.approx(0.00144, rel=0.02)


def test_before_a_fit_a_round_is_priced_by_its_rows_at_the_cheapest_rows_seen():
    """Until the model is fitted (8 rounds), each row costs the lowest price per row a round has had: not nothing (a
    fresh engine's first rounds at 8 streams proposed everywhere), not a stall's price."""
    cost = ProposerCostModel()
    assert cost.estimate(4, 32) == 0.0  # nothing measured: try
    cost.observe(4, 4, 0.004)  # a batch-1 round of 4 forwards: 1 ms a row
    assert cost.estimate(4, 4) == pytest.approx(0.004) and cost.estimate(4, 32) == pytest.approx(0.032)
    cost.observe(2, 2, 0.5)  # a stall among the first rounds does not raise the price
    cost.observe(2, 2, 0.0016)  # a cheaper round lowers it
    assert cost.fit() is None and cost.estimate(1, 8) == pytest.approx(0.0064)


def test_one_stalled_round_does_not_price_every_round_after_it():
    """A round 4000x its usual cost (a one-off stall) is counted at OUTLIER x the estimate, so the estimate stays near
    the usual rounds' (unclipped, one in the window of 128 priced every round at ~30x); a sustained slowdown still
    moves the estimate to the new cost."""
    cost = ProposerCostModel()
    for _ in range(20):
        cost.observe(4, 4, 0.001)
    cost.observe(4, 4, 4.0)
    for _ in range(20):
        cost.observe(4, 4, 0.001)
    assert cost.estimate(4, 4) < 0.0012
    for _ in range(200):
        cost.observe(4, 4, 0.002)  # every round twice as slow from here
    assert cost.estimate(4, 4) == pytest.approx(0.002)


def test_step_cost_table_interpolates_between_kernel_shapes():
    table = StepCostTable()
    assert table.estimate(1) is None
    for seconds in (3.0, 3.1, 9.0, 2.9, 3.0):  # one outlier among five: the median ignores it
        table.observe(1, seconds)
    assert table.estimate(1) == 3.0 and table.estimate(4) is None  # one size: nothing to interpolate from
    table.observe(5, 4.0)
    table.observe(64, 20.0)
    assert table.estimate(3) == 4.0 and table.estimate(32) == 20.0  # priced at the next measured size up
    assert table.estimate(128) == pytest.approx(20.0 + 64 * 17.0 / 63)  # past the largest: the line from 1 to it
    assert table.measured(64) == 20.0 and table.measured(32) is None
    table.observe(6, 26.0)  # a slow outlier: 6 rows and 64 rows pooled (more rows never cost less)
    assert table.measured(6) == table.measured(64) == table.estimate(32) == 23.0
    assert table.measured(1) == 3.0 and table.estimate(3) == 4.0


def test_a_first_step_prices_its_size_less_the_set_up_measured_on_sizes_seen_twice():
    """A runner's first step of a size carries its set-up: the table prices the size by it less what first steps of
    the same shape class measured over their size's next step, never below a smaller size, until the size recurs."""
    table = StepCostTable()
    table.observe(20, 0.008, first=True)
    assert table.measured(20) == 0.008  # no set-up measured yet: priced whole
    table.observe(20, 0.005)
    assert table.measured(20) == 0.005 and table.setup(24) == pytest.approx(0.003)
    assert table.setup(4) == 0.0  # another shape class (a handful of rows: other kernels)
    table.observe(30, 0.010, first=True)
    assert list(table.samples[30]) == [pytest.approx(0.007)]
    table.observe(40, 0.0065, first=True)
    assert list(table.samples[40]) == [pytest.approx(0.005)]  # (0.0035 is under 20 rows' price: floored there)
    assert table.measured(30) == table.measured(40) == pytest.approx(0.006)  # (the monotone fit pools them)
    table.observe(30, 0.0071)
    assert list(table.samples[30]) == [0.0071] and table.setup(30) == pytest.approx(0.0030, abs=1e-4)
    table.observe(30, 0.009, first=True)  # (a first step where real ones priced the size: ignored)
    assert list(table.samples[30]) == [0.0071]


def _cost_ms(rows: int, handful_ms: float = 4.0) -> float:
    """A CPU-like step: one row 3 ms (a GEMV streaming the weights), 2-6 rows handful_ms, then a GEMM's
    2 ms + 0.25 ms per row."""
    return 3.0 if rows == 1 else handful_ms if rows <= 6 else 2.0 + 0.25 * rows


def _ngram_speculator() -> Speculator:
    return Speculator(NgramProposer(1, 3), k=3, max_model_len=1024, adaptive=True)


def _speculator(handful_ms: float = 4.0) -> Speculator:
    """A speculator that measured all-decode steps of many sizes at _cost_ms (and ignores prefill steps), past its
    first drafts (LEARN_DRAFTS)."""
    spec = _ngram_speculator()
    spec.stats.num_drafts = Speculator.LEARN_DRAFTS
    prefilling = Sequence("p", list(range(40)), SamplingParams(temperature=0.0), 0)
    for rows in [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 160, 256, 512]:
        spec.observe([(_seq(), 1)] * rows, _cost_ms(rows, handful_ms) / 1e3)
        spec.observe([(_seq(), 1)] * rows + [(prefilling, 40)], 1.0)  # a prefill step: not in the table
    return spec


def _seq(drafts: int = 0, accepted: int = 0, spec: Speculator | None = None) -> Sequence:
    """A greedy sequence whose past drafts (in spec's record) were each expected to yield 1.5 tokens."""
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0.0), 0)
    if spec is not None:
        spec.records[seq.seq_id] = SpecRecord(drafts, accepted, 1.5 * drafts)
    return seq


def test_a_runners_first_step_of_a_size_is_left_out_of_the_step_costs_and_the_payoff(model_factory):
    """The first forward over a number of tokens sets up that shape (oneDNN's primitives: 1.4-3.4 ms more than the
    next step of the size on the embedded model): the runner flags it; the speculator's table prices the size by it
    only until the size's next step (an overpriced size withholds proposals, an unpriced one would be priced along
    the small sizes' line), and its payoff leaves it out."""
    engine = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), speculative_model="ngram",
                                  num_speculative_tokens=2, speculative_adaptive=False))
    seen: list[tuple[int, bool]] = []
    observe = engine.speculator.observe

    def spy(scheduled: list[tuple[Sequence, int]], seconds: float, first: bool = False) -> None:
        seen.append((sum(n for _, n in scheduled), first))
        observe(scheduled, seconds, first)

    engine.speculator.observe = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8][i:]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    flagged = [t for t, first in seen if first]
    assert flagged and len(flagged) == len(set(flagged))  # each size at most once (start-up may have run some)
    assert all(seen.index((t, True)) == [s for s, _ in seen].index(t) for t in flagged)  # and at its first step
    decode = seen[1:]  # (the first step prefills all three prompts: 21 tokens, no decode step as large)
    assert all(t < 21 for t, _ in decode)
    table = engine.speculator.steps
    counts = {t: sum(1 for s, first in decode if s == t and not first) for t, _ in decode}
    assert any(c and (t, True) in decode for t, c in counts.items())  # a size flagged once, then measured
    # a flagged step prices its size until the size's next step replaces it
    assert {t: len(table.samples[t]) for t in counts} == {t: min(c, table.keep) or 1 for t, c in counts.items()}
    spec = _ngram_speculator()
    spec.observe([(_seq(), 1)] * 4, 0.009, first=True)
    assert spec.steps.measured(4) == 0.009 and spec.payoff.rates == {}
    spec.observe([(_seq(), 1)] * 4, 0.003)
    spec.observe([(_seq(), 1)] * 4, 0.004)
    assert spec.steps.measured(4) == 0.0035


def test_adaptive_speculation_pays_at_batch_one_not_in_a_large_batch_nor_for_a_failing_request():
    cold = _ngram_speculator()
    assert cold.worth([(_seq(), 3)], 1, True) == []  # nothing measured: the plain decode step first
    cold.observe([(_seq(), 1)], 0.003)
    assert [k for _, k in cold.worth([(_seq(), 3)], 1, True)] == [1]  # a size never measured: try it
    spec = _speculator()
    assert spec.steps.estimate(40) == pytest.approx(_cost_ms(64) / 1e3)  # next size up; prefill steps left out
    one = [(_seq(), 3)]
    assert spec.worth(one, 1, True) == one  # batch 1: 1 token in 3 ms vs ~2.5 tokens in 4 ms
    many = [(_seq(), 3) for _ in range(128)]
    assert spec.worth(many, 128, True) == []  # 128 tokens in 34 ms vs ~320 in 130 ms
    assert spec.worth([(_seq(20, 0, spec), 3)], 1, True) == []  # its proposals never held
    good = [(_seq(20, 57, spec), 3)]
    assert spec.worth(good, 1, True) == good
    failing = [(_seq(20, 0, spec), 3)]
    for _ in range(40):  # withheld step after step, it forgets its record and gets to propose again
        spec.forget_withheld(failing, spec.worth(failing, 1, True))
    assert spec.worth(failing, 1, True) == failing
    assert spec.worth(one, 16, False) == []  # a step with prefill chunks: no proposals
    assert _speculator(handful_ms=12.0).worth([(_seq(), 1)], 1, True) == []  # 1 token in 3 ms beats 1.5 in 12
    # Withheld long enough (at that batch size), the best proposal's first token goes through once: a bad measurement
    # cannot stick forever.
    spec.exploration.clock(128).steps = Exploration.EXPLORE_EVERY
    assert spec.worth(many, 128, True) == [(many[0][0], 1)]


def test_lookup_rounds_are_priced_as_measured_per_sequence():
    """n-gram and suffix rounds cost their lookups, measured per sequence looked up (the median of recent rounds, so
    one stalled round is not the price), and the adaptive rule weighs them: priced at nothing, n-gram lookups were
    ~0.5 ms of a 2.5 ms step at 8 streams (2026-12-06)."""
    cost = LookupCost()
    assert cost.estimate(8) == 0.0  # nothing measured yet
    for _ in range(20):
        cost.observe(4, 4 * 20e-6)
    cost.observe(4, 0.2)  # a collection in one round
    assert cost.estimate(8) == pytest.approx(8 * 20e-6)
    cost.observe(0, 1.0)  # a round with nothing to look up says nothing
    assert cost.estimate(1) == pytest.approx(20e-6)
    ngram = NgramProposer(1, 3)
    batch = [(Sequence("r", list(range(50)) * 4, SamplingParams(temperature=0.0), 0), 3) for _ in range(4)]
    assert len(ngram.propose(batch)) == 4
    assert 0 < ngram.overhead(3, 12, 4) == pytest.approx(4 * ngram.overhead(3, 3, 1))
    spec = _speculator()
    one = [(_seq(), 3)]
    assert spec.worth(one, 1, True) == one  # 1 token in 3 ms against ~2.5 in 4 ms
    spec.proposer.cost.per_seq = 0.004  # a lookup of 4 ms: ~2.5 tokens in 8 ms
    assert spec.worth(one, 1, True) == []
    spec.proposer.cost.per_seq = 0.0005
    assert spec.worth(one, 1, True) == one


def test_learning_and_explorations_force_a_proposal_only_where_the_proposer_need_not_catch_up():
    """A proposal its costs did not choose (the first drafts' learning, an exploration) goes only to a sequence the
    proposer has kept up with: a draft's catch-up on a paused sequence (5-8 ms of prefill) cost it 2-4% at 8 streams.
    With none such, nothing is forced, the "no" holds, and a due exploration's wait doubles as if it found nothing."""
    spec = _speculator()
    behind = [_seq() for _ in range(127)]
    kept_up = _seq()
    spec.proposer.catch_up_cost = lambda seq: 0.0 if seq is kept_up else 0.0005  # type: ignore[method-assign]
    spec.stats.num_drafts = 0  # learning: the first drafts
    assert spec.worth([(s, 3) for s in behind] + [(kept_up, 3)], 128, True) == [(kept_up, 3)]
    assert spec.worth([(s, 3) for s in behind], 128, True) == []
    assert not spec._may_pay(128, True)  # (held: the next steps skip the check)
    spec.stats.num_drafts = Speculator.LEARN_DRAFTS
    spec._step += Speculator.RECHECK_EVERY
    clock = spec.exploration.clock(128)
    clock.steps = clock.wait  # an exploration is due at 128 sequences
    assert spec.worth([(s, 3) for s in behind] + [(kept_up, 3)], 128, True) == [(kept_up, 1)]
    assert spec.worth([(s, 3) for s in behind], 128, True) == []
    assert clock.wait == 2 * Exploration.EXPLORE_EVERY and clock.last == clock.steps
    assert not spec.exploration.due(128)


def test_a_fresh_speculator_learns_its_acceptance_from_whole_proposals_before_judging_by_it():
    """Until LEARN_DRAFTS drafts were verified, a step whose proposals are not expected to pay (even odds per
    position, lookups priced) still verifies the best candidate's whole proposal, so the acceptance by position is
    measured; then the rule judges by it. An engine that met 8 streams first otherwise never proposed there."""
    spec = _speculator()
    spec.stats.num_drafts = 0
    many = [(_seq(), 3) for _ in range(128)]
    assert spec._may_pay(128, True)
    assert spec.worth(many, 128, True) == [(many[0][0], 3)]  # every position of one candidate
    spec.stats.num_drafts = Speculator.LEARN_DRAFTS
    assert spec.worth(many, 128, True) == []  # 128 tokens in 34 ms vs ~320 in 130 ms
    assert spec.worth(many, 16, False) == []  # (a step with prefill chunks: never)


def test_proposals_stop_where_their_measured_payoff_loses():
    # The cost model predicts from forward times; the whole steps' realized yield has the last word: where steps of
    # a size yielded fewer tokens per second with proposals than without, that size stops proposing (others keep on,
    # and exploration still lets one through now and then).
    spec = _speculator()
    one = [(_seq(), 3)]
    assert spec.worth(one, 1, True) == one
    for _ in range(spec.payoff.MIN_SAMPLES - 1):
        spec.payoff.observe(1, True, 2, 0.010)  # 200 tokens/s with proposals
        spec.payoff.observe(1, False, 1, 0.004)  # 250 without
    assert spec.worth(one, 1, True) == one  # too few steps for a verdict
    spec.payoff.observe(1, True, 2, 0.010)
    spec.payoff.observe(1, False, 1, 0.004)
    assert spec.payoff.loses(1) and spec.worth(one, 1, True) == []
    assert not spec.payoff.loses(2) and spec.worth([(_seq(), 3)] * 2, 2, True)  # another size is unaffected
    spec.exploration.clock(1).steps = Exploration.EXPLORE_EVERY  # withheld long enough: exploration re-measures
    assert spec.worth(one, 1, True)
    for _ in range(spec.payoff.WINDOW):
        spec.payoff.observe(1, True, 3, 0.008)  # 375 tokens/s: now they pay
    assert not spec.payoff.loses(1)


def test_a_no_from_the_cheap_check_holds_until_a_step_speculates_or_a_recheck_is_due(monkeypatch):
    """Proposals that cannot pay at a batch size are not re-priced every step (the check is 2% of an 8-stream
    step): the "no" holds RECHECK_EVERY steps, or until some step speculated (what it weighs changed)."""
    spec = _speculator()
    priced = []
    estimate = spec.steps.estimate
    monkeypatch.setattr(spec.steps, "estimate", lambda rows: priced.append(rows) or estimate(rows))
    assert not spec._may_pay(128, True)  # 128 tokens in 34 ms: no proposal length pays
    first = len(priced)
    assert first > 0
    for _ in range(spec.RECHECK_EVERY - 1):
        spec._step += 1
        assert not spec._may_pay(128, True)
    assert len(priced) == first  # held
    assert spec._may_pay(1, True)  # another size is priced afresh (and pays at batch 1)
    spec._step += 1
    priced.clear()
    assert not spec._may_pay(128, True) and priced  # RECHECK_EVERY steps later: priced again
    priced.clear()
    spec._version += 1  # a step speculated: the acceptance or the proposer's cost moved
    assert not spec._may_pay(128, True) and priced
    spec.exploration.clock(128).steps += Exploration.EXPLORE_EVERY
    assert spec._may_pay(128, True)  # exploration is never held back


def test_a_held_no_sits_out_its_steps_and_rechecks_ever_more_rarely(monkeypatch):
    """Where proposals do not pay at a batch size, the speculator sits its steps out (the hooks' Python runs on cold
    caches after a forward: 45 us a step of the attached draft at 8 streams, where it proposed nothing): no check and
    no payoff; the last few before a recheck price the size for it. A recheck that finds "no" again holds twice as
    long (up to RECHECK_MAX); worth's "no" (which weighs catch-ups) holds as the cheap check's does, unless a
    sequence's record gave it; a sequence leaving the batch ends the holds."""
    spec = _speculator()
    running = [_seq() for _ in range(128)]
    for seq in running:
        seq.num_computed_tokens = seq.num_tokens - 1  # decoding
    checks: list[int] = []
    may_pay = spec._may_pay
    monkeypatch.setattr(spec, "_may_pay", lambda n, pure: checks.append(spec._step) or may_pay(n, pure))
    paid: list[int] = []
    observe = spec.payoff.observe
    monkeypatch.setattr(spec.payoff, "observe", lambda *a: paid.append(spec._step) or observe(*a))

    def run(steps: int) -> None:
        for _ in range(steps):
            assert spec.propose(running) == []
            spec.observe([(s, 1) for s in running], 0.034 + spec._step * 1e-7)  # (each step's own time)
            spec.end_step()

    first = spec._step + 1
    run(Exploration.EXPLORE_EVERY - 1)
    spans = [b - a for a, b in zip(checks, checks[1:], strict=False)]
    assert checks[0] == first and spans == [16, 32, 64]  # rechecked after 16, 32, 64 steps
    last = checks[-1]  # the table priced it by the steps just before it (and itself), fresh for the recheck
    assert list(spec.steps.samples[128]) == [0.034 + (last - i) * 1e-7 for i in range(4, -1, -1)]
    assert paid == [c + 1 for c in checks]  # the payoff measured only the steps that checked (closed at the next)
    spec.release(running[0])  # the batch changed: held no more, and the next "no" holds 16 steps again
    checks.clear()
    run(20)
    assert checks == [checks[0], checks[0] + 16]
    # worth's "no" holds too: here nothing is held by the cheap check (a catch-up makes every proposal too dear)
    fresh = _speculator()
    fresh.proposer.catch_up_cost = lambda seq: 1.0  # type: ignore[method-assign]
    one = [(_seq(), 3)]
    assert fresh._may_pay(1, True) and fresh.worth(one, 1, True) == []
    assert fresh._held(1) and not fresh._may_pay(1, True)
    poor = _speculator()  # a "no" its record gave is not held: withheld, the record forgets a little every step
    bad = _seq(drafts=8, accepted=0, spec=poor)
    assert poor.worth([(bad, 3)], 1, True) == [] and not poor._held(1)


def test_explorations_that_find_nothing_come_ever_more_rarely_until_proposals_pay_again():
    """An exploration costs a draft a catch-up on all it skipped: where proposals keep not paying (128 sequences here)
    the wait for the next one doubles up to EXPLORE_MAX; a step of that size that speculates on its merits resets it,
    one of another size does not (the speculation bench's 1-stream runs, where the draft pays every step, had the
    8-stream runs between them explore once each)."""
    spec = _speculator()
    many = [(_seq(), 3) for _ in range(128)]

    def steps_to_next_exploration() -> int:
        for n in range(1, 4 * Exploration.EXPLORE_MAX):
            spec._step += 1
            spec.exploration.tick(128)
            if spec._may_pay(128, True) and spec.worth(many, 128, True):
                spec._speculated_at(128, spec.exploration.due(128))
                return n
        raise AssertionError("never explored")

    every, most = Exploration.EXPLORE_EVERY, Exploration.EXPLORE_MAX
    waits = [steps_to_next_exploration() for _ in range(5)]
    assert waits == [every, 2 * every, 4 * every, most, most]
    for _ in range(3):  # proposals that pay at batch 1, between: the wait at 128 holds
        spec._step += 1
        spec.exploration.tick(1)
        spec._speculated_at(1, spec.exploration.due(1))
    assert steps_to_next_exploration() == most
    spec._step += 1
    spec.exploration.tick(128)
    spec._speculated_at(128, False)  # a step of 128 that speculated on its merits: the wait starts over
    assert steps_to_next_exploration() == every


def test_payoff_counts_whole_steps_in_the_engine(model_factory):
    """The speculator measures each pure-decode step's tokens and wall time, by kind, in a real engine."""
    path = model_factory("tiny-llama")
    eng = LLMEngine(EngineArgs(model=path, num_kv_blocks=512, speculative_model="ngram", num_speculative_tokens=3))
    spec = eng.speculator
    assert spec is not None
    prompt = [5, 6, 7, 8] * 12  # repetitive: n-gram proposals
    for i in range(2):
        eng.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=60,
                                                                              ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    rates = spec.payoff.rates  # (each size's first step left out: its set-up, not its rate)
    assert rates and all(size in (1, 2) for size, _ in rates)
    assert sum(len(d) for d in rates.values()) >= 10 and all(r > 0 for d in rates.values() for r in d)


def test_adaptive_proposal_length_follows_the_acceptance_by_position():
    """Each row costs 0.6 ms more: a draft whose later guesses rarely hold proposes one token, a proposer
    whose guesses keep holding proposes all k."""
    def speculator(accepted: list[int], proposed: list[int]) -> Speculator:
        spec = _ngram_speculator()
        for rows in (1, 2, 3, 4):
            spec.observe([(_seq(), 1)] * rows, (3.0 + 0.6 * (rows - 1)) / 1e3)
        spec.stats.accepted_per_position, spec.stats.proposed_per_position = accepted, proposed
        return spec

    seq = _seq()
    draft = speculator([50, 10, 5], [100, 60, 40])  # 50%, then 17% and 12%
    assert draft.worth([(seq, 3)], 1, True) == [(seq, 1)]  # 1.5 tokens in 3.6 ms; 1.67 in 4.2; 1.8 in 4.8
    ngram = speculator([90, 80, 70], [100, 90, 80])
    assert ngram.worth([(seq, 3)], 1, True) == [(seq, 3)]
    assert ngram.position_rates()[:2] == pytest.approx([91 / 102, 81 / 92])  # Laplace-smoothed per position


def test_adaptive_speculation_stays_lossless_in_the_engine(model_factory):
    """With the cost model deciding per step and request, greedy outputs are still exactly the target's."""
    path = model_factory("tiny-llama")
    base = LLMEngine(EngineArgs(model=path, num_kv_blocks=512))
    text = corpus_token_ids(base.tokenizer, 300)
    prompts = [text[:30] + text[7 * i: 7 * i + 10] + text[:15] for i in range(12)]
    want = _run(base, prompts)
    engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=512, check_invariants=True, speculative_model="ngram",
                                  num_speculative_tokens=3, speculative_adaptive=True))
    got = _run(engine, prompts)
    greedy = [str(i) for i in range(12) if _params(i).greedy]
    assert {r: got[r] for r in greedy} == {r: want[r] for r in greedy}
    assert len(engine.speculator.steps.samples) >= 2  # it measured steps and decided from them


def test_a_catch_up_is_priced_over_the_steps_a_sequence_has_left(monkeypatch):
    """A draft that has not seen a sequence catches up on its prompt and output so far before proposing: a one-off
    that pays over the steps the sequence has left, not near its end (at the tail of a 64-sequence batch, rounds for
    28-49 such sequences cost 25-53 ms each of a 1.3 s run)."""
    spec = _speculator()
    fresh = Sequence("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200), 0)
    ending = Sequence("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), 0)
    assert spec.worth([(fresh, 3)], 1, True) == [(fresh, 3)]
    assert spec.worth([(ending, 2)], 1, True) == [(ending, 2)]  # n-gram: nothing to catch up on
    monkeypatch.setattr(spec.proposer, "catch_up_cost", lambda seq: 0.020)  # a prompt through a draft: 20 ms
    assert spec.worth([(fresh, 3)], 1, True) == [(fresh, 3)]  # 20 ms over its ~80 steps: 0.25 ms a step
    assert spec.worth([(ending, 2)], 1, True) == []  # 20 ms over 1.5 steps for ~1 token of 3 ms
    assert spec.worth([(ending, 2), (fresh, 3)], 2, True) == [(fresh, 3)]  # each candidate priced on its own


def test_the_draft_prices_a_catch_up_by_its_tokens():
    """The draft measures what a token of a long catch-up costs (rounds with a prompt in them), and prices a sequence it
    has not seen at its tokens; one it keeps up with costs nothing to catch up."""
    eng = LLMEngine(EngineArgs(num_kv_blocks=256, speculative_model="default-draft", num_speculative_tokens=3))
    spec = eng.speculator
    assert spec is not None
    draft = spec.proposer
    assert isinstance(draft, DraftModelProposer)
    assert draft.catch_up_cost(Sequence("x", list(range(40)), SamplingParams(), 0)) == 0.0  # nothing measured yet
    eng.add_request("r", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        seen += [draft.catch_up_cost(s) for s in eng.scheduler.running]
    assert draft.catch_up_price > 0
    assert seen and min(seen) == 0.0  # the running request, caught up round by round
    unseen = Sequence("x", list(range(40)), SamplingParams(), 0)
    assert draft.catch_up_cost(unseen) == pytest.approx(40 * draft.catch_up_price)
    assert draft.catch_up_cost(Sequence("y", [1, 2], SamplingParams(), 0)) == 0.0  # a round's usual catch-up
