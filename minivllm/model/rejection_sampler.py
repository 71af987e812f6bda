"""Rejection sampling of speculative proposals (Leviathan et al. 2023; Chen et al. 2023): the kept tokens are
distributed exactly as if the target had sampled them one at a time.

Proposal i was drawn from the proposer's distribution q_i (a point mass for a proposer that looks tokens
up rather than sampling them). It is accepted with probability min(1, p_i(x) / q_i(x)), p_i the target's
distribution at that position after the request's temperature, top-k, top-p and min-p; at the first
rejection a token is drawn from the residual max(p_i - q_i, 0) (renormalized) instead and the rest is
discarded; when every proposal is accepted, one more token is drawn from the target's next distribution.
Every call consumes exactly n + 1 uniforms of the given generator, so a seeded request replays the same
tokens whenever its proposals and the target's logits are the same.
"""

from __future__ import annotations

import torch

from minivllm.model.input_batch import VerifySettings
from minivllm.model.sampler import draw_from, penalize_dense, processed_probs


def rejection_sample(target: torch.Tensor, draft: torch.Tensor | None, proposed: list[int],
                     generator: torch.Generator) -> list[int]:
    """The tokens kept: the accepted run of `proposed`, then one token from the target side.

    target: [n + 1, V] the target's (unnormalized) processed probabilities at each proposal's position and
    at the position after the last; draft: [n, V] the distributions the proposals were drawn from (None:
    the proposals were given, each a point mass)."""
    n = len(proposed)
    u = torch.rand(n + 1, generator=generator, device=generator.device, dtype=torch.float64).cpu()
    p = target.double().cpu()
    p = p / p.sum(dim=-1, keepdim=True).clamp(min=1e-300)
    rows, ids = torch.arange(n), torch.tensor(proposed, dtype=torch.int64)
    px = p[rows, ids]
    q = None
    if draft is not None:
        q = draft.double().cpu()
        q = q / q.sum(dim=-1, keepdim=True).clamp(min=1e-300)
        qx = q[rows, ids]
    else:
        qx = torch.ones(n, dtype=torch.float64)
    rejected = (u[:n] * qx >= px).nonzero()
    j = int(rejected[0, 0]) if rejected.numel() else n
    if j == n:
        last = p[n]
    else:
        last = (p[j] - q[j]).clamp(min=0) if q is not None else p[j].clone()
        if q is None:
            last[proposed[j]] = 0.0
        if not last.sum() > 0:  # p == q up to rounding: a rejection had probability ~0; p itself is exact
            last = p[j]
    tok = int(draw_from(last[None], u[n:]).item())
    return proposed[:j] + [tok]


def greedy_kept(proposed: list[int], target: list[int]) -> list[int]:
    """A greedy verification's kept tokens: the run of proposals equal to the target's argmax at each position
    (target: the argmax after the last token, then after each proposal), then the argmax after that run."""
    j = 0
    while j < len(proposed) and proposed[j] == target[j]:
        j += 1
    return proposed[:j] + [target[j]]


@torch.inference_mode()
def verify_proposals(x: torch.Tensor, proposed: list[int], draft: torch.Tensor | None, settings: VerifySettings,
                     generator: torch.Generator) -> list[int]:
    """The tokens a speculating sequence keeps: x [n, V] are the target's logits at its last token and at each
    proposal verified after it (n - 1 of them; the step budget may have cut some off). Greedy: the run of
    proposals equal to the argmax, then the argmax after it; sampled: rejection_sample on the processed
    probabilities. Penalties as sampling would apply them at each position (row i counts the first i proposals
    among the outputs: they precede that position if accepted)."""
    proposed = proposed[:x.shape[0] - 1]
    if settings.penalties is not None:
        x = penalized_rows(x.float(), proposed, *settings.penalties)
    if settings.temperature == 0.0:
        return greedy_kept(proposed, x.argmax(dim=-1).tolist())
    n = x.shape[0]
    probs = processed_probs(x, torch.full((n,), settings.temperature), torch.full((n,), settings.top_k),
                            torch.full((n,), settings.top_p), torch.full((n,), settings.min_p))
    return rejection_sample(probs, None if draft is None else draft[:len(proposed)], proposed, generator)


def penalized_rows(x: torch.Tensor, proposed: list[int], counts: torch.Tensor, prompt_seen: torch.Tensor,
                   repetition: float, frequency: float, presence: float) -> torch.Tensor:
    """A verification's rows with its slot's penalties (counts [V] of its outputs so far, prompt_seen [V]): row i
    also counts the first i proposals as outputs."""
    rows = counts[None, :].repeat(x.shape[0], 1)
    for i, tok in enumerate(proposed):
        rows[i + 1:, tok] += 1
    return penalize_dense(x, rows.to(x.device), prompt_seen.to(x.device), repetition, frequency, presence)
