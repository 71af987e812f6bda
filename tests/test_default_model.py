"""The embedded default model: shipped, loaded when no model is given (LLM(), generate, serve), and
good: held-out perplexity by our engine equals HF's and sits far below a unigram baseline."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from server_utils import ServerProcess

from minivllm import LLM, SamplingParams
from minivllm.bench.perplexity import engine_perplexity, held_out_ids, hf_perplexity, load_tokenizer
from minivllm.default_model import (
    DRAFT_NAME,
    MAIN_NAME,
    default_draft_model_path,
    default_model_path,
    training_metrics_path,
)
from minivllm.default_model.corpus import (
    encode_stream,
    read_texts,
    relative_path,
    split_files,
    unigram_perplexity,
    windows,
)

MAIN, DRAFT = default_model_path(), default_draft_model_path()


@pytest.fixture(scope="module")
def metrics() -> dict:
    with open(training_metrics_path()) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def held() -> np.ndarray:
    return held_out_ids(load_tokenizer(MAIN))


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
    assert llm.llm_engine.args.model == MAIN
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0 and out.outputs[0].text.strip()


def test_held_out_split_is_the_training_split(metrics):
    """The split rebuilt here is the one training held out: no held-out file was trained on."""
    train, held = split_files(metrics["held_out_every"])
    assert {relative_path(f) for f in held} == set(metrics["held_out"])
    assert not {relative_path(f) for f in train} & set(metrics["held_out"])


@pytest.mark.parametrize("path", [MAIN, DRAFT], ids=[MAIN_NAME, DRAFT_NAME])
def test_engine_perplexity_equals_hf(path, held):
    """prompt_logprobs from our engine give HF's perplexity on a held-out sample, within 1e-3 relative."""
    sample = windows(held, 256, max_tokens=1025)
    ours, ref = engine_perplexity(path, sample, kv_cache_memory="32MiB"), hf_perplexity(path, sample)
    assert abs(ours - ref) / ref < 1e-3, (ours, ref)


def test_held_out_perplexity_far_below_unigram_and_draft_between(metrics, held):
    """Over the whole held-out text, by our engine: main << unigram, and main < draft < unigram."""
    tok = load_tokenizer(MAIN)
    train_files, _ = split_files(metrics["held_out_every"])
    unigram = unigram_perplexity(encode_stream(tok, read_texts(train_files)), held, tok.get_vocab_size())
    wins = windows(held, 256)
    main, draft = engine_perplexity(MAIN, wins), engine_perplexity(DRAFT, wins)
    assert main < unigram / 10 and main < draft < unigram, (main, draft, unigram)
    if len(held) == metrics["held_out_tokens"]:  # the same stdlib as training's: the model card's figures
        for ours, card in ((main, metrics["main"]["held_out_ppl"]), (draft, metrics["draft"]["held_out_ppl"]),
                           (unigram, metrics["unigram_ppl"])):
            assert math.isclose(ours, card, rel_tol=1e-3), (ours, card)


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
