"""Statistical and exact checks of the sampler (both the compiled CPU path and the portable torch path).

Bound for the statistical checks: with N draws over k categories, E[TV] <= 0.5 * sum_i sqrt(p_i / N)
<= 0.5 * sqrt(k / N) (Cauchy-Schwarz), and one draw moves TV by at most 1/N, so by McDiarmid
P(TV > E[TV] + t) <= exp(-2 N t^2). With t = sqrt(ln(1e6) / (2N)) a correct sampler fails with
probability < 1e-6; N = 20,000 and k = 24 give a bound of about 0.036. The seeds are fixed, so the
test is also deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from minivllm.model import cpu_kernels
from minivllm.model.sampler import Sampler, SamplingMetadata

VOCAB, N = 24, 20_000
BOUND = 0.5 * math.sqrt(VOCAB / N) + math.sqrt(math.log(1e6) / (2 * N))
PATHS = [pytest.param(True, id="native", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no cc")),
         pytest.param(False, id="torch")]


def _logits() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5


def expected(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The target distribution, straight from the definitions (float64, sorting)."""
    p = torch.softmax(logits.double() / t, dim=-1)
    keep = p >= min_p * p.max()
    if top_k > 0:
        kept = p[keep].sort(descending=True).values
        if top_k < len(kept):
            keep &= p >= kept[top_k - 1]
    q = p * keep
    q = q / q.sum()
    ascending, order = q.sort()
    drop = ascending.cumsum(0) <= 1 - top_p
    drop[-1] = False
    keep[order[drop]] = False
    q = p * keep
    return q / q.sum()


def _metadata(rows: int, t: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0, **kw) -> SamplingMetadata:
    base = dict(temperature=[t] * rows, top_k=[top_k] * rows, top_p=[top_p] * rows, min_p=[min_p] * rows,
                generators=[None] * rows, banned=[[]] * rows, presence_penalty=[0.0] * rows,
                frequency_penalty=[0.0] * rows, repetition_penalty=[1.0] * rows, prompt_ids=[[]] * rows,
                output_ids=[[]] * rows, num_logprobs=[None] * rows)
    base.update(kw)
    return SamplingMetadata(**base)


def _empirical(native: bool, logits: torch.Tensor, **cfg) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=11, native=native)
    tokens = sampler.sample(logits.repeat(N, 1), _metadata(N, **cfg)).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / N


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def passes(emp: torch.Tensor, target: torch.Tensor) -> bool:
    """The check: total variation under BOUND, and no draw of a token the filters remove."""
    return _tv(emp, target) < BOUND and emp[target == 0].sum().item() == 0


CONFIGS = {
    "temperature": dict(t=0.7),
    "top_k": dict(t=1.0, top_k=5),
    "top_p": dict(t=1.0, top_p=0.8),
    "min_p": dict(t=1.3, min_p=0.1),
    "all": dict(t=0.9, top_k=10, top_p=0.9, min_p=0.02),
}


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("name", CONFIGS)
def test_empirical_distribution_matches(native, name):
    cfg = CONFIGS[name]
    logits = _logits()
    target = expected(logits, cfg["t"], cfg.get("top_k", -1), cfg.get("top_p", 1.0), cfg.get("min_p", 0.0))
    emp = _empirical(native, logits, **cfg)
    assert passes(emp, target), (name, _tv(emp, target), BOUND)


# Each wrong sampler is a plausible bug; its draws must fail the same check against the right target.
WRONG = {
    "ignores temperature": (dict(t=0.7), dict(t=1.0)),
    "top_k off by one": (dict(t=1.0, top_k=5), dict(t=1.0, top_k=6)),
    "top_p before renormalising after top_k": (dict(t=1.0, top_k=10, top_p=0.6), dict(t=1.0, top_p=0.6)),
    "min_p ignored": (dict(t=1.3, min_p=0.1), dict(t=1.3, min_p=0.0)),
    "top_p off (nucleus not applied)": (dict(t=1.0, top_p=0.8), dict(t=1.0)),
}


@pytest.mark.parametrize("name", WRONG)
def test_deliberately_wrong_sampler_fails_the_check(name):
    right, wrong = WRONG[name]
    logits = _logits()
    target = expected(logits, right["t"], right.get("top_k", -1), right.get("top_p", 1.0), right.get("min_p", 0.0))
    emp = _empirical(False, logits, **wrong)
    assert not passes(emp, target), (name, _tv(emp, target))


