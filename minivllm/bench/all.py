"""`minivllm bench all`: every bench in one command, then BENCHMARKS.md regenerated from their JSON.

Runs, one after the other (never two heavy jobs at once on a small machine): the seed's serving workload
against static batching served the same way; offline throughput with its ablations, concurrency sweep
and step split; single-request latency; and the transports side by side. Each writes JSON and a PNG
into --out-dir; the markdown is rendered from those files only, so `--render-only` rebuilds it without
measuring again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
from collections.abc import Callable
from typing import Any

SEED_STATIC = "--batching static --max-num-seqs 8 --batch-wait-ms 20"


def add_all_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench all`."""
    p.add_argument("--out-dir", default="benchmarks/results", help="JSON and PNG of every bench go here")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="the report to (re)write")
    p.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(BENCHES))
    p.add_argument("--render-only", action="store_true", help="rebuild the markdown from the JSON in --out-dir")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes on --model for every bench (a smoke run: the figures mean nothing)")
    p.add_argument("--model", default=None, help="with --quick: the model every bench uses")


def _argv(quick: bool, model: str | None) -> dict[str, list[str]]:
    """Each bench's command line: the documented workloads, or tiny ones with --quick."""
    if quick:
        m = ["--model", model or ""]
        return {
            "seed": ["serve", *m, "--transport", "http", "--no-stream", "--variant", "continuous=", "--variant",
                     "static=--batching static --max-num-seqs 2 --batch-wait-ms 20", "--concurrency", "5",
                     "--num-requests", "10", "--input-len-min", "8", "--input-len-max", "16", "--output-len", "3",
                     "--kv-cache-memory", "64MiB", "--roofline", "--no-offline", "--server-threads", "1"],
            "throughput": ["throughput", *m, "--num-requests", "4", "--input-len-min", "20", "--input-len-max", "40",
                           "--output-len", "6", "--batch1-output-len", "4", "--kv-cache-memory", "8MiB",
                           "--ablation-requests", "4", "--concurrency-levels", "1,4", "--no-hf", "--no-portable"],
            "latency": ["latency", *m, "--prompt-lens", "16,32", "--output-len", "4", "--repeats", "1"],
            "transports": ["serve", *m, "--transport", "grpc,http", "--concurrency", "2", "--num-requests", "4",
                           "--input-len-min", "8", "--input-len-max", "16", "--output-len", "3", "--rounds", "1",
                           "--kv-cache-memory", "64MiB", "--server-threads", "1", "--no-offline"],
            "perplexity": ["perplexity", *m, "--max-tokens", "1024"],
            "speculative": ["speculative", *m, "--ks", "2", "--streams", "1,2", "--output-len", "8",
                            "--prompt-len", "16", "--large-batch", "4", "--rounds", "1",
                            *(["--draft", model] if model else [])],  # the model as its own draft: same tokenizer
            "step": ["step", *m, "--batches", "4,8", "--steps", "2", "--kv-cache-memory", "8MiB"],
            "parallel": ["parallel", *m, "--batches", "1,4", "--steps", "3", "--rounds", "1", "--prompt-len", "8",
                         "--kv-cache-memory", "8MiB"],
            "replicas": ["replicas", *m, "--concurrency", "4", "--num-requests", "8", "--output-len", "3",
                         "--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--rounds", "1",
                         "--latency-requests", "4", "--latency-output-len", "2"],
            "liveview": ["liveview", *m, "--concurrency", "2", "--num-requests", "4", "--output-len", "3",
                         "--input-len-min", "8", "--input-len-max", "16", "--rounds", "1",
                         "--kv-cache-memory", "64MiB"],
            "beam": ["beam", *m, "--num-prompts", "2", "--prompt-len", "8", "--beam-width", "2", "--max-tokens", "3",
                     "--rounds", "1", "--kv-cache-memory", "8MiB"],
            "quantization": ["quantization", *m, "--quality-model", model or "", "--output-len", "4", "--repeats", "1",
                             "--batches", "2", "--batch-output-len", "2", "--perplexity-tokens", "600",
                             "--kl-tokens", "256", "--no-hf"],
            "kvcache": ["kvcache", *m, "--kv-cache-memory", "1MiB", "--num-requests", "4", "--prompt-len", "24",
                        "--output-len", "4", "--rounds", "1", "--quality-windows", "2", "--quality-len", "48",
                        "--windows", "16"],
            "preemption": ["preemption", *m, "--workloads",
                           "long-prompt=6x60x4,long-output=6x8x40,shared-prefix=6x8x8x32",
                           "--kv-cache-memory", "256KiB", "--swap-space", "4MiB", "--rounds", "1"],
            "slo": ["slo", *m, "--duration", "2", "--interactive-shape", "8x4", "--batch-shape", "32x8",
                    "--interactive-rate", "4", "--batch-rate", "4",
                    "--rounds", "1", "--kv-cache-memory", "8MiB"],
            "soak": ["soak", *m, "--minutes", "0.1", "--warmup-minutes", "0.02", "--request-rate", "10",
                     "--output-len", "2-6", "--sample-every", "1", "--num-kv-blocks", "256"],
            "guided": ["guided", *m, "--requests", "4", "--max-num-seqs", "4", "--max-tokens", "24", "--rounds", "1"],
        }
    return {
        # The seed's workload: 50 clients, 500 requests, 30 new tokens, GPT-2 (124M) in float32, the seed's
        # /generate, whole answers; continuous batching against the seed's static batching.
        "seed": ["serve", "--preset", "gpt2", "--transport", "http", "--no-stream", "--variant", "continuous=",
                 "--variant", f"static={SEED_STATIC}", "--concurrency", "50", "--max-num-seqs", "64",
                 "--num-requests", "500", "--input-len-min", "8", "--input-len-max", "32", "--output-len", "30",
                 "--kv-cache-memory", "1GiB", "--roofline", "--rounds", "2", "--no-offline"],
        "throughput": ["throughput"],
        "latency": ["latency"],
        "transports": ["serve", "--transport", "grpc,http,openai", "--concurrency", "32", "--num-requests", "64",
                       "--output-len", "128", "--rounds", "2"],
        "perplexity": ["perplexity"],
        "quantization": ["quantization"],
        "step": ["step"],
        "beam": ["beam"],
        "speculative": ["speculative"],
        "parallel": ["parallel"],
        "replicas": ["replicas"],
        "liveview": ["liveview", "--rounds", "3"],
        "kvcache": ["kvcache"],
        "preemption": ["preemption"],
        "slo": ["slo"],
        "soak": ["soak", "--minutes", "10"],
        "guided": ["guided"],
    }


