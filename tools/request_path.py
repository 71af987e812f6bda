"""Which package files one streamed chat completion passes through, from the route to the logits and back.

A real server (the FastAPI app under uvicorn on 127.0.0.1, an in-process AsyncLLMEngine) on a model directory (the
embedded model by default); a profile hook on every thread records the minivllm files whose code runs between the
request's first byte out and its last byte in (start-up and idle engine ticks before it are not counted). Prints the
files, grouped by folder, and their number.

    python tools/request_path.py [MODEL_DIR]
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import httpx

import minivllm

ROOT = os.path.dirname(minivllm.__file__)
_seen: set[str] = set()
_active = False


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if _active and event == "call":
        path = frame.f_code.co_filename
        if path.startswith(ROOT):
            _seen.add(os.path.relpath(path, ROOT))


@contextmanager
def recording() -> Iterator[set[str]]:
    """Record the package files run on any thread while inside."""
    global _active
    _seen.clear()
    _active = True
    try:
        yield _seen
    finally:
        _active = False


def main() -> int:
    import uvicorn

    from minivllm.config import EngineArgs
    from minivllm.engine.async_engine import AsyncLLMEngine
    from minivllm.entrypoints.api_server import build_app
    from minivllm.entrypoints.server_args import ServerArgs, uvicorn_limits
    from minivllm.utils import free_port

    threading.setprofile(_profile)  # threads started from here on (the engine's, uvicorn's, workers')
    sys.setprofile(_profile)
    model = sys.argv[1] if len(sys.argv) > 1 else None
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model, kv_cache_memory="64MiB"), [])
    port = free_port()
    app = build_app(engine, ServerArgs(port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           **uvicorn_limits(app.state.server.args)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
    body = {"model": name, "messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": 8,
            "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as r:  # warm-up: first-use imports are not the path
        r.read()
    with recording() as files, httpx.stream("POST", url, json=body, timeout=60) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data:")]
    server.should_exit = True
    thread.join(10)
    engine.shutdown()
    print(f"{len(chunks)} SSE chunks; {len(files)} package files:")
    for f in sorted(files):
        print(f"  {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
