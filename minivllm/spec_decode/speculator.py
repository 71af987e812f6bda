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
from minivllm.spec_decode.cost import Payoff, StepCostTable
from minivllm.spec_decode.exploration import Exploration
from minivllm.spec_decode.proposer import Proposer
from minivllm.spec_decode.records import SpecDecodeStats, SpecRecord


class Speculator:
    """Proposes for the running sequences before a step, verifies their rows after it.

    Adaptive (--speculative-adaptive): proposals go into a step only when measured costs say the step then
    yields tokens faster. Costs come from a table of all-decode steps by rows (a verification step is one:
    its proposals are decode rows), priced at the next measured size where a size was not measured, plus
    the proposer's own measured time (a draft model's forwards, one per proposal position). When the step
    would otherwise be a pure decode of n rows, proposal positions (best expected gain first: the
    position's acceptance rate over all drafts, scaled by the sequence's own record) are added while
    (n + expected accepted) / (cost(n + proposed rows) + proposer time) beats n / cost(n) by MARGIN. So
    each sequence proposes as many tokens (up to k) as pay: at batch 1 a good proposer's whole k, a draft
    whose later guesses rarely hold one or two, in a large batch (where extra rows' FLOPs cost what they
    yield) none; a request whose proposals keep failing pauses proposing. A step with prefill chunks gets no
    proposals. A size never measured is tried once; and now and then a batch size that has gone without speculation
    lets the best proposal through anyway (Exploration), so one unlucky measurement cannot switch it off for good.

    The costs are predictions from the forward's time; what steps with proposals really yield is measured too
    (Payoff): each pure-decode step's whole wall time (rejection sampling, proposer and outputs included) and its
    tokens (with proposals: those they were expected to yield, see Payoff), by its number of sequences; one plain
    step now and then keeps the rate without proposals measured. Where steps with proposals have yielded fewer
    tokens per second than plain steps of the same size, proposals stop at that size (exploration still re-measures
    them). A step that speculates after a pause of more than one step counts its proposer at the proposer's usual
    round time, not at what this round took: a draft model catches up on the whole pause in it (~128 tokens through
    its prefill path after an exploration's pause), which steady speculation does not pay; counted, those rounds kept
    an exploration from ever finding that proposals pay again (a batch-1 draft stopped at 0.8x of what speculating
    every step gave)."""

    # A sequence's record weighs its recent drafts most (each older one by RECENT more): how well a text is
    # guessed changes as it goes (a proposer that failed on fresh code guesses a repeated block well). A
    # sequence withheld for its record forgets some of it each step (FORGET), so it proposes again
    # later instead of never: without that, n-gram speculation on repetitive text stopped for good in most
    # sequences after a few early misses (738 of 837 steps without proposals, against 141 with the rule off).
    RECENT = 0.75
    FORGET = 0.9
    # A step must be expected to yield this much faster with its proposals: a smaller gain is within the
    # step-to-step spread of the measurements (contexts differ, the machine drifts), so not worth the risk.
    MARGIN = 1.05
    # A "no" from _may_pay holds this many steps at its batch size while nothing it weighs but the plain step's cost
    # has changed (no step has speculated since): the check costs ~65 us, 2% of an 8-stream step of the embedded
    # model, paid on every step a draft that does not pay there sits attached (measured: the draft at 8 streams
    # proposed in 2 of 129 steps and the rest paid the check).
    RECHECK_EVERY = 16
    # Until this many drafts were verified, a pure-decode step whose proposals are not expected to pay still sends
    # the best candidate's whole proposal through: the acceptance by position starts at even odds (position_rates),
    # and at 8 streams even odds did not pay once n-gram and suffix lookups were priced (0.1-0.2 ms a sequence in
    # the step), so an engine that met many streams first never proposed and never learned that its proposals hold
    # (85-97% on code; the explorations' one token a few hundred steps apart measured only the first position).
    LEARN_DRAFTS = 16
    # FORCED_CATCH_UP: what learning or an exploration sends through against its costs goes only to a sequence the
    # proposer need not catch up on (catch_up_cost 0: n-gram and suffix always; a draft, where it kept up). A draft
    # that paused on a sequence first runs all of it through its prefill (~220 tokens, 5-8 ms; an 8-stream step 2.8
    # ms). (The draft's 2-6% loss at 8 streams on a Zen 4 stayed after this, proposing 5 tokens in a whole run: that
    # loss is the attached speculator's per-step work, BENCHMARKS.md 2026-12-06.)

    def __init__(self, proposer: Proposer, k: int, max_model_len: int, adaptive: bool) -> None:
        self.proposer, self.k, self.adaptive = proposer, k, adaptive
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_position=[0] * k, proposed_per_position=[0] * k)
        self.steps = StepCostTable()  # all-decode steps' model time by rows
        self.num_skipped = 0  # proposal tokens withheld because they were not expected to pay
        self.draft_probs: dict[int, torch.Tensor] = {}  # seq_id → [k, V] what its proposals were drawn from
        self.proposing: list[Sequence] = []  # this step's speculating sequences
        self.records: dict[int, SpecRecord] = {}  # seq_id → its record, from its first verification to its end
        self._step = self._last_spec = 0  # steps proposed for, and the last one that speculated
        self.exploration = Exploration()
        self.payoff = Payoff()
        # The step in progress, for the payoff: its start, sequences, whether it proposed, the tokens it produced
        # (None: not a pure-decode step, not measured).
        self._began, self._seqs, self._speculated = 0.0, 0, False
        self._tokens: int | None = None
        self._excess = 0.0  # seconds of the step in progress not counted in its payoff (see the class docstring)
        self._expected = 0.0  # tokens its proposals were expected to yield, plain rows included (see Payoff)
        self._version = 0  # steps that speculated so far: what _may_pay weighs besides plain steps changed
        self._no_pay: dict[int, tuple[int, int]] = {}  # sequences → (version, step) a "no" was found at

    # ---- cost model ----------------------------------------------------------------------------
    def observe(self, scheduled: list[tuple[Sequence, int]], seconds: float, first: bool = False) -> None:
        """One step's model time, if it was all decode rows (one-token decodes and verifications); steps
        with prefill chunks are left out (long chunks' attention is another shape). The runner's first step of a size
        (first: its shapes' set-up in it, see ModelRunner.last_forward_first) prices its size less the set-up measured
        elsewhere until the size's next step (StepCostTable.observe), and stays out of the payoff."""
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

    def position_rates(self) -> list[float]:
        """P(proposal i is accepted) for each position i < k, over all drafts that reached i (Laplace-smoothed:
        a position never tried counts as even odds, so it gets tried)."""
        st = self.stats
        return [(a + 1) / (n + 2) for a, n in zip(st.accepted_per_position, st.proposed_per_position, strict=True)]

    def _factor(self, seq: Sequence) -> float:
        """How seq's proposals fare against all drafts' (accepted / expected at their positions), once it has
        a history of its own: a request whose proposals keep failing pauses proposing (see FORGET)."""
        rec = self.records.get(seq.seq_id)
        return (rec.accepted + 1) / (rec.expected + 1) if rec is not None and rec.drafts >= 4 else 1.0

    def _gains(self, seq: Sequence, rates: list[float]) -> list[float]:
        """seq's expected gain at each proposal position: the position's acceptance rate scaled by seq's record,
        never above the position before (a sequence's units stay in order)."""
        f, g, out = self._factor(seq), float("inf"), []
        for rate in rates:
            g = min(g, rate * f)
            out.append(g)
        return out

    def _may_pay(self, num_seqs: int, pure_decode: bool) -> bool:
        """Whether proposals at the batch's usual acceptance could pay for one sequence or for all of them, at
        some proposal length (the yield per second is monotone in how many speculate, so the ends decide);
        a cheap check before any proposing."""
        if not pure_decode:
            return False  # see worth()
        held = self._no_pay.get(num_seqs)
        if held is not None and held[0] == self._version and self._step - held[1] < self.RECHECK_EVERY:
            return self.exploration.due(num_seqs)  # (see RECHECK_EVERY)
        if self.stats.num_drafts < self.LEARN_DRAFTS:
            return True  # (see LEARN_DRAFTS)
        base = self.steps.measured(num_seqs)
        if base is None:
            return False  # measure the plain decode step first
        plain_rate = self.MARGIN * num_seqs / max(base, 1e-9)
        over = self.proposer.overhead
        e = 0.0
        for length, rate in enumerate(self.position_rates(), start=1):
            e += rate
            for m in (1, num_seqs):
                cost = self.steps.estimate(num_seqs + m * length)
                if cost is None or (num_seqs + m * e) / max(cost + over(length, m * length, m), 1e-9) > plain_rate:
                    return True
        self._no_pay[num_seqs] = (self._version, self._step)
        return self.exploration.due(num_seqs)

    def worth(self, candidates: list[tuple[Sequence, int]], num_seqs: int, pure_decode: bool
              ) -> list[tuple[Sequence, int]]:
        """The candidates (sequence, longest proposal it may take) worth verifying in a step of num_seqs
        sequences (pure_decode: every one of them a one-token decode), each with the proposal length that
        pays best. Each proposal position is a unit of expected gain (its acceptance rate, scaled by the
        sequence's own record); units are added best first while the step's expected yield per second
        improves, so a draft whose later positions rarely hold proposes fewer tokens, and in a large
        batch, where extra rows cost as much as they yield, none at all."""
        if not pure_decode:
            # A step with prefill chunks: its cost is not in the table (another shape), and the sequences that
            # would speculate wait for the chunks anyway; measured on 64 arriving requests, proposals there
            # cost throughput (the batch finishes with its slowest sequence) and gained nothing.
            return []
        base = self.steps.measured(num_seqs)
        if base is None:
            return []  # measure the plain decode step first
        if self.payoff.loses(num_seqs) and not self.exploration.due(num_seqs):
            return []  # steps of this size with proposals have yielded less than without
        rates = self.position_rates()
        units: list[tuple[float, int]] = []  # (expected gain, candidate index), positions in order per candidate
        upfront = [0.0] * len(candidates)  # each candidate's catch-up, per step it has left (see _upfront)
        for j, (seq, k) in enumerate(candidates):
            gains = self._gains(seq, rates[:k])
            upfront[j] = self._upfront(seq, gains, base / num_seqs)
            if upfront[j] < float("inf"):
                units += [(g, j) for g in gains]
        units.sort(key=lambda u: -u[0])  # stable: ties keep each sequence's positions in order
        over = self.proposer.overhead
        lengths = [0] * len(candidates)
        taken = 0  # candidates with a unit so far: the sequences a round would look up
        best_rate, best, longest, gained = self.MARGIN * num_seqs / max(base, 1e-9), 0, 0, 0.0
        extra = 0.0  # the catch-ups of the candidates taken so far
        for i, (g, j) in enumerate(units, start=1):
            lengths[j] += 1
            longest, gained = max(longest, lengths[j]), gained + g
            if lengths[j] == 1:
                extra, taken = extra + upfront[j], taken + 1
            cost = self.steps.estimate(num_seqs + i)
            if cost is None:  # a size never measured, nor two to price it from: take it to measure it
                best = i
                break
            rate = (num_seqs + gained) / max(cost + over(longest, i, taken) + extra, 1e-9)
            if rate > best_rate:
                best_rate, best = rate, i
        if not best:
            # A proposal its costs did not choose (learning, exploring) only where the proposer need not catch up
            # first (see FORCED_CATCH_UP): the best such candidate.
            j = next((i for _, i in units if not upfront[i]), -1)
            if j >= 0 and self.stats.num_drafts < self.LEARN_DRAFTS:  # (see LEARN_DRAFTS: its whole proposal)
                return [(candidates[j][0], sum(1 for _, i in units if i == j))]
            due = self.exploration.due(num_seqs)
            if j >= 0 and due:
                return [(candidates[j][0], 1)]
            if j < 0 and units and (due or self.stats.num_drafts < self.LEARN_DRAFTS):
                # Nothing to try without a catch-up: the check held as a "no" (see RECHECK_EVERY) and the
                # exploration counted as one that found nothing, so the next steps do not redo this one.
                self._no_pay[num_seqs] = (self._version, self._step)
                if due:
                    self.exploration.skipped(num_seqs)
        lengths = [0] * len(candidates)
        for _, j in units[:best]:
            lengths[j] += 1
        return [(seq, n) for (seq, _), n in zip(candidates, lengths, strict=True) if n]

    def _upfront(self, seq: Sequence, gains: list[float], token_s: float) -> float:
        """The proposer's catch-up on seq (a draft that has not seen its prompt and output so far), spread over the
        steps seq has left if it proposes every one (at most its tokens left, fewer by what its proposals yield a
        step); inf where even its whole expected gain at a plain step's price a token (token_s) would not pay that
        share: a sequence near its end is not worth a prompt's catch-up. Counted nowhere, proposals for the 28-49
        sequences left at the tail of a 64-sequence batch took 25-53 ms a round of catch-ups and the draft ran
        0.92-0.94x its engine without it (2026-12-05)."""
        cost = self.proposer.catch_up_cost(seq)
        if not cost:
            return 0.0
        p = seq.sampling_params
        left = self.max_model_len - seq.num_tokens
        if p.max_tokens is not None:
            left = min(left, p.max_tokens - seq.num_output_tokens)
        share = cost / max(left / (1.0 + sum(gains)), 1.0)
        return share if share < sum(gains) * token_s else float("inf")

    def forget_withheld(self, candidates: list[tuple[Sequence, int]], kept: list[tuple[Sequence, int]]) -> None:
        """The candidates withheld this step forget some of their record (FORGET), so a bad early record
        does not silence a sequence for good."""
        chosen = {seq.seq_id for seq, _ in kept}
        for seq, _ in candidates:
            rec = self.records.get(seq.seq_id)
            if seq.seq_id not in chosen and rec is not None and rec.drafts >= 4:
                rec.accepted *= self.FORGET
                rec.expected *= self.FORGET

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
        self.end_step()  # proposals left by a step that raised
        self._step += 1
        now = time.perf_counter()
        self._close_step(now)
        if not running:
            return []
        self.exploration.tick(len(running))
        lacking = [s.num_tokens - s.num_computed_tokens for s in running]
        pure_decode = not waiting and all(n <= 1 for n in lacking)  # waiting requests: prefill chunks join
        self._began, self._seqs, self._speculated, self._excess = now, len(running), False, 0.0
        self._tokens = 0 if pure_decode else None
        if self.adaptive and not self._may_pay(len(running), pure_decode):
            return []  # not even typical proposals for everyone would pay: skip the proposing
        if self.adaptive and pure_decode and self.payoff.wants_plain(len(running)):
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
            kept = self.worth(batch, len(running), pure_decode)
            self.num_skipped += sum(k for _, k in batch) - sum(k for _, k in kept)
            self.forget_withheld(batch, kept)
            batch = kept
        t = time.perf_counter()
        found = self.proposer.propose(batch) if batch else []
        gap = self._step - self._last_spec
        if found and gap > 2:  # (a pause's catch-up: the round counted at its usual time)
            usual = self.proposer.overhead(max(k for _, k in batch), sum(k for _, k in batch), len(batch))
            self._excess = max(time.perf_counter() - t - usual, 0.0)
        for seq, spec, dist in found:
            seq.spec_token_ids = spec
            if dist is not None:
                self.draft_probs[seq.seq_id] = dist
        self.proposing = [seq for seq, _, _ in found]
        if found:
            self._speculated_at(len(running), self.exploration.due(len(running)))
            self._speculated = True
            rates = self.position_rates()
            # (a record above the average scales a gain past certainty: at most a token each)
            self._expected = len(running) + sum(min(g, 1.0) for seq, spec, _ in found
                                                for g in self._gains(seq, rates[:len(spec)]))
        return self.proposing

    def _speculated_at(self, num_seqs: int, exploring: bool) -> None:
        """This step of num_seqs sequences speculates (exploring: only because an exploration was due); what _may_pay
        weighed may have moved."""
        self.exploration.speculated(num_seqs, exploring)
        self._last_spec = self._step
        self._version += 1

    def end_step(self) -> None:
        """After the step: proposals cleared, the proposer's state rolled back to what was accepted."""
        for seq in self.proposing:
            seq.spec_token_ids = []
        self.proposing = []
        self.draft_probs.clear()
        self.proposer.settle()

    def release(self, seq: Sequence) -> None:
        """seq finished, was aborted or was preempted: the proposer lets go of what it holds for it."""
        self.proposer.release(seq)

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
            rec = self.records.setdefault(seq.seq_id, SpecRecord())
            rec.drafts += 1
            rec.accepted = self.RECENT * rec.accepted + j
            rec.expected = self.RECENT * rec.expected + sum(self.position_rates()[:len(proposed)])
            st.num_drafts += 1
            st.num_draft_tokens += len(proposed)
            st.num_accepted_tokens += j
            for i in range(len(proposed)):
                st.proposed_per_position[i] += 1
            for i in range(j):
                st.accepted_per_position[i] += 1
