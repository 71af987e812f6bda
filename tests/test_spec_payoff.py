"""Speculation's payoff (spec_decode/cost.py's Payoff, fed by the speculator): plain steps measured where proposals
run every step, a round after a pause counted at the proposer's usual time, and proposals counted at the tokens they
were expected to yield."""

from __future__ import annotations

import time

from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.cost import Payoff
from tests.conftest import PROMPTS


def test_a_size_that_speculates_still_measures_plain_steps():
    """Where proposals are predicted to pay every step, the plain rate they must beat is still measured: every
    FIRST_EVERY-th step goes plain until MIN_SAMPLES plain ones were seen, then one in every PLAIN_EVERY (before, a
    batch-1 engine measured one plain step, its first, and the payoff verdict never came)."""
    pay = Payoff()
    assert not pay.wants_plain(1)  # never speculated: nothing to compare
    for _ in range(pay.MIN_SAMPLES):
        for _ in range(pay.FIRST_EVERY - 1):
            assert not pay.wants_plain(1)
            pay.observe(1, True, 3, 0.01)
        assert pay.wants_plain(1) and not pay.wants_plain(2)
        pay.observe(1, False, 1, 0.005)
    for _ in range(pay.PLAIN_EVERY - 1):
        assert not pay.wants_plain(1)
        pay.observe(1, True, 3, 0.01)
    assert pay.wants_plain(1)
    pay.observe(1, False, 1, 0.005)
    assert not pay.wants_plain(1)


def test_a_speculating_engine_measures_its_plain_rate_too():
    """A batch-1 engine whose draft's proposals are predicted to pay every step still runs the plain steps that give
    the payoff its verdict (before: one plain step, the first, then every step speculated)."""
    eng = LLMEngine(EngineArgs(num_kv_blocks=512, speculative_model="default-draft", num_speculative_tokens=4))
    spec = eng.speculator
    assert spec is not None
    code = PROMPTS[1] + "    def size(self):\n        return len(self.x)\n"
    prompt = code + "\n\n# The same code again, unchanged:\n" + code[:30]  # (the embedded model copies it)
    rates = spec.payoff.rates
    # Whether the draft's proposals are predicted to pay comes from measured times: on a busy machine a first round
    # can be measured slow enough that one request speculates once (a full suite run, once). The premise is the
    # engine speculating step after step, so the same request goes again (the engine keeps what it measured) until
    # it has.
    for i in range(3):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        if len(rates.get((1, True), ())) >= 8:
            break
    assert len(rates[(1, True)]) >= 8 and len(rates[(1, False)]) >= spec.payoff.MIN_SAMPLES


def test_payoff_counts_the_tokens_proposals_were_expected_to_yield(model_factory):
    """A step with proposals enters the payoff at the tokens its proposals were expected to yield (1 + each proposal's
    chance, at most 1), not at those the target accepted: the verdict judges the cost model, the records judge each
    sequence's guesses."""
    path = model_factory("tiny-llama")
    eng = LLMEngine(EngineArgs(model=path, num_kv_blocks=512, speculative_model="ngram", num_speculative_tokens=3))
    spec = eng.speculator
    assert spec is not None
    seen: list[tuple[bool, float, int]] = []  # (speculated, tokens counted, tokens the step made)
    observe = spec.payoff.observe
    spec.payoff.observe = lambda n, s, t, sec: seen.append((s, t, spec._tokens or 0)) or observe(n, s, t, sec)
    eng.add_request("r", {"prompt_token_ids": [5, 6, 7, 8] * 12}, SamplingParams(temperature=0.0, max_tokens=60,
                                                                                  ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    speculated = [(t, made) for s, t, made in seen if s]
    assert speculated and all(1 < t <= 4 for t, _ in speculated)  # (1 + each proposal's chance, at most 1 each)
    assert any(t != made for t, made in speculated)
    assert all(t == made for s, t, made in seen if not s)


def test_payoff_counts_a_round_after_a_pause_at_the_proposers_usual_time(model_factory):
    """A round right after a pause (a draft catching up on it) counts in the payoff at the proposer's usual round time,
    not at what it took: here such a round is made to take 50 ms longer, and no step's counted time holds it."""
    path = model_factory("tiny-llama")
    eng = LLMEngine(EngineArgs(model=path, num_kv_blocks=512, speculative_model="ngram", num_speculative_tokens=3))
    spec = eng.speculator
    assert spec is not None
    propose, slowed = spec.proposer.propose, []

    def slow_after_a_pause(batch):
        if spec._step - spec._last_spec > 2:
            slowed.append(spec._step)
            time.sleep(0.05)
        return propose(batch)

    spec.proposer.propose = slow_after_a_pause
    counted: list[float] = []
    observe = spec.payoff.observe
    spec.payoff.observe = lambda n, s, t, sec: counted.append(sec) or observe(n, s, t, sec)
    eng.add_request("r", {"prompt_token_ids": [5, 6, 7, 8] * 12}, SamplingParams(temperature=0.0, max_tokens=40,
                                                                                  ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert slowed and counted and max(counted) < 0.05
