"""LoRA adapters through a real server: --lora-modules, /v1/models, a request's model picking its adapter (the
official openai client, concurrent requests on different adapters), and vLLM's load/unload routes with 400s and
404s naming the problem."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import PROMPTS
from server_utils import ServerProcess

from minivllm import LLM, LoRARequest, SamplingParams
from minivllm.modelgen.make_lora import make_lora

N = 12


@pytest.fixture(scope="module")
def base(model_factory):
    return model_factory("tiny-llama")


@pytest.fixture(scope="module")
def adapters(base, model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-loras")
    return {"qv": make_lora(base, str(root / "qv"), rank=4, targets=("q_proj", "v_proj"), seed=1, std=0.1),
            "all": make_lora(base, str(root / "all"), rank=8, seed=2, std=0.1),
            "late": make_lora(base, str(root / "late"), rank=2, targets=("down_proj",), seed=3, std=0.1),
            "big": make_lora(base, str(root / "big"), rank=16, targets=("q_proj",), seed=4, std=0.1),
            # For another model: the qwen2 test preset's shapes differ (one KV head), so its k/v do not fit.
            "other": make_lora(model_factory("tiny-qwen2"), str(root / "other"), rank=4, seed=5, std=0.1)}


@pytest.fixture(scope="module")
def server(base, adapters):
    proc = ServerProcess(base, "--num-threads", "1", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "3",
                         "--lora-modules", f"qv={adapters['qv']}", f"all={adapters['all']}",
                         "--allow-runtime-lora-updating")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(base, adapters):
    """Greedy completions of PROMPTS[:3] by the offline engine: base model and each adapter."""
    llm = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    out = {}
    for name in (None, "qv", "all", "late"):
        req = LoRARequest(name, len(out) + 1, adapters[name]) if name else None
        out[name] = [o.outputs[0].text for o in llm.generate(PROMPTS[:3], greedy, lora_request=req, use_tqdm=False)]
    return out


def test_models_lists_the_adapters(server):
    data = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    base = data[0]["id"]
    assert [(m["id"], m["parent"]) for m in data] == [(base, None), ("qv", base), ("all", base)]


def test_model_name_picks_the_adapter_in_a_mixed_concurrent_load(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    base = client.models.list().data[0].id

    def one(job: tuple[str | None, int]) -> tuple[str | None, int, str, str]:
        name, i = job
        r = client.completions.create(model=name or base, prompt=PROMPTS[i], max_tokens=N, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        return name, i, r.choices[0].text, r.model

    jobs = [(name, i) for i in range(3) for name in (None, "qv", "all")] * 2
    with ThreadPoolExecutor(8) as pool:
        for name, i, text, model in pool.map(one, jobs):
            assert text == offline[name][i], (name, i)
            assert model == (name or base)
    chat = client.chat.completions.create(model="qv", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "qv" and chat.choices[0].message.content is not None


def test_load_and_unload_at_runtime(server, adapters, offline):
    url = server.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]},
                   timeout=60)
    assert r.status_code == 200 and "late" in r.text
    got = httpx.post(url + "/v1/completions", json={"model": "late", "prompt": PROMPTS[1], "max_tokens": N,
                                                    "temperature": 0, "ignore_eos": True}, timeout=60).json()
    assert got["choices"][0]["text"] == offline["late"][1]
    assert "late" in [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "fourth", "lora_path": adapters["late"]},
                   timeout=60)
    assert r.status_code == 400 and "all 3 adapter slots are in use" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"model": "late", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 404 and "late" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, status, param, message", [
    ({"lora_name": "big", "lora_path": "BIG"}, 400, "lora_path", "rank 16, above --max-lora-rank 8"),
    ({"lora_name": "other", "lora_path": "OTHER"}, 400, "lora_path", "made for another model"),
    ({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}, 400, "lora_path", "no adapter_config.json"),
    ({"lora_name": "qv", "lora_path": "QV"}, 400, "lora_name", "already loaded"),
    ({"lora_name": "x"}, 400, "lora_path", "lora_path"),
])
def test_bad_loads_are_400_naming_the_problem(server, adapters, body, status, param, message):
    named = {"BIG": adapters["big"], "QV": adapters["qv"], "OTHER": adapters["other"]}
    body = {k: named.get(v, v) for k, v in body.items()}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_unknown_adapters_are_404(server):
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]}, timeout=30)
    assert r.status_code == 404 and "qv" in r.json()["error"]["message"]  # the message lists what is served


def test_runtime_updates_need_their_flags(model_factory, serve, adapters):
    url = serve(model_factory("tiny-llama"))  # no --enable-lora
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["qv"]}, timeout=30)
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    url = serve(model_factory("tiny-llama"), "--enable-lora")
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["qv"]}, timeout=30)
    assert r.status_code == 400 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
