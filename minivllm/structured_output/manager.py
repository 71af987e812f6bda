"""Guided decoding (structured outputs): grammars compiled per request, one matcher per sequence, and each step's
token bitmask for the rows that need one (vLLM v1's StructuredOutputManager, on llguidance).

Why llguidance (benchmarks/micro_grammar.py on our vocabularies, one core): a mask costs ~40 us (8k vocabulary)
to ~110 us (32k) and a JSON schema compiles in ~1-3 ms, where xgrammar compiled the same schema in 150-360 ms
(paid on the request path when every request brings its own schema) and outlines-core, the fastest masks (a
precomputed DFA), in 145-405 ms, with no context-free grammars at all (no guided_grammar, no recursive
schemas). llguidance takes JSON schema, regex, Lark and GBNF grammars, checks draft tokens for speculative
decoding, has no dependencies and is MIT-licensed.

The flow: InputProcessor compiles and validates a request's constraint (off the engine thread; an invalid one is
a ValueError naming the field: HTTP 400); each of its sequences gets a matcher (children of n > 1 fork before
their first token, so a fresh one each). Each step, `start_step` fills the bitmask rows of the sequences about
to be sampled (one per verified position for a speculating one): on a worker thread during the forward where a
core is free (llguidance drops the GIL), else just before the forward (on 2 cores with both in the forward's
OpenMP team, a competing thread stretched the forward by more than the masks cost: `bench guided`). The
sampler's input gets -inf at the forbidden tokens of those rows only; each sampled or accepted token then
advances the sequence's matcher, and a matcher that can take nothing more finishes its sequence ("stop").
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minivllm.sampling_params import GuidedDecodingParams
from minivllm.structured_output.reasoning import reasoning_ended

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # (declared in llguidance's stub only)

    from minivllm.engine.sequence import Sequence

# Field names the request APIs use for each kind (error messages name them).
FIELD_NAMES = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar",
               "json_object": "response_format"}


@dataclass(slots=True)
class StepMasks:
    """One step's bitmasks, being filled on the worker while the forward runs."""

    future: Future[torch.Tensor]
    rows: dict[int, int]  # seq_id → its first row in the mask (a speculating sequence has 1 + drafts rows)
    manager: StructuredOutputManager
    _mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """[rows, words] int32 (waits for the worker; the wait is what the forward did not hide)."""
        if self._mask is None:
            t0 = time.perf_counter()
            self._mask = self.future.result()
            self.manager.wait_time += time.perf_counter() - t0
        return self._mask


# llguidance's resource limits, tighter than its defaults where a client's constraint could otherwise take the server's
# time or memory: fuel bounds the work of analysing the grammar's regexes (~50k units per ms) and of one token mask
# (~14k per ms); lexer states (~1-2 kB each) bound a matcher's memory; grammar size bounds the symbols compiled.
LIMITS: dict[str, Any] = {"initial_lexer_fuel": 500_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
                          "max_lexer_states": 50_000, "max_grammar_size": 200_000, "max_items_in_row": 2000}


def _limits() -> Any:
    from llguidance import LLParserLimits

    return LLParserLimits(**LIMITS)


