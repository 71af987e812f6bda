"""Guided decoding in the engine (structured_output/manager.py on llguidance): sampled outputs follow their JSON
schema, regex, choices or grammar every time; with n > 1, prefix caching, preemption and speculative decoding;
other rows of the batch are untouched; bad constraints are ValueErrors naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import PROMPTS, noisy_copy

from minivllm import LLM, GuidedDecodingParams, SamplingParams
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                   "geo": {"type": "array", "items": {"type": "integer", "minimum": -180,
                                                                      "maximum": 180}, "minItems": 2, "maxItems": 2}},
                    "required": ["city", "zip", "geo"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9] [a-z]{1,8}@[a-z]{1,8}\.(com|org)"
CHOICES = ["positive", "negative", "neutral", "mixed"]
GBNF = 'root ::= "SELECT " cols " FROM " table\ncols ::= col | col ", " cols\ncol ::= "id" | "name" | "age"\n' \
       'table ::= [a-z]{1,6}'
LARK = 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]{1,3}/'


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("tiny-llama"), num_kv_blocks=512, check_invariants=True)


def _samples(llm, guided, count, max_tokens=160, prompts=PROMPTS):
    """count completions at temperature 1.0 (n = 8 per prompt, seeded)."""
    n = 8
    params = [SamplingParams(temperature=1.0, n=n, seed=100 + i, max_tokens=max_tokens, guided_decoding=guided)
              for i in range(count // n)]
    outs = llm.generate([prompts[i % len(prompts)] for i in range(count // n)], params, use_tqdm=False)
    found = [c for o in outs for c in o.outputs]
    assert len(found) == count
    return found


def test_json_schema_200_samples_all_parse_and_validate(llm):
    outs = _samples(llm, GuidedDecodingParams(json=SCHEMA), 200, max_tokens=200)
    assert {c.finish_reason for c in outs} == {"stop"}  # the grammar completed every time
    for c in outs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in outs}) > 150  # real samples, not one answer repeated
    assert llm.llm_engine.block_manager.num_used == 0 and llm.llm_engine.structured.num_live == 0


def test_regex_choice_and_grammars_200_samples(llm):
    for c in _samples(llm, GuidedDecodingParams(regex=REGEX), 200):
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c.text
    texts = [c.text for c in _samples(llm, GuidedDecodingParams(choice=CHOICES), 200)]
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1
    sql = re.compile(r"SELECT (id|name|age)(, (id|name|age))* FROM [a-z]{1,6}")
    for c in _samples(llm, GuidedDecodingParams(grammar=GBNF), 40, max_tokens=60):
        assert sql.fullmatch(c.text) or c.finish_reason == "length", c.text  # a column list may run on
    for c in _samples(llm, GuidedDecodingParams(grammar=LARK), 40, max_tokens=60):
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", c.text) or c.finish_reason == "length", c.text


def test_json_object_and_whitespace_pattern(llm):
    for c in _samples(llm, GuidedDecodingParams(json_object=True), 16, max_tokens=120):
        assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict)
    ws = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                    "additionalProperties": False}, whitespace_pattern=r"[ ]{0,2}")
    for c in _samples(llm, ws, 16, max_tokens=60):
        assert json.loads(c.text).keys() == {"a"}


def test_guided_rows_leave_the_other_rows_alone(llm):
    """Greedy unguided requests give the same tokens alone and batched with guided ones; a greedy guided request
    gives the same answer alone and batched (its mask is its own row's)."""
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    guided = SamplingParams(temperature=0.0, max_tokens=60, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], plain, use_tqdm=False)]
    alone_guided = llm.generate(PROMPTS[3], guided, use_tqdm=False)[0].outputs[0].text
    mixed = llm.generate(PROMPTS[:4], [plain, plain, plain, guided], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert mixed[3].outputs[0].text == alone_guided


def test_prefix_cache_hits_and_preemption_keep_outputs_valid(model_factory):
    """A pool small enough to preempt (recompute keeps each sequence's matcher, as its tokens are kept), prefix
    hits on a shared prompt; every answer still validates and greedy ones equal the roomy engine's."""
    path = model_factory("tiny-llama")
    shared = PROMPTS[1] * 3
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=120,
                             guided_decoding=GuidedDecodingParams(json=SCHEMA)) for i in range(12)]
    roomy = LLM(path, num_kv_blocks=512).generate([shared] * 12, params, use_tqdm=False)
    tight = LLM(path, num_kv_blocks=40, block_size=8, max_num_batched_tokens=64, check_invariants=True)
    got = tight.generate([shared] * 12, params, use_tqdm=False)
    eng = tight.llm_engine
    assert eng.scheduler.stats.num_preemptions > 0 and eng.scheduler.stats.prefix_cache_hits > 0
    for want, out, p in zip(roomy, got, params, strict=True):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        if p.greedy:
            assert out.outputs[0].text == want.outputs[0].text
    assert eng.block_manager.num_used == 0 and eng.structured.num_live == 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_decoding_checks_drafts_against_the_grammar(model_factory, tmp_path, proposer):
    """Proposals the grammar refuses are cut before verification, the verified rows are masked per position:
    greedy guided outputs equal those without speculation, sampled ones validate, and drafts were accepted."""
    path = model_factory("tiny-llama")
    spec = "ngram" if proposer == "ngram" else noisy_copy(path, str(tmp_path / "draft"), 0.0)
    guided = GuidedDecodingParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=150, guided_decoding=guided)
              for i in range(8)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    want = LLM(path, num_kv_blocks=512).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, num_kv_blocks=512, check_invariants=True, speculative_model=spec, num_speculative_tokens=3,
              speculative_adaptive=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g, p in zip(want, got, params, strict=True):
        jsonschema.validate(json.loads(g.outputs[0].text), SCHEMA)
        if p.greedy:
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    st = llm.llm_engine.speculator.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0


