"""SamplingParams / BeamSearchParams: how to decode one request; validated at construction."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy (vLLM's rule): dividing logits by ~0 only overflows.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


def _int(name: str, value: object, low: int, high: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = False
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a number in {bracket}{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Constrain a request's output (vLLM's guided decoding): exactly one of a JSON schema, any JSON object, a
    regex, a list of choices or a grammar (Lark, or llama.cpp's GBNF). Compiled and checked when the request
    is added (structured_output/manager.py): an invalid one is a ValueError naming the field."""

    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    whitespace_pattern: str | None = None  # JSON only: the whitespace allowed between tokens (default: none)

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise ValueError(f"guided_decoding: give exactly one of json, regex, choice, grammar, json_object "
                             f"(got {found})")
        checks = (("json", str | dict), ("regex", str), ("grammar", str), ("whitespace_pattern", str))
        for name, types in checks:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, types) or v == ""):
                what = "object or string" if name == "json" else "string"
                raise ValueError(f"guided_{name}: expected a non-empty {what}, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"guided_choice: expected a non-empty list of non-empty strings, got {self.choice!r}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"guided_json_object: expected true, got {self.json_object!r}")
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise ValueError("guided_whitespace_pattern: applies to a JSON schema or json_object only")

    def kinds(self) -> list[str]:
        """The constraint fields that are set."""
        return [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) is not None]

    @property
    def kind(self) -> str:
        """json, regex, choice, grammar or json_object."""
        return self.kinds()[0]


@dataclass
class SamplingParams:
    """Decoding settings of one request, with vLLM's names, defaults and meanings.

    Processing order of one step (as vLLM v1): EOS/stop ids masked before min_tokens → repetition,
    frequency and presence penalties → greedy argmax, or temperature → min_p → top_k → top_p → draw.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token (plus the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # beam search: True, False or "never" (HF's meanings)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        _int("n", self.n, 1, 64)
        _float("temperature", self.temperature, 0.0, 1e6)
        _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int("top_k", self.top_k, -1, 2**31 - 1)
        _float("min_p", self.min_p, 0.0, 1.0)
        _int("seed", self.seed, 0, 2**63 - 1 - 64, allow_none=True)  # sample i draws with seed + i
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float("repetition_penalty", self.repetition_penalty, 0.0, 1e6, low_open=True)
        _int("max_tokens", self.max_tokens, 1, allow_none=True)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for tok in self.stop_token_ids:
            _int("stop_token_ids entries", tok, 0)
        self.stop_token_ids = list(self.stop_token_ids)
        _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allow_none=True)
        _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, allow_none=True)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _int("beam_width", self.beam_width, 1, 64)
        _float("length_penalty", self.length_penalty, -1e6, 1e6)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(f"guided_decoding must be a GuidedDecodingParams, got {self.guided_decoding!r}")
        if self.top_k == 0:
            self.top_k = -1
        if self.use_beam_search:
            # Beam search here is deterministic (HF's num_beams without sampling): temperature and the
            # sampling filters do not apply; these options would be silently ignored, so they are refused.
            for name, off in (("n", 1), ("stop", []), ("min_tokens", 0), ("logprobs", None),
                              ("guided_decoding", None)):
                if getattr(self, name) != off:
                    raise ValueError(f"{name} is not supported with use_beam_search (got {getattr(self, name)!r})")

    @property
    def greedy(self) -> bool:
        """Whether decoding takes the argmax."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with some fields replaced (validated again)."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters; `LLM.beam_search` takes these."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        """The equivalent SamplingParams (validates)."""
        return SamplingParams(use_beam_search=True, beam_width=self.beam_width, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, length_penalty=self.length_penalty,
                              early_stopping=self.early_stopping, temperature=0.0,
                              include_stop_str_in_output=self.include_stop_str_in_output)
