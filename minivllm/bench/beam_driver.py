"""`minivllm bench beam`: beam search inside the engine's step vs as a driver over the engine's API.

vLLM v1 runs beam search outside its engine core: each step sends one request per live beam (prompt +
the beam's tokens, one new token, the top 2·width logprobs) and lets prefix caching find the shared
KV. Ours runs inside the step: beams fork sequences that share KV blocks copy-on-write, and the step
hands their logits to the beam searcher. This bench runs both on the same prompts, in ABAB order, with
the same beam_step (HF's algorithm), and reports the time of each and whether the beams agree.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from minivllm.bench.results import save
from minivllm.bench.throughput import add_model_args, random_prompts, resolve_model
from minivllm.config import EngineArgs, ModelConfig, cpu_count
from minivllm.engine.beam_search import beam_step
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import BeamState, Sequence
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def add_beam_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench beam`."""
    add_model_args(p)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures to this JSON file")


def in_engine(engine: LLMEngine, prompts: list[list[int]], width: int, max_tokens: int) -> list[list[list[int]]]:
    """The engine's own beam search: each prompt's beams, best first."""
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True).to_sampling_params()
    for i, p in enumerate(prompts):
        engine.add_request(f"beam-{i}", {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return [done[f"beam-{i}"] for i in range(len(prompts))]


def as_driver(engine: LLMEngine, prompts: list[list[int]], width: int, max_tokens: int) -> list[list[list[int]]]:
    """vLLM v1's way: per step, one single-token request per live beam with its top 2·width logprobs
    (enough for the 2·width candidates beam_step keeps), prefix caching reusing the shared KV."""
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True,
                         output_kind=RequestOutputKind.FINAL_ONLY)
    vocab = engine.model_config.vocab_size
    states = []
    for p in prompts:
        root = Sequence("driver", p, one, 0)
        states.append(BeamState(width, 1.0, False, max_tokens, [root], [0.0]))
    step = 0
    while any(st.live for st in states):
        for i, st in enumerate(states):
            for b, beam in enumerate(st.live):
                engine.add_request(f"drv-{step}-{i}-{b}", {"prompt_token_ids": beam.token_ids}, one)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    lps = out.outputs[0].logprobs
                    assert lps is not None  # asked for (logprobs=2·width)
                    outs[out.request_id] = lps[0]
        for i, st in enumerate(states):
            if not st.live:
                continue
            lp = torch.full((len(st.live), vocab), float("-inf"))
            for b in range(len(st.live)):
                top = outs[f"drv-{step}-{i}-{b}"]
                lp[b, list(top)] = torch.tensor([v.logprob for v in top.values()])
            nxt = beam_step(st, lp, frozenset())
            live = []
            for parent_idx, token, _ in nxt:
                seq = Sequence("driver", prompts[i], one, 0)
                seq.token_ids = st.live[parent_idx].token_ids + [token]
                live.append(seq)
            st.live, st.scores = live, [score for _, _, score in nxt]
        step += 1
    return [[ids for _, ids, _ in st.finished] for st in states]


def run_beam(ns: argparse.Namespace) -> int:
    """Entry point."""
    torch.set_num_threads(cpu_count())
    path = resolve_model(ns.model, ns.preset)
    mc = ModelConfig.from_pretrained(path)
    engine = LLMEngine(EngineArgs(model=path, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory,
                                  enable_prefix_caching=True, seed=ns.seed))
    vocab = min(len(engine.tokenizer), mc.vocab_size)
    prompts = random_prompts(ns.num_prompts, ns.prompt_len, ns.prompt_len, vocab, ns.seed)
    in_engine(engine, [p[:8] for p in prompts], ns.beam_width, 2)  # warm-up
    times: dict[str, list[float]] = {"in-engine": [], "driver": []}
    beams: dict[str, Any] = {}
    abba = [("in-engine", in_engine), ("driver", as_driver), ("driver", as_driver), ("in-engine", in_engine)]
    for name, fn in (abba * ns.rounds)[:2 * ns.rounds]:  # ABBA order: drift hits both alike
        engine.block_manager.reset_prefix_cache()
        t = time.perf_counter()
        beams[name] = fn(engine, prompts, ns.beam_width, ns.max_tokens)
        times[name].append(time.perf_counter() - t)
    same = sum(a == b for a, b in zip(beams["in-engine"], beams["driver"], strict=True))
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    result = {"model": ns.model or ns.preset, "num_prompts": ns.num_prompts, "prompt_len": ns.prompt_len,
              "beam_width": ns.beam_width, "max_tokens": ns.max_tokens, "times_s": times, "mean_s": mean,
              "driver_over_in_engine": mean["driver"] / mean["in-engine"], "same_beams": same}
    print(f"beam search, {ns.num_prompts} prompts x {ns.prompt_len} tokens, width {ns.beam_width}, "
          f"{ns.max_tokens} tokens: in the engine's step {mean['in-engine']:.2f} s, as a driver over requests "
          f"{mean['driver']:.2f} s (x{result['driver_over_in_engine']:.2f}); identical beams for {same} of "
          f"{ns.num_prompts} prompts")
    save(result, ns.out, None)
    return 0
