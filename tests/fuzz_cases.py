"""The catalog of hand-written bad inputs for test_fuzz_inputs.py: HTTP bodies (wrong types for every field of every
route, number literals JSON cannot hold, raw bodies that are not JSON or not UTF-8, out-of-range values), WebSocket
frames, and gRPC messages (raw bytes that do not parse or carry a field with the wrong wire type, and well-typed
messages with bad values)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from fuzz_utils import GOOD
from google.protobuf.descriptor import FieldDescriptor

from minivllm.entrypoints.proto import inference_pb2 as pb

VOCAB = 1024  # tiny-llama's vocabulary (make_model's preset)

# ---- HTTP: the cases --------------------------------------------------------------------------------------
G, B, C, CH = "/generate", "/batch_generate", "/v1/completions", "/v1/chat/completions"
BASE: dict[str, dict[str, Any]] = {
    G: {"prompt": "hello", "max_new_tokens": 2},
    B: {"prompts": ["hello"], "max_new_tokens": 2},
    C: {"prompt": "hello", "max_tokens": 2},
    CH: {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
}


@dataclass
class HttpCase:
    """One bad request: raw body bytes, its content type, the status it must get and words its message holds."""

    name: str
    path: str
    body: bytes | None
    status: int = 400
    words: tuple[str, ...] = ()
    content_type: str | None = "application/json"

    @property
    def id(self) -> str:
        return f"{self.path} {self.name}"[:120]


def _raw(path: str, extra: dict[str, Any] | None = None, raw: dict[str, str] | None = None,
         drop: tuple[str, ...] = ()) -> bytes:
    """The route's base body with `extra` fields (JSON) and `raw` fields (literal JSON text, e.g. NaN or
    10**400's 401 digits) put in."""
    body = {k: v for k, v in BASE[path].items() if k not in drop}
    body.update(extra or {})
    body.update({key: f"@RAW{i}@" for i, key in enumerate(raw or {})})
    text = json.dumps(body)
    for i, literal in enumerate((raw or {}).values()):
        text = text.replace(f'"@RAW{i}@"', literal)
    return text.encode()


# Field kinds of each route (protocol.py): f float, i int, b bool, each with "?" when null is allowed.
_SAMPLING = {"temperature": "f?", "top_p": "f?", "top_k": "i?", "min_p": "f?", "seed": "i?",
             "presence_penalty": "f?", "frequency_penalty": "f?", "repetition_penalty": "f?", "stop": "stop",
             "stop_token_ids": "ids", "ignore_eos": "b?", "min_tokens": "i?", "skip_special_tokens": "b?",
             "include_stop_str_in_output": "b?", "priority": "priority", "ttft_slo_ms": "f?", "timeout": "f?"}
_OPENAI = {**_SAMPLING, "model": "s?", "n": "i", "stream": "b", "stream_options": "stream_options",
           "logit_bias": "logit_bias", "use_beam_search": "b", "length_penalty": "f", "early_stopping": "early",
           "prompt_logprobs": "i?"}
FIELDS: dict[str, dict[str, str]] = {
    G: {**_SAMPLING, "max_new_tokens": "i?", "prompt": "s", "stream": "b", "beam_width": "i?", "length_penalty": "f?",
        "early_stopping": "early", "prompt_logprobs": "i?"},
    B: {**_SAMPLING, "max_new_tokens": "i?", "prompts": "prompts"},
    C: {**_OPENAI, "prompt": "completion_prompt", "max_tokens": "i?", "logprobs": "i?", "echo": "b", "best_of": "i?",
        "suffix": "s?"},
    CH: {**_OPENAI, "messages": "messages", "max_tokens": "i?", "max_completion_tokens": "i?", "logprobs": "b",
         "top_logprobs": "i?", "add_generation_prompt": "b", "chat_template": "s?"},
}
# Values of the wrong type for each kind ("false is not a number and 0 is not a boolean": SPEC §4).
WRONG: dict[str, list[Any]] = {
    "f": ["0.5", True, False, [0.5], {"value": 0.5}],
    "i": ["2", True, False, 2.5, [2], {"value": 2}],
    "b": [0, 1, "true", [True], {"value": True}],
    "s": [5, True, 1.5, {"value": "a"}],
    "stop": [5, True, [1], [None], {"value": "a"}, [["a"]]],
    "ids": ["1", 5, [1.5], ["1"], [True], [None], {"value": 1}],
    "priority": [1.5, True, None, [0], {"value": 0}],
    "stream_options": [True, "x", [], {"include_usage": 1}, {"include_usage": "yes"}],
    "logit_bias": ["x", [1], {"5": "a"}, 5],
    "early": [0, "always", 1.5, [], {}],
    "prompts": ["a", [5], [None], [["a"]], {"value": "a"}, None],
    "completion_prompt": [5, True, None, {"value": "a"}, [1.5], [[1, "a"]], [True], [None]],
    "messages": ["hi", [5], [{"content": "x"}], [{"role": 5}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}],
                 [{"role": "user", "content": [{"type": "text"}]}], None, {"role": "user"}],
}


