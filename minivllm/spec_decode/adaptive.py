"""The adaptive speculation rule: which proposals go into a step, from what steps and proposals were measured to cost
and yield (AdaptiveRule; the Speculator, spec_decode/speculator.py, proposes and verifies on top of it)."""

from __future__ import annotations

from minivllm.engine.sequence import Sequence
from minivllm.spec_decode.cost import Payoff, StepCostTable
from minivllm.spec_decode.exploration import Exploration
from minivllm.spec_decode.proposer import Proposer
from minivllm.spec_decode.records import SpecDecodeStats, SpecRecord


class AdaptiveRule:
    """Adaptive speculation (--speculative-adaptive): proposals go into a step only when measured costs say the step
    then yields tokens faster. Costs come from a table of all-decode steps by rows (a verification step is one:
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
    # proposed in 2 of 129 steps and the rest paid the check). HELD_NO: a "no" from worth (which weighs what the cheap
    # check cannot: catch-ups) holds alike, unless a sequence's record held it back (a held record forgets nothing
    # while withheld, FORGET), and a sequence leaving the batch ends every hold: held by _may_pay alone, worth's "no"
    # came in 36 of 128 steps of the draft at 8 streams, each paying both checks (the hook 32 us a step before the
    # schedule; 2026-12-06, the Zen 5).
    RECHECK_EVERY = 16
    # A recheck that finds "no" again (nothing speculated since) holds twice as long, up to this: a recheck that ends in
    # worth costs ~100 us on cold caches, 8 of them a 128-step 8-stream run of the draft (2026-12-06, the Zen 5).
    RECHECK_MAX = 128
    # Until this many drafts were verified, a pure-decode step whose proposals are not expected to pay still sends
    # the best candidate's whole proposal through: the acceptance by position starts at even odds (position_rates),
    # and at 8 streams even odds did not pay once n-gram and suffix lookups were priced (0.1-0.2 ms a sequence in
    # the step), so an engine that met many streams first never proposed and never learned that its proposals hold
    # (85-97% on code; the explorations' one token a few hundred steps apart measured only the first position).
    LEARN_DRAFTS = 16
    # FORCED_CATCH_UP: what learning or an exploration sends through against its costs goes only to a sequence the
    # proposer need not catch up on (catch_up_cost 0: n-gram and suffix always; a draft, where it kept up). A draft
    # that paused on a sequence first runs all of it through its prefill (~220 tokens, 5-8 ms; an 8-stream step 2.8
    # ms). (The draft's 2-6% loss at 8 streams on the Zen 5 EPYC stayed after this, proposing 5 tokens in a whole
    # run: that loss is the attached speculator's per-step work, BENCHMARKS.md 2026-12-06; see SIT_OUT.)
    # SIT_OUT: a step whose batch size a "no" holds at is one the speculator sits out: no check and no payoff (a plain
    # rate matters where a size speculates, and there wants_plain measures it); the last few before a recheck (the
    # table's window) put their cost into the table, so the recheck prices the size as it is now, not as it was one
    # recheck (up to RECHECK_MAX steps) before. Python right after a forward runs on cold caches: measured every step,
    # the attached draft's hooks took 45 us of a 2.6 ms 8-stream step where it proposed 5 tokens a run (the payoff's
    # deque append alone 3.7 us); sitting out, ~12 us (~18 us where every step went into the table).

    def __init__(self, proposer: Proposer, k: int, max_model_len: int) -> None:
        self.proposer, self.k, self.max_model_len = proposer, k, max_model_len
        self.stats = SpecDecodeStats(accepted_per_position=[0] * k, proposed_per_position=[0] * k)
        self.steps = StepCostTable()  # all-decode steps' model time by rows
        self.num_skipped = 0  # proposal tokens withheld because they were not expected to pay
        self.records: dict[int, SpecRecord] = {}  # seq_id → its record, from its first verification to its end
        self._step = self._last_spec = 0  # steps proposed for, and the last one that speculated
        self.exploration = Exploration()
        self.payoff = Payoff()
        self._version = 0  # steps that speculated so far: what _may_pay weighs besides plain steps changed
        # sequences → (version, step) a "no" was found at, and the steps it holds (see RECHECK_EVERY)
        self._no_pay: dict[int, tuple[int, int, int]] = {}

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

    def _holding(self, num_seqs: int) -> tuple[int, int, int] | None:
        """The "no" found at this batch size, (version, step, steps it holds), while it holds (see RECHECK_EVERY)."""
        held = self._no_pay.get(num_seqs)
        return held if held is not None and held[0] == self._version and self._step - held[1] < held[2] else None

    def _held(self, num_seqs: int) -> bool:
        return self._holding(num_seqs) is not None

    def _hold_no(self, num_seqs: int) -> None:
        """A "no" found at this batch size: it holds RECHECK_EVERY steps, twice as long as the last one where that one
        held until its recheck found "no" again (nothing speculated since), up to RECHECK_MAX."""
        last, span = self._no_pay.get(num_seqs), self.RECHECK_EVERY
        if last is not None and last[0] == self._version:
            span = min(2 * last[2], self.RECHECK_MAX)
        self._no_pay[num_seqs] = (self._version, self._step, span)

    def _may_pay(self, num_seqs: int, pure_decode: bool) -> bool:
        """Whether proposals at the batch's usual acceptance could pay for one sequence or for all of them, at
        some proposal length (the yield per second is monotone in how many speculate, so the ends decide);
        a cheap check before any proposing."""
        if not pure_decode:
            return False  # see worth()
        if self._held(num_seqs):
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
        self._hold_no(num_seqs)
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
            self._hold_no(num_seqs)  # (see RECHECK_EVERY)
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
            if j < 0 and units and due:
                self.exploration.skipped(num_seqs)  # (nothing to try without a catch-up: one that found nothing)
            # The "no" holds as the cheap check's does (see RECHECK_EVERY), so the next steps skip both; not where a
            # sequence's record held it back, which forgets some of it every step it is withheld (FORGET).
            if all(self._factor(seq) >= 1.0 for seq, _ in candidates):
                self._hold_no(num_seqs)
            return []
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

    def _speculated_at(self, num_seqs: int, exploring: bool) -> None:
        """This step of num_seqs sequences speculates (exploring: only because an exploration was due); what _may_pay
        weighed may have moved."""
        self.exploration.speculated(num_seqs, exploring)
        self._last_spec = self._step
        self._version += 1
