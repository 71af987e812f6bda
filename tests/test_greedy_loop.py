"""The draft model's native greedy round (model/greedy_loop.py, csrc/greedy_loop.c): the same proposals as the
Python loop it replaces, for batches mixing proposal lengths and catch-ups of one to several tokens, and the same
K/V left in the draft's pool; sampled requests and long catch-ups keep the Python loop."""

from __future__ import annotations

import pytest
import torch

from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import Sequence
from minivllm.model import cpu_kernels
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.draft_proposer import DraftModelProposer
from tests.conftest import corpus_token_ids, noisy_copy

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the native CPU kernels")


def _proposer(engine: LLMEngine, draft: str, native: bool) -> DraftModelProposer:
    p = DraftModelProposer.build(draft, engine.config, engine.tokenizer, 64, True, torch.Generator())
    assert p.loop is not None  # a Llama draft on the decode stack
    if not native:
        p.loop = None
    return p


def _pool(p: DraftModelProposer) -> list[torch.Tensor]:
    return [t.clone() for layer in p.runner.model.layers for t in (layer.self_attn.attn.k_cache,
                                                                     layer.self_attn.attn.v_cache)]


def _assert_bf16_tie(draft: str, before: list[list[int]], a: list[list[int]], b: list[list[int]]) -> None:
    """Where the two loops part in a bfloat16 model, their first differing tokens tie in HF's bf16 logits: the
    stack keeps the residual stream, norms and attention in float32 where the modules round each op's output, so a
    tie at bf16's precision may break either way (seen: two logits 0.009 apart in float32, equal in bf16)."""
    from transformers import AutoModelForCausalLM

    i = next(j for j in range(len(a)) if a[j] != b[j])
    t = next(j for j in range(min(len(a[i]), len(b[i]))) if a[i][j] != b[i][j])
    hf = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([before[i] + a[i][:t]])).logits[0, -1].float()
    assert abs(logits[a[i][t]] - logits[b[i][t]]).item() <= logits.abs().max().item() * 2 ** -7, (i, t)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_round_proposes_what_the_python_loop_does(model_factory, tmp_path, dtype):
    path = model_factory("tiny-llama")
    engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=64, dtype=dtype))
    draft = noisy_copy(path, str(tmp_path / "draft"), 0.02)
    text = corpus_token_ids(engine.tokenizer, 200)
    native, python = _proposer(engine, draft, True), _proposer(engine, draft, False)
    calls = 0
    rounds = native.loop.round  # type: ignore[union-attr]

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return rounds(*a, **kw)

    native.loop.round = counted  # type: ignore[union-attr, method-assign]
    # The stack runs a row count natively only where the draft's kernel plan chose a streamed kernel for its shape
    # class, and a plan timed (or re-checked) under load may choose oneDNN for one: count the rounds it allowed.
    allowed = 0
    runs = native.loop.runs  # type: ignore[union-attr]

    def counted_runs(counts):  # type: ignore[no-untyped-def]
        nonlocal allowed
        ok = runs(counts)
        allowed += ok
        return ok

    native.loop.runs = counted_runs  # type: ignore[union-attr, method-assign]
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    seqs = {name: [Sequence(str(i), text[7 * i:7 * i + 20 + 3 * i], greedy, 20 + 3 * i) for i in range(4)]
            for name in ("native", "python")}
    for step, ks in enumerate([(3, 3, 3, 3), (4, 1, 2, 4), (1, 3, 4, 2), (2, 2, 1, 4), (4, 4, 4, 4)]):
        before = [list(seq.token_ids) for seq in seqs["native"]]
        got = {}
        for name, p in (("native", native), ("python", python)):
            out = p.propose(list(zip(seqs[name], ks, strict=True)))
            got[name] = [spec for _, spec, _ in out]
            assert all(dist is None for *_, dist in out)
            # The target "accepts" a prefix of each proposal (a different count per sequence and step) and adds
            # its own token: the next round catches up on one to several tokens.
            for i, (seq, spec) in enumerate(zip(seqs[name], got[name], strict=True)):
                keep = (i + step) % (len(spec) + 1)
                seq.token_ids += spec[:keep] + [text[100 + step + i]]
            p.settle()
        if dtype == "bfloat16" and got["native"] != got["python"]:
            _assert_bf16_tie(draft, before, got["native"], got["python"])
            break  # (the sequences part from here)
        assert got["native"] == got["python"], f"step {step}"
        if dtype == "float32":  # the stack keeps bf16 activations in float32 where the modules round them
            for a, b in zip(_pool(native), _pool(python), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Every round the plan allowed, which is every round but the first (the prompts' catch-up: the module path's
    # prefill) unless a plan chose oneDNN for a class the round needs.
    assert calls == allowed >= 1 and allowed <= 4
    native.check_invariants()


def test_sampled_requests_keep_the_python_loop(model_factory, tmp_path):
    path = model_factory("tiny-llama")
    engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=64))
    p = _proposer(engine, noisy_copy(path, str(tmp_path / "draft"), 0.02), True)
    text = corpus_token_ids(engine.tokenizer, 60)
    seq = Sequence("s", text[:30], SamplingParams(temperature=0.8, seed=1, max_tokens=16), 30)
    for _ in range(2):
        (_, spec, dist), = p.propose([(seq, 3)])
        assert len(spec) == 3 and dist is not None and dist.shape[0] == 3  # drawn, with their distributions
        seq.token_ids += spec[:1] + [text[40]]
        p.settle()
