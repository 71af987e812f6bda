"""Vectorized sampling over the whole batch of logits rows, with penalties and logprobs.

Order of one step (vLLM v1's): EOS/stop ids banned before min_tokens → repetition penalty (prompt and
output tokens, HF's rule) → frequency and presence penalties (output tokens, OpenAI's rule) → greedy
argmax, or temperature → min_p → top_k → top_p → one draw per row. Logprobs are those of the raw
model distribution (log_softmax of the logits before any processing), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model import cpu_kernels


@dataclass
class SamplingMetadata:
    """Per-row settings of one step (plain lists built by the engine; one entry per logits row)."""

    temperature: list[float]  # 0 → greedy
    top_k: list[int]  # -1 → off
    top_p: list[float]
    min_p: list[float]
    generators: list[torch.Generator | None]  # a request's own seeded generator, else None
    banned: list[list[int]]  # ids a row may not produce this step (EOS / stop ids before min_tokens)
    presence_penalty: list[float]
    frequency_penalty: list[float]
    repetition_penalty: list[float]
    prompt_ids: list[list[int]]  # read only for rows with a repetition penalty
    output_ids: list[list[int]]  # read only for rows with any penalty
    num_logprobs: list[int | None]  # top-N to report, None → no logprobs for that row


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


class Sampler:
    """Turns one step's logits [S, vocab] into one token id per row."""

    def __init__(self, device: torch.device, seed: int = 0, native: bool | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # The compiled CPU kernel draws in a few linear passes; the torch path sorts (what CUDA runs).
        self.native = (device.type == "cpu" and cpu_kernels.available()) if native is None else native

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of float32 logits."""
        raw = logits
        x = logits
        if any(md.banned) or any(_has_penalty(md, i) for i in range(len(md.temperature))):
            x = logits.clone()
            self._ban(x, md.banned)
            self._apply_penalties(x, md)
        temps = md.temperature
        tokens = x.argmax(dim=-1) if not all(temps) else torch.empty(len(temps), dtype=torch.long, device=x.device)
        rows = [i for i, t in enumerate(temps) if t]
        if len(rows) == len(temps):
            tokens = self._sample_random(x, md, rows).to(x.device)  # all rows random: no row copy
        elif rows:
            tokens[rows] = self._sample_random(x[rows], md, rows).to(tokens.device)
        token_ids = tokens.tolist()
        rows_lp = [i for i, n in enumerate(md.num_logprobs) if n is not None]
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if rows_lp:
            found = self.logprobs_of(raw[rows_lp], [token_ids[i] for i in rows_lp],
                                     [md.num_logprobs[i] or 0 for i in rows_lp])
            for i, lp in zip(rows_lp, found, strict=True):
                logprobs[i] = lp
        return SamplerOutput(token_ids, logprobs)

    # ---- logits processing ---------------------------------------------------------------------
    @staticmethod
    def _ban(x: torch.Tensor, banned: list[list[int]]) -> None:
        rows = [i for i, ids in enumerate(banned) for _ in ids]
        if rows:
            x[rows, [t for ids in banned for t in ids]] = float("-inf")

    @staticmethod
    def _apply_penalties(x: torch.Tensor, md: SamplingMetadata) -> None:
        rows = [i for i in range(x.shape[0]) if _has_penalty(md, i)]
        if not rows:
            return
        vocab, dev = x.shape[1], x.device
        xs = x[rows]
        out_counts = _token_counts([md.output_ids[i] for i in rows], vocab, dev)
        rep = torch.tensor([md.repetition_penalty[i] for i in rows], device=dev)[:, None]
        if (rep != 1).any():
            seen = (out_counts > 0) | (_token_counts([md.prompt_ids[i] for i in rows], vocab, dev) > 0)
            xs = torch.where(seen, torch.where(xs > 0, xs / rep, xs * rep), xs)
        freq = torch.tensor([md.frequency_penalty[i] for i in rows], device=dev)[:, None]
        pres = torch.tensor([md.presence_penalty[i] for i in rows], device=dev)[:, None]
        xs = xs - freq * out_counts - pres * (out_counts > 0).float()
        x[rows] = xs

    # ---- drawing -------------------------------------------------------------------------------
    def _uniforms(self, md: SamplingMetadata, rows: list[int]) -> torch.Tensor:
        """One U[0, 1) per row; a seeded request draws from its own generator, so its tokens do not
        depend on what else is in the batch."""
        u = torch.rand(len(rows), generator=self.generator, device=self.device, dtype=torch.float64)
        for j, i in enumerate(rows):
            g = md.generators[i]
            if g is not None:
                u[j] = torch.rand(1, generator=g, device=self.device, dtype=torch.float64)[0]
        return u

    def _sample_random(self, x: torch.Tensor, md: SamplingMetadata, rows: list[int]) -> torch.Tensor:
        dev = x.device
        temp = torch.tensor([md.temperature[i] for i in rows], device=dev)
        top_k = torch.tensor([md.top_k[i] for i in rows], device=dev)
        top_p = torch.tensor([md.top_p[i] for i in rows], device=dev)
        min_p = torch.tensor([md.min_p[i] for i in rows], device=dev)
        u = self._uniforms(md, rows)
        if self.native and dev.type == "cpu":
            return cpu_kernels.sample_rows(x.float().contiguous(), temp, top_k, top_p, min_p, u)
        return sample_torch(x, temp, top_k, top_p, min_p, u)

    # ---- logprobs ------------------------------------------------------------------------------
    @staticmethod
    @torch.inference_mode()
    def logprobs_of(logits: torch.Tensor, token_ids: list[int], num: list[int]) -> list[TokenLogprobs]:
        """Per row: logprob and rank of token_ids[row] under log_softmax(logits[row]), plus the top num[row]."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = torch.tensor(token_ids, device=lp.device)
        chosen_lp = lp.gather(1, chosen[:, None])
        ranks = (lp >= chosen_lp).sum(-1).tolist()  # ties take the worse rank, as vLLM counts
        k = max(num)
        top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, None][:, :0])
        chosen_vals, top_lp, top_ids = chosen_lp[:, 0].tolist(), top_lp.tolist(), top_ids.tolist()
        return [TokenLogprobs([token_ids[j], *top_ids[j][:n]], [chosen_vals[j], *top_lp[j][:n]],
                              [ranks[j], *range(1, n + 1)]) for j, n in enumerate(num)]


def _has_penalty(md: SamplingMetadata, i: int) -> bool:
    return bool(md.presence_penalty[i] or md.frequency_penalty[i] or md.repetition_penalty[i] != 1.0)


def _token_counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each row's list (one scatter, padding to a spare column)."""
    width = max((len(r) for r in ids), default=0)
    padded = torch.full((len(ids), width), vocab, dtype=torch.long)
    for j, r in enumerate(ids):
        padded[j, :len(r)] = torch.tensor(r, dtype=torch.long)
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def sample_torch(x: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Portable draw (CPU or CUDA), same semantics as csrc/sampling.c; top-p sorts the row."""
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
        drop = cums <= (1 - top_p[:, None]) * cums[:, -1:]
        drop[:, -1] = False  # the most likely token always stays
        keep &= ~torch.zeros_like(drop).scatter(1, order, drop)
    cdf = (probs * keep).double().cumsum(dim=-1)
    target = (u.to(cdf.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=vocab - 1)
