"""The real command line: make-model then generate, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minivllm", *args], capture_output=True, text=True, timeout=300)


def test_make_model_then_generate(tmp_path):
    out = tmp_path / "m"
    r = _run("make-model", "--preset", "tiny-qwen2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors"):
        assert (out / f).is_file()
    r = _run("generate", "--model", str(out), "--prompt", "def fibonacci(n):", "--prompt", "import os",
             "--max-tokens", "7", "--ignore-eos", "--json", "--kv-cache-memory", "16MiB")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["def fibonacci(n):", "import os"]
    assert all(len(line["token_ids"]) == 7 and line["finish_reason"] == "length" for line in lines)


def test_errors_are_reported_not_raised(tmp_path):
    r = _run("generate", "--model", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "no config.json" in r.stderr
    r = _run("make-model", "--preset", "nope", "--out", str(tmp_path))
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr


def test_help_lists_verbs():
    r = _run("--help")
    assert r.returncode == 0 and all(v in r.stdout for v in ("generate", "make-model", "bench"))
