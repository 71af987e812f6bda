"""tools/train_tiny.py end to end at toy size: both models, the held-out data, metrics and model cards,
in directories our engine loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from minivllm import LLM, SamplingParams
from minivllm.default_model import DRAFT_NAME, MAIN_NAME
from minivllm.default_model.corpus import load_held_out

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "tools", "train_tiny.py")


def test_train_tiny_smoke(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--main-steps", "2", "--draft-steps", "2",
                        "--vocab", "512", "--eval-tokens", "2048", "--threads", "2", "--distill-steps", "2",
                        "--distill-continuations", "4"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "metrics.json") as f:
        m = json.load(f)
    assert m["main"]["steps"] == m["draft"]["steps"] == 2 and m["main"]["parameters"] > 10 * m["draft"]["parameters"]
    d = m["draft"]["distill"]  # the draft then distilled on the main model: agreement measured before and after
    assert d["steps"] == 2 and d["continuations"] == 4 and d["tokens"] == 2 * 16 * 256
    assert all(0 <= d[k][f"next_{j}"] <= 1 for k in ("agreement_before", "agreement_after") for j in range(1, 5))
    assert d["agreement_after"]["next_4"] <= d["agreement_after"]["next_1"]
    assert "held_out_ppl_before_distill" in m["draft"] and "Draft distillation" in (tmp_path / DRAFT_NAME /
                                                                                  "README.md").read_text()
    assert m["eval_tokens"] == 2048 and m["held_out"] and m["software"]["threads"] == 2
    ids, counts = load_held_out(str(tmp_path / "held_out.safetensors"))
    assert len(ids) == 2048 and len(counts) == 512 and counts.sum() == m["train_tokens"]
    assert len((tmp_path / "train_log.jsonl").read_text().splitlines()) == 0  # logged every 10 steps
    for name in (MAIN_NAME, DRAFT_NAME):
        assert "held-out perplexity" in (tmp_path / name / "README.md").read_text()
        out = LLM(str(tmp_path / name), kv_cache_memory="16MiB").generate(
            "def f(x):", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