BENCHES = ("seed", "throughput", "latency", "transports", "perplexity", "quantization", "step", "beam",
           "speculative", "parallel", "replicas", "liveview", "kvcache", "preemption", "slo", "soak", "guided")


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import psutil
    import torch

    from minivllm.config import cpu_count

    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in (platform.processor(), platform.machine()):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in have]
                    break
    except OSError:
        pass
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu,
            "cpu_flags": flags, "cores": cpu_count(), "memory_gib": psutil.virtual_memory().total / 2**30,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "python": platform.python_version(), "os": platform.platform()}


def run_all(ns: argparse.Namespace) -> int:
    """Run the benches (unless --render-only), then write the markdown."""
    from minivllm.bench.verbs import run_bench

    if ns.quick and not ns.model:
        raise ValueError("--quick needs --model (a small model directory)")
    only = [b.strip() for b in ns.only.split(",")] if ns.only else list(BENCHES)
    if any(b not in BENCHES for b in only):
        raise ValueError(f"--only: choose among {', '.join(BENCHES)}, got {ns.only!r}")
    os.makedirs(ns.out_dir, exist_ok=True)
    codes = {}
    if not ns.render_only:
        with open(os.path.join(ns.out_dir, "machine.json"), "w") as f:
            json.dump(machine_info(), f, indent=2)
        argv = _argv(ns.quick, ns.model)
        for b in only:
            print(f"=== minivllm bench {' '.join(argv[b])}", flush=True)
            out = os.path.join(ns.out_dir, f"{b}.json")
            codes[b] = run_bench([*argv[b], "--out", out])
            if os.path.isfile(out):  # what produced it and when, for the report
                with open(out) as f:
                    r = json.load(f)
                r["command"] = argv[b]
                r["measured_at"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
                with open(out, "w") as f:
                    json.dump(r, f, indent=2)
    md = render(ns.out_dir, _argv(False, None))
    with open(ns.markdown, "w") as f:
        f.write(md)
    print(f"wrote {ns.markdown}")
    return max(codes.values(), default=0)


def _load(out_dir: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(out_dir, f"{name}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def render(out_dir: str, argv: dict[str, list[str]]) -> str:
    """BENCHMARKS.md from the JSON files in out_dir (a section per bench found)."""
    from minivllm.bench import (
        guided,
        kv_cache,
        latency,
        live_view,
        parallel,
        perplexity,
        preemption,
        quantization_report,
        replicas,
        serve_report,
        slo,
        soak,
        speculative,
        step_overhead,
        throughput_report,
    )

    m = _load(out_dir, "machine") or {}
    lines = [
        "# Benchmarks", "",
        "Generated by `minivllm bench all` (JSON and PNG plots in `benchmarks/results/`, not committed); "
        "`minivllm bench all --render-only` rebuilds this file from them. Every figure is measured side by "
        "side with its baseline in one run: this machine's speed drifts ±30% over minutes, so only ratios "
        "from the same run mean anything. Development records of earlier issues (micro-benchmarks, the "
        "sampling kernel, what each fast path bought) are in [benchmarks/RECORDS.md](benchmarks/RECORDS.md).",
        "",
    ]
    if m:
        mem = f"{m['memory_gib']:.0f} GiB"
        lines += [f"**Machine**: {m['cpu']} ({', '.join(m['cpu_flags']) or 'no AVX-512'}), "
                  f"{m['cores']} cores, {mem} RAM, {m['gpu'] or 'no GPU'}; torch {m['torch']}, Python {m['python']}, "
                  f"{m['os']}.", ""]
    sections: list[tuple[str, Callable[[dict[str, Any]], list[str]]]] = [
        ("seed", lambda r: _seed(r, serve_report.report)),
        ("throughput", lambda r: _throughput(r, throughput_report)),
        ("latency", lambda r: ["## Single-request latency (`bench latency`)", "", latency.report(r)]),
        ("transports", lambda r: ["## Transports: gRPC vs HTTP vs OpenAI (`bench serve`)", "",
                                  "One server, the same requests over each endpoint in ABBA order, prefix "
                                  "caching off (each endpoint replays the same prompts).", "", serve_report.report(r)]),
        ("perplexity", lambda r: ["## The embedded default model's quality (`bench perplexity`)", "",
                                  "Held-out perplexity (standard-library files the training never saw, windows of "
                                  f"{r['seq_len']} scored tokens), by our engine's prompt_logprobs and by HF "
                                  "transformers on the same weights, with a unigram baseline on the same tokens.",
                                  "", perplexity.report(r)]),
        ("quantization", lambda r: ["## Weight formats: fp32, bf16, int8, int4, W8A8, W4A8 (`bench quantization`)", "",
                                    "One run: batch-1 requests (a "
                                    f"{r['prompt_len']}-token prompt, {r['output_len']} new tokens) and offline "
                                    f"batches ({r['batch_output_len']} new tokens each) on "
                                    f"`{os.path.basename(r['model'])}`, HF transformers fp32 beside them; each "
                                    "mode's roofline is its weight bytes read once per step at the probe's median "
                                    "bandwidth. int4 groups of "
                                    f"{r['group_size']}.", "", quantization_report.report(r)]),
        ("step", lambda r: ["## Engine overhead: a decode step with mixed sampling (`bench step`)", "",
                            step_overhead.report(r), "", step_overhead.verdict(r)]),
        ("beam", lambda r: ["## Beam search: inside the step vs as a driver over requests (`bench beam`)", "",
                            _beam(r)]),
        ("speculative", lambda r: ["## Speculative decoding (`bench speculative`)", "",
                                   f"Greedy decoding of `{os.path.basename(r['model'].rstrip('/'))}`, "
                                   f"{r['output_len']} new tokens per request, output tok/s (ratio to no "
                                   "speculation in the same run; n streams = the same 8 prompts n at a time; 64 "
                                   "sequences = each proposer's engine against itself with speculation detached); "
                                   "n-gram "
                                   "(prompt lookup) and draft-model "
                                   f"(`{os.path.basename(str(r.get('draft')).rstrip('/'))}`) proposers with adaptive "
                                   "speculation (the default); code = held-out standard-library code, repetitive "
                                   "= a code excerpt then \"the same code again\".", "", speculative.report(r), "",
                                   speculative.verdict(r)]),
        ("parallel", lambda r: ["## Tensor parallelism: a decode step, TP=2 vs one process (`bench parallel`)", "",
                                f"`{os.path.basename(r['model'].rstrip('/'))}` in float32, ms per engine step with "
                                "every sequence decoding (in brackets: the forward alone), the two engines "
                                "alternating in one run.", "", parallel.report(r), "", parallel.verdict(r)]),
        ("replicas", lambda r: ["## Scale-out: Ray Serve replicas vs one server (`bench replicas`)", "",
                                f"`{os.path.basename(r['model'].rstrip('/'))}` in float32 on one 2-core machine: "
                                "every variant's front and replicas on one local Ray cluster, the plain server "
                                "beside them, all driven by `bench serve` on the same requests. Capacity "
                                "planning from these figures: [docs/scaling.md](docs/scaling.md).", "",
                                replicas.report(r), "", replicas.verdict(r)]),
        ("liveview", lambda r: ["## The live view's cost (`bench liveview`)", "",
                                f"`{os.path.basename(r['model'].rstrip('/'))}`: the same server and requests with "
                                "and without a viewer reading every step record from `/ws/events` (as the "
                                "`/dashboard` page does).", "", live_view.report(r)]),
        ("kvcache", lambda r: ["## KV cache storage at one budget: fp32, bf16, int8 (`bench kvcache`)", "",
                               f"`{os.path.basename(r['model'].rstrip('/'))}`, offline, every storage in one run "
                               "(ABBA order).", "", kv_cache.report(r)]),
        ("preemption", lambda r: ["## Preemption: swap vs recompute (`bench preemption`)", "",
                                  f"`{os.path.basename(r['model'].rstrip('/'))}` in {r['dtype']}, KV pool "
                                  f"{r['kv_cache_memory']}, host tier {r['swap_space']} (a memory-mapped file), "
                                  f"max_num_seqs {r['max_num_seqs']}; the three modes alternate in one run, "
                                  f"{r['rounds']} rounds ABBA (medians).", "", preemption.report(r)]),
        ("slo", lambda r: ["## SLO-aware scheduling: interactive TTFT vs batch throughput (`bench slo`)", "",
                           f"`{os.path.basename(r['model'].rstrip('/'))}`, an open-loop driver over the engine "
                           "(each request added at its arrival time, the engine stepped in between).", "",
                           slo.report(r)]),
        ("soak", lambda r: ["## Soak: a real server under constant load with hang-ups (`bench soak`)", "",
                            f"`{os.path.basename(r['model'].rstrip('/'))}`, served by `minivllm serve` in a "
                            "subprocess (HTTP, WebSocket and gRPC on one engine).", "", soak.report(r)]),
        ("guided", lambda r: ["## Guided decoding: JSON schema vs unguided (`bench guided`)", "",
                              f"`{os.path.basename(r['model'].rstrip('/'))}` in {r['dtype']}, offline engine; the "
                              "unguided twin of each request generates exactly as many tokens as the guided one did.",
                              "", guided.report(r)]),
    ]
    for name, section in sections:
        r = _load(out_dir, name)
        if r is None:
            continue
        lines += section(r)
        cmd = shlex.join(r.get("command", argv[name]))
        lines += ["", f"Command: `minivllm bench {cmd}`" + (f" (run {r['measured_at']})" if "measured_at" in r else ""),
                  ""]
    return "\n".join(lines).rstrip() + "\n"



def _beam(r: dict[str, Any]) -> str:
    runs = lambda k: ", ".join(f"{t:.2f}" for t in r["times_s"][k])  # noqa: E731
    return (f"{r['num_prompts']} prompts of {r['prompt_len']} tokens, beam width {r['beam_width']}, "
            f"{r['max_tokens']} new tokens, `{os.path.basename(r['model'].rstrip('/'))}`, ABBA order. In the engine's "
            f"step (beams fork sequences that share KV blocks copy-on-write): **{r['mean_s']['in-engine']:.2f} s** "
            f"(runs {runs('in-engine')}). As a driver over the engine's requests, vLLM v1's way (per step one "
            f"single-token request per live beam with its top {2 * r['beam_width']} logprobs, prefix caching "
            f"finding the shared KV): **{r['mean_s']['driver']:.2f} s** (runs {runs('driver')}), "
            f"**x{r['driver_over_in_engine']:.2f}** the time. Same beams for {r['same_beams']} of {r['num_prompts']} "
            "prompts (both run HF's beam_step; the driver sees each beam's top logprobs only, which holds every "
            "candidate the step keeps).")


def _ceilings(c: dict[str, float]) -> str:
    spread = (f" (probe spread {c['bandwidth_min'] / 1e9:.1f}-{c['bandwidth_max'] / 1e9:.1f})"
              if c.get("bandwidth_max") else "")
    return (f"peak GEMM {c['peak_flops'] / 1e9:.0f} GFLOP/s (aten/MKL {c['mkl_gemm_flops'] / 1e9:.0f}), "
            f"memory bandwidth {c['bandwidth'] / 1e9:.1f} GB/s{spread}")


def _seed(r: dict[str, Any], report: Callable[[dict[str, Any]], str]) -> list[str]:
    s = r["server"]
    cont, stat = (next(k for k in r["endpoints"] if k.startswith(v + "/")) for v in ("continuous", "static"))
    a, b = s[cont], s[stat]
    ratio = a["output_tok_per_s"] / b["output_tok_per_s"]
    rf = r["roofline"]["columns"]
    roof_ratio = rf[cont]["output_tok_s"] / rf[stat]["output_tok_s"]
    errors = a["failures"] + b["failures"]
    p95_met = "met" if a["e2e_ms"]["p95"] < b["e2e_ms"]["p50"] else "not met"
    frac = lambda k, x: x["output_tok_per_s"] / rf[k]["output_tok_s"]  # noqa: E731
    verdict = [
        f"- zero errors: **{'met' if errors == 0 else f'not met ({errors} failures)'}** "
        f"({a['successes']} + {b['successes']} successes over {len(r['order'])} runs).",
        f"- ≥ 3x the static-batching throughput: **{'met' if ratio >= 3 else 'not met'}: {ratio:.2f}x** "
        f"({a['output_tok_per_s']:.0f} vs {b['output_tok_per_s']:.0f} tok/s). By this run's ceilings the workload "
        f"needs {rf[cont]['compute_s']:.1f} s of FLOPs at peak (prefill and decode), and one weight read per step "
        f"takes {rf[stat]['memory_s']:.1f} s in all with {rf[stat]['batch']} running, {rf[cont]['memory_s']:.1f} s "
        f"with {rf[cont]['batch']}: rooflines of {rf[stat]['output_tok_s']:.0f} and {rf[cont]['output_tok_s']:.0f} "
        f"tok/s, a ratio of **{roof_ratio:.2f}x**. The 3–4x estimate counts decode only, with weights streamed at "
        f"~21 GB/s; this run measured {r['roofline']['ceilings']['bandwidth'] / 1e9:.0f} GB/s, and the prompts' "
        "prefill is compute that batching cannot share. Measured, continuous batching reaches "
        f"{100 * frac(cont, a):.0f}% of its roofline and static batching {100 * frac(stat, b):.0f}%, which is "
        f"why the measured ratio is {'above' if ratio > roof_ratio else 'below'} the roofline ratio (see "
        "benchmarks/RECORDS.md for where each one's step time goes).",
        f"- p95 latency below the static-batching p50: **{p95_met}** ({a['e2e_ms']['p95']:.0f} ms vs "
        f"{b['e2e_ms']['p50']:.0f} ms).",
    ]
    model = os.path.basename(r["model"].rstrip("/"))
    return ["## The seed's serving workload: continuous vs static batching (`bench serve`)", "",
            f"{r['concurrency']} concurrent clients, {r['num_requests']} requests, {r['output_len'][0]} new tokens "
            f"each, {model} shape in float32, over the seed's `/generate`. The static-batching server is the same "
            f"engine with `{r['variants'].get('static', '')}` (the seed's policy: up to 8 requests per batch, a "
            "20 ms window to fill it, no request joins a batch "
            "once it runs, so each batch runs to its longest request). Both servers run with the same client, "
            "on the same requests, in ABBA order. Rooflines: the workload's FLOPs (prefill and decode) at the "
            "measured peak, or one read of the weights per step of at most B tokens at the measured bandwidth, "
            f"whichever is slower; ceilings measured in this run: {_ceilings(r['roofline']['ceilings'])}.", "",
            report(r), "", "Targets:", "", *verdict]


def _mermaid_line(title: str, xs: list[int], series: dict[str, list[float]]) -> list[str]:
    top = max(max(v) for v in series.values())
    out = ["```mermaid", "xychart-beta", f'    title "{title}"',
           f'    x-axis "concurrent sequences" [{", ".join(str(x) for x in xs)}]',
           f'    y-axis "output tok/s" 0 --> {int(top * 1.1) + 1}']
    out += [f"    line [{', '.join(f'{v:.0f}' for v in vals)}]" for vals in series.values()]
    names = list(series)
    return out + ["```", "", f"First line: {names[0]}; " + "; ".join(f"then {n}" for n in names[1:]) + "."]


def _throughput(r: dict[str, Any], tp: Any) -> list[str]:
    lines = ["## Offline throughput, ablations and step split (`bench throughput`)", "",
             f"Ceilings measured in this run: {_ceilings(r['ceilings'])}.", "", *tp.main_report(r)]
    if r.get("decode_profile", {}).get("phases_ms"):
        lines += ["", f"### Step-time split at {r['decode_profile']['batch']} concurrent sequences",
                  *tp.step_split_report(r)]
    sw = r.get("concurrency_sweep")
    if sw:
        name = os.path.basename(r["model"].rstrip("/"))
        lines += ["", f"### Throughput vs concurrency ({name} shape, {r['dtype']})", *tp.concurrency_report(r),
                  "", *_mermaid_line(f"{name}: output tok/s vs concurrency", [x["concurrency"] for x in sw],
                                     {"Mini-vLLM": [x["output_tok_s"] for x in sw],
                                      "roofline": [x["roofline_tok_s"] for x in sw]}),
                  "", "The PNG (`benchmarks/results/throughput.png`) has the same curve on log axes."]
    if r.get("ablations"):
        ab = r["ablations"]
        lines += ["", "### Ablations", *tp.ablation_report(r)]
        full, cont = ab.get("full engine (mixed)"), ab.get("contiguous-cache")
        if full and cont:
            fits = full["pool_slots"] // full["max_model_len"]
            bound = next((x["concurrency"] for x in sw or [] if x["roofline_bound"] == "compute"), None)
            cost = max(0.0, 1 - cont["ratio_to_full"])
            why = (f": from {bound} sequences on, this machine's roofline is compute-bound (the concurrency sweep "
                   f"above), and {fits} sequences is past that, so fewer sequences per step lose little"
                   if bound is not None and fits >= bound else "")
            lines += ["", f"KV memory: the paged cache left {100 * full['kv_waste']:.1f}% of its allocated slots empty "
                      f"(the unfilled tail block of each sequence); the contiguous cache "
                      f"{100 * cont['kv_waste']:.1f}%, because it reserves max_model_len ({full['max_model_len']}) "
                      f"slots per sequence from the start, so the same pool held at most {fits} sequences at once "
                      f"instead of {full['requests']}. That cost {100 * cost:.0f}% of throughput here{why}; where "
                      "memory, not compute, bounds the batch (a GPU), the same waste caps throughput directly."]
    return lines
