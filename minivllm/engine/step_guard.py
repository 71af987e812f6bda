"""Keeps a step's failures to the requests that caused them.

A forward that raises is retried on halves of the batch until the entries that fail alone are found
(bisection: about 2·log2(N) extra forwards, paid only when a step fails). Retrying is safe because a
forward only writes the K/V of its own tokens at their slots (a retry writes the same values again) and the
engine advances nothing before the forward returns. A speculating sequence's rows stay in one entry, as
its verification needs all of them in one forward.

Logits that are not finite (NaN, +Inf: a numerical blow-up, or a bad weight reached by one prompt) would
be sampled as garbage or make the sampler raise for the whole batch; the rows are checked (one sum per
row, ~0.1% of the lm_head's FLOPs) and their requests failed instead.

The entries of failed requests are dropped from the step with their logits rows and inputs; the engine
aborts those requests after the step and reports why (LLMEngine.take_failed_requests). The forward the guard
runs is the hooks' (engine/hooks.py): test fault injection wraps it there, not here."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minivllm.engine.async_stream import failure_text
from minivllm.engine.hooks import Entry, Forward
from minivllm.model.runner import SequenceInput
from minivllm.spec_decode.proposer import verify_rows

logger = logging.getLogger(__name__)

Span = tuple[int, int, int, int]  # one scheduled entry's inputs [i0, i1) and logits rows [r0, r1)


def runner_inputs(scheduled: list[Entry], every_row: bool = False) -> tuple[list[SequenceInput], list[Span]]:
    """One input per scheduled sequence (a speculating one gives one per token: see spec_decode), and the
    step's layout, built here once: each entry's inputs and the logits rows the runner returns for them (every
    token's with `every_row`: a pooling engine's MEAN / CLS)."""
    inputs: list[SequenceInput] = []
    spans: list[Span] = []
    r = 0
    for seq, n in scheduled:
        start, i = seq.num_computed_tokens, len(inputs)
        if seq.spec_token_ids:
            inputs += verify_rows(seq, n)
            spans.append((i, i + n, r, r + n))
            r += n
            continue
        group = seq.group
        assert group is not None
        lps = group.prompt_logprobs
        wants_prompt_lp = (lps is not None and seq.index == 0 and len(lps) < seq.num_prompt_tokens
                           and start < seq.num_prompt_tokens - 1)
        inp = SequenceInput(seq.token_ids[start:start + n], start, seq.block_table, start + n == seq.num_tokens,
                            wants_prompt_lp or every_row, group.lora.slot if group.lora is not None else -1,
                            tuple(v.block_table for v in seq.kv_views))
        inputs.append(inp)
        rows = inp.num_logits_rows
        spans.append((i, i + 1, r, r + rows))
        r += rows
    return inputs, spans


@dataclass(slots=True)
class GuardedForward:
    """What a guarded forward left to process: the entries that ran, their inputs, spans and logits rows, and
    request id → why each failed request failed."""

    scheduled: list[Entry]
    inputs: list[SequenceInput]
    spans: list[Span]
    logits: torch.Tensor
    failed: dict[str, str]


def entry_spans(scheduled: list[Entry], inputs: list[SequenceInput]) -> list[Span]:
    """Per scheduled entry: its inputs [i0, i1) and logits rows [r0, r1). The engine builds a step's layout once,
    with its inputs (runner_inputs); this rebuilds it for a part of a step (a fault hook's wrapper
    around a bisection's half): a verification has one input and row per scheduled token, any other entry one
    input with SequenceInput.num_logits_rows rows."""
    spans, i, r = [], 0, 0
    for seq, n in scheduled:
        if seq.spec_token_ids:
            spans.append((i, i + n, r, r + n))
            i, r = i + n, r + n
            continue
        rows = inputs[i].num_logits_rows
        spans.append((i, i + 1, r, r + rows))
        i, r = i + 1, r + rows
    return spans


class StepGuard:
    """Runs a step's forward so that one request's failure fails only that request."""

    def __init__(self, run: Forward, isolate: bool = True) -> None:
        self._run = run  # (entries, their inputs) → logits rows
        # Off under tensor parallelism: the workers run each forward rank 0 sends them, and one that raised on
        # rank 0 mid-command would leave them out of step; the whole step fails there, as before.
        self.isolate = isolate

    def forward(self, scheduled: list[Entry], inputs: list[SequenceInput], spans: list[Span]) -> GuardedForward:
        """The step's logits; entries whose requests failed (forward error, non-finite logits) dropped. `spans`:
        each entry's inputs and logits rows (entry_spans)."""
        failed: dict[str, str] = {}
        try:
            logits = self._run(scheduled, inputs)
        except Exception as error:
            groups = {seq.request_id for seq, _ in scheduled}
            if not self.isolate or len(groups) < 2:
                raise
            logger.warning("a step of %d requests raised (%r); isolating the request(s) that cause it",
                           len(groups), error)
            logits = self._bisect(scheduled, inputs, spans, failed)
        # One sum over every row first: whenever some row's sum is NaN or +inf, so is it (a -inf logit is a masked
        # token: rows of -inf sums add up to -inf). The rows are looked at only then: one reduction where the per-row
        # sums, two masks and their any() took four ops (one row of 49k-128k logits: 11-13 us against 19-25).
        total = float(logits.sum()) if logits.numel() else 0.0
        if total != total or total == float("inf"):
            sums = logits.sum(dim=-1)
            bad = torch.isnan(sums) | torch.isposinf(sums)
            if bool(bad.any()):
                rows = bad.nonzero().flatten().tolist()
                for (seq, _), (_, _, r0, r1) in zip(scheduled, spans, strict=True):
                    if any(r0 <= r < r1 for r in rows):
                        failed.setdefault(seq.request_id, "the model produced non-finite logits (NaN or Inf) for "
                                                          "this request; it was aborted")
        if not failed:
            return GuardedForward(scheduled, inputs, spans, logits, failed)
        return self._drop(scheduled, inputs, logits, spans, failed)

    def _bisect(self, scheduled: list[Entry], inputs: list[SequenceInput], spans: list[Span],
                failed: dict[str, str]) -> torch.Tensor:
        """Logits of every entry whose forward succeeds, run in halves; an entry failing alone fails its request.
        Rows of failed entries are left as NaN (dropped with their entries afterwards)."""
        total = spans[-1][3] if spans else 0
        parts: list[torch.Tensor] = []

        def run(lo: int, hi: int) -> None:
            sub = scheduled[lo:hi]
            sub_inputs = inputs[spans[lo][0]:spans[hi - 1][1]]
            try:
                parts.append(self._run(sub, sub_inputs))
            except Exception as e:
                if hi - lo == 1:
                    failed.setdefault(sub[0][0].request_id, f"internal error in an engine step: {failure_text(e)}")
                    rows = spans[lo][3] - spans[lo][2]
                    parts.append(torch.full((rows, 0), float("nan")))  # width fixed below
                    return
                mid = (lo + hi) // 2
                run(lo, mid)
                run(mid, hi)

        run(0, len(scheduled))
        width = max((p.shape[1] for p in parts if p.shape[1]), default=0)
        ref = next((p for p in parts if p.shape[1]), None)
        parts = [p if p.shape[1] else torch.full((p.shape[0], width), float("nan"),
                                                  dtype=ref.dtype if ref is not None else torch.float32,
                                                  device=ref.device if ref is not None else None)
                 for p in parts]
        logits = torch.cat(parts) if parts else torch.empty(0, 0)
        assert logits.shape[0] == total, (logits.shape, total)
        return logits

    @staticmethod
    def _drop(scheduled: list[Entry], inputs: list[SequenceInput], logits: torch.Tensor, spans: list[Span],
              failed: dict[str, str]) -> GuardedForward:
        """The step without the failed requests' entries (all of a request's sequences go together); the kept
        entries' spans moved up to their new places."""
        kept: list[Entry] = []
        kept_inputs: list[SequenceInput] = []
        kept_spans: list[Span] = []
        rows: list[int] = []
        for entry, (i0, i1, r0, r1) in zip(scheduled, spans, strict=True):
            if entry[0].request_id in failed:
                continue
            kept.append(entry)
            i, r = len(kept_inputs), len(rows)
            kept_spans.append((i, i + i1 - i0, r, r + r1 - r0))
            kept_inputs += inputs[i0:i1]
            rows += range(r0, r1)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        return GuardedForward(kept, kept_inputs, kept_spans,
                              logits.index_select(0, index) if logits.numel() else logits, failed)
