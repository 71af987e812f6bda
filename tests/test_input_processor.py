"""The one input processor every front end uses (engine/input_processor.py): the offline and the serving rules
for max_tokens, and errors that name the problem."""

from __future__ import annotations

import re

import pytest

from minivllm.config import EngineArgs
from minivllm.engine.input_processor import RequestSpec
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def processor(model_factory):
    return LLMEngine(EngineArgs(model=model_factory("tiny-llama"), max_model_len=64, num_kv_blocks=32)).input_processor


UNSET = SamplingParams(max_tokens=None)


def test_offline_fills_max_tokens_to_the_end_of_the_context(processor):
    req = processor.process("a", [5] * 60, RequestSpec(UNSET))
    assert req.params.max_tokens == 4 and req.prompt is None and req.prompt_token_ids == [5] * 60
    # the engine stops at the context end
    assert processor.process("b", [5] * 64, RequestSpec(UNSET)).params.max_tokens == 1
    assert processor.process("c", [5] * 10, RequestSpec(SamplingParams(max_tokens=500))).params.max_tokens == 500


def test_serving_rule_fits_the_context(processor):
    assert processor.process("a", [5] * 60, RequestSpec(UNSET, fit_context=True)).params.max_tokens == 4
    fit16 = RequestSpec(UNSET, fit_context=True, default_max_tokens=16)
    assert processor.process("b", [5] * 10, fit16).params.max_tokens == 16
    assert processor.process("c", [5] * 60, fit16).params.max_tokens == 4
    with pytest.raises(ValueError, match="prompt: 64 tokens leave no room to generate within max_model_len 64"):
        processor.process("d", [5] * 64, RequestSpec(UNSET, fit_context=True))
    with pytest.raises(ValueError, match="max_tokens: the prompt has 10 tokens and max_tokens is 55, together over "
                                         "max_model_len 64"):
        processor.process("e", [5] * 10, RequestSpec(SamplingParams(max_tokens=55), fit_context=True))


@pytest.mark.parametrize("fit", [False, True])
def test_bad_prompts_name_the_problem(processor, fit):
    with pytest.raises(ValueError, match="prompt: 65 tokens exceed max_model_len 64; shorten the prompt"):
        processor.process("a", [5] * 65, RequestSpec(fit_context=fit))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, \d+\); position 1 holds -3"):
        processor.process("b", [5, -3], RequestSpec(fit_context=fit))
    with pytest.raises(ValueError, match="the prompt is empty"):
        processor.process("c", "", RequestSpec(fit_context=fit))
    with pytest.raises(ValueError, match="a dict prompt needs 'prompt' or 'prompt_token_ids'"):
        processor.process("d", {"text": "x"}, RequestSpec(fit_context=fit))


BAD_IDS = [([5, 1.0, 7], "position 1 holds 1.0"), ([5, 6, True], "position 2 holds True"),
           ([5, "7"], "position 1 holds '7'"), ([5] * 40 + [2**70], "position 40"),
           ([5] * 40 + [10**6], "position 40 holds 1000000"), ([None], "holds None")]


@pytest.mark.parametrize(("ids", "bad"), BAD_IDS)
def test_token_id_prompts_are_checked_whole_and_name_the_culprit(processor, ids, bad):
    """Issue 33, item 10: the check runs in C over the whole list (types, then min and max); a bad list is then
    walked once to name the first bad position."""
    with pytest.raises(ValueError, match=re.escape(bad)):
        processor.process("a", ids, RequestSpec())


def test_large_token_id_prompts_are_prepared_off_the_event_loop():
    """A token-id prompt counts its ids (it counted as 64 whatever its length): a long one is prepared on a worker
    thread, as long text is."""
    from minivllm.entrypoints.serving import _INLINE_TOKENIZE_CHARS, _prompt_size

    assert _prompt_size([1] * 50_000) == 50_000 > _INLINE_TOKENIZE_CHARS
    assert _prompt_size({"prompt_token_ids": [1] * 9000}) == 9000 and _prompt_size("abc") == 3
