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
from minivllm.model.input_batch import InputBatch, SlotParams
from minivllm.model.sampler import Sampler, sample_torch

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


class Rows:
    """A step of `rows` rows in a fresh input batch, every row with the same settings unless a per-row
    list is given (prompt_ids / output_ids: per-row token lists for the penalties)."""

    def __init__(self, rows: int, t: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0,
                 prompt_ids: list[list[int]] | None = None, output_ids: list[list[int]] | None = None, **kw) -> None:
        self.batch = InputBatch()
        slots = []
        kw.update(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
        for j in range(rows):
            params = SlotParams(**{k: (v[j] if isinstance(v, list) else v) for k, v in kw.items()})
            slots.append(self.batch.add(params, (prompt_ids or [[]] * rows)[j], (output_ids or [[]] * rows)[j]))
        self.rows = self.batch.rows(slots)

    def sample(self, sampler: Sampler, logits: torch.Tensor):
        out = sampler.sample(logits, self.batch, self.rows)
        self.batch.append(self.rows, out.tokens)
        return out


def _empirical(native: bool, logits: torch.Tensor, **cfg) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=11, native=native)
    tokens = Rows(N, **cfg).sample(sampler, logits.repeat(N, 1)).token_ids
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
    cfg = dict(t=0.8, top_k=100, top_p=0.9, min_p=0.01)
    a = Rows(64, **cfg).sample(Sampler(torch.device("cpu"), seed=5, native=True), logits.clone()).token_ids
    b = Rows(64, **cfg).sample(Sampler(torch.device("cpu"), seed=5, native=False), logits.clone()).token_ids
    assert a == b


def test_repetition_penalty_equals_hf():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB) * 3
    prompt = [[1, 2, 3], [4, 4], [5]]
    output = [[3, 7, 7], [], [9, 10, 11]]
    rep = [1.3, 1.7, 0.8]
    step = Rows(3, t=1.0, repetition_penalty=rep, prompt_ids=prompt, output_ids=output)
    ours = logits.clone()
    step.batch.apply_penalties(ours, step.rows)
    for row in range(3):
        ids = torch.tensor([prompt[row] + output[row]])
        ref = RepetitionPenaltyLogitsProcessor(rep[row])(ids, logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row], ref[0])


def test_presence_and_frequency_follow_vllm_definitions():
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    output = [[3, 3, 3, 8], [0]]
    presence, frequency = [0.5, -1.0], [0.25, 1.5]
    step = Rows(2, t=1.0, presence_penalty=presence, frequency_penalty=frequency, prompt_ids=[[3, 8, 9], [1]],
                output_ids=output)
    ours = logits.clone()
    step.batch.apply_penalties(ours, step.rows)
    ref = logits.clone()
    for row in range(2):  # vLLM: logits -= frequency * count + presence * (count > 0), output tokens only
        counts = torch.bincount(torch.tensor(output[row]), minlength=VOCAB).float()
        ref[row] -= frequency[row] * counts + presence[row] * (counts > 0).float()
    torch.testing.assert_close(ours, ref)
    assert ours[0, 9] == logits[0, 9]  # a prompt-only token is untouched by presence/frequency


def test_banned_tokens_never_sampled_and_greedy_skips_them():
    logits = torch.zeros(4, VOCAB)
    logits[:, 7] = 10.0
    step = Rows(4, t=[1.0, 0.0, 1.0, 1.0], min_tokens=2, early_banned=[(7,), (7,), (), (7, 8)])  # row 1 greedy
    out = step.sample(Sampler(torch.device("cpu"), seed=0), logits.clone()).token_ids
    assert out[0] != 7 and out[1] != 7 and out[2] == 7 and out[3] not in (7, 8)


