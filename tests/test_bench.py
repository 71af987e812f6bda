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
