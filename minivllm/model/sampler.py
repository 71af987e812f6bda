"""Vectorized sampling over the whole batch of logits rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step (plain data built by the engine)."""

    temperatures: list[float]  # 0 for greedy rows
    generators: list[torch.Generator | None]  # a request's own seeded generator, else None
    banned: list[list[int]]  # token ids a row may not produce this step (EOS/stop ids before min_tokens)

    @property
    def all_greedy(self) -> bool:
        """Whether every row takes the argmax."""
        return not any(self.temperatures)


class Sampler:
    """Turns one step's logits [S, vocab] into one token id per row."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> list[int]:
        """One token per row: argmax for greedy rows, a temperature-scaled draw for the others."""
        if any(md.banned):
            rows = [i for i, ids in enumerate(md.banned) for _ in ids]
            cols = [t for ids in md.banned for t in ids]
            logits[rows, cols] = float("-inf")
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy.tolist()  # fast path: no softmax over the vocabulary
        temps = torch.tensor([t or 1.0 for t in md.temperatures], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        drawn = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        # Seeded requests draw from their own generator so their tokens do not depend on the batch.
        for i, g in enumerate(md.generators):
            if g is not None and md.temperatures[i]:
                drawn[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        is_greedy = torch.tensor([not t for t in md.temperatures], device=logits.device)
        return torch.where(is_greedy, greedy, drawn).tolist()
