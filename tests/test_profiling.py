"""`minivllm monitor` and `minivllm profile` against a live `minivllm serve` under load (SPEC §9)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading

import httpx
import psutil
import pytest
from server_utils import ServerProcess


@pytest.fixture(scope="module")
def busy_server():
    """The embedded model's server with a client keeping it busy until the tests are done."""
    server = ServerProcess(None, "--kv-cache-memory", "128MiB", "--log-level", "warning")
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                c.post(server.url + "/generate", json={"prompt": "def f(x):", "max_new_tokens": 32})

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        yield server
    finally:
        stop.set()
        t.join(60)
        server.stop()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minivllm", *args], capture_output=True, text=True, timeout=120)


def test_monitor_writes_the_server_processs_own_figures(busy_server, tmp_path):
    pid = busy_server.proc.pid
    out = tmp_path / "mon.csv"
    r = _cli("monitor", "--pid", str(pid), "--duration", "2", "--interval", "0.2", "--out", str(out), "--plot")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) >= 5
    proc = psutil.Process(pid)
    rss_now = proc.memory_info().rss
    with open(f"/proc/{pid}/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    for row in rows:
        rss, peak = int(row["rss_bytes"]), int(row["peak_rss_bytes"])
        assert 0 < rss <= peak <= hwm
    # The server's RSS, not the monitor's own: a loaded model and KV pool, within 10% of the value now.
    assert abs(int(rows[-1]["rss_bytes"]) - rss_now) < 0.1 * rss_now
    assert int(rows[-1]["rss_bytes"]) > 128 * 2**20  # at least the server's 128 MiB KV pool
    assert int(rows[-1]["ctx_voluntary"]) >= int(rows[0]["ctx_voluntary"]) > 0
    assert int(rows[0]["num_threads"]) > 1 and int(rows[-1]["minor_faults"]) > 0
    assert float(rows[-1]["t_s"]) >= 1.9
    assert (tmp_path / "mon.png").stat().st_size > 0


def test_monitor_and_profile_refuse_a_missing_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a finished child's pid: no process has it now
    for args in (("monitor", "--pid", str(p.pid), "--duration", "1"), ("profile", "--pid", str(p.pid))):
        r = _cli(*args)
        assert r.returncode == 2 and f"no process {p.pid}" in r.stderr, r.stderr


def test_profile_gives_counters_and_a_flame_graph_or_says_why(busy_server, tmp_path):
    r = _cli("profile", "--pid", str(busy_server.proc.pid), "--seconds", "2", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "perf_stat.json").read_text())
    assert r.returncode == (0 if result["perf"] or result["flamegraph"] else 1), r.stdout + r.stderr
    if result["flamegraph"]:
        svg = (tmp_path / "flamegraph.svg").read_text()
        assert "<svg" in svg and "minivllm" in svg  # the server's own Python frames were sampled
    else:
        assert result["flamegraph_unavailable"] and "flame graph: unavailable: " in r.stdout
    if result["perf"]:
        figures = result["perf"]["figures"]
        assert figures.get("context-switches", 0) > 0  # a software counter: every kernel that allows perf has it
        assert "ipc" in figures or any("IPC" in n for n in result["perf"]["notes"])
    else:
        assert result["perf_unavailable"] and "perf stat: unavailable: " in r.stdout
