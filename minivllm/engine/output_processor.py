"""Turns sampled tokens into sequence state (text, stops, logprobs) and sequence state into RequestOutputs.

Incremental detokenization with stop strings, one per generated sequence (IncrementalDetokenizer).

Text grows one token at a time through tokenizers' `DecodeStream` (it buffers tokens until their
bytes form whole UTF-8 characters, so a multi-byte character is never split). Stop strings are
matched on the text as it grows (stop_matcher.py: each new character read once), so a stop split across
token boundaries is caught; while streaming, the tail that could still grow into a stop string is held
back, so a stop string never leaks into a delta.
"""

from __future__ import annotations

from typing import Any, cast

from tokenizers.decoders import DecodeStream

from minivllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from minivllm.engine.stop_matcher import StopMatcher
from minivllm.model.sampler import TokenLogprobs
from minivllm.model.step_sampling import SamplingRequest
from minivllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from minivllm.sampling_params import RequestOutputKind

LOGPROB_FLOOR = -9999.0
# Prompt tokens fed to the stream first, so the first generated token decodes in context (leading
# spaces of SentencePiece-style tokenizers); vLLM uses the same small window.
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Output text of one sequence, grown token by token; knows its stop strings."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool, stop: StopMatcher | None,
                 include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend: Any = backend  # the fast tokenizer's `tokenizers.Tokenizer` wherever _stream is set
        self._stream = DecodeStream(ids=prompt_ids[-PROMPT_CONTEXT:], skip_special_tokens=skip_special_tokens) \
            if backend is not None else None
        self._ids: list[int] = []  # only for slow tokenizers (no DecodeStream)
        self.stop = stop  # the request's stop strings (None: none)
        self._stop_state = 0  # the automaton's state after the text so far
        self.include_stop = include_stop_str_in_output
        self.text = ""
        self.emitted = 0  # characters already handed out as deltas

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one more token; return the stop string it completed, if any (text is then cut).
        check_stop=False before min_tokens: stop strings may not end the sequence yet."""
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
        else:
            self._ids.append(token_id)
            full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
            piece = None if full.endswith("\ufffd") else full[len(self.text):]
        if not piece:
            return None
        offset = len(self.text)
        self.text += piece
        if self.stop is None:
            return None
        # (before min_tokens the state still follows the text, so a stop completed by a later token is found)
        self._stop_state, index, at = self.stop.feed(self._stop_state, piece, offset)
        if index == -1 or not check_stop:
            return None
        best = self.stop.stops[index]
        self.text = self.text[:at + (len(best) if self.include_stop else 0)]
        return best

    def holdback(self) -> int:
        """Length of the text's tail that is a proper prefix of some stop string."""
        return self.stop.holdback(self._stop_state) if self.stop is not None else 0

    def visible_text(self, finished: bool) -> str:
        """The text so far, minus a tail that may still become a stop string (unless finished)."""
        return self.text if finished or self.stop is None else self.text[:len(self.text) - self.holdback()]

    def delta(self, finished: bool) -> str:
        """Text not handed out yet, minus a tail that may still become a stop string (unless finished)."""
        end = len(self.visible_text(finished))
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


