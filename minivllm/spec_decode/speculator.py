"""Speculative decoding inside continuous batching: proposals before a step, verification after it.

Before a step, eligible decoding sequences get up to k proposed tokens (`seq.spec_token_ids`) from the
proposer: n-gram prompt lookup (spec_decode/ngram_proposer.py, no model) or a draft model on its own KV pool
(spec_decode/draft_proposer.py). The scheduler schedules the sequence's last token plus its proposals; the
runner computes them as single-token decode rows (verify_rows) and returns logits for each. Verification
keeps, for a greedy request, the longest run of proposals equal to the target's argmax plus the target's
own token after it (exactly the tokens it would produce without speculation); for a sampled request,
rejection sampling keeps a run distributed exactly as the target's own samples under its penalties, temperature,
top-k, top-p and min-p (both in model/rejection_sampler.py, run by the runner's sampler on what `verification`
describes; `record` takes the outcome). The K/V written for rejected proposals lies beyond
the sequence's computed tokens: never read, overwritten later, and never hashed for prefix caching.

Eligible: requests without logprobs or pending min_tokens, and not beam search (those decode as usual).
"""

from __future__ import annotations

import time

import torch

from minivllm.engine.sequence import Sequence
from minivllm.model.step_sampling import Verification
from minivllm.spec_decode.adaptive import AdaptiveRule
from minivllm.spec_decode.proposer import Proposer
from minivllm.spec_decode.records import SpecRecord


