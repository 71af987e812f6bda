"""Run the real server (`minivllm serve` under uvicorn) on 127.0.0.1 on a free port, for tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from minivllm.utils import free_port  # noqa: F401  (the tests import it from here)

TEST_KV_CACHE_MEMORY = "64MiB"  # tens of thousands of tokens for the tiny test models


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when pytest dies (killed, say), so no server outlives the session."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """`python -m minivllm serve [MODEL] ...` in a subprocess, with its log kept for failure messages
    (no MODEL: the embedded default model)."""

    def __init__(self, model: str | None, *args: str, stop_timeout: float = 15.0,
                 env: dict[str, str] | None = None) -> None:
        self.stop_timeout = stop_timeout  # a front of Ray replicas tears its cluster down on the way out
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minivllm-serve-", suffix=".log", delete=False)
        if not {"--kv-cache-memory", "--num-kv-blocks"} & set(args):
            # The default 2 GiB pool is touched at start; a dozen servers of tiny models would fill this machine.
            args = (*args, "--kv-cache-memory", TEST_KV_CACHE_MEMORY)
        cmd = [sys.executable, "-m", "minivllm", "serve", *([model] if model else []), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     preexec_fn=_die_with_parent)
        deadline = time.time() + 120
        # One client for the polls (each bare httpx.get builds an SSL context: ~20 ms of a core the starting server
        # wants), polled often: the suite starts dozens of servers.
        with httpx.Client(timeout=1) as poll:
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
                try:
                    if poll.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        """Everything the server printed so far."""
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> None:
        """Terminate the server."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.log.name)


@contextmanager
def in_process_server(app) -> Iterator[str]:
    """Serve a FastAPI app with uvicorn on a thread of this process (for fault-injection tests)."""
    import uvicorn

    from minivllm.entrypoints.server_args import uvicorn_limits

    port = free_port()
    server_state = getattr(app.state, "server", None)  # (a test's own app has none: uvicorn's defaults)
    limits = uvicorn_limits(server_state.args) if server_state is not None else {}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "in-process server did not start"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(20)


def metrics(url: str) -> dict[str, float]:
    """/metrics parsed with prometheus_client's parser: 'name{label="v",...}' → value (labels sorted)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, nothing waits and no KV block is in use; return the metrics."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        idle = (m["minivllm:num_requests_running"] == 0 and m["minivllm:num_requests_waiting"] == 0
                and m["minivllm:kv_cache_usage_perc"] == 0)
        if idle:
            return m
        assert time.time() < deadline, f"the server did not become idle in {timeout} s: running " \
            f"{m['minivllm:num_requests_running']}, waiting {m['minivllm:num_requests_waiting']}, " \
            f"KV usage {m['minivllm:kv_cache_usage_perc']}"
        time.sleep(0.1)


# promtool's lint cannot be switched off; these two are vLLM's naming, kept on purpose: the colon of the
# `minivllm:` namespace, and `iteration_tokens_total` (vLLM's name for a histogram).
_EXPECTED_LINTS = (re.compile(r"^minivllm:\w+ metric names should not contain ':'$"),
                   re.compile(r'^minivllm:iteration_tokens_total non-counter metrics should not have "_total" suffix$'))


def promtool_lints(text: str) -> tuple[list[str], list[str]] | None:
    """`promtool check metrics` on a scrape: (every lint, those beyond vLLM's deliberate names); None
    without promtool."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    lints = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return lints, [line for line in lints if not any(p.match(line) for p in _EXPECTED_LINTS)]