class OutputProcessor:
    """Per-token bookkeeping after sampling, and output assembly per RequestOutputKind."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._token_text: dict[int, str] = {}

    def init_sequence(self, seq: Sequence, prompt_ids: list[int]) -> None:
        """Give a (new or forked) sequence its detokenizer and logprob accumulators."""
        p = seq.sampling_params
        group = seq.group
        if group is not None and group.beam is None:
            if p.stop and group.stop_matcher is None:  # (one automaton for all of a request's samples)
                group.stop_matcher = StopMatcher(p.stop)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, p.skip_special_tokens,
                                                     group.stop_matcher, p.include_stop_str_in_output)
        if p.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0

    def token_text(self, token_id: int) -> str:
        """The text of one token (cached: logprobs name many tokens per step)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def position_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        """token id → Logprob for one position (the chosen token first, then the top-N). A token that cannot be
        drawn (masked by guided decoding or min_tokens) has logprob -inf, reported as -9999.0 as vLLM does: JSON
        has no infinity."""
        return {t: Logprob(max(v, LOGPROB_FLOOR), r, self.token_text(t))
                for t, v, r in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True)}

    def append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> SequenceStatus | None:
        """Record a sampled token; return the finishing status if it ends the sequence."""
        seq.token_ids.append(token)
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(self.position_logprobs(lp))
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + lp.logprobs[0]
        p = seq.sampling_params
        n_out = seq.num_output_tokens
        # Before min_tokens nothing stops a sequence but its length (EOS / stop ids are masked then).
        may_stop = n_out >= p.min_tokens
        status = None
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif may_stop and token in p.stop_token_ids:
            seq.stop_reason, status = token, SequenceStatus.FINISHED_STOPPED
        det = seq.detokenizer
        assert det is not None
        # As vLLM: the token that stops a sequence adds no text unless include_stop_str_in_output.
        if status is None or p.include_stop_str_in_output:
            stop_str = det.append(token, check_stop=may_stop)
            if stop_str is not None:
                seq.stop_reason = stop_str
                return SequenceStatus.FINISHED_STOPPED
        if status is None and ((p.max_tokens is not None and n_out >= p.max_tokens)
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        return status

    # ---- outputs -------------------------------------------------------------------------------
    def make_output(self, group: SequenceGroup) -> RequestOutput | None:
        """The RequestOutput this step owes for group under its output kind (None: nothing to report)."""
        kind = group.params.output_kind
        finished = group.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if group.beam is not None:
            if not finished:
                return None
            completions = self._beam_completions(group)
        else:
            completions = [c for s in sorted(group.seqs, key=lambda s: s.index)
                           if (c := self._completion(s, kind)) is not None]
            if not completions and not finished:
                return None
        prompt_lp = group.prompt_logprobs
        if kind == RequestOutputKind.DELTA and prompt_lp is not None:
            # Prompt logprobs go out once, with the first output after they are complete.
            complete = len(prompt_lp) == len(group.prompt_token_ids)
            prompt_lp = prompt_lp if complete and not group.prompt_logprobs_sent else None
            group.prompt_logprobs_sent |= prompt_lp is not None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             prompt_lp, group.num_cached_tokens, group.embedding)

    def _completion(self, seq: Sequence, kind: RequestOutputKind) -> CompletionOutput | None:
        det = seq.detokenizer
        assert det is not None
        done = seq.status.finished
        reason = seq.status.value if done else None
        if kind == RequestOutputKind.DELTA:
            start = seq.num_emitted_tokens
            ids = seq.token_ids[seq.num_prompt_tokens + start:]
            if not ids and (not done or seq.finish_reported):
                return None
            seq.num_emitted_tokens += len(ids)
            seq.finish_reported = done
            lps = seq.logprobs[start:] if seq.logprobs is not None else None
            return CompletionOutput(seq.index, det.delta(done), ids, seq.cumulative_logprob, lps, reason,
                                    seq.stop_reason)
        return CompletionOutput(seq.index, det.visible_text(done), seq.output_token_ids, seq.cumulative_logprob,
                                list(seq.logprobs) if seq.logprobs is not None else None, reason, seq.stop_reason)

    def _beam_completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        assert group.beam is not None
        out = []
        skip = group.params.skip_special_tokens
        for i, (_, ids, cum) in enumerate(group.beam.finished):
            reason = "stop" if ids and ids[-1] in self.eos_token_ids else "length"
            out.append(CompletionOutput(i, self.tokenizer.decode(ids, skip_special_tokens=skip), ids, cum, None,
                                        "abort" if group.aborted else reason))
        return out

    def prompt_logprob_rows(self, jobs: list[tuple[Sequence, int, int, int]], req: SamplingRequest
                            ) -> list[Sequence]:
        """The rows that score prompt tokens, added to the runner's request (logits at position j score token
        j + 1); returns each row's sequence, for add_prompt_logprobs."""
        owners = []
        for seq, start, n, row in jobs:
            assert seq.group is not None and seq.group.prompt_logprobs is not None
            end = min(start + n, seq.num_prompt_tokens - 1)
            # After a preemption the prompt is recomputed from 0: positions already scored are skipped.
            for j in range(max(start, len(seq.group.prompt_logprobs) - 1), end):
                req.prompt_rows.append(row + j - start)
                req.prompt_targets.append(seq.token_ids[j + 1])
                # (set for every owner: a group keeps prompt logprobs only when its request asked for them)
                req.prompt_nums.append(cast(int, seq.sampling_params.prompt_logprobs))
                owners.append(seq)
        return owners

    def add_prompt_logprobs(self, owners: list[Sequence], tlps: list[TokenLogprobs]) -> None:
        """The runner's prompt logprobs, appended to each request's."""
        for seq, tlp in zip(owners, tlps, strict=True):
            assert seq.group is not None and seq.group.prompt_logprobs is not None
            seq.group.prompt_logprobs.append(self.position_logprobs(tlp))
