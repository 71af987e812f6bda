"""Incremental detokenization with stop strings, one per generated sequence.

Text grows one token at a time through tokenizers' `DecodeStream` (it buffers tokens until their
bytes form whole UTF-8 characters, so a multi-byte character is never split). Stop strings are
matched on the text as it grows (stop_matcher.py: each new character read once), so a stop split across
token boundaries is caught; while streaming, the tail that could still grow into a stop string is held
back, so a stop string never leaks into a delta.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from minivllm.engine.stop_matcher import StopMatcher

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
