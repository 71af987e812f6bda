"""The sampling half of a step, behind the runner: one step's logits rows in, token ids and logprobs out.

The engine describes in plain data what each row is for (SamplingRequest): a draw for a slot of the persistent
input batch (n > 1 forks draw several times from one row), a speculating sequence's verification (its proposals
checked by greedy comparison or rejection sampling with its slot's settings and penalties), a beam's next-token
log-probabilities, a prompt position's logprob; and which logits processors (guided decoding's masks) change the
rows first. The logits never leave the runner: the engine reads tokens and logprobs (RunnerOutput).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minivllm.model.input_batch import InputBatch
from minivllm.model.rejection_sampler import greedy_kept, verify_proposals
from minivllm.model.sampler import Sampler, SamplerOutput, TokenLogprobs


@dataclass(slots=True)
class Verification:
    """A speculating sequence's rows [row, row + num_rows): after its last token, then after each proposal."""

    row: int
    num_rows: int
    slot: int  # its input-batch slot (settings, penalties, seeded generator)
    proposed: list[int]
    draft_probs: torch.Tensor | None  # [k, V] what a draft model drew the proposals from (None: looked up)


@dataclass(slots=True)
class SamplingRequest:
    """What to do with a step's logits rows (plain data: the model knows no requests)."""

    samples: list[tuple[int, int]] = field(default_factory=list)  # (row, slot): one draw each, in this order
    verifications: list[Verification] = field(default_factory=list)
    beam_rows: list[int] = field(default_factory=list)  # rows whose log-softmax beam search reads
    prompt_rows: list[int] = field(default_factory=list)  # prompt logprobs: each row scores one target token
    prompt_targets: list[int] = field(default_factory=list)
    prompt_nums: list[int] = field(default_factory=list)  # top-N alternatives per prompt row
    # Change rows in place before anything reads them (guided decoding's token masks).
    logits_processors: list[Callable[[torch.Tensor], None]] = field(default_factory=list)


@dataclass(slots=True)
class RunnerOutput:
    """A step's tokens and logprobs, in the order the request listed them."""

    sampled: SamplerOutput | None
    verified: list[list[int]]  # per verification: the tokens kept (accepted proposals, then one more)
    beam_logprobs: torch.Tensor | None  # [len(beam_rows), V] float32 on the CPU
    prompt_logprobs: list[TokenLogprobs]
    seconds: float  # spent here


class StepSampler:
    """The runner's sampler and persistent input batch, run on a step's logits."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.sampler = Sampler(device, seed)
        self.input_batch = InputBatch()

    @torch.inference_mode()
    def run(self, logits: torch.Tensor, req: SamplingRequest) -> RunnerOutput:
        """Prompt logprobs and beams (raw rows), then the processors, then draws (in place), then verifications."""
        t0 = time.perf_counter()
        prompt = (self.sampler.logprobs_of(logits[req.prompt_rows], req.prompt_targets, req.prompt_nums)
                  if req.prompt_rows else [])
        beams = (torch.log_softmax(logits[req.beam_rows].float(), dim=-1).cpu() if req.beam_rows else None)
        for process in req.logits_processors:
            process(logits)
        sampled = None
        if req.samples:
            batch = self.input_batch
            step_rows = batch.rows([s for _, s in req.samples])
            idx = [r for r, _ in req.samples]
            # Usually every logits row is drawn once, in order: the sampler then works on the logits in place.
            sampled = self.sampler.sample(logits if idx == list(range(logits.shape[0])) else logits[idx], batch,
                                          step_rows)
            batch.append(step_rows, sampled.tokens)
        verified = self._verify(logits, req.verifications) if req.verifications else []
        return RunnerOutput(sampled, verified, beams, prompt, time.perf_counter() - t0)

    def _verify(self, logits: torch.Tensor, vs: list[Verification]) -> list[list[int]]:
        """Each verification's kept tokens. The greedy ones without penalties share one argmax over their rows (one
        by one, each sequence's settings, slice and argmax cost ~25 us: 0.2 ms of an 8-stream verification step);
        the others verify_proposals each."""
        batch = self.input_batch
        greedy = batch.greedy_unpenalized([v.slot for v in vs])
        out: list[list[int]] = []
        picked = [v for v, g in zip(vs, greedy, strict=True) if g]
        target: list[int] = []
        at: dict[int, int] = {}  # a picked verification's first row → where its argmaxes start in target
        if picked:
            lo, hi = min(v.row for v in picked), max(v.row + v.num_rows for v in picked)
            if hi - lo <= 2 * sum(v.num_rows for v in picked):  # (usually one span, a view: plain rows between are few)
                target, at = self.sampler.greedy(logits[lo:hi]).tolist(), {v.row: v.row - lo for v in picked}
            else:
                index = [r for v in picked for r in range(v.row, v.row + v.num_rows)]
                target = self.sampler.greedy(logits[index]).tolist()
                off = 0
                for v in picked:
                    at[v.row], off = off, off + v.num_rows
        for v, g in zip(vs, greedy, strict=True):
            if g:
                a = at[v.row]
                out.append(greedy_kept(v.proposed[:v.num_rows - 1], target[a:a + v.num_rows]))
            else:
                settings = batch.verify_settings(v.slot, logits.shape[1])
                generator = batch.generator(v.slot) or self.sampler.generator
                out.append(verify_proposals(logits[v.row:v.row + v.num_rows], v.proposed, v.draft_probs, settings,
                                            generator))
        return out
