"""Dropping an engine frees it at once (weights and KV pool), without waiting for the cyclic collector:
no reference cycle reaches it, not even the one torch._dynamo's import leaves around every frame on the stack
when it runs (it ran lazily inside the first engine's build, from random init on the meta device). Building and
running an engine does not import torch._dynamo at all (model/loader.py: _no_init): 1.4 s of every process's start."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def first_engine_freed_on_del(path: str) -> tuple[bool, bool]:
    """(freed on del, torch._dynamo imported) for the first engine of a fresh process on path."""
    code = textwrap.dedent(f"""
        import gc, sys, weakref
        gc.disable()
        from minivllm import LLM, SamplingParams
        llm = LLM({path!r}, num_kv_blocks=64)
        llm.generate(["def f(x):"], SamplingParams(max_tokens=4, seed=1, temperature=0.8, presence_penalty=0.5,
                                                    logprobs=2), use_tqdm=False)
        ref = weakref.ref(llm.llm_engine)
        del llm
        print("FREED" if ref() is None else "ALIVE", "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    freed, dynamo = out.stdout.split()[-2:]
    return freed == "FREED", dynamo == "True"


def test_first_engine_of_a_process_is_freed_on_del(model_factory):
    assert first_engine_freed_on_del(model_factory("tiny-llama")) == (True, False)
