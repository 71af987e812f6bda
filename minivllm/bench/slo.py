"""`minivllm bench slo`: interactive TTFT and batch throughput under a mixed open-loop load, FCFS vs SLO-aware.

One engine per policy, the same arrival schedule for both (Poisson, seeded): short interactive requests at a
low rate and long batch jobs at a rate past what the machine serves, so a queue of batch work builds up. The
driver adds each request at its arrival time (its arrival_time is that instant: waiting for the engine's step
counts as queueing) whatever the engine is doing, and steps the engine in between (open loop: arrivals never
wait for completions). Policies:

- fcfs: every request priority 0 with no deadline (arrival order: vLLM's default FCFS);
- slo: interactive requests `priority="interactive"` with `ttft_slo_ms`, batch jobs `priority="batch"`.

Reported: interactive TTFT p50/p95/p99 and deadline misses, batch TTFT, batch output tok/s (batch tokens over
the run's span, from the first arrival to the last batch job's end), preemptions; runs in ABBA order.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from minivllm.bench.perplexity import evaluation_data
from minivllm.bench.results import save
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams

POLICIES = ("fcfs", "slo")


def add_slo_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench slo`."""
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--interactive-rate", type=float, default=2.0, help="interactive requests per second")
    p.add_argument("--batch-rate", type=float, default=12.0,
                   help="batch jobs per second (past what the embedded model serves here: a backlog builds)")
    p.add_argument("--interactive-shape", default="32x32", help="PROMPTxOUTPUT tokens of an interactive request")
    p.add_argument("--batch-shape", default="384x128", help="PROMPTxOUTPUT tokens of a batch job")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0, help="the interactive requests' TTFT deadline")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--rounds", type=int, default=2, help="ABBA-ordered rounds")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _shape(spec: str) -> tuple[int, int]:
    p, o = (int(x) for x in spec.split("x"))
    return p, o


def _schedule(ns: argparse.Namespace, held: np.ndarray) -> list[tuple[float, str, list[int], int]]:
    """(arrival offset in seconds, class, prompt ids, max_tokens) for every request, by arrival."""
    g = np.random.default_rng(0)
    out = []
    for cls, rate, shape in (("interactive", ns.interactive_rate, ns.interactive_shape),
                             ("batch", ns.batch_rate, ns.batch_shape)):
        plen, olen = _shape(shape)
        t = float(g.exponential(1 / rate))
        while t < ns.duration:
            start = int(g.integers(0, len(held) - plen))
            out.append((t, cls, held[start:start + plen].tolist(), olen))
            t += float(g.exponential(1 / rate))
    return sorted(out, key=lambda x: x[0])


def _run(eng: LLMEngine, schedule: list[tuple[float, str, list[int], int]], policy: str, slo_ms: float,
         tag: str) -> dict[str, Any]:
    pre0 = eng.scheduler.stats.num_preemptions
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    cls_of: dict[str, str] = {}
    nxt = 0
    t0 = time.time()
    while nxt < len(schedule) or eng.has_unfinished_requests():
        now = time.time()
        while nxt < len(schedule) and t0 + schedule[nxt][0] <= now:
            offset, cls, prompt, olen = schedule[nxt]
            rid = f"{tag}-{nxt}"
            arrival[rid], cls_of[rid] = t0 + offset, cls
            params = SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True)
            if policy == "slo":
                eng.add_request(rid, {"prompt_token_ids": prompt}, params, priority=cls, arrival_time=arrival[rid],
                                ttft_slo_ms=slo_ms if cls == "interactive" else None)
            else:
                eng.add_request(rid, {"prompt_token_ids": prompt}, params, arrival_time=arrival[rid])
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, t0 + schedule[nxt][0] - time.time()))
            continue
        outs = eng.step()
        now = time.time()
        for o in outs:
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = now
    ttft = {c: np.array([first[r] - arrival[r] for r in arrival if cls_of[r] == c])
            for c in ("interactive", "batch")}
    batch = [r for r in arrival if cls_of[r] == "batch"]
    span = max((done[r] for r in batch), default=t0) - t0
    batch_tokens = sum(schedule[int(r.rsplit("-", 1)[1])][3] for r in batch)
    pct = lambda a, q: float(np.percentile(a, q) * 1000) if len(a) else 0.0  # noqa: E731
    return {"interactive_ttft_ms": {f"p{q}": pct(ttft["interactive"], q) for q in (50, 95, 99)},
            "batch_ttft_ms": {f"p{q}": pct(ttft["batch"], q) for q in (50, 95)},
            "interactive_misses": int((ttft["interactive"] * 1000 > slo_ms).sum()),
            "interactive": len(ttft["interactive"]), "batch": len(batch),
            "batch_tok_s": batch_tokens / span if span else 0.0, "span_s": span,
            "preemptions": eng.scheduler.stats.num_preemptions - pre0}