def _wrong_type_cases() -> Iterator[HttpCase]:
    for path, fields in FIELDS.items():
        for field, kind in fields.items():
            values = list(WRONG[kind.rstrip("?")])
            if kind in ("f", "i", "b", "s"):  # not optional: null is a wrong type too
                values.append(None)
            for v in values:
                yield HttpCase(f"{field}={json.dumps(v)}", path, _raw(path, {field: v}), 400, (field,))


_INT_FIELDS = {G: ["max_new_tokens", "top_k", "seed", "min_tokens", "beam_width", "prompt_logprobs", "priority"],
               C: ["max_tokens", "top_k", "seed", "min_tokens", "n", "logprobs", "best_of", "prompt_logprobs",
                   "priority"],
               CH: ["max_tokens", "max_completion_tokens", "n", "top_logprobs", "seed"]}
_FLOAT_FIELDS = {G: ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "length_penalty", "ttft_slo_ms", "timeout"],
                 C: ["temperature", "top_p", "min_p", "repetition_penalty", "length_penalty", "ttft_slo_ms"],
                 CH: ["temperature", "presence_penalty", "timeout"]}
_BEAM = {G: {"beam_width": 2}, C: {"use_beam_search": True, "n": 2}, CH: {"use_beam_search": True, "n": 2}}


