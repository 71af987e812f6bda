"""The embedded default model: shipped, loaded when no model is given (LLM(), generate, serve), and
good: held-out perplexity by our engine equals HF's and sits far below a unigram baseline."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import subprocess
import sys
import tomllib

import httpx
import numpy as np
import pytest
from server_utils import ServerProcess

from minivllm import LLM, SamplingParams
from minivllm.bench.perplexity import (
    engine_token_logprobs,
    evaluation_data,
    hf_model,
    hf_token_logprobs,
    load_tokenizer,
    perplexity,
)
from minivllm.default_model import (
    DRAFT_NAME,
    MAIN_NAME,
    default_draft_model_path,
    default_model_path,
    held_out_path,
    training_metrics_path,
)
from minivllm.default_model.corpus import encode_stream, load_held_out, read_texts, relative_path, split_files, windows

MAIN, DRAFT = default_model_path(), default_draft_model_path()
ROOT = os.path.dirname(MAIN)


@pytest.fixture(scope="module")
def metrics() -> dict:
    with open(training_metrics_path()) as f:
        return json.load(f)


def test_shipped_within_budget():
    size = sum(os.path.getsize(os.path.join(d, f)) for d in (MAIN, DRAFT) for f in os.listdir(d))
    assert size <= 50 * 2**20, f"embedded models take {size / 2**20:.1f} MiB"
    for d in (MAIN, DRAFT):
        assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(os.listdir(d))
    # One tokenizer for both: the draft's proposals are the main model's tokens.
    with open(os.path.join(MAIN, "tokenizer.json")) as a, open(os.path.join(DRAFT, "tokenizer.json")) as b:
        assert a.read() == b.read()


def test_llm_without_a_model_loads_the_embedded_one():
    llm = LLM(kv_cache_memory="64MiB")
    assert llm.llm_engine.config.model.path == MAIN
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0 and out.outputs[0].text.strip()


def test_package_data_ships_every_model_file():
    """A non-editable install gets what the repo has: every data file matches pyproject's package-data."""
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["minivllm.default_model"]
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), ROOT).replace(os.sep, "/")
            if not rel.endswith((".py", ".pyc")):
                assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


def test_shipped_held_out_text_is_the_training_split(metrics):
    """The shipped held-out tokens are the held-out files' (which training never saw); checked where
    the local stdlib is the one training read (another Python version has other files)."""
    train, held = split_files(metrics["held_out_every"])
    if {relative_path(f) for f in held} != set(metrics["held_out"]):
        pytest.skip("this Python's standard library is not the one the model was trained on")
    assert not {relative_path(f) for f in train} & set(metrics["held_out"])
    ids, counts = load_held_out(held_out_path())
    assert np.array_equal(encode_stream(load_tokenizer(MAIN), read_texts(held)), ids)
    assert counts.sum() == metrics["train_tokens"] and len(counts) == metrics["vocab"]


@pytest.mark.parametrize("path", [MAIN, DRAFT], ids=[MAIN_NAME, DRAFT_NAME])
def test_engine_logprobs_equal_hf(path):
    """prompt_logprobs from our engine equal HF's on a held-out sample: the perplexity within 1e-3
    relative, and every token's logprob within 1e-3."""
    held, _ = evaluation_data(path, max_tokens=1025)
    sample = windows(held, 256)
    ours = engine_token_logprobs(path, sample, kv_cache_memory="32MiB")
    ref = hf_token_logprobs(hf_model(path), sample)
    assert len(ours) == len(ref) == 1024
    assert abs(perplexity(ours) - perplexity(ref)) / perplexity(ref) < 1e-3
    assert np.abs(ours - ref).max() < 1e-3


def test_held_out_perplexity_far_below_unigram_and_draft_between(metrics):
    """Over the whole held-out text, by our engine: main << unigram, main < draft < unigram, and the
    model card's figures (computed by HF at training time) reproduce."""
    held, unigram = evaluation_data(MAIN)
    wins = windows(held, 256)
    main, draft = perplexity(engine_token_logprobs(MAIN, wins)), perplexity(engine_token_logprobs(DRAFT, wins))
    assert main < unigram / 10 and main < draft < unigram, (main, draft, unigram)
    for ours, card in ((main, metrics["main"]["held_out_ppl"]), (draft, metrics["draft"]["held_out_ppl"]),
                       (unigram, metrics["unigram_ppl"])):
        assert math.isclose(ours, card, rel_tol=1e-3), (ours, card)


def test_shipped_draft_is_distilled_on_the_main_model(metrics):
    """The draft ships distilled (tools/distill_draft.py): its greedy agreement with the main model, measured
    again here with transformers on the shipped weights, is the card's, and well above the undistilled draft's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("distill_draft", os.path.join(
        os.path.dirname(__file__), "..", "tools", "distill_draft.py"))
    assert spec is not None and spec.loader is not None
    distill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(distill)
    held, _ = load_held_out(held_out_path())
    agree = distill.greedy_agreement(hf_model(MAIN), hf_model(DRAFT), held)
    card = metrics["draft"]["distill"]
    for j in range(1, 5):  # an argmax tie broken otherwise on another CPU moves a run or two
        assert abs(agree[f"next_{j}"] - card["agreement_after"][f"next_{j}"]) < 0.02, (agree, card)
    assert agree["next_1"] > card["agreement_before"]["next_1"] + 0.05
    assert agree["next_4"] > 1.5 * card["agreement_before"]["next_4"]


def test_generate_cli_without_a_model():
    r = subprocess.run([sys.executable, "-m", "minivllm", "generate", "--prompt", "import os", "--max-tokens", "8",
                        "--ignore-eos", "--json", "--kv-cache-memory", "16MiB"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout)
    assert line["prompt"] == "import os" and len(line["token_ids"]) == 8


def test_serve_without_a_model_answers_generate():
    """The README's first command: `minivllm serve` with no model, then /generate."""
    server = ServerProcess(None, "--kv-cache-memory", "64MiB")
    try:
        r = httpx.post(server.url + "/generate", json={"prompt": "def fibonacci(n):", "max_new_tokens": 16},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens_generated"] > 0 and body["generated_text"].strip()
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == MAIN_NAME
    finally:
        server.stop()
