"""Shared fixtures: test models are made on demand (random weights, locally trained tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm.config import ModelConfig
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.engine_config import EngineConfig
from minivllm.model.decode_stack import DecodeStack
from minivllm.model.layers import Linear
from minivllm.model.runner import ModelRunner, SequenceInput
from minivllm.modelgen.make_model import make_model

T = TypeVar("T")

def pytest_collection_finish(session: pytest.Session) -> None:
    """The type checker starts in the background as soon as its test is selected (tests/test_types.py)."""
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] == "test_types":
            module.start_mypy()
            return


TINY_FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gpt2"]

# Prompts of different lengths and content (code, prose, unicode) used across tests.
PROMPTS = [
    "def fibonacci(n):\n    return",
    "import os\nimport sys\n\nclass Foo(object):\n    def __init__(self, x):\n        self.x = x\n",
    "The quick brown fox",
    "for i in range(10):\n    print(i * i)\n# the squares of the first ten integers are",
    "Hello",
    "x = {'a': 1, 'b': [1, 2, 3], 'c': (4, 5)}\nprint(x['b'][1:])\n",
    "    raise ValueError('unexpected value: %r' % (value,))",
    "\"\"\"Return the number of items in the container, ignoring duplicates and None values.\"\"\"",
]


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(preset, **kw) → directory of a test model, made once per session per arguments."""
    made: dict[tuple, str] = {}

    def make(preset: str, **kw) -> str:
        key = (preset, json.dumps(kw, sort_keys=True))  # (overrides may hold dicts and lists)
        if key not in made:
            out = str(tmp_path_factory.mktemp(preset))
            made[key] = make_model(preset, out, **kw)
        return made[key]

    return make


def hf_model(path: str):
    """The HF transformers reference model in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def gguf_hf_model(path: str):
    """transformers' float32 reading of a GGUF file (the gguf package's dequantizer)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def last_logits_and_hf(runner: ModelRunner, path: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(our runner's last-token logits of ids, transformers' of the GGUF file at path, that HF model)."""
    from minivllm.model.runner import SequenceInput

    hf = gguf_hf_model(path)
    ours = runner.execute([SequenceInput(ids, 0, list(range(16)), True)])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    return ours, ref, hf


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """HF transformers' greedy continuation of exactly n tokens."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def corpus_token_ids(tokenizer, n: int) -> list[int]:
    """n token ids of real text (the stdlib's own source), for prompts of chosen lengths."""
    import inspect
    import json as json_module

    text = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)
    ids = tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


def run_staggered(engine, prompts, params, arrival_steps, aborts=None):
    """Drive an LLMEngine step by step: request i is added at step arrival_steps[i]; aborts maps
    request index → step at which it is aborted. Returns {index: output token ids} of finished ones."""
    order = sorted(range(len(prompts)), key=lambda i: arrival_steps[i])
    aborts = dict(aborts or {})
    done: dict[int, list[int]] = {}
    step = 0
    while order or engine.has_unfinished_requests():
        while order and arrival_steps[order[0]] <= step:
            i = order.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        for i, at in list(aborts.items()):
            if at <= step:
                engine.abort_request(str(i))
                del aborts[i]
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
        assert step < 10_000, "engine made no progress"
    return done