@pytest.mark.parametrize("native", PATHS)
def test_logprobs_ranks_and_top_n(native):
    torch.manual_seed(4)
    logits = torch.randn(2, VOCAB)
    out = Rows(2, t=0.0, num_logprobs=[3, None]).sample(Sampler(torch.device("cpu"), native=native), logits.clone())
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


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("top_k", [5, -1, 300])
@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_native_kernel_returns_on_rows_without_a_distribution(top_k, top_p):
    """A row whose every token is forbidden (-inf) or that holds NaN looped forever in the small-top_k path and its
    selections (found by fuzzing /v1/messages: the engine thread spun and every client timed out). Each call must
    return, with a token id inside the vocabulary (the first id for a row with nothing allowed, as greedy's argmax)."""
    import threading

    rows = torch.randn(4, 1024)
    rows[0] = float("-inf")
    rows[1] = float("nan")
    rows[2, 0] = float("nan")
    rows[3, ::7] = float("nan")
    n = rows.shape[0]
    result: list[torch.Tensor] = []
    call = threading.Thread(target=lambda: result.append(cpu_kernels.sample_rows(
        rows, torch.full((n,), 0.7), torch.full((n,), top_k), torch.full((n,), top_p), torch.zeros(n),
        torch.full((n,), 0.5, dtype=torch.float64))), daemon=True)
    call.start()
    call.join(30)
    assert result, "sample_rows did not return"
    (out,) = result
    assert out[0] == 0 and out[1] == 0 and ((out >= 0) & (out < 1024)).all(), out


def test_loading_the_kernels_keeps_denormals():
    # -ffast-math at link time would add crtfastmath.o and flush denormals to zero process-wide.
    cpu_kernels.available()
    assert (torch.tensor(1e-39, dtype=torch.float32) * 1).item() > 0


@pytest.mark.parametrize("native", PATHS)
def test_logprobs_of_sampled_rows_match_log_softmax(native):
    """Random rows, a large vocabulary, different N per row: chosen logprob, rank and top-N as log_softmax."""
    torch.manual_seed(5)
    logits = torch.randn(6, 5000) * 2
    nums = [0, 1, 5, None, 20, 2]
    out = Rows(6, t=0.9, top_k=[-1, 50, -1, -1, 7, -1], num_logprobs=nums).sample(
        Sampler(torch.device("cpu"), seed=1, native=native), logits.clone())
    ref = torch.log_softmax(logits, -1)
    for j, n in enumerate(nums):
        lp = out.logprobs[j]
        if n is None:
            assert lp is None
            continue
        tok = out.token_ids[j]
        assert lp.token_ids[0] == tok and lp.ranks[0] == int((ref[j] >= ref[j, tok]).sum())
        torch.testing.assert_close(torch.tensor(lp.logprobs[0]), ref[j, tok])
        top = ref[j].topk(n) if n else None
        assert lp.token_ids[1:] == (top.indices.tolist() if n else [])
        if n:
            torch.testing.assert_close(torch.tensor(lp.logprobs[1:]), top.values)


def test_logprobs_report_the_raw_distribution_of_penalised_and_banned_rows():
    torch.manual_seed(6)
    logits = torch.randn(3, VOCAB) * 2
    step = Rows(3, t=1.0, num_logprobs=2, repetition_penalty=[1.0, 2.0, 1.0], presence_penalty=[0.0, 1.0, 0.0],
                min_tokens=[0, 0, 1], early_banned=[(), (), (int(logits[2].argmax()),)],
                output_ids=[[], [int(logits[1].argmax())] * 3, []])
    out = step.sample(Sampler(torch.device("cpu"), seed=2), logits.clone())
    ref = torch.log_softmax(logits, -1)
    for j in range(3):
        assert out.logprobs[j].token_ids[1:] == ref[j].topk(2).indices.tolist()
        torch.testing.assert_close(torch.tensor(out.logprobs[j].logprobs[0]), ref[j, out.token_ids[j]])


def test_min_tokens_bans_lift_after_min_tokens_outputs():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 50.0  # EOS stand-in: greedy would always pick it
    step = Rows(1, t=0.0, min_tokens=2, early_banned=[(3,)])
    sampler = Sampler(torch.device("cpu"))
    picks = []
    for _ in range(3):
        rows = step.batch.rows([0])
        out = sampler.sample(logits.clone(), step.batch, rows)
        step.batch.append(rows, out.tokens)
        picks.append(out.token_ids[0])
    assert picks[0] != 3 and picks[1] != 3 and picks[2] == 3


