"""The live view (SPEC §7) driven in a real headless browser: Debian's chromium under Playwright, against a
real server while a burst of requests runs. Assertions read the DOM (data attributes the page keeps),
never pixels; a screenshot is saved under the test's tmp dir for a person to look at."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_utils import ServerProcess

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the [test] extra")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: tools/install_system_deps.sh installs "
                                                         "Debian's where apt is available")


def _burst(url: str, n: int, done: threading.Event) -> None:
    """n concurrent requests, half of them sharing a long prefix (shared KV blocks), then done."""
    shared = "import os\nimport sys\n\nclass Loader(object):\n    def __init__(self, path):\n" * 3

    def one(i: int) -> None:
        prompt = (shared if i % 2 else f"def f{i}(x):\n") + f"    return {i}"
        httpx.post(url + "/generate", json={"prompt": prompt, "max_new_tokens": 40, "ignore_eos": True}, timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()


@contextlib.contextmanager
def _live_page(server: ServerProcess) -> Iterator[Any]:
    """A headless chromium page on the server's live view, once its feed is live."""
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(server.url + "/dashboard")
        page.wait_for_selector('#status[data-state="live"]', timeout=30_000)
        yield page
        browser.close()


def test_live_view_follows_a_burst(tmp_path):
    server = ServerProcess(None, "--num-kv-blocks", "192", "--block-size", "16", "--max-num-seqs", "6",
                           "--max-num-batched-tokens", "64", "--log-level", "warning")
    try:
        with _live_page(server) as page:
            # The page itself keeps the most blocks it ever showed owned: polled from here every 100 ms, a loaded
            # suite once missed every busy frame of a burst that finished in a few seconds.
            page.evaluate("""() => { const el = document.getElementById('kv-stats'); window.maxOwned = 0;
                new MutationObserver(() => { window.maxOwned = Math.max(window.maxOwned, +(el.dataset.owned || 0)); })
                    .observe(el, {attributes: true}); }""")
            done = threading.Event()
            threading.Thread(target=_burst, args=(server.url, 16, done), daemon=True).start()
            deadline = time.time() + 180
            while not done.is_set():
                assert time.time() < deadline, "the burst did not finish"
                page.wait_for_timeout(100)
            max_owned = int(page.evaluate("() => window.maxOwned"))
            page.screenshot(path=str(tmp_path / "live_view_busy.png"), full_page=True)
            # After the burst every request's blocks are released: the grid drains to no owned block.
            page.wait_for_function("document.getElementById('kv-stats').dataset.owned === '0' && "
                                   "document.getElementById('kv-stats').dataset.used === '0'", timeout=30_000)
            histories = page.eval_on_selector_all("#requests tr", "rows => rows.map(r => r.dataset.history)")
            steps_points = int(page.get_attribute("#steps", "data-points"))
            tput_points = int(page.get_attribute("#throughput", "data-points"))
            log = page.inner_text("#log")
            total = int(page.get_attribute("#kv-stats", "data-total"))
            page.screenshot(path=str(tmp_path / "live_view_idle.png"), full_page=True)
            experts_hidden = page.is_hidden("#experts-panel")
    finally:
        server.stop()
    assert total == 192
    assert max_owned > 0, "the KV grid never showed a block owned by a request"
    assert len(histories) == 16
    # Each request moved through its states: queued or prefilled, decoded, finished.
    assert all(h.split(">")[-1] == "FINISHED" and "DECODE" in h for h in histories), histories
    assert all(h.split(">")[0] in ("WAITING", "PREFILL") for h in histories), histories
    assert any(h.startswith("WAITING>") for h in histories), "with 6 slots for 16 requests some must wait"
    assert steps_points > 0 and tput_points > 0
    assert "admitted" in log and "finished (length)" in log and "prefill chunk" in log
    assert (tmp_path / "live_view_busy.png").stat().st_size > 0
    assert experts_hidden, "a dense model has no expert heat map"


def test_live_view_heat_map_of_a_mixtures_expert_load(model_factory, tmp_path):
    """A mixture of experts' server shows a heat map (a row per sparse layer, a column per expert): after a request
    of P prompt tokens and N outputs, every sparse layer of tiny-qwen3-moe (0 and 2: layer 1 is dense) has routed
    top-k (2) x (P + N - 1) tokens since the view connected, the same count /metrics adds."""
    server = ServerProcess(model_factory("tiny-qwen3-moe"), "--log-level", "warning")
    prompt = list(range(300, 337))
    try:
        with _live_page(server) as page:
            page.wait_for_selector("#experts-panel", state="visible", timeout=10_000)
            r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                                                                 "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            want = str(2 * (len(prompt) + 6 - 1))
            page.wait_for_function(f"document.getElementById('experts-stats').dataset.routed === '{want},{want}'",
                                   timeout=15_000)
            layers = page.get_attribute("#experts-stats", "data-layers")
            experts = page.get_attribute("#experts-stats", "data-experts")
            page.screenshot(path=str(tmp_path / "live_view_experts.png"), full_page=True)
    finally:
        server.stop()
    assert layers == "0,2" and experts == "8"


def test_live_view_behind_the_key_in_a_browser():
    """With --api-key the page is opened as /dashboard?token=<key>: the token leaves the address bar, the feed gets
    it as a WebSocket subprotocol and goes live; a reload keeps it for the tab; another tab without it is refused."""
    key = "sk-browser-0a9b8c7d"
    server = ServerProcess(None, "--api-key", key, "--log-level", "warning")
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page()
            page.goto(server.url + f"/dashboard?token={key}")
            page.wait_for_selector('#status[data-state="live"]', timeout=30_000)
            assert "token" not in page.url
            page.reload()
            page.wait_for_selector('#status[data-state="live"]', timeout=30_000)
            other = browser.new_context().new_page()
            response = other.goto(server.url + "/dashboard")
            assert response is not None and response.status == 401
            browser.close()
    finally:
        server.stop()