class StructuredOutputManager:
    """Compiles constraints (cached) and computes bitmasks for the engine; llguidance is loaded on first use."""

    CACHE_SIZE = 256  # compiled grammars kept, keyed by the constraint...
    CACHE_BYTES = 16 << 20  # ...and at most this much text (constraint + grammar) between them

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], overlap: bool = True) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: mask rows cover it (ids past the tokenizer's stay masked)
        self.eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()  # compile runs on request threads, matchers on the engine thread
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_chars = 0
        self._ll_limits: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self.words = (vocab_size + 31) // 32  # int32 words per mask row
        self.mask_time = 0.0  # seconds spent filling masks (the worker's), for the step split and benchmarks
        self.num_masks = 0
        # Per guided sequence (seq_id), on the engine thread: its grammar's state, or the grammar waiting for its
        # thinking to end (reasoning.py). Empty → a step pays nothing for guided decoding.
        self.matchers: dict[int, Any] = {}
        self.pending: dict[int, str] = {}
        self.wait_time = 0.0  # seconds the engine waited for masks after the forward
        self.num_steps = 0  # steps with guided rows
        # Fill masks on a worker during the forward, or before it on the engine thread: overlap pays only where a
        # core is free while the forward runs (a GPU forward, or fewer torch threads than cores). With every core in
        # the forward's OpenMP team, a busy worker stretched the forward by more than the masks cost (bench guided).
        self.overlap = overlap

    # ---- compiling (any thread) ------------------------------------------------------------------
    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer

                # ~0.1 s for a 32k vocabulary: once per engine, on the first guided request.
                self._ll_tokenizer = LLTokenizer(_plain_added_tokens_in_vocab(self.tokenizer),
                                                 n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def compile(self, params: GuidedDecodingParams) -> str:
        """The llguidance grammar of a constraint, checked against the tokenizer; ValueError naming the field."""
        kind = params.kind
        key = json.dumps([kind, getattr(params, kind), params.whitespace_pattern], sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._grammar(params, kind)
        from llguidance import LLMatcher

        ok_error = LLMatcher.validate_grammar(grammar, self._tokenizer(), limits=self.limits())
        if ok_error and not ok_error.startswith("WARNING"):
            raise ValueError(f"{FIELD_NAMES[kind]}: {_one_line(ok_error)}")
        with self._lock:
            if key not in self._cache:
                self._cache[key] = grammar
                self._cache_chars += len(key) + len(grammar)
            while self._cache and (len(self._cache) > self.CACHE_SIZE or self._cache_chars > self.CACHE_BYTES):
                old_key, old = self._cache.popitem(last=False)
                self._cache_chars -= len(old_key) + len(old)
        return grammar

    def limits(self) -> Any:
        """llguidance's LLParserLimits (LIMITS), made once."""
        if self._ll_limits is None:
            self._ll_limits = _limits()
        return self._ll_limits

    @property
    def cache_chars(self) -> int:
        """Characters held by the compile cache (bounded by CACHE_BYTES)."""
        return self._cache_chars

    @staticmethod
    def _grammar(params: GuidedDecodingParams, kind: str) -> str:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"guided_json: not valid JSON: {e}") from None
            if schema is True:  # JSON Schema's `true`: any JSON value (llguidance takes only objects with options)
                schema = {}
            if schema is False:
                raise ValueError("guided_json: the schema `false` accepts no document")
            if not isinstance(schema, dict):
                raise ValueError(f"guided_json: a JSON schema is an object, got {type(schema).__name__}")
            # Compact JSON by default: flexible whitespace lets a sampled answer wander through blank lines until
            # max_tokens; vLLM's whitespace_pattern widens it again.
            options: JsonCompileOptions = {"whitespace_flexible": False}
            if params.whitespace_pattern is not None:
                options = {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
            try:
                return LLMatcher.grammar_from_json_schema(schema, overrides=options)
            except (ValueError, TypeError) as e:
                raise ValueError(f"guided_json: {e}") from None
        if kind == "regex":
            assert params.regex is not None  # the kind is the field that is set
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice or []))
        text = params.grammar or ""
        try:
            # Lark as it is; GBNF (llama.cpp's, vLLM's grammar format for llguidance too) converted to Lark.
            return LLMatcher.grammar_from_lark(text if _looks_like_lark(text) else any_to_lark(text))
        except Exception as e:
            raise ValueError(f"guided_grammar: cannot read the grammar: {e}") from None

    # ---- matchers (engine thread) ----------------------------------------------------------------
    def new_matcher(self, grammar: str) -> Any:
        """A matcher at the start of the grammar."""
        from llguidance import LLMatcher

        m = LLMatcher(self._tokenizer(), grammar, log_level=0, limits=self.limits())
        if m.is_error():
            raise ValueError(f"guided decoding: {_one_line(m.get_error())}")
        return m

    @property
    def num_live(self) -> int:
        """Sequences holding a matcher."""
        return len(self.matchers)

    def attach(self, seq: Sequence, grammar: str) -> None:
        """Give a sequence of a guided request its matcher."""
        self.matchers[seq.seq_id] = self.new_matcher(grammar)

    def attach_later(self, seq: Sequence, grammar: str) -> None:
        """A thinking sequence's grammar starts with its answer (attach_after_reasoning)."""
        self.pending[seq.seq_id] = grammar

    def attach_after_reasoning(self, seq: Sequence) -> None:
        """A thinking sequence's grammar starts with its answer: attached once </think> is in its output."""
        text = seq.detokenizer.text if seq.detokenizer is not None else ""
        if seq.seq_id in self.pending and reasoning_ended(text):
            self.attach(seq, self.pending.pop(seq.seq_id))

    def detach(self, seq: Sequence) -> None:
        """A finished sequence lets its matcher (or its waiting grammar) go."""
        self.matchers.pop(seq.seq_id, None)
        self.pending.pop(seq.seq_id, None)

    def check_proposals(self, seqs: list[Sequence]) -> None:
        """Cut each guided sequence's proposed tokens to the run its grammar accepts: a draft token the grammar
        forbids could never be accepted, and neither could any after it."""
        for seq in seqs:
            m = self.matchers.get(seq.seq_id)
            if m is not None and seq.spec_token_ids:
                seq.spec_token_ids = seq.spec_token_ids[:m.validate_tokens(seq.spec_token_ids)]

    def accept(self, seq: Sequence, token: int) -> tuple[bool, bool]:
        """Advance seq's matcher by one token: (accepted, the grammar is complete and takes nothing more)."""
        m = self.matchers[seq.seq_id]
        if not m.consume_token(token):
            return False, True
        return True, m.is_stopped()

    def error(self, seq: Sequence) -> str:
        """Why seq's matcher refused its last token."""
        return str(self.matchers[seq.seq_id].get_error())

    # ---- masks ----------------------------------------------------------------------------------
    def start_step(self, scheduled: list[tuple[Sequence, int]]) -> StepMasks | None:
        """Start filling the masks of this step's guided rows (before the forward): a sequence sampling this step
        gets one row; a speculating one a row per verified position (after its last token, then after each
        proposal in turn). None when no scheduled sequence is guided."""
        if not self.matchers:
            return None
        jobs, rows, r = [], {}, 0
        for seq, n in scheduled:
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None:
                continue
            if seq.spec_token_ids:
                drafts = seq.spec_token_ids[:n - 1]
            elif seq.num_computed_tokens + n == seq.num_tokens:
                drafts = []
            else:
                continue  # a prefill chunk short of the prompt's end samples nothing
            jobs.append((matcher, drafts))
            rows[seq.seq_id] = r
            r += 1 + len(drafts)
        if not jobs:
            return None
        self.num_steps += 1
        if not self.overlap:
            done: Future[torch.Tensor] = Future()
            done.set_result(self._fill(jobs))
            return StepMasks(done, rows, self)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="minivllm-grammar")
        return StepMasks(self._pool.submit(self._fill, jobs), rows, self)

    def _fill(self, jobs: list[tuple[Any, list[int]]]) -> torch.Tensor:
        # One matcher after another on this thread (each call drops the GIL): llguidance's parallel executor was
        # 3.5x slower than this loop on 2 cores (its thread handoffs cost more than a ~30 us mask).
        t0 = time.perf_counter()
        rows = sum(1 + len(d) for _, d in jobs)
        mask = torch.zeros(rows, self.words, dtype=torch.int32)
        ptr, width = mask.data_ptr(), self.words * 4
        r = 0
        for m, drafts in jobs:
            for tok in drafts:  # the mask at each proposal's position, then the proposals are taken back
                m.unsafe_compute_mask_ptr(ptr + r * width, width)
                m.consume_token(tok)
                r += 1
            m.unsafe_compute_mask_ptr(ptr + r * width, width)
            r += 1
            if drafts:
                m.rollback(len(drafts))
        self.mask_time += time.perf_counter() - t0
        self.num_masks += rows
        return mask

    def close(self) -> None:
        """Stop the worker thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _plain_added_tokens_in_vocab(tokenizer: Any) -> str:
    """The tokenizer's JSON for llguidance, its non-special added tokens (Qwen3's <think>, <tool_call>) moved into
    the vocabulary. llguidance takes every added token for a special one (text can only name it with its 0xFF
    marker), yet tokenizes a forced "<tool_call>" to that token: the mask then offered it and the matcher refused
    it. Text to the model, they are plain tokens to the grammar too."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    model = data.get("model") or {}
    plain = [t for t in data.get("added_tokens", []) if not t.get("special")]
    if not plain or not isinstance(model.get("vocab"), dict):
        return json.dumps(data)
    byte_level = "ByteLevel" in json.dumps(data.get("decoder"))
    for t in plain:
        text = t["content"]
        model["vocab"][_byte_level(text) if byte_level else text] = t["id"]
    data["added_tokens"] = [t for t in data["added_tokens"] if t.get("special")]
    return json.dumps(data)


def _byte_level(text: str) -> str:
    """GPT-2's byte-to-unicode spelling of text, as byte-level BPE vocabularies store tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in text.encode())


def _one_line(message: str, limit: int = 400) -> str:
    """llguidance's message (with its source excerpt) on one line, bounded."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _looks_like_lark(text: str) -> bool:
    """Lark rules read `name: ...`; GBNF's read `name ::= ...`."""
    return "::=" not in text
