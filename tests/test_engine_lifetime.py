"""Dropping an engine frees it at once (weights and KV pool), without waiting for the cyclic collector:
no reference cycle reaches it, not even the one a lazy torch import used to leave around the first
engine of a process (engine/tokenizer.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_first_engine_of_a_process_is_freed_on_del(model_factory):
    path = model_factory("tiny-llama")
    code = textwrap.dedent(f"""
        import gc, weakref
        gc.disable()
        from minivllm import LLM, SamplingParams
        llm = LLM({path!r}, num_kv_blocks=64)
        llm.generate(["def f(x):"], SamplingParams(max_tokens=4, seed=1, temperature=0.8, presence_penalty=0.5,
                                                    logprobs=2), use_tqdm=False)
        ref = weakref.ref(llm.llm_engine)
        del llm
        print("FREED" if ref() is None else "ALIVE")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("FREED"), out.stdout