def test_check_proposals_cuts_at_the_first_refused_token(llm):
    eng = llm.llm_engine
    eng.add_request("cut", "x", SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes"])))
    seq = eng.groups["cut"].seqs[0]
    tok = eng.tokenizer
    good = tok.encode("yes", add_special_tokens=False)
    seq.spec_token_ids = good + tok.encode("no", add_special_tokens=False)
    eng.structured.check_proposals([seq])
    assert seq.spec_token_ids == good
    seq.spec_token_ids = tok.encode("no", add_special_tokens=False)
    eng.structured.check_proposals([seq])
    assert seq.spec_token_ids == []
    seq.spec_token_ids = []
    eng.abort_request("cut")
    assert eng.structured.num_live == 0


@pytest.mark.parametrize("guided, message", [
    (dict(json={"type": "strung"}), "guided_json: Invalid type: strung"),
    (dict(json='{"type": '), "guided_json: not valid JSON"),
    (dict(json={"$ref": "#/definitions/missing"}), "guided_json"),
    (dict(regex="(abc"), "guided_regex: "),
    (dict(regex="a(?=b)"), "guided_regex: "),  # look-ahead: a feature the engine does not support
    (dict(grammar="root ::= missing"), "guided_grammar: "),
    (dict(grammar="start: %import common.NUMBER"), "guided_grammar: "),
    (dict(choice=[]), "guided_choice: expected a non-empty list"),
    (dict(), "give exactly one of"),
    (dict(regex="a", choice=["a"]), "give exactly one of"),
])
def test_bad_constraints_are_value_errors_naming_the_field(llm, guided, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(**guided)), use_tqdm=False)
    assert llm.llm_engine.structured.num_live == 0 and not llm.llm_engine.has_unfinished_requests()