def run_slo(ns: argparse.Namespace) -> int:
    """Run the bench; print the report; JSON with --out."""
    if ns.model is None:
        from minivllm.default_model import default_model_path

        ns.model = default_model_path()
    held, _ = evaluation_data(ns.model)
    schedule = _schedule(ns, held)
    engines = {p: LLMEngine(EngineArgs(model=ns.model, kv_cache_memory=ns.kv_cache_memory,
                                       max_num_seqs=ns.max_num_seqs, enable_prefix_caching=False))
               for p in POLICIES}
    for p, eng in engines.items():  # warm-up: first-step allocations and kernel plans out of the timing
        _run(eng, schedule[:4], p, ns.ttft_slo_ms, "warm")
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for r in range(ns.rounds):
        for p in POLICIES if r % 2 == 0 else POLICIES[::-1]:
            runs[p].append(_run(engines[p], schedule, p, ns.ttft_slo_ms, str(r)))
    result = {"model": ns.model, "duration_s": ns.duration, "interactive_rate": ns.interactive_rate,
              "batch_rate": ns.batch_rate, "interactive_shape": ns.interactive_shape, "batch_shape": ns.batch_shape,
              "ttft_slo_ms": ns.ttft_slo_ms, "max_num_seqs": ns.max_num_seqs,
              "token_budget": engines["fcfs"].scheduler_config.max_num_batched_tokens,
              "kv_cache_memory": ns.kv_cache_memory, "runs": runs}
    print(report(result))
    save(result, ns.out, None)
    return 0


def _median(runs: list[dict[str, Any]], *path: str) -> float:
    vals = []
    for r in runs:
        x: Any = r
        for k in path:
            x = x[k]
        vals.append(x)
    return float(np.median(vals))


def report(r: dict[str, Any]) -> str:
    """A table of both policies (medians over rounds, each round's figure in brackets) and the targets."""
    runs = r["runs"]
    one = runs["fcfs"][0]
    lines = [f"{r['duration_s']:.0f} s of Poisson arrivals: {one['interactive']} interactive requests "
             f"({r['interactive_shape']} prompt x output tokens, {r['interactive_rate']}/s, TTFT SLO "
             f"{r['ttft_slo_ms']:.0f} ms) and {one['batch']} batch jobs ({r['batch_shape']}, {r['batch_rate']}/s); "
             f"max_num_seqs {r['max_num_seqs']}, step budget {r['token_budget']} tokens, KV "
             f"{r['kv_cache_memory']}; {len(runs['fcfs'])} rounds in ABBA order (medians; each round in brackets).",
             "", "| policy | interactive TTFT p50 | p95 | p99 | missed SLO | batch TTFT p50 | batch output tok/s | "
             "preemptions |", "|---|---|---|---|---|---|---|---|"]
    for p, rs in runs.items():
        def each(*k: str, rs: list[dict[str, Any]] = rs) -> str:
            return ", ".join(f"{_median([x], *k):.0f}" for x in rs)

        lines.append(f"| {p} | {_median(rs, 'interactive_ttft_ms', 'p50'):.0f} ms | "
                     f"**{_median(rs, 'interactive_ttft_ms', 'p95'):.0f} ms** ({each('interactive_ttft_ms', 'p95')}) | "
                     f"{_median(rs, 'interactive_ttft_ms', 'p99'):.0f} ms | "
                     f"{_median(rs, 'interactive_misses'):.0f} of {rs[0]['interactive']} | "
                     f"{_median(rs, 'batch_ttft_ms', 'p50') / 1000:.1f} s | "
                     f"**{_median(rs, 'batch_tok_s'):.0f}** ({each('batch_tok_s')}) | "
                     f"{_median(rs, 'preemptions'):.0f} |")
    p95 = _median(runs["slo"], "interactive_ttft_ms", "p95")
    ratio = _median(runs["slo"], "batch_tok_s") / _median(runs["fcfs"], "batch_tok_s")
    met = p95 <= r["ttft_slo_ms"] and ratio >= 0.9
    lines += ["", "Target (interactive p95 TTFT ≤ its SLO with batch throughput ≥ 90% of FCFS): "
              f"**{'met' if met else 'not met'}**: SLO-aware p95 {p95:.0f} ms against {r['ttft_slo_ms']:.0f} ms "
              f"(FCFS {_median(runs['fcfs'], 'interactive_ttft_ms', 'p95'):.0f} ms), batch throughput "
              f"**{ratio:.2f}x** FCFS's."]
    return "\n".join(lines)