class Speculator(AdaptiveRule):
    """Proposes for the running sequences before a step, verifies their rows after it.

    The adaptive rule (--speculative-adaptive) that decides which proposals go into a step, from measured costs and
    yields: AdaptiveRule (spec_decode/adaptive.py)."""

    def __init__(self, proposer: Proposer, k: int, max_model_len: int, adaptive: bool) -> None:
        super().__init__(proposer, k, max_model_len)
        self.adaptive = adaptive
        self.draft_probs: dict[int, torch.Tensor] = {}  # seq_id → [k, V] what its proposals were drawn from
        self.proposing: list[Sequence] = []  # this step's speculating sequences
        # The step in progress, for the payoff: its start, sequences, whether it proposed, the tokens it produced
        # (None: not a pure-decode step, not measured).
        self._began, self._seqs, self._speculated = 0.0, 0, False
        self._tokens: int | None = None
        self._excess = 0.0  # seconds of the step in progress not counted in its payoff (see AdaptiveRule)
        self._expected = 0.0  # tokens its proposals were expected to yield, plain rows included (see Payoff)
        self._unsettled = False  # the proposer was asked this step: end_step settles it (a step that raised: propose)
        self._sitting_out = False  # this step is one a held "no" sits out (see SIT_OUT)
        self._pricing = False  # and one of the last before its recheck, whose cost goes into the table

    # ---- cost model ----------------------------------------------------------------------------
    def observe(self, scheduled: list[tuple[Sequence, int]], seconds: float, first: bool = False) -> None:
        """One step's model time, if it was all decode rows (one-token decodes and verifications); steps
        with prefill chunks are left out (long chunks' attention is another shape). The runner's first step of a size
        (first: its shapes' set-up in it, see ModelRunner.last_forward_first) prices its size less the set-up measured
        elsewhere until the size's next step (StepCostTable.observe), and stays out of the payoff."""
        if self._sitting_out:  # (see SIT_OUT)
            if self._pricing and sum(n for _, n in scheduled) == len(scheduled):
                self.steps.observe(len(scheduled), seconds, first)
            return
        rows = plain = 0
        for seq, n in scheduled:
            if not seq.spec_token_ids:
                if n != 1:
                    self._tokens = None  # a prefill chunk: neither in the table nor in the payoff
                    return
                plain += 1
            rows += n
        self.steps.observe(rows, seconds, first)
        if first:
            self._tokens = None
        if self._tokens is not None:  # plain rows yield a token each; verifications count theirs in record()
            self._tokens += plain

    def _close_step(self, now: float) -> None:
        """The last step's payoff, once the next one begins (its outputs were built in between)."""
        if self._tokens and self._seqs:
            tokens = self._expected if self._speculated else self._tokens
            self.payoff.observe(self._seqs, self._speculated, tokens, now - self._began - self._excess)
        self._tokens = None

    # ---- proposing -------------------------------------------------------------------------------
    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether seq's next tokens may be proposed: a decode whose tokens depend on nothing but the
        target's distribution at each position, penalties included (no logprobs, pending min_tokens or
        beams)."""
        group = seq.group
        p = seq.sampling_params
        return (group is not None and group.beam is None and p.logprobs is None
                and seq.num_output_tokens >= p.min_tokens and seq.num_computed_tokens == seq.num_tokens - 1)

    def propose(self, running: list[Sequence], waiting: bool = False) -> list[Sequence]:
        """Set spec_token_ids of the eligible running sequences whose proposals are worth it (never past
        max_tokens or the context); returns those (end_step clears them after the step)."""
        if self._unsettled:
            self.end_step()  # proposals left by a step that raised
        self._step += 1
        now = time.perf_counter()
        self._close_step(now)
        self._sitting_out = False
        if not running:
            return []
        num_seqs = len(running)
        self.exploration.tick(num_seqs)
        hold = self._holding(num_seqs) if self.adaptive else None
        if hold is not None and not self.exploration.due(num_seqs):
            # (see SIT_OUT: the last steps before the recheck price the size for it)
            self._tokens, self._sitting_out = None, True
            self._pricing = self._step - hold[1] >= hold[2] - self.steps.keep
            return []
        # waiting requests: prefill chunks join
        pure_decode = not waiting and all(s.num_tokens - s.num_computed_tokens <= 1 for s in running)
        self._began, self._seqs, self._speculated, self._excess = now, num_seqs, False, 0.0
        self._tokens = 0 if pure_decode else None
        if self.adaptive and not self._may_pay(num_seqs, pure_decode):
            return []  # not even typical proposals for everyone would pay: skip the proposing
        if self.adaptive and pure_decode and self.payoff.wants_plain(num_seqs):
            return []  # a plain step to measure the rate proposals must beat
        batch = []
        for seq in running:
            if not self.eligible(seq):
                continue
            p = seq.sampling_params
            room = self.max_model_len - seq.num_tokens
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)  # the target adds one token anyway
            if (k := min(self.k, room)) > 0:
                batch.append((seq, k))
        if self.adaptive and batch:
            kept = self.worth(batch, num_seqs, pure_decode)
            self.num_skipped += sum(k for _, k in batch) - sum(k for _, k in kept)
            self.forget_withheld(batch, kept)
            batch = kept
        t = time.perf_counter()
        self._unsettled = bool(batch)
        found = self.proposer.propose(batch) if batch else []
        gap = self._step - self._last_spec
        if found and gap > 2:  # (a pause's catch-up: the round counted at its usual time)
            usual = self.proposer.overhead(max(k for _, k in batch), sum(k for _, k in batch), len(batch))
            self._excess = max(time.perf_counter() - t - usual, 0.0)
        if len(found) < len(batch):
            # A lookup that found nothing goes into its sequence's record as a draft none of whose tokens held: the
            # rule prices a round by the sequences looked up and the gain by the acceptance of what was proposed, so a
            # suffix lookup (0.1-0.2 ms a round at 8 streams) on fresh code, hitting a few times a run, kept being
            # paid for (0.975-0.981x at 8 streams, 2026-12-06).
            hit, rates = {seq.seq_id for seq, _, _ in found}, self.position_rates()
            for seq, k in batch:
                if seq.seq_id not in hit:
                    self._note(seq, 0, sum(rates[:k]))
        for seq, spec, dist in found:
            seq.spec_token_ids = spec
            if dist is not None:
                self.draft_probs[seq.seq_id] = dist
        self.proposing = [seq for seq, _, _ in found]
        if found:
            self._speculated_at(num_seqs, self.exploration.due(num_seqs))
            self._speculated = True
            rates = self.position_rates()
            # (a record above the average scales a gain past certainty: at most a token each)
            self._expected = num_seqs + sum(min(g, 1.0) for seq, spec, _ in found
                                                for g in self._gains(seq, rates[:len(spec)]))
        elif self.adaptive and pure_decode and self.exploration.due(num_seqs):
            # A due exploration that proposed nothing (no sequence eligible, no match found) found nothing: left due,
            # every step after it would pay the checks (see SIT_OUT).
            self.exploration.skipped(num_seqs)
        return self.proposing

    def end_step(self) -> None:
        """After the step: proposals cleared, the proposer's state rolled back to what was accepted."""
        if not self._unsettled:
            return  # (nothing proposed this step)
        self._unsettled = False
        for seq in self.proposing:
            seq.spec_token_ids = []
        self.proposing = []
        self.draft_probs.clear()
        self.proposer.settle()

    def release(self, seq: Sequence) -> None:
        """seq finished, was aborted or was preempted: the proposer lets go of what it holds for it; the batch changed,
        so no "no" found for the old one holds (see HELD_NO)."""
        self.proposer.release(seq)
        self._no_pay.clear()

    def forget(self, seq: Sequence) -> None:
        """seq finished or was aborted: its record goes too (a preempted one keeps it for when it resumes)."""
        self.release(seq)
        self.records.pop(seq.seq_id, None)

    # ---- verification ----------------------------------------------------------------------------
    def verification(self, seq: Sequence, row: int, num_rows: int) -> Verification:
        """What the runner verifies for seq this step (rows [row, row + num_rows): after its last token and after
        each proposal the step budget kept)."""
        assert seq.slot >= 0, "the engine gives a verifying sequence its slot first"
        return Verification(row, num_rows, seq.slot, seq.spec_token_ids[:num_rows - 1],
                            self.draft_probs.get(seq.seq_id))

    def record(self, seq: Sequence, proposed: list[int], kept: list[int]) -> None:
        """A verification's outcome into the stats and seq's record: proposals 0..len(kept) - 2 held."""
        j = len(kept) - 1
        if self._tokens is not None:
            self._tokens += len(kept)
        st = self.stats
        if proposed:
            self._note(seq, j, sum(self.position_rates()[:len(proposed)]))
            st.num_drafts += 1
            st.num_draft_tokens += len(proposed)
            st.num_accepted_tokens += j
            for i in range(len(proposed)):
                st.proposed_per_position[i] += 1
            for i in range(j):
                st.accepted_per_position[i] += 1

    def _note(self, seq: Sequence, accepted: int, expected: float) -> None:
        """One draft of seq's into its record (see RECENT): accepted tokens of the expected."""
        rec = self.records.setdefault(seq.seq_id, SpecRecord())
        rec.drafts += 1
        rec.accepted = self.RECENT * rec.accepted + accepted
        rec.expected = self.RECENT * rec.expected + expected
