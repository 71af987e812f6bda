"""One layout for a float32 model too large for two (model/weight_layout.py): the plain weight or csrc/gemm_f32.c's
panels alone, chosen by timing both; panels alone run every token count, in the modules and in the decode stack,
with the outputs of the plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import PROMPTS

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.model import cpu_kernels, runner, weight_layout
from minivllm.model.kernel_plan import SHAPE_CLASSES
from minivllm.model.layers import Linear
from tests.conftest import make_runner, panel_steps_equal

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels did not build here")


def _linear(k: int, n: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


@pytest.mark.parametrize(("k", "n", "bias"), [(96, 80, True), (1024, 40, False), (33, 7, True)])
def test_panels_alone_run_every_token_count_as_the_plain_weight_does(k, n, bias):
    """Held as panels alone, a projection has no plain weight, offers only the native kernel, and that kernel gives
    F.linear's result at one token, a handful, past PANELS_PAST and at a prefill's rows (2-D and 3-D inputs)."""
    lin = _linear(k, n, bias)
    assert lin.weight is not None
    w, b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    lin.keep_panels_only()
    assert lin.weight is None and lin.panels_only() and list(lin.candidates()) == ["native"]
    assert not any(lin.native_rows(largest) for largest, _ in SHAPE_CLASSES)
    x = torch.randn(70, k)
    for m in (1, 2, 5, 6, 7, 16, 17, 70):
        torch.testing.assert_close(lin.forward_native(x[:m]), F.linear(x[:m], w, b), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lin.forward_native(x[:12].view(3, 4, k)), F.linear(x[:12], w, b).view(3, 4, n),
                               atol=2e-5, rtol=1e-5)
    assert lin.kernel_copies() and lin.layout_dtype() == torch.float32


def test_the_panels_are_chosen_only_where_one_token_does_not_lose():
    assert weight_layout.prefer_panels((1.0, 0.8, 0.6, 0.9))
    assert weight_layout.prefer_panels((1.02, 0.95, 1.0, 1.0))
    assert not weight_layout.prefer_panels((1.08, 0.5, 0.5, 0.5))  # decode's class loses: the plain rows stay
    assert not weight_layout.prefer_panels((1.0, 1.1, 1.1, 1.0))  # no gain over the classes


@pytest.mark.parametrize("panels", [True, False])
def test_the_choice_times_both_layouts_and_keeps_one(monkeypatch, panels):
    """Every shape class timed with the panels beside the plain layout's kernels; then every projection holds the
    chosen layout alone, the trial's panels gone where the plain one stays."""
    monkeypatch.setattr(weight_layout, "prefer_panels", lambda ratios: panels)
    linears = [_linear(256, 192, bias=i % 2 == 0, seed=i) for i in range(5)]
    x = torch.randn(20, 256)
    ref = [F.linear(x, m.weight, m.bias) for m in linears]
    choice = weight_layout.choose_layout(linears, "auto", torch.float32)
    assert choice.panels == panels and len(choice.ratios) == len(SHAPE_CLASSES)
    assert all(r > 0 for r in choice.ratios)
    for m, want in zip(linears, ref, strict=True):
        assert m._trial is None and m.panels_only() == panels and (m.weight is None) == panels
        assert "panels" not in m.candidates()
        if panels:
            torch.testing.assert_close(m.forward_native(x), want, atol=2e-5, rtol=1e-5)


def _one_layout(monkeypatch, panels: bool) -> None:
    """The runner as on a machine where a second copy of the weights exceeds a tenth of memory, the timed choice
    forced to `panels`."""
    monkeypatch.setattr(runner, "second_layout_affordable", lambda linears: False)
    monkeypatch.setattr(weight_layout, "prefer_panels", lambda ratios: panels)


def test_a_model_too_large_for_two_layouts_may_keep_the_plain_one(model_factory, monkeypatch):
    """Past the memory a second layout may take, no packed copy is made: where the timing keeps the plain weights,
    they serve every shape, through the native rows and oneDNN on plain weights, with the same greedy output."""
    path = model_factory("tiny-llama")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(path, linear_backend="torch", num_kv_blocks=64).generate(
        PROMPTS, sp, use_tqdm=False)]
    _one_layout(monkeypatch, panels=False)
    llm = LLM(path, num_kv_blocks=64)
    linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Linear)]
    assert llm.llm_engine.runner.weight_layout is not None and not llm.llm_engine.runner.weight_layout.panels
    assert linears and all(m.packed is None and m.weight is not None and m._panels is None for m in linears)
    assert set(llm.llm_engine.runner.linear_kernels.values()) <= {"native", "onednn_plain"}
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == ref


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_a_model_too_large_for_two_layouts_may_hold_the_panels_alone(model_factory, monkeypatch, preset):
    """Where the timing picks the panels, every projection (the head too) holds them alone, every class runs
    them natively, and greedy outputs (prefill, batched decode through the stack) are the plain weights'."""
    path = model_factory(preset)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(path, linear_backend="torch", num_kv_blocks=64).generate(
        PROMPTS, sp, use_tqdm=False)]
    _one_layout(monkeypatch, panels=True)
    llm = LLM(path, num_kv_blocks=64)
    r = llm.llm_engine.runner
    linears = [m for m in r.model.modules() if isinstance(m, Linear)]
    assert r.weight_layout is not None and r.weight_layout.panels
    assert linears and all(m.panels_only() and m.packed is None for m in linears)
    assert set(r.linear_kernels.values()) == {"native"}
    assert r.decode_stack is not None and all(r.decode_stack.native_classes)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == ref


def test_the_stack_runs_panels_alone_at_every_row_count_as_the_modules_do(model_factory, monkeypatch, stack_calls):
    """Decode steps of 1, 3, 9 and 20 tokens through the stack, whose tables hold no rows for these projections
    (w NULL: csrc/decode_stack.h runs their panels at any row count): logits the modules' to the bit."""
    _one_layout(monkeypatch, panels=True)
    path = model_factory("tiny-qwen3")
    r = make_runner(ModelConfig.from_pretrained(path), 96, linear_backend="native")
    assert all(p.panels_only() for p in r.model.modules() if isinstance(p, Linear))
    panel_steps_equal(r, path, stack_calls, steps=(1, 3, 9, 20))