def _number_literal_cases() -> Iterator[HttpCase]:
    """Huge integers and NaN / Infinity / -Infinity literals (Python's json takes them; strict JSON does not)."""
    huge = {"2**64": str(2**64), "10**400": "1" + "0" * 400, "-10**400": "-1" + "0" * 400,
            "2**64 as a float": "1.8446744073709552e19"}
    nonfinite = {"NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "1e400": "1e400"}
    for path, fields in _INT_FIELDS.items():
        for field in fields:
            extra = _BEAM[path] if field == "beam_width" else {}
            for name, literal in {**huge, **nonfinite}.items():
                # pydantic names the field sent, SamplingParams its own max_tokens
                words = ("max_",) if field in ("max_new_tokens", "max_completion_tokens") else (field,)
                if field == "priority" and name in ("2**64", "10**400", "-10**400"):  # any integer is a priority
                    continue
                yield HttpCase(f"{field}={name}", path, _raw(path, extra, {field: literal}), 400, words)
    for path, fields in _FLOAT_FIELDS.items():
        for field in fields:
            extra = _BEAM[path] if field == "length_penalty" else {}
            for name, literal in {"10**400": "1" + "0" * 400, **nonfinite}.items():
                yield HttpCase(f"{field}={name}", path, _raw(path, extra, {field: literal}), 400, (field,))
    for path in (G, C):  # past Python's 4300-digit limit on int(): the JSON parser refuses it
        yield HttpCase("an int of 5000 digits", path, _raw(path, raw={"seed": "9" * 5000}), 400, ("JSON", "digits"))
    yield HttpCase("a priority string of 5000 digits", G, _raw(G, {"priority": "9" * 5000}), 400, ("priority",))
    yield HttpCase("a stop token id of 2**64", G, _raw(G, raw={"stop_token_ids": f"[{2**64}]"}), 400,
                   ("stop_token_ids",))
    yield HttpCase("a prompt token id of 2**64", C, _raw(C, raw={"prompt": f"[{2**64}]"}), 400, ("token ids",))


OUT_OF_RANGE: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    (G, {"temperature": -0.5}, ("temperature",)), (G, {"temperature": 1e7}, ("temperature",)),
    (G, {"top_p": 0}, ("top_p",)), (G, {"top_p": 1.5}, ("top_p",)), (G, {"top_p": -1}, ("top_p",)),
    (G, {"top_k": -2}, ("top_k",)), (G, {"top_k": 2**31}, ("top_k",)),
    (G, {"min_p": -0.1}, ("min_p",)), (G, {"min_p": 1.5}, ("min_p",)),
    (G, {"presence_penalty": 2.5}, ("presence_penalty",)), (G, {"presence_penalty": -3}, ("presence_penalty",)),
    (G, {"frequency_penalty": 3}, ("frequency_penalty",)), (G, {"frequency_penalty": -2.5}, ("frequency_penalty",)),
    (G, {"repetition_penalty": 0}, ("repetition_penalty",)), (G, {"repetition_penalty": -1}, ("repetition_penalty",)),
    (G, {"seed": -1}, ("seed",)), (G, {"seed": 2**63}, ("seed",)),
    (G, {"min_tokens": -1}, ("min_tokens",)), (G, {"min_tokens": 10}, ("min_tokens",)),
    (G, {"max_new_tokens": 0}, ("max_tokens",)), (G, {"max_new_tokens": -1}, ("max_tokens",)),
    (G, {"max_new_tokens": 65}, ("max_tokens", "max_model_len")), (G, {"max_tokens": 10**9}, ("max_tokens",)),
    (G, {"stop_token_ids": [-1]}, ("stop_token_ids",)), (G, {"stop_token_ids": [VOCAB]}, ("stop_token_ids",)),
    (G, {"stop": [f"s{i}" for i in range(65)]}, ("stop", "--max-stop-strings")),
    (G, {"stop": ["x" * 1025]}, ("stop", "--max-stop-string-length")),
    (C, {"stop": [f"s{i}" for i in range(10_000)], "stream": True}, ("stop", "--max-stop-strings")),
    (CH, {"stop": ["y" * 100_000]}, ("stop", "--max-stop-string-length")),
    (C, {"guided_regex": "ab|" * 50_000}, ("guided_regex", "--max-constraint-chars")),
    (CH, {"guided_choice": [f"choice {i}" for i in range(20_000)]}, ("guided_choice", "--max-constraint-chars")),
    (G, {"priority": "urgent"}, ("priority",)), (G, {"priority": ""}, ("priority",)),
    (G, {"priority": "1.5"}, ("priority",)),
    (G, {"ttft_slo_ms": 0}, ("ttft_slo_ms",)), (G, {"ttft_slo_ms": -1}, ("ttft_slo_ms",)),
    (G, {"timeout": 0}, ("timeout",)), (G, {"timeout": -5}, ("timeout",)),
    (G, {"beam_width": 0}, ("beam_width",)), (G, {"beam_width": -1}, ("beam_width",)),
    (G, {"beam_width": 1000}, ("beam_width",)), (G, {"beam_width": 2, "stream": True}, ("beam_width", "stream")),
    (G, {"prompt_logprobs": -1}, ("prompt_logprobs",)), (G, {"prompt_logprobs": 1000}, ("prompt_logprobs",)),
    (G, {"beam_width": 2, "length_penalty": 1e7}, ("length_penalty",)),
    (G, {"prompt": ""}, ("prompt", "empty")), (G, {"prompt": "word " * 2000}, ("prompt", "max_model_len")),
    (G, {"prompt": "\ud800"}, ("prompt", "Unicode")), (G, {"prompt": "ok \udfff"}, ("prompt", "Unicode")),
    (G, {"model": "/etc/passwd"}, ("model",)), (G, {"max_new_token": 4}, ("max_new_token",)),
    (B, {"prompts": []}, ("prompts",)), (B, {"prompts": [""]}, ("prompt",)), (B, {"prompts": ["a", "\ud800"]},
                                                                            ("prompt", "Unicode")),
    (B, {"prompts": ["a"] * 600}, ("prompts", "max_waiting")), (B, {"temperature": -1}, ("temperature",)),
    (C, {"n": 0}, ("n",)), (C, {"n": -1}, ("n",)), (C, {"n": 5}, ("n", "max_num_seqs")),
    (C, {"logprobs": -1}, ("logprobs",)), (C, {"logprobs": 1000}, ("logprobs",)),
    (C, {"best_of": 3}, ("best_of",)), (C, {"prompt": [VOCAB]}, ("token ids",)), (C, {"prompt": [-1]}, ("token ids",)),
    (C, {"prompt": []}, ("prompt",)), (C, {"prompt": [[]]}, ("prompt",)), (C, {"prompt": [[1, 2], []]}, ("prompt",)),
    (C, {"prompt": ["a", ""]}, ("prompt",)), (C, {"prompt": list(range(100))}, ("prompt", "max_model_len")),
    (C, {"suffix": "x"}, ("suffix",)), (C, {"logit_bias": {"5": 1.0}}, ("logit_bias",)),
    (C, {"echo": True, "logprobs": 1, "stream": True}, ("echo",)),
    (C, {"stream_options": {"include_usage": True}}, ("stream_options",)),
    (C, {"use_beam_search": True, "stream": True}, ("use_beam_search",)), (C, {"max_tokens": 0}, ("max_tokens",)),
    (C, {"max_tokens": 2, "min_tokens": 3}, ("min_tokens",)), (C, {"prompt_logprobs": 1000}, ("prompt_logprobs",)),
    (CH, {"messages": []}, ("messages",)), (CH, {"top_logprobs": 2}, ("top_logprobs",)),
    (CH, {"logprobs": True, "top_logprobs": 1000}, ("logprobs",)), (CH, {"chat_template": "{{ 7 * 7 }}"},
                                                                    ("chat_template",)),
    (CH, {"n": 0}, ("n",)), (CH, {"max_completion_tokens": 0}, ("max_tokens",)),
    (CH, {"messages": [{"role": "user", "content": "\ud800"}]}, ("Unicode",)),
    (CH, {"messages": [{"role": "user", "content": "word " * 200}]}, ("prompt", "max_model_len")),
    (CH, {"temperature": -1}, ("temperature",)), (CH, {"stop_token_ids": [-5]}, ("stop_token_ids",)),
]


