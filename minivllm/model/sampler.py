"""Vectorized sampling over the whole batch of logits rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minivllm.sampling_params import SamplingParams


class Sampler:
    """Turns one step's logits [S, vocab] into one token id per row."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int]:
        """One token per row: argmax for greedy rows, a temperature-scaled draw for the others."""
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy.tolist()  # fast path: no softmax over the vocabulary
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        drawn = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy, drawn).tolist()
