"""Hand-written bad inputs (issue 20), the ones a schema cannot describe, against the real server (HTTP, WebSocket
and gRPC on one engine): huge integers and NaN/Infinity literals in raw JSON, deep nesting, invalid UTF-8 and
lone surrogates, wrong content types, truncated JSON, a 10 MB body, a slow-loris body, a wrong type for every
field of every route, out-of-range values, unknown and path-like model names, WebSocket garbage frames, and gRPC
messages that do not parse, carry a field with the wrong wire type, or break the limits.

Every case must get a 4xx (gRPC INVALID_ARGUMENT / RESOURCE_EXHAUSTED / OUT_OF_RANGE) whose message names the
problem, never a 5xx, never a hang (a timeout on every call); afterwards nothing runs, no KV block is in use,
/health is 200 and a good request is answered over HTTP, WebSocket and gRPC.

What uvicorn does with a slow client, as measured here: it has no timeout of its own on a request body, so the
server bounds the wait for each next piece of a body with --client-stall-timeout (408 and the connection closed;
GuardMiddleware); a client that trickles its body in steadily is served. A request head (request line and
headers) that never completes is held open by uvicorn without a timeout (its h11_max_incomplete_event_size caps
only its size, 16 KiB); the ASGI app never sees it, so only a front proxy's header timeout bounds those. Either
way the event loop keeps serving everyone else. A WebSocket frame over --max-body-size (4 MiB; uvicorn's
ws_max_size) closes the connection with 1009 (message too big), and a connection that floods requests gets a 429
for each beyond the few it may have waiting.
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from fuzz_cases import (
    BAD_CODES,
    GRPC_RAW,
    GRPC_TYPED,
    HTTP_CASES,
    SERVICE,
    WS_CASES,
    G,
    HttpCase,
    field_bytes,
    model_name_cases,
    varint,
)
from fuzz_utils import GOOD, SERVER_FLAGS, TIMEOUT, assert_error_shape, assert_server_whole, good_answer
from server_utils import ServerProcess, free_port, metrics
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc

STALL_S = 3.0  # --client-stall-timeout of this server (the slow-loris tests wait for it)
VOCAB = 1024  # tiny-llama's vocabulary (make_model's preset)
MIN_CASES = 200
COUNTS: collections.Counter[str] = collections.Counter()  # cases run, by kind


class Server:
    """A real `minivllm serve` with HTTP on .url and gRPC on .target."""

    def __init__(self, proc: ServerProcess, grpc_port: int) -> None:
        self.proc, self.url, self.target = proc, proc.url, f"127.0.0.1:{grpc_port}"
        self.host, self.port = "127.0.0.1", proc.port
        self.ws_url = self.url.replace("http://", "ws://") + "/ws/generate"
        self.expected = ""  # the greedy answer to GOOD before any fuzzing
        self.model_path = ""


@pytest.fixture(scope="module")
def server(model_factory):
    grpc_port = free_port()
    proc = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", *SERVER_FLAGS,
                         "--grpc-port", str(grpc_port), "--client-stall-timeout", str(STALL_S))
    srv = Server(proc, grpc_port)
    srv.model_path = model_factory("tiny-llama")
    srv.expected = good_answer(srv.url)
    yield srv
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


def _check_http(http: httpx.Client, case: HttpCase) -> None:
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    r = http.post(case.path, content=case.body, headers=headers)
    assert r.status_code == case.status, (case.id, r.status_code, r.text[:500])
    message = assert_error_shape(r.json(), case.status)
    for w in case.words:
        assert w in message, (case.id, w, message[:500])




@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.id for c in HTTP_CASES])
def test_http_bad_input(http, case):
    _check_http(http, case)
    COUNTS["http"] += 1


def test_unknown_and_path_like_model_names(server, http):
    """404 for every name but the served one; a path is never opened as a model (nothing about it in the log,
    /v1/models unchanged)."""
    models = http.get("/v1/models").json()["data"]
    assert all("/" not in m["root"] for m in models)  # no server path shown
    cases = list(model_name_cases(server.model_path))
    for case in cases:
        _check_http(http, case)
    COUNTS["http model names"] += len(cases)
    assert http.get("/v1/models").json()["data"] == models
    log = server.proc.log_text()
    for secret in ("/etc/passwd", "id_rsa", "system32", "environ"):
        assert secret not in log, log[-2000:]


def test_chunked_10mb_body_gets_413(http):
    """A body with no Content-Length is counted as it arrives."""
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 100_000
        yield b'"}'

    r = http.post(G, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert "exceeds the limit" in assert_error_shape(r.json(), 413)
    COUNTS["http"] += 1


# ---- slow loris ------------------------------------------------------------------------------------------
def _open(server: Server, head: bytes) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=TIMEOUT)
    s.sendall(head)
    return s


def _read_all(s: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or the timeout passes)."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def _served_meanwhile(server: Server) -> float:
    """A good request is answered while the slow client holds its connection; its latency."""
    t = time.monotonic()
    r = httpx.post(server.url + G, json={"prompt": "a", "max_new_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return time.monotonic() - t


def test_slow_loris_stalled_body_gets_408_and_others_are_served(server):
    body = json.dumps(GOOD).encode()
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    stalled = [_open(server, head + body[:10]) for _ in range(3)]  # then nothing more
    try:
        t0 = time.monotonic()
        assert _served_meanwhile(server) < STALL_S  # not held up by the stalled bodies
        for s in stalled:
            answer = _read_all(s, STALL_S + TIMEOUT)  # 408, then the server closes the connection
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
            assert b"connection: close" in answer.lower()
            message = assert_error_shape(json.loads(answer.split(b"\r\n\r\n", 1)[1]), 408)
            assert "request body" in message and "--client-stall-timeout" in message, message
        assert STALL_S - 0.5 < time.monotonic() - t0 < STALL_S + 10
    finally:
        for s in stalled:
            s.close()
    COUNTS["slow loris"] += len(stalled)


def test_slow_body_trickled_in_is_served(server):
    """A body sent in small pieces, each within the stall timeout but all together longer than it, is served
    (the limit is on each wait, as nginx's client_body_timeout), while other requests go on."""
    body = json.dumps(GOOD).encode()
    s = _open(server, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    pieces = [body[i:i + 8] for i in range(0, len(body), 8)]
    gap = (STALL_S + 1.5) / len(pieces)  # all of it takes longer than the stall timeout
    assert gap < STALL_S / 2
    try:
        for piece in pieces:
            s.sendall(piece)
            assert _served_meanwhile(server) < STALL_S
            time.sleep(gap)
        answer = _read_all(s, TIMEOUT)
    finally:
        s.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["generated_text"] == server.expected
    COUNTS["slow loris"] += 1


def test_slow_loris_stalled_headers_do_not_block_others(server):
    """A request head that never completes: uvicorn keeps the connection (it has no header timeout; only a proxy
    in front bounds that), but it holds nothing else up."""
    stalled = [_open(server, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: appl") for _ in range(5)]
    try:
        for _ in range(3):
            assert _served_meanwhile(server) < STALL_S
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    finally:
        for s in stalled:
            s.close()
    COUNTS["slow loris"] += len(stalled)


# ---- WebSocket ---------------------------------------------------------------------------------------------


def _ws_final(ws: Any) -> dict[str, Any]:
    """Read messages of one request up to its final one (finish_reason, or an error)."""
    while True:
        msg = json.loads(ws.recv(timeout=TIMEOUT))
        if "finish_reason" in msg or "error" in msg:
            return msg


def test_websocket_garbage_frames(server):
    """Each bad frame gets an error message in OpenAI's shape naming the problem, and the same connection then
    serves a good request."""
    with connect(server.ws_url, max_size=None, open_timeout=TIMEOUT, close_timeout=5) as ws:
        for name, frame, words in WS_CASES:
            ws.send(frame)
            reply = json.loads(ws.recv(timeout=TIMEOUT))
            message = assert_error_shape(reply, 400)
            for w in words:
                assert w in message, (name, w, message[:300])
            COUNTS["websocket"] += 1
        ws.send(json.dumps(GOOD))
        final = _ws_final(ws)
        assert final["generated_text"] == server.expected, final


def test_websocket_flood_gets_429s_and_is_not_buffered(server):
    """100 requests sent on one connection without reading: the running one and WS_MAX_QUEUED waiting ones are
    answered, every other one gets a 429 naming the bound (nothing is buffered past it)."""
    from minivllm.entrypoints.server_args import WS_MAX_QUEUED

    with connect(server.ws_url, max_size=None, open_timeout=TIMEOUT, close_timeout=5) as ws:
        for _ in range(100):
            ws.send(json.dumps(GOOD))
        finals = [_ws_final(ws) for _ in range(100)]
    answered = [f for f in finals if "error" not in f]
    refused = [f["error"] for f in finals if "error" in f]
    assert all(f["generated_text"] == server.expected for f in answered)
    assert 1 <= len(answered) <= 100 - len(refused) and len(refused) >= 100 - 1 - WS_MAX_QUEUED - 8, len(answered)
    assert all(e["code"] == 429 and "already wait on this connection" in e["message"] for e in refused)
    COUNTS["websocket"] += 1


def test_websocket_huge_frame_closes_with_1009(server):
    """A frame over --max-body-size (4 MiB, uvicorn's ws_max_size): the connection is closed with 1009 (message too
    big) before the frame is buffered whole."""
    with connect(server.ws_url, max_size=None, open_timeout=TIMEOUT, close_timeout=5) as ws:
        ws.send("x" * (4 * 2**20 + 1))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=TIMEOUT)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
    assert closed.value.rcvd.reason, closed.value
    COUNTS["websocket"] += 1




@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as ch:
        grpc.channel_ready_future(ch).result(timeout=TIMEOUT)
        yield ch


def _grpc_call(channel: grpc.Channel, method: str, data: bytes) -> None:
    """Send raw bytes to a method; the call must fail with a client-error status naming the problem."""
    ident = bytes  # identity (de)serializers: the bytes go as they are
    if method == "GenerateStream":
        call = channel.unary_stream(f"{SERVICE}/{method}", request_serializer=ident, response_deserializer=ident)
        list(call(data, timeout=TIMEOUT))
    else:
        call = channel.unary_unary(f"{SERVICE}/{method}", request_serializer=ident, response_deserializer=ident)
        call(data, timeout=TIMEOUT)


@pytest.mark.parametrize("method,name,data,words", GRPC_RAW, ids=[f"{c[0]} {c[1]}" for c in GRPC_RAW])
def test_grpc_raw_bytes(channel, method, name, data, words):
    with pytest.raises(grpc.RpcError) as err:
        _grpc_call(channel, method, data)
    _check_status(err.value, words)
    COUNTS["grpc"] += 1


@pytest.mark.parametrize("method,name,request_msg,words", GRPC_TYPED, ids=[f"{c[0]} {c[1]}" for c in GRPC_TYPED])
def test_grpc_bad_values(channel, method, name, request_msg, words):
    with pytest.raises(grpc.RpcError) as err:
        _grpc_call(channel, method, request_msg.SerializeToString())
    _check_status(err.value, words)
    COUNTS["grpc"] += 1


def _check_status(err: grpc.RpcError, words: tuple[str, ...]) -> None:
    assert err.code() in BAD_CODES, (err.code(), err.details())
    details = err.details() or ""
    assert details.strip(), err
    for w in words:
        assert w in details, (w, details[:300])


def test_grpc_unknown_field_is_ignored(channel):
    """A field number this server does not know (a newer client's) is skipped, as protobuf intends."""
    data = pb.GenerateRequest(**{k: v for k, v in GOOD.items() if k != "prompt"}, prompt=GOOD["prompt"]
                              ).SerializeToString() + field_bytes(999, 0, varint(1))
    reply = pb.GenerateResponse.FromString(channel.unary_unary(f"{SERVICE}/Generate", request_serializer=bytes,
                                                               response_deserializer=bytes)(data, timeout=TIMEOUT))
    assert reply.tokens_generated == GOOD["max_new_tokens"]


# ---- afterwards ------------------------------------------------------------------------------------------
def test_case_count(capsys):
    """How many bad inputs this file holds (and, run after the cases above, how many ran)."""
    defined = {"http": len(HTTP_CASES) + 1, "http model names": len(list(model_name_cases("/m"))),
               "slow loris": 9, "websocket": len(WS_CASES) + 2, "grpc": len(GRPC_RAW) + len(GRPC_TYPED)}
    with capsys.disabled():
        print(f"\nbad-input cases: {sum(defined.values())} defined {defined}; "
              f"{sum(COUNTS.values())} run {dict(COUNTS)}")
    assert sum(defined.values()) >= MIN_CASES, defined


def test_server_whole_after_fuzzing(server, channel):
    """Nothing running, 0 KV blocks, /health 200, no 5xx counted, no traceback in the log, and a good request
    answered over HTTP, WebSocket and gRPC (unary and streaming) with the greedy text it got before."""
    assert_server_whole(server.url, server.expected)
    m = metrics(server.url)
    errors = {k: v for k, v in m.items() if k.startswith("inference_requests_total") and 'status="server_error"' in k
              and v}
    assert not errors, errors
    log = server.proc.log_text()
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
    with connect(server.ws_url, open_timeout=TIMEOUT, close_timeout=5) as ws:
        ws.send(json.dumps(GOOD))
        assert _ws_final(ws)["generated_text"] == server.expected
    stub = pb_grpc.InferenceServiceStub(channel)
    req = pb.GenerateRequest(prompt=GOOD["prompt"], max_new_tokens=GOOD["max_new_tokens"], temperature=0,
                             ignore_eos=True)
    assert stub.Generate(req, timeout=TIMEOUT).generated_text == server.expected
    assert "".join(m.text for m in stub.GenerateStream(req, timeout=TIMEOUT)) == server.expected
    # Many clients at once after all that: still answered, then idle again.
    results: list[int] = []

    def one() -> None:
        results.append(httpx.post(server.url + G, json=GOOD, timeout=TIMEOUT).status_code)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert results == [200] * 8
    assert_server_whole(server.url, server.expected)
