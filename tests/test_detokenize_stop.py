"""Incremental detokenization and stops on real multi-byte output (CJK, emoji), through the engine."""

from __future__ import annotations

import pytest
from conftest import make_scripted_model
from transformers import AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.engine.output_processor import IncrementalDetokenizer
from minivllm.sampling_params import RequestOutputKind

SCRIPT = "猫😀 ok 世"  # 13 distinct byte-level tokens: the emoji alone spans 4
PROMPT = "x ="


@pytest.fixture(scope="module")
def scripted(model_factory, tmp_path_factory):
    base = model_factory("tiny-llama")
    tok = AutoTokenizer.from_pretrained(base)
    prompt_ids = tok.encode(PROMPT)
    chain = [prompt_ids[-1], *tok.encode(SCRIPT, add_special_tokens=False), tok.eos_token_id]
    path = make_scripted_model(base, str(tmp_path_factory.mktemp("scripted") / "m"), chain)
    return path, tok, chain


@pytest.fixture(scope="module")
def llm(scripted):
    return LLM(scripted[0], num_kv_blocks=32, check_invariants=True)


def _stream(llm: LLM, params: SamplingParams) -> tuple[list[str], object, object]:
    """Run one request with DELTA outputs (the streaming path) and once through generate(); return the
    text deltas, the final completion and the last streamed output."""
    engine = llm.llm_engine
    engine.add_request("stream", PROMPT, params.clone(output_kind=RequestOutputKind.DELTA))
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            last = out
    final = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    return deltas, final, last


def test_script_decodes_to_cjk_and_emoji(scripted, llm):
    _, tok, chain = scripted
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == chain[1:] and out.finish_reason == "stop"  # stopped by EOS
    assert out.text == SCRIPT == tok.decode(out.token_ids, skip_special_tokens=True)


def test_streamed_deltas_concatenate_and_never_split_a_character(scripted, llm):
    chain = scripted[2]
    deltas, final, _ = _stream(llm, SamplingParams(temperature=0, max_tokens=30))
    assert "".join(deltas) == final.text == SCRIPT
    assert all("\ufffd" not in d for d in deltas)
    assert len([d for d in deltas if d]) < len(chain) - 1  # partial UTF-8 bytes produced no text


@pytest.mark.parametrize(("stop", "include", "text"), [
    ("ok", False, "猫😀 "),  # "o" and "k" are two tokens
    ("ok", True, "猫😀 ok"),
    ("😀 o", False, "猫"),  # emoji bytes + space + "o" across five tokens
    ("世", False, "猫😀 ok "),  # a multi-byte character as the stop
])
def test_stop_string_across_tokens_is_caught_and_never_leaks(llm, stop, include, text):
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=include)
    deltas, final, last = _stream(llm, params)
    assert final.text == text and final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(deltas) == text
    if not include:
        assert all(stop not in d for d in deltas)
        assert stop not in "".join(deltas)
    assert last.finished


def test_stop_token_id_and_special_tokens(scripted, llm):
    _, tok, chain = scripted
    k_token = next(t for t in chain[1:-1] if tok.decode([t]) == "k")
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[k_token])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    # As vLLM: the stopping token is in token_ids but adds no text unless include_stop_str_in_output.
    assert out.stop_reason == k_token and out.token_ids[-1] == k_token and out.text == "猫😀 o"
    kept = llm.generate([PROMPT], params.clone(include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == "猫😀 ok"
    raw = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, skip_special_tokens=False,
                                                include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert raw.text == SCRIPT + tok.eos_token
    capped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 5
    ignored = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == 20 and ignored.finish_reason == "length"


@pytest.mark.parametrize("text", ["你好，世界！", "emoji 😀🎉🚀 mixed 中文 text", "plain ascii", "éàü ñ ß"])
def test_incremental_detokenizer_equals_full_decode(model_factory, text):
    tok = AutoTokenizer.from_pretrained(model_factory("tiny-qwen2"))
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, tok.encode("prefix"), True, None, False)
    pieces = []
    for t in ids:
        det.append(t)
        pieces.append(det.delta(finished=False))
    assert "".join(pieces) == det.text == tok.decode(ids) == text
