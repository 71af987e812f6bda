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

from minivllm.model.sampler import draw_from


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
