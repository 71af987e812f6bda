"""--runner pooling: embeddings from decoder checkpoints, checked against sentence-transformers itself.

The checkpoints are what sentence-transformers saves (its Transformer module over a random tiny Qwen3 / Llama: the
bare transformer as `Qwen3Model`, modules.json, 1_Pooling/config.json, a Normalize module or not), so the pooling and
normalization come from the files as in Qwen3-Embedding-style checkpoints. Offline (LLM.embed) and served (the official
openai client's embeddings.create, float and base64; gRPC Embed), with chunked prefill splitting long prompts across
steps; matryoshka `dimensions`; the refusals (generation on an embedding server and the reverse, a bare transformer
under --runner generate); no KV block kept."""

from __future__ import annotations

import json
import os
import shutil

import grpc
import httpx
import openai
import pytest
import torch
from server_utils import ServerProcess, free_port

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n" * 12, "x", "class Foo(object):\n    pass\n" * 3]
SMALL = {"kv_cache_memory": "64MiB", "max_num_batched_tokens": 32}  # 32-token steps: the long prompts span chunks


def _sentence_transformer(src: str, out: str, mode: str, normalize: bool, matryoshka: list[int] | None = None) -> str:
    """src wrapped and saved by sentence-transformers with one Pooling mode (and a Normalize module or not). The chat
    template is dropped first: sentence-transformers 6 would wrap every text in it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    plain = out + "-src"
    shutil.copytree(src, plain)
    for f in os.listdir(plain):
        if f.endswith(".jinja"):
            os.remove(os.path.join(plain, f))
    with open(os.path.join(plain, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc.pop("chat_template", None)
    with open(os.path.join(plain, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    word = Transformer(plain)
    word.tokenizer.pad_token = word.tokenizer.eos_token
    pool = Pooling(word.get_embedding_dimension(), pooling_mode=mode)
    SentenceTransformer(modules=[word, pool, *([Normalize()] if normalize else [])], device="cpu").save(out)
    if matryoshka:
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**cfg, "matryoshka_dimensions": matryoshka}, f)
    return out


def _reference(path: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(texts, convert_to_tensor=True, batch_size=2)


@pytest.fixture(scope="module")
def qwen3_last(model_factory, tmp_path_factory) -> str:
    """A Qwen3-Embedding-shaped checkpoint: last-token pooling, normalized, matryoshka 16 / 32."""
    out = str(tmp_path_factory.mktemp("emb") / "qwen3-last")
    return _sentence_transformer(model_factory("tiny-qwen3"), out, "lasttoken", True, [16, 32])


@pytest.mark.parametrize("preset,mode,normalize", [("tiny-qwen3", "lasttoken", True), ("tiny-qwen3", "mean", False),
                                                    ("tiny-llama", "mean", True), ("tiny-llama", "cls", False)])
def test_embed_matches_sentence_transformers(model_factory, tmp_path, preset, mode, normalize):
    path = _sentence_transformer(model_factory(preset), str(tmp_path / "st"), mode, normalize)
    want = _reference(path, TEXTS)
    llm = LLM(path, runner="pooling", **SMALL)
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == want.shape and torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    norms = got.norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5) if normalize else (norms > 1.5).all()
    assert [len(o.prompt_token_ids) for o in outs] == [len(llm.get_tokenizer().encode(t)) for t in TEXTS]
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * SMALL["max_num_batched_tokens"]  # chunked across steps
    eng = llm.llm_engine
    assert eng.block_manager.num_free_blocks == eng.cache_config.num_blocks  # nothing kept
    eng.check_invariants()


FAMILIES = ["tiny-llama3", "tiny-qwen2", "tiny-mistral", "tiny-gpt2", "tiny-gemma2", "tiny-gemma3", "tiny-phi3",
            "tiny-smollm3", "tiny-olmo2", "tiny-granite", "tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe",
            "tiny-qwen2-moe"]


def test_every_family_pools_hf_hidden_states(model_factory):
    """Every decoder family the engine loads embeds: its mean-pooled final hidden states are HF's (AutoModel, the
    bare transformer of the same checkpoint), also where a long prompt spans several steps."""
    from transformers import AutoModel

    for preset in FAMILIES:
        path = model_factory(preset)
        llm = LLM(path, runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False}, **SMALL)
        outs = llm.embed(TEXTS[:2], use_tqdm=False)
        hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        for o in outs:
            with torch.no_grad():
                want = hf(torch.tensor([o.prompt_token_ids])).last_hidden_state[0].mean(0)
            got = torch.tensor(o.outputs.embedding)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (preset, (got - want).abs().max())
        del llm, hf


def test_pooler_config_overrides_and_refusals(qwen3_last, tmp_path):
    # --pooler-config over the checkpoint's files: the mean, not normalized, is HF's mean of the last hidden states
    from transformers import AutoModel, AutoTokenizer

    llm = LLM(qwen3_last, runner="pooling", pooler_config='{"pooling_type": "MEAN", "normalize": false}', **SMALL)
    got = torch.tensor(llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding)
    tok, hf = AutoTokenizer.from_pretrained(qwen3_last), AutoModel.from_pretrained(qwen3_last).eval()
    with torch.no_grad():
        want = hf(tok(TEXTS[1], return_tensors="pt").input_ids).last_hidden_state[0].mean(0)
    assert torch.allclose(got, want, atol=2e-5)
    with pytest.raises(ValueError, match="embed"):
        llm.generate("x", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="runner pooling"):  # a bare transformer has no head to generate with
        LLM(qwen3_last, **SMALL)
    for bad, words in [('{"pooling_type": "MAX"}', "pooling_type"), ('{"normalise": true}', "unknown field"),
                       ("{oops", "not valid JSON")]:
        with pytest.raises(ValueError, match=words):
            LLM(qwen3_last, runner="pooling", pooler_config=bad, **SMALL)
    with open(os.path.join(qwen3_last, "1_Pooling", "config.json")) as f:
        pooling = json.load(f)
    broken = str(tmp_path / "max")
    shutil.copytree(qwen3_last, broken)
    with open(os.path.join(broken, "1_Pooling", "config.json"), "w") as f:
        json.dump({**pooling, "pooling_mode": "max"}, f)
    with pytest.raises(ValueError, match="pools by"):
        LLM(broken, runner="pooling", **SMALL)


@pytest.fixture(scope="module")
def server(qwen3_last):
    port = free_port()
    proc = ServerProcess(qwen3_last, "--num-threads", "1", "--runner", "pooling", "--max-num-batched-tokens", "32",
                         "--grpc-port", str(port))
    proc.grpc_target = f"127.0.0.1:{port}"
    yield proc
    proc.stop()


def test_served_embeddings_with_the_openai_client(server, qwen3_last):
    want = _reference(qwen3_last, TEXTS)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    got = torch.tensor([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and torch.allclose(got, want, atol=2e-5)
    tok = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    assert torch.allclose(torch.tensor(tok.data[0].embedding), want[0], atol=2e-5)
    assert r.usage.prompt_tokens == r.usage.total_tokens > tok.usage.prompt_tokens
    ids = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[0]}, timeout=60).json()["tokens"]
    by_ids = client.embeddings.create(model=model, input=[ids, ids[:3]], encoding_format="float")
    assert torch.allclose(torch.tensor(by_ids.data[0].embedding), want[0], atol=2e-5)
    short = client.embeddings.create(model=model, input=TEXTS, dimensions=16, encoding_format="float")
    prefix = torch.nn.functional.normalize(want[:, :16], dim=-1)
    assert torch.allclose(torch.tensor([d.embedding for d in short.data]), prefix, atol=2e-5)
    for kw, words in [({"dimensions": 20}, "matryoshka_dimensions"), ({"input": []}, "input"),
                      ({"input": [[10**9]]}, "token ids"), ({"model": "nope"}, "does not exist")]:
        with pytest.raises((openai.BadRequestError, openai.NotFoundError), match=words):
            client.embeddings.create(**{"model": model, "input": "x", **kw})
    with pytest.raises(openai.BadRequestError, match="generation is off"):
        client.completions.create(model=model, prompt="x", max_tokens=2)
    assert httpx.post(server.url + "/generate", json={"prompt": "x"}, timeout=60).status_code == 400
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    usage = [line for line in metrics.splitlines() if line.startswith("minivllm:kv_cache_usage_perc")]
    assert usage and all(float(line.split()[-1]) == 0.0 for line in usage)  # no KV kept once answered


def test_grpc_embed_and_tokenize(server, qwen3_last):
    want = _reference(qwen3_last, TEXTS[:2])
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.InferenceServiceStub(ch)
        out = stub.Embed(pb.EmbedRequest(inputs=TEXTS[:2]), timeout=60)
        got = torch.tensor([list(e.values) for e in out.embeddings])
        assert torch.allclose(got, want, atol=2e-5)
        assert out.prompt_tokens == sum(e.prompt_tokens for e in out.embeddings) > 0
        short = stub.Embed(pb.EmbedRequest(inputs=TEXTS[:1], dimensions=32), timeout=60)
        assert len(short.embeddings[0].values) == 32
        toks = stub.Tokenize(pb.TokenizeRequest(prompt=TEXTS[0], return_token_strs=True), timeout=60)
        assert toks.count == len(toks.tokens) == len(toks.token_strs) == out.embeddings[0].prompt_tokens
        assert toks.max_model_len > 0
        for bad in (pb.EmbedRequest(), pb.EmbedRequest(inputs=["x"], dimensions=7)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Embed(bad, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=2), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "generation is off" in e.value.details()