def model_name_cases(model_path: str) -> Iterator[HttpCase]:
    """Unknown and path-like model names: 404 naming the model, never a file opened or a model loaded."""
    names = ["gpt-4", "", " ", "TINY-LLAMA", "x" * 10_000, "\u202emodel", "\x00", "/etc/passwd", "../x",
             "../../../../etc/passwd", "./", ".", "..", "/", "~/.ssh/id_rsa", "C:\\Windows\\system32",
             "file:///etc/passwd", "http://127.0.0.1:1/model", "hf://org/model", model_path, model_path + "/",
             model_path + "/../" + model_path.rstrip("/").rsplit("/", 1)[-1], "/proc/self/environ"]
    for path in (C, CH):
        for name in names:
            yield HttpCase(f"model={name[:40]!r}", path, _raw(path, {"model": name}), 404, ("does not exist",))


def _raw_body_cases() -> Iterator[HttpCase]:
    for path in BASE:
        text = json.dumps(BASE[path]).encode()
        for cut in sorted({1, 2, len(text) // 4, len(text) // 3, len(text) // 2, len(text) - 8, len(text) - 2,
                           len(text) - 1}):
            yield HttpCase(f"JSON cut at byte {cut}", path, text[:cut], 400, ("JSON",))
        yield HttpCase("an empty body", path, b"", 400, ("body",))
        yield HttpCase("a trailing comma", path, text[:-1] + b",}", 400, ("JSON",))
        yield HttpCase("single quotes", path, text.replace(b'"', b"'"), 400, ("JSON",))
        yield HttpCase("trailing garbage", path, text + b"}}", 400, ("JSON",))
        key = b'"hello"'
        for name, bad in {"0xff": b"\xff", "an overlong NUL": b"\xc0\x80", "a cut 3-byte char": b"\xe2\x82",
                          "a lone continuation byte": b"\x80", "a 5-byte sequence": b"\xf8\x88\x80\x80\x80",
                          "above U+10FFFF": b"\xf4\x90\x80\x80", "latin-1": "h\xe9llo".encode("latin-1")}.items():
            yield HttpCase(f"invalid UTF-8: {name}", path, text.replace(key, b'"' + bad + b'"'), 400, ("UTF-8",))
        for name, bad in {"escaped \\ud800": b'"\\ud800"', "escaped \\udfff": b'"x\\udfffy"',
                          "encoded surrogate bytes": b'"\xed\xa0\x80"'}.items():
            yield HttpCase(f"a lone surrogate: {name}", path, text.replace(key, bad), 400, ("Unicode",))
        deep = 100_000
        yield HttpCase("a body of 100000 nested arrays", path, b"[" * deep + b"]" * deep, 400, ("nested too deeply",))
        yield HttpCase("100000 nested objects", path, b'{"a":' * deep + b"1" + b"}" * deep, 400, ("nested too deeply",))
        yield HttpCase("a prompt of 100000 nested arrays", path, text.replace(key, b"[" * deep + b"]" * deep), 400,
                       ("nested too deeply",))
        for name, body in {"a list": b"[]", "a string": b'"hello"', "a number": b"5", "null": b"null",
                           "true": b"true"}.items():
            yield HttpCase(f"the body is {name}", path, body, 400, ("body",))
        for ct, body in {"text/plain": text, "application/x-www-form-urlencoded": b"prompt=a&max_new_tokens=2",
                         "multipart/form-data; boundary=x":
                             b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na\r\n--x--\r\n',
                         "application/xml": b"<prompt>a</prompt>", "application/octet-stream": text,
                         None: text}.items():
            yield HttpCase(f"content type {ct}", path, body, 400, ("JSON",), content_type=ct)
        yield HttpCase("a 10 MB body", path, b'{"prompt": "' + b"a" * 10_000_000 + b'"}', 413,
                       ("exceeds the limit", "max-body-size"))


