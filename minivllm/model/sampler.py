"""Vectorized sampling over the whole batch of logits rows, with penalties and logprobs; each row's
settings come from the persistent input batch (model/input_batch.py).

Order of one step (vLLM v1's): EOS/stop ids banned before min_tokens → repetition penalty (prompt and
output tokens, HF's rule) → frequency and presence penalties (output tokens, OpenAI's rule) → greedy
argmax, or temperature → min_p → top_k → top_p → one draw per row. Logprobs are those of the raw
model distribution (log_softmax of the logits before any processing), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model import cpu_kernels
from minivllm.model.input_batch import InputBatch, StepRows


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled position: the chosen token first, then the top-N alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class SamplerOutput:
    """One token per row, with logprobs where asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    tokens: torch.Tensor  # the same ids, [R] int64 on the CPU (for the input batch's stores)


class Sampler:
    """Turns one step's logits [R, vocab] into one token id per row, reading the rows' settings from the
    persistent input batch."""

    def __init__(self, device: torch.device, seed: int = 0, native: bool | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # The compiled CPU kernels draw (and score logprobs) in a few linear passes per row, on the rows in
        # place; the torch path sorts (what CUDA runs).
        self.native = (device.type == "cpu" and cpu_kernels.available()) if native is None else native

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: InputBatch, rows: StepRows) -> SamplerOutput:
        """Sample one token per row of float32 logits [R, V]. The logits are processed in place (bans and
        penalties): the caller hands them over."""
        x = logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.float().contiguous()
        banned = batch.banned(rows)
        lp_rows = rows.logprob_rows
        # Logprobs report the raw distribution: keep a copy of the few logprob rows about to be changed.
        raw: torch.Tensor | None = None
        raw_rows: list[int] = []
        if lp_rows and (banned or len(rows.penalty_rows)):
            touched = set(rows.penalty_rows.tolist()) | {j for j, _ in banned}
            raw_rows = [j for j in lp_rows if j in touched]
            if raw_rows:
                raw = x[raw_rows].clone()
        if banned:
            x[[j for j, ids in banned for _ in ids], [t for _, ids in banned for t in ids]] = float("-inf")
        batch.apply_penalties(x, rows)
        tokens = self._draw(x, rows).cpu()
        token_ids = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if lp_rows:
            nums = dict(zip(lp_rows, rows.logprob_nums, strict=True))
            plain = [j for j in lp_rows if j not in raw_rows]
            for src, js, at in ((x, plain, plain), (raw, raw_rows, range(len(raw_rows)))):
                if js:
                    assert src is not None
                    found = self._logprobs_at(src, list(at), [token_ids[j] for j in js], [nums[j] for j in js])
                    for j, lp in zip(js, found, strict=True):
                        logprobs[j] = lp
        return SamplerOutput(token_ids, logprobs, tokens)

    # ---- drawing -------------------------------------------------------------------------------
    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (the first among ties), by the native kernel where it runs (a vectorised max per row,
        rows across threads: torch's argmax took ~90 us for 36 rows of an 8k vocabulary, one thread): speculative
        verification's greedy rows."""
        if not (self.native and x.device.type == "cpu" and x.dtype == torch.float32):
            return x.argmax(dim=-1)
        zeros = torch.zeros(x.shape[0])
        return cpu_kernels.sample_rows(x.contiguous(), zeros, zeros.long(), zeros, zeros, zeros.double())

    def _draw(self, x: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """One token per row: argmax for greedy rows, a draw for the rest. A seeded request draws from its
        own generator, so its tokens do not depend on what else is in the batch."""
        n, rand = x.shape[0], rows.random_rows
        if not rand:  # (the rows' own settings tensors: no new ones on every decode step, as greedy() makes)
            return x.argmax(dim=-1) if not (self.native and x.device.type == "cpu") else cpu_kernels.sample_rows(
                x, rows.temperature, rows.top_k, rows.top_p, rows.min_p, torch.zeros(n, dtype=torch.float64))
        u_rand = torch.rand(len(rand), generator=self.generator, device=self.device, dtype=torch.float64).cpu()
        u = u_rand if len(rand) == n else torch.zeros(n, dtype=torch.float64).index_put_(
            (torch.tensor(rand),), u_rand)
        for j, g in rows.seeded:
            u[j] = torch.rand(1, generator=g, device=self.device, dtype=torch.float64)[0]
        if self.native and x.device.type == "cpu":
            # Greedy rows (temperature 0) are argmax inside the same call: no row is gathered or copied.
            return cpu_kernels.sample_rows(x, rows.temperature, rows.top_k, rows.top_p, rows.min_p, u)
        dev = x.device
        if len(rand) == n:
            return sample_torch(x, rows.temperature.to(dev), rows.top_k.to(dev), rows.top_p.to(dev),
                                rows.min_p.to(dev), u)
        tokens = x.argmax(dim=-1)
        r = torch.tensor(rand, device=dev)
        tokens[r] = sample_torch(x[r], rows.temperature.to(dev)[r], rows.top_k.to(dev)[r], rows.top_p.to(dev)[r],
                                 rows.min_p.to(dev)[r], u[rand])
        return tokens

    # ---- logprobs ------------------------------------------------------------------------------
    @torch.inference_mode()
    def logprobs_of(self, logits: torch.Tensor, token_ids: list[int], num: list[int]) -> list[TokenLogprobs]:
        """Per row: logprob and rank of token_ids[row] under log_softmax(logits[row]), plus the top num[row]."""
        return self._logprobs_at(logits, list(range(logits.shape[0])), token_ids, num)

    def _logprobs_at(self, x: torch.Tensor, at: list[int], token_ids: list[int], num: list[int]
                     ) -> list[TokenLogprobs]:
        """logprobs_of for rows `at` of x, read in place."""
        if self.native and x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1:
            chosen, ranks, top_ids, top_lp = cpu_kernels.logprobs_rows(x, torch.tensor(at), torch.tensor(token_ids),
                                                                       torch.tensor(num))
            chosen_vals, ranks_l = chosen.tolist(), ranks.tolist()
            top_ids_l, top_lp_l = top_ids.tolist(), top_lp.tolist()
        else:
            lp = torch.log_softmax(x[at].float(), dim=-1)
            ids = torch.tensor(token_ids, device=lp.device)
            chosen_lp = lp.gather(1, ids[:, None])
            ranks_l = (lp >= chosen_lp).sum(-1).tolist()  # ties take the worse rank, as vLLM counts
            k = max(num)
            top_lp, top_idx = lp.topk(k, dim=-1) if k else (lp[:, :0], ids[:, None][:, :0])
            chosen_vals, top_lp_l, top_ids_l = chosen_lp[:, 0].tolist(), top_lp.tolist(), top_idx.tolist()
        return [TokenLogprobs([token_ids[j], *top_ids_l[j][:n]], [chosen_vals[j], *top_lp_l[j][:n]],
                              [ranks_l[j], *range(1, n + 1)]) for j, n in enumerate(num)]


_BITS = torch.arange(32, dtype=torch.int32)


@torch.inference_mode()
def apply_token_bitmask(x: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """Guided decoding: in place, set to -inf the logits of x's `rows` [R, V] that their bitmask rows forbid
    (mask [len(rows), ceil(V / 32)] int32; bit t % 32 of word t // 32 set = token t allowed)."""
    vocab = x.shape[1]
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1 and cpu_kernels.available():
        cpu_kernels.apply_token_bitmask(x, rows, mask)  # one pass over the set bits' words, no [R, V] temporaries
        return
    forbidden = ((mask.unsqueeze(-1) >> _BITS) & 1).view(mask.shape[0], -1)[:, :vocab] == 0
    if rows == list(range(x.shape[0])):
        x.masked_fill_(forbidden.to(x.device), float("-inf"))
    else:
        idx = torch.tensor(rows, device=x.device)
        x[idx] = x[idx].masked_fill(forbidden.to(x.device), float("-inf"))


def penalize_dense(x: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor, repetition: float,
                   frequency: float, presence: float) -> torch.Tensor:
    """The input batch's penalties (InputBatch.apply_penalties: repetition over prompt and output tokens,
    HF's rule; then frequency and presence over output tokens, OpenAI's rule) on a few rows x [R, V] whose
    output-token counts [R, V] differ row by row (speculative verification: row i has seen the first i
    proposals as outputs too). prompt_seen [V] bool. Returns new rows."""
    if repetition != 1.0:
        seen = (counts > 0) | prompt_seen[None, :]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0).float()


def processed_probs(x: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """The distribution a row is drawn from (rows of temperature > 0): softmax(x / temperature) with the
    tokens min_p, top_k and top_p drop set to 0, not renormalized. Same semantics as csrc/sampling.c;
    top-p sorts the row."""
    probs = torch.softmax(x.float() / temp[:, None], dim=-1)
    vocab = probs.shape[1]
    keep = torch.ones_like(probs, dtype=torch.bool)
    if (min_p > 0).any():
        keep &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    if (top_k > 0).any():
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        top = probs.masked_fill(~keep, -1.0).topk(int(k.max()), dim=-1).values
        keep &= probs >= top.gather(1, (k - 1)[:, None]).clamp(min=0)
    if (top_p < 1).any():
        p = probs * keep
        sorted_p, order = p.sort(dim=-1)
        cums = sorted_p.cumsum(dim=-1)
        # The mass of all tokens with p <= p_i: a tie group's cumulative sum at its last member (tied tokens are
        # kept or dropped together, as the kernel does), not wherever the sort happened to put each of them.
        cums = cums.gather(1, torch.searchsorted(sorted_p, sorted_p, right=True) - 1)
        drop = cums <= (1 - top_p[:, None]) * cums[:, -1:]
        drop[:, -1] = False  # the most likely token always stays
        keep &= ~torch.zeros_like(drop).scatter(1, order, drop)
    return probs * keep


def draw_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalized probabilities, by inverse CDF at uniforms u [R] (float64)."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u.to(cdf.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)


def sample_torch(x: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Portable draw (CPU or CUDA), same semantics as csrc/sampling.c."""
    return draw_from(processed_probs(x, temp, top_k, top_p, min_p), u)
