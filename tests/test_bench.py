"""`minivllm bench throughput` runs end to end (tiny model, few tokens) and reports consistent figures."""

from __future__ import annotations

import json

from minivllm.cli import main


def test_bench_throughput_smoke(model_factory, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", model_factory("tiny-llama"), "--num-requests", "4",
               "--input-len-min", "4", "--input-len-max", "12", "--output-len", "6", "--batch1-output-len", "4",
               "--kv-cache-memory", "8MiB", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["output_tokens"] == 4 * 6
    # Same greedy tokens as HF and as the portable paths: the comparison is apples to apples.
    assert r["hf"]["identical_outputs"] == 4 and r["portable"]["identical_outputs"] == 4
    assert 0 < r["ours"]["roofline_fraction"] and r["speedup_vs_hf"] > 0
    assert set(r["step_split"]) == {"schedule", "prepare", "forward", "sample", "update"}
    assert r["decode_profile"]["batch"] == 4
    assert r["sampled"]["output_tok_s"] > 0 and r["sampled"]["ratio_to_greedy"] > 0


def test_bench_latency_smoke(model_factory, tmp_path):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", model_factory("tiny-llama"), "--prompt-lens", "64,16",
               "--output-len", "5", "--repeats", "2", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [x["prompt_len"] for x in r["rows"]] == [16, 64]
    for x in r["rows"]:
        assert x["ttft_ms"] > 0 and x["tpot_ms"] > 0 and x["ttft_floor_ms"] > 0 and x["tpot_floor_ms"] > 0
    assert (tmp_path / "latency.png").stat().st_size > 0


def test_bench_serve_smoke_over_grpc_and_http(model_factory, tmp_path):
    """The real server started by the bench, two endpoints in ABBA order, the offline engine around them."""
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--model", model_factory("tiny-llama"), "--transport", "grpc,http",
               "--concurrency", "3", "--num-requests", "6", "--input-len-min", "8", "--input-len-max", "16",
               "--output-len", "4", "--output-len-max", "6", "--server-threads", "1", "--threads", "1",
               "--kv-cache-memory", "64MiB", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["order"] == ["grpc", "http", "http", "grpc"]
    for t in ("grpc", "http"):
        s = r["server"][t]
        assert s["successes"] == 12 and s["failures"] == 0  # 6 requests x 2 rounds
        assert 4 * 12 <= s["output_tokens"] <= 6 * 12 and s["ttft_ms"]["p50"] > 0
        assert r["server_vs_offline"][t] > 0
    assert r["server"]["grpc"]["output_tokens"] == r["server"]["http"]["output_tokens"]  # the same requests
    assert (tmp_path / "serve.png").stat().st_size > 0