def test_penalty_counts_follow_sampled_tokens_incrementally():
    """Tokens sampled in earlier steps are penalised in later ones exactly as a recount from the full list."""
    torch.manual_seed(7)
    prompt = [[1, 2, 2], [5]]
    step = Rows(2, t=0.0, repetition_penalty=[1.5, 1.0], frequency_penalty=[0.4, 2.0], presence_penalty=[0.1, 0.3],
                prompt_ids=prompt)
    sampler = Sampler(torch.device("cpu"))
    outputs: list[list[int]] = [[], []]
    base = torch.randn(2, VOCAB) * 0.5
    for _ in range(12):
        rows = step.batch.rows([0, 1])
        out = sampler.sample(base.clone(), step.batch, rows)
        step.batch.append(rows, out.tokens)
        for j in range(2):
            outputs[j].append(out.token_ids[j])
    ours = base.clone()
    step.batch.apply_penalties(ours, step.batch.rows([0, 1]))
    ref = base.clone()
    for j, (rep, freq, pres) in enumerate([(1.5, 0.4, 0.1), (1.0, 2.0, 0.3)]):
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[prompt[j] + outputs[j]] = True
        ref[j] = torch.where(seen, torch.where(ref[j] > 0, ref[j] / rep, ref[j] * rep), ref[j])
        counts = torch.bincount(torch.tensor(outputs[j]), minlength=VOCAB).float()
        ref[j] -= freq * counts + pres * (counts > 0).float()
    torch.testing.assert_close(ours, ref)
    assert len(set(outputs[1])) > 3  # the penalties really steered the greedy picks away from repeats


def test_slots_are_reused_and_views_follow_membership():
    batch = InputBatch(initial_slots=2)
    a = batch.add(SlotParams(0.5), [], [])
    b = batch.add(SlotParams(0.0, presence_penalty=1.0), [4], [])
    c = batch.add(SlotParams(0.7, num_logprobs=1), [], [])  # grows past the initial two
    assert len({a, b, c}) == 3 and batch.num_active == 3
    rows = batch.rows([a, b, c])
    assert rows.random_rows == [0, 2] and rows.logprob_rows == [2] and rows.penalty_rows.tolist() == [1]
    assert batch.rows([a, b, c]) is rows  # unchanged membership: the cached view
    batch.remove(b)
    d = batch.add(SlotParams(0.0), [], [])
    assert d == b and batch.num_active == 3
    rows = batch.rows([a, d, c])
    assert rows.penalty_rows.numel() == 0 and rows.temperature.tolist() == pytest.approx([0.5, 0.0, 0.7])


@pytest.mark.skipif(not cpu_kernels.available(), reason="no cc")
@pytest.mark.parametrize("top_k", [1, 5, 50, 256])
def test_small_top_k_rows_draw_as_the_torch_path_with_ties_and_bans(top_k):
    # The native kernel samples a small-top_k row on its candidates only (found from block maxima); bf16-rounded
    # logits tie often, and ties at the k-th value must stay in the set, as the torch path keeps them.
    g = torch.Generator().manual_seed(top_k)
    rows, vocab = 48, 3000
    logits = (torch.randn(rows, vocab, generator=g) * 2).bfloat16().float()
    logits[::3, :40] = float("-inf")  # banned tokens
    logits[-1] = 0.5  # every entry tied: the kernel falls back to its whole-row path
    temp = torch.full((rows,), 0.9)
    k = torch.full((rows,), top_k)
    top_p = torch.tensor([1.0, 0.9, 0.5] * (rows // 3))
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05] * (rows // 4))
    for seed in range(4):
        u = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        native = cpu_kernels.sample_rows(logits.clone(), temp, k, top_p, min_p, u)
        portable = sample_torch(logits.clone(), temp, k, top_p, min_p, u)
        assert native.tolist() == portable.tolist()
