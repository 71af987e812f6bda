"""deploy/: the Prometheus config and a live /metrics pass promtool, the Grafana dashboard's every query
names a metric a live server exports, the compose file validates and the Dockerfile lints (SPEC §6, §8)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess, promtool_lints

ROOT = os.path.join(os.path.dirname(__file__), "..")
DEPLOY = os.path.join(ROOT, "deploy")
def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (tools/install_system_deps.sh installs it where apt is available)")
    return path


@pytest.fixture(scope="module")
def live_metrics():
    """A live scrape of the embedded model's server after a few requests (streamed, whole, and a 400)."""
    server = ServerProcess(None, "--kv-cache-memory", "128MiB", "--log-level", "warning")
    try:
        for body in ({"prompt": "def f(x):", "max_new_tokens": 8},
                     {"prompt": "import os", "max_new_tokens": 4, "stream": True},
                     {"prompt": "x", "max_new_tokens": 10**6}):
            httpx.post(server.url + "/generate", json=body, timeout=60)
        yield httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()


def test_promtool_checks_the_scrape_config():
    promtool = _tool("promtool")
    out = subprocess.run([promtool, "check", "config", os.path.join(DEPLOY, "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_finds_only_vllms_deliberate_names_in_a_live_scrape(live_metrics):
    _tool("promtool")
    lints, unexpected = promtool_lints(live_metrics)
    assert not unexpected, unexpected
    assert any("minivllm:num_requests_running" in line for line in lints)  # the lint did run on our names


def test_every_dashboard_query_names_an_exported_metric(live_metrics):
    exported = {s.name for fam in text_string_to_metric_families(live_metrics) for s in fam.samples}
    with open(os.path.join(DEPLOY, "grafana", "dashboards", "minivllm.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 12 and exprs
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\b((?:minivllm:|inference_|process_)[A-Za-z0-9_:]*)", expr))
        assert names, f"no metric in {expr!r}"
        used |= names
        assert names <= exported, f"{expr!r} names {sorted(names - exported)}, which the server does not export"
    # SPEC §6 is covered: throughput, latencies, running/waiting, KV, preemptions, prefix cache, errors.
    for needed in ("minivllm:generation_tokens_total", "minivllm:time_to_first_token_seconds_bucket",
                   "minivllm:inter_token_latency_seconds_bucket", "minivllm:e2e_request_latency_seconds_bucket",
                   "minivllm:num_requests_running", "minivllm:num_requests_waiting", "minivllm:kv_cache_usage_perc",
                   "minivllm:num_preemptions_total", "minivllm:prefix_cache_hits_total", "inference_requests_total"):
        assert needed in used, needed
    # Provisioning points Grafana at that dashboard and at the datasource uid its panels use.
    with open(os.path.join(DEPLOY, "grafana", "provisioning", "datasources", "prometheus.yml")) as f:
        assert "uid: prometheus" in f.read()
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {"prometheus"}


def test_compose_file_validates(tmp_path):
    docker = shutil.which("docker")
    has_plugin = docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True,
                                                       timeout=30).returncode == 0
    cmd = [docker, "compose"] if has_plugin else [_tool("docker-compose")]
    compose = os.path.join(DEPLOY, "docker-compose.yml")
    example = os.path.abspath(os.path.join(DEPLOY, "env.example"))
    out = subprocess.run([*cmd, "--env-file", example, "-f", compose, "config"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for service in ("minivllm:", "prometheus:", "grafana:"):
        assert service in out.stdout
    assert "/etc/grafana/provisioning" in out.stdout and "/etc/prometheus/prometheus.yml" in out.stdout
    # Issue 33, item 11: every port on loopback only; the API key and Grafana's admin password from the env file,
    # and no anonymous Grafana.
    ports = re.findall(r"^\s*- (?:['\"])?([0-9.]*:?\d+:\d+)", out.stdout, re.M)
    assert sorted(p.split(":", 1)[1] for p in ports) == ["3000:3000", "8000:8000", "9090:9090"], ports
    assert all(p.startswith("127.0.0.1:") for p in ports), ports
    assert "replace-me-with-a-long-random-key" in out.stdout and "replace-me-too" in out.stdout
    assert 'GF_AUTH_ANONYMOUS_ENABLED: "false"' in out.stdout or "GF_AUTH_ANONYMOUS_ENABLED: 'false'" in out.stdout
    empty = tmp_path / "empty.env"
    empty.write_text("")
    out = subprocess.run([*cmd, "--env-file", str(empty), "-f", compose, "config"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "set MINIVLLM_API_KEY in deploy/.env" in out.stdout + out.stderr


def test_dockerfile_lints_clean():
    hadolint = _tool("hadolint")
    out = subprocess.run([hadolint, os.path.join(DEPLOY, "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    assert "torch==2.13.0" in text and "HEALTHCHECK" in text and "/health" in text and "USER 10001" in text