@pytest.mark.parametrize("native", PATHS)
def test_native_and_torch_paths_draw_identically(native):
    torch.manual_seed(0)
    logits = torch.randn(64, 5000) * 2
    md = _metadata(64, t=0.8, top_k=100, top_p=0.9, min_p=0.01)
    a = Sampler(torch.device("cpu"), seed=5, native=True).sample(logits, md).token_ids
    b = Sampler(torch.device("cpu"), seed=5, native=False).sample(logits, md).token_ids
    assert a == b


def test_repetition_penalty_equals_hf():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB) * 3
    prompt = [[1, 2, 3], [4, 4], [5]]
    output = [[3, 7, 7], [], [9, 10, 11]]
    md = _metadata(3, t=1.0, repetition_penalty=[1.3, 1.7, 0.8], prompt_ids=prompt, output_ids=output)
    ours = logits.clone()
    Sampler._apply_penalties(ours, md)
    for row in range(3):
        ids = torch.tensor([prompt[row] + output[row]])
        ref = RepetitionPenaltyLogitsProcessor(md.repetition_penalty[row])(ids, logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row], ref[0])


def test_presence_and_frequency_follow_vllm_definitions():
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    output = [[3, 3, 3, 8], [0]]
    md = _metadata(2, t=1.0, presence_penalty=[0.5, -1.0], frequency_penalty=[0.25, 1.5],
                   prompt_ids=[[3, 8, 9], [1]], output_ids=output)
    ours = logits.clone()
    Sampler._apply_penalties(ours, md)
    ref = logits.clone()
    for row in range(2):  # vLLM: logits -= frequency * count + presence * (count > 0), output tokens only
        counts = torch.bincount(torch.tensor(output[row]), minlength=VOCAB).float()
        ref[row] -= md.frequency_penalty[row] * counts + md.presence_penalty[row] * (counts > 0).float()
    torch.testing.assert_close(ours, ref)
    assert ours[0, 9] == logits[0, 9]  # a prompt-only token is untouched by presence/frequency


def test_banned_tokens_never_sampled_and_greedy_skips_them():
    logits = torch.zeros(4, VOCAB)
    logits[:, 7] = 10.0
    md = _metadata(4, t=1.0, banned=[[7], [7], [], [7, 8]])
    md.temperature[1] = 0.0  # greedy row
    out = Sampler(torch.device("cpu"), seed=0).sample(logits, md).token_ids
    assert out[0] != 7 and out[1] != 7 and out[2] == 7 and out[3] not in (7, 8)


def test_logprobs_ranks_and_top_n():
    torch.manual_seed(4)
    logits = torch.randn(2, VOCAB)
    md = _metadata(2, t=0.0, num_logprobs=[3, None])
    out = Sampler(torch.device("cpu")).sample(logits, md)
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert out.logprobs[1] is None
    assert lp.token_ids[0] == out.token_ids[0] == int(ref.argmax()) and lp.ranks[0] == 1
    torch.testing.assert_close(torch.tensor(lp.logprobs[1:]), ref.topk(3).values)
    assert lp.token_ids[1:] == ref.topk(3).indices.tolist() and lp.ranks[1:] == [1, 2, 3]


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
def test_native_kernel_edge_cases():
    logits = torch.randn(2, 32000)
    logits[0, -5:] = float("-inf")  # banned: even a draw at the very end of [0, 1) must not land there
    ones = torch.ones(2)
    u = torch.tensor([1 - 2**-53, 0.5], dtype=torch.float64)
    out = cpu_kernels.sample_rows(logits, ones, torch.full((2,), -1), torch.tensor([1.0, 1e-30]), torch.zeros(2), u)
    assert out[0] < 32000 - 5
    assert out[1] == logits[1].argmax()  # a vanishing top_p keeps only the most likely token


def test_loading_the_kernels_keeps_denormals():
    # -ffast-math at link time would add crtfastmath.o and flush denormals to zero process-wide.
    cpu_kernels.available()
    assert (torch.tensor(1e-39, dtype=torch.float32) * 1).item() > 0