def _out_of_range_cases() -> Iterator[HttpCase]:
    for path, extra, words in OUT_OF_RANGE:
        yield HttpCase(f"{json.dumps(extra)[:60]}", path, _raw(path, extra), 400, words)



HTTP_CASES = [*_wrong_type_cases(), *_number_literal_cases(), *_raw_body_cases(), *_out_of_range_cases()]


def _ws_frames() -> Iterator[tuple[str, str | bytes, tuple[str, ...]]]:
    """(name, frame, words the error message holds)."""
    good = json.dumps(GOOD)
    for name, frame in {"a binary frame": b"\x00\x01\x02\xff", "valid JSON as a binary frame": good.encode(),
                        "an empty binary frame": b"", "a 1 MB binary frame": b"\x00" * 1_000_000}.items():
        yield name, frame, ("binary frame",)
    for name, frame in {"an empty text frame": "", "invalid JSON": "{nope", "truncated JSON": good[: len(good) // 2],
                        "a trailing comma": good[:-1] + ",}", "single quotes": good.replace('"', "'"),
                        "100000 nested arrays": "[" * 100_000 + "]" * 100_000,
                        "a prompt of 100000 nested arrays": '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
                        "an int of 5000 digits": '{"prompt": "a", "seed": ' + "9" * 5000 + "}",
                        "an escaped lone surrogate": '{"prompt": "\\ud800"}'}.items():
        yield name, frame, ("JSON",)
    for name, frame in {"a list": "[]", "a number": "5", "a string": '"hello"', "null": "null", "true": "true",
                        "an empty object": "{}"}.items():
        yield f"valid JSON of the wrong shape: {name}", frame, ("body" if name != "an empty object" else "prompt",)
    literals = {"NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "10**400": "1" + "0" * 400}
    for name, literal in literals.items():
        for field in ("temperature", "top_p", "max_new_tokens", "top_k"):
            yield f"{field}={name}", _raw(G, raw={field: literal}).decode(), ("max_" if field == "max_new_tokens"
                                                                             else field,)
    for field, kind in FIELDS[G].items():
        values = list(WRONG[kind.rstrip("?")]) + ([None] if kind in ("f", "i", "b", "s") else [])
        for v in values:
            yield f"{field}={json.dumps(v)}", _raw(G, {field: v}).decode(), (field,)
    for extra, words in [({"prompt": ""}, ("prompt",)), ({"max_new_tokens": 0}, ("max_tokens",)),
                         ({"prompt": "word " * 2000}, ("max_model_len",)), ({"stream": True, "beam_width": 2},
                                                                           ("beam_width",)),
                         ({"model": "/etc/passwd"}, ("model",)), ({"priority": "urgent"}, ("priority",))]:
        yield json.dumps(extra)[:50], _raw(G, extra).decode(), words


WS_CASES = list(_ws_frames())


# ---- gRPC ---------------------------------------------------------------------------------------------------
SERVICE = "/minivllm.v1.InferenceService"
BAD_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE)


def varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def field_bytes(number: int, wire: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire) + payload


# A payload of each wire type: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32.
_PAYLOADS = {0: varint(3), 1: b"\x00" * 8, 2: varint(1) + b"x", 5: b"\x00" * 4}
_WIRE_OF = {FieldDescriptor.TYPE_DOUBLE: 1, FieldDescriptor.TYPE_INT32: 0, FieldDescriptor.TYPE_INT64: 0,
            FieldDescriptor.TYPE_BOOL: 0, FieldDescriptor.TYPE_STRING: 2}  # a field type → its wire type


def _wrong_wire_cases(message: Any, method: str) -> Iterator[tuple[str, str, bytes, tuple[str, ...]]]:
    """Every declared field of the message sent with a wire type its type cannot have (a wrong type)."""
    base = message(prompt="a") if message is pb.GenerateRequest else message(prompts=["a"])
    for fd in message.DESCRIPTOR.fields:
        wire = _WIRE_OF[fd.type]
        repeated_scalar = fd.is_repeated and wire != 2
        ok = {wire, 2} if repeated_scalar else {wire}  # a repeated number may come packed (length-delimited)
        for bad in sorted(set(_PAYLOADS) - ok):
            yield (method, f"{fd.name} as wire type {bad}", base.SerializeToString() + field_bytes(fd.number, bad,
                                                                                               _PAYLOADS[bad]),
                   (fd.name,))


def _grpc_raw_cases() -> Iterator[tuple[str, str, bytes, tuple[str, ...]]]:
    """(method, name, raw request bytes, words the status details hold)."""
    garbage = {"0xff bytes": b"\xff" * 8, "a cut varint": b"\x18", "a cut length": b"\x0a\x05ab",
               "field number 0": b"\x00\x01", "an end-group tag alone": b"\x0c",
               "a string that is not UTF-8": b"\x0a\x02\xff\xfe", "random bytes": bytes(range(256)) * 4}
    for method in ("Generate", "GenerateStream", "BatchGenerate"):
        for name, data in garbage.items():
            if method == "BatchGenerate" and name == "a string that is not UTF-8":
                data = b"\x0a\x02\xff\xfe"  # prompts (field 1) too
            yield method, name, data, ("not a valid message",)
    for method in ("Generate", "GenerateStream"):
        yield from _wrong_wire_cases(pb.GenerateRequest, method)
    yield from _wrong_wire_cases(pb.BatchGenerateRequest, "BatchGenerate")
    big = pb.GenerateRequest(prompt="a").SerializeToString()
    yield "Generate", "max_new_tokens as a 10-byte varint (2**64 - 1)", big + field_bytes(3, 0, varint(2**64 - 1)), \
        ("max_new_tokens",)


def _grpc_typed_cases() -> Iterator[tuple[str, str, Any, tuple[str, ...]]]:
    """(method, name, request message, words the details hold) of well-formed messages with bad values."""
    g = pb.GenerateRequest
    nan, inf = float("nan"), float("inf")
    cases: list[tuple[str, Any, tuple[str, ...]]] = [
        ("max_new_tokens=-1", g(prompt="a", max_new_tokens=-1), ("max_new_tokens",)),
        ("max_new_tokens=0", g(prompt="a", max_new_tokens=0), ("max_new_tokens",)),
        ("max_new_tokens=2**31-1", g(prompt="a", max_new_tokens=2**31 - 1), ("max_new_tokens",)),
        ("unknown priority_class", g(prompt="a", priority_class="urgent"), ("priority",)),
        ("priority_class with priority", g(prompt="a", priority=1, priority_class="batch"), ("priority_class",)),
        ("empty prompt", g(prompt=""), ("prompt",)),
        ("prompt and prompt_token_ids", g(prompt="a", prompt_token_ids=[1]), ("prompt",)),
        ("prompt token id -1", g(prompt_token_ids=[-1]), ("token ids",)),
        ("prompt token id past the vocabulary", g(prompt_token_ids=[VOCAB]), ("token ids",)),
        ("prompt over max_model_len", g(prompt="word " * 2000), ("max_model_len",)),
        ("seed=-5", g(prompt="a", seed=-5), ("seed",)), ("top_k=-2", g(prompt="a", top_k=-2), ("top_k",)),
        ("stop_token_ids=[-1]", g(prompt="a", stop_token_ids=[-1]), ("stop_token_ids",)),
        ("65 stop strings", g(prompt="a", stop=[f"s{i}" for i in range(65)]), ("--max-stop-strings",)),
        ("a 1025-character stop string", g(prompt="a", stop=["x" * 1025]), ("--max-stop-string-length",)),
        ("logprobs=1000", g(prompt="a", logprobs=1000), ("logprobs",)),
        ("logprobs=-1", g(prompt="a", logprobs=-1), ("logprobs",)),
        ("beam_width=0", g(prompt="a", beam_width=0), ("beam_width",)),
        ("min_tokens over max", g(prompt="a", max_new_tokens=2, min_tokens=5), ("min_tokens",)),
        ("prompt_logprobs=-1", g(prompt="a", prompt_logprobs=-1), ("prompt_logprobs",)),
    ]
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "ttft_slo_ms", "timeout"):
        for name, v in {"NaN": nan, "inf": inf, "-inf": -inf, "-1": -1.0}.items():
            if field in ("presence_penalty", "frequency_penalty") and name == "-1":
                continue  # in range
            cases.append((f"{field}={name}", g(prompt="a", **{field: v}), (field,)))
    cases.append(("timeout=0", g(prompt="a", timeout=0.0), ("timeout",)))
    cases.append(("ttft_slo_ms=0", g(prompt="a", ttft_slo_ms=0.0), ("ttft_slo_ms",)))
    for name, req, words in cases:
        yield "Generate", name, req, words
        if not name.startswith("beam"):
            yield "GenerateStream", name, req, words
    yield "GenerateStream", "beam search streamed", g(prompt="a", beam_width=2), ("beam_width",)
    b = pb.BatchGenerateRequest
    for name, req, words in [("no prompts", b(), ("prompts",)), ("an empty prompt", b(prompts=["a", ""]), ("prompt",)),
                             ("1000 prompts", b(prompts=["a"] * 1000), ("max_waiting",)),
                             ("max_new_tokens=-1", b(prompts=["a"], max_new_tokens=-1), ("max_new_tokens",)),
                             ("unknown priority_class", b(prompts=["a"], priority_class="x"), ("priority",)),
                             ("temperature=NaN", b(prompts=["a"], temperature=nan), ("temperature",)),
                             ("timeout=inf", b(prompts=["a"], timeout=inf), ("timeout",))]:
        yield "BatchGenerate", name, req, words
    yield "Generate", "a 5 MB prompt (over the 4 MiB message limit)", g(prompt="a" * 5_000_000), ("larger than max",)
    yield "BatchGenerate", "5 MB of prompts", b(prompts=["a" * 1_000_000] * 5), ("larger than max",)


GRPC_RAW = list(_grpc_raw_cases())
GRPC_TYPED = list(_grpc_typed_cases())