def test_boolean_json_schemas(llm):
    """A schema given as JSON text may be a boolean: `true` accepts any JSON document (it was a 400: llguidance takes
    a boolean schema only without options), and every finished sample parses; `false` accepts none: a ValueError
    naming the field."""
    outs = _samples(llm, GuidedDecodingParams(json="true"), 16, max_tokens=120)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for o in finished:
        json.loads(o.text)
    with pytest.raises(ValueError, match="guided_json: the schema `false` accepts no document"):
        llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(json="false")), use_tqdm=False)


def test_beam_search_with_guided_decoding_is_refused():
    with pytest.raises(ValueError, match="guided_decoding is not supported with use_beam_search"):
        SamplingParams(use_beam_search=True, beam_width=2, temperature=0.0,
                       guided_decoding=GuidedDecodingParams(choice=["a"]))


def test_mask_applies_to_the_model_vocabulary_beyond_the_tokenizer(model_factory):
    """A model whose vocab_size pads past the tokenizer (smollm2's 49,152 over an 8k tokenizer): padded ids are
    never allowed, and the guided answer is still one of the choices."""
    eng = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), num_kv_blocks=64))
    eng.structured.vocab_size += 64  # as if the model's vocabulary were larger than the tokenizer's
    eng.structured.words = (eng.structured.vocab_size + 31) // 32
    eng.add_request("v", "x", SamplingParams(temperature=1.0, max_tokens=8,
                                             guided_decoding=GuidedDecodingParams(choice=CHOICES)))
    seq = eng.groups["v"].seqs[0]
    masks = eng.structured.start_step([(seq, seq.num_tokens)])
    bits = masks.mask()
    assert bits.shape == (1, eng.structured.words)
    allowed = [t for t in range(eng.structured.vocab_size) if (int(bits[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and max(allowed) < eng.model_config.vocab_size
    eng.abort_request("v")


def test_constraints_are_bounded_in_size_and_the_compile_cache_in_bytes(model_factory, monkeypatch):
    """Issue 33, item 7: a constraint over --max-constraint-chars is refused before it is compiled (naming the
    flag), whatever its kind; matchers get the engine's llguidance limits; the compile cache holds at most
    CACHE_BYTES of text, however many distinct constraints arrive."""
    from minivllm.structured_output.manager import LIMITS, StructuredOutputManager

    llm = LLM(model_factory("tiny-llama"), num_kv_blocks=64, max_constraint_chars=2000)
    big = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(200)}}
    compiled = []
    real = StructuredOutputManager.compile
    monkeypatch.setattr(StructuredOutputManager, "compile", lambda self, p: compiled.append(p) or real(self, p))
    for guided, field in ((dict(json=big), "guided_json"), (dict(regex="|".join(f"w{i}" for i in range(500))),
                          "guided_regex"), (dict(choice=[f"c{i}" for i in range(500)]), "guided_choice"),
                          (dict(grammar="start: " + " | ".join(f'"t{i}"' for i in range(500))), "guided_grammar")):
        with pytest.raises(ValueError, match=rf"{field}: the constraint is \d+ characters, over the server's limit "
                                             r"of 2000 \(--max-constraint-chars\)"):
            llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(**guided)), use_tqdm=False)
    assert compiled == []  # refused before compiling
    ok = llm.generate("x", SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(choice=CHOICES)),
                      use_tqdm=False)[0].outputs[0].text
    assert ok in CHOICES and len(compiled) == 1
    manager = llm.llm_engine.structured
    assert {k: getattr(manager.limits(), k) for k in LIMITS} == LIMITS
    monkeypatch.setattr(StructuredOutputManager, "CACHE_BYTES", 20_000)
    for i in range(60):  # ~1,500 characters of constraint and more of grammar each
        manager.compile(GuidedDecodingParams(regex="|".join(f"v{i}x{j}" for j in range(250))))
        assert manager.cache_chars <= 20_000
    assert 0 < len(manager._cache) < 60
    assert manager.cache_chars == sum(len(k) + len(v) for k, v in manager._cache.items())