def make_scripted_model(base: str, out: str, chain: list[int]) -> str:
    """A copy of a tiny-llama model whose greedy continuation of chain[i] is chain[i + 1].

    A real model run by the real engine, with weights chosen so it follows a script: attention and MLP
    outputs are zeroed (the residual stream is the token embedding), chain token i embeds as the
    one-hot vector e_i, and the head maps e_i to chain[i + 1]. Lets tests make the engine emit exactly
    the text they need (CJK, emoji, stop strings split across tokens)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    path = f"{out}/model.safetensors"
    w = load_file(path)
    hidden = w["model.norm.weight"].shape[0]
    assert len(chain) - 1 <= hidden and len(set(chain[:-1])) == len(chain) - 1, "chain tokens must be distinct"
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name].zero_()
    w["model.norm.weight"].fill_(1.0)
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    emb.mul_(0.01)
    head.zero_()
    for i, (tok, nxt) in enumerate(zip(chain, chain[1:], strict=False)):
        emb[tok].zero_()
        emb[tok, i] = 1.0
        head[nxt, i] = 10.0
    save_file(w, path)
    return out


@pytest.fixture(scope="module")
def serve():
    """serve(model_dir, *flags) → base URL of a real `minivllm serve` subprocess, one per argument set; stopped
    when the module ends (servers kept for the whole session had filled the machine's memory by its end)."""
    from server_utils import ServerProcess

    servers: dict[tuple, ServerProcess] = {}

    def start(model: str, *args: str) -> str:
        key = (model, *args)
        if key not in servers:
            servers[key] = ServerProcess(model, "--num-threads", "1", *args)
        return servers[key].url

    yield start
    for s in servers.values():
        s.stop()


def noisy_copy(path: str, out: str, noise: float, seed: int = 0) -> str:
    """A draft for the model at path: the same tokenizer and shape, every weight perturbed by Gaussian noise
    of std `noise` (so it agrees with the target often, not always)."""
    shutil.copytree(path, out, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(out, name))
            save_file({k: (v + noise * torch.randn(v.shape, generator=g)).to(v.dtype) if v.is_floating_point() else v
                       for k, v in tensors.items()}, os.path.join(out, name), metadata={"format": "pt"})
    return out


def make_runner(mc: ModelConfig, num_blocks: int = 16, dtype: torch.dtype = torch.float32, **kw: Any) -> ModelRunner:
    """A model runner on its own, built as the engine builds one: from mc's checkpoint at EngineArgs settings (on
    the CPU; max_model_len 256 and block size 16 unless given)."""
    kw = {"max_model_len": 256, "block_size": 16, **kw}
    return ModelRunner(EngineConfig.of_model(mc, dtype=str(dtype).removeprefix("torch."), device="cpu", **kw),
                       num_blocks)


def write_experts_apart(merged: str, out: str, mixtral: bool) -> None:
    """The merged checkpoint as the released ones store experts: one tensor per expert and projection
    (experts.N.gate_proj / up_proj / down_proj; Mixtral's block_sparse_moe.experts.N.w1 / w3 / w2)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(merged, out)
    tensors = {}
    for name, t in load_file(f"{merged}/model.safetensors").items():
        block = name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, half = block.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                gate, up = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
                tensors[f"{prefix}{e}.{gate}.weight"] = t[e, :half].clone()
                tensors[f"{prefix}{e}.{up}.weight"] = t[e, half:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = block.removesuffix("down_proj")
            for e in range(t.shape[0]):
                tensors[f"{prefix}{e}.{'w2' if mixtral else 'down_proj'}.weight"] = t[e].clone()
        else:
            tensors[block if ".mlp.gate." in name else name] = t
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})


def with_threads(fn: Callable[[], T], threads: int) -> T:
    """fn() with torch's thread count set to threads (put back after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _int16_blocks(x: torch.Tensor) -> torch.Tensor:
    """x's image as int16 in blocks of 32 (each block's amax / 32767 a step, rounded to nearest even, in float32 as the
    staging does), in float64, checked here to stay within half a step of x."""
    k = x.shape[1]
    xb = torch.nn.functional.pad(x.float(), (0, -k % 32)).view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    image = (torch.round(xb * inv) * (amax / 32767.0)).view(x.shape[0], -1)[:, :k]
    step = (amax / 32767.0).expand_as(xb).reshape(x.shape[0], -1)[:, :k]
    # the rounding bound, 2^-16 of the block's amax, plus the float32 products' few ulps of x
    assert ((image - x).abs() <= step * 0.5 + 4 * 2.0**-24 * x.abs() + 1e-30).all()
    return image.double()


def int4_native_x(x: torch.Tensor) -> torch.Tensor:
    """The x int4's native rows compute with, in float64: x itself, or where they take a float32 x as int16 in blocks
    of 32 its image (_int16_blocks). One token: csrc/gemv_avx2.h (AVX2 without VNNI) and csrc/gemv_int4_int16dot.h
    (AVX512-VNNI), a bf16-exact x keeping gemv_int4_bf16dot.h's exact rows where the CPU has them. A handful of
    tokens (2 to gemv_int4_few_tokens, AVX512-VNNI: csrc/gemv_int4_int16dot.h's few-token rows): int16 unless every
    row is bf16-exact (the float rows, exact for a bfloat16 model's x); more tokens (a prefill) the float rows."""
    from minivllm.model import cpu_kernels

    lib = cpu_kernels.load_library()
    if lib is None or not cpu_kernels.int4_x_int16():
        return x.double()
    if x.shape[0] == 1:
        bf16dot = lib.gemv_int4_bf16dot() and torch.equal(x, x.bfloat16().float())
        return x.double() if bf16dot else _int16_blocks(x)
    if not lib.gemv_int4_int16dot():
        return x.double()
    if x.shape[0] > lib.gemv_int4_few_tokens() or torch.equal(x, x.bfloat16().float()):
        return x.double()
    return _int16_blocks(x)


@pytest.fixture
def stack_calls(monkeypatch):
    """Counts the steps the stack ran, so a test fails if the stack was silently not taken."""
    calls = []
    original = DecodeStack.__call__

    def spy(self, h, positions):
        calls.append(h.shape[0])
        return original(self, h, positions)

    monkeypatch.setattr(DecodeStack, "__call__", spy)
    return calls


def panel_steps_equal(runner: ModelRunner, path: str, stack_calls: list[int], steps: tuple[int, ...] = (9, 20, 3)
                      ) -> None:
    """Decode steps of `steps` tokens (at most 20), every projection but the head on panels the stack binds: the
    stack's logits are the modules' to the bit."""
    stack = runner.decode_stack
    assert stack is not None and all(stack.native_classes)
    projections = [p for p in runner.model.modules() if isinstance(p, Linear) and p is not runner.model.lm_head]
    assert projections and all(p._panels is not None and id(p) in stack._with_panels for p in projections)
    tok = get_tokenizer(path)
    n = 20
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)])[: 5 + i] for i in range(n)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(n)]
    runner.execute([SequenceInput(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    lens = [len(p) for p in prompts]
    for step, rows in enumerate(steps):
        seqs = [SequenceInput([7 + step + i], lens[i], tables[i], True) for i in range(rows)]
        with_stack = runner.execute(seqs)
        runner.model.decode_stack = None
        modules = runner.execute(seqs)
        runner.model.decode_stack = stack
        torch.testing.assert_close(with_stack, modules, atol=0, rtol=0)
        for i in range(rows):
            lens[i] += 1
    assert stack_calls == list(steps)
