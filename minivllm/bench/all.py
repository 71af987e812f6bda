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
import time
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
                     "static=--batching static --max-num-seqs 2 --batch-wait-ms 20", "--concurrency", "4",
                     "--num-requests", "8", "--input-len-min", "8", "--input-len-max", "16", "--output-len", "5",
                     "--kv-cache-memory", "64MiB", "--roofline", "--probe-mib", "64", "--no-offline",
                     "--server-threads", "1"],
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
            # The latency pair alone: each Ray deployment costs a front and a replica start (~30 s here).
            "replicas": ["replicas", *m, "--variants", "server,1 replica x 2 threads", "--concurrency", "4",
                         "--num-requests", "8", "--output-len", "3",
                         "--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--rounds", "1",
                         "--latency-requests", "4", "--latency-output-len", "2"],
            "liveview": ["liveview", *m, "--concurrency", "2", "--num-requests", "4", "--output-len", "3",
                         "--input-len-min", "8", "--input-len-max", "16", "--rounds", "1",
                         "--kv-cache-memory", "64MiB"],
            "beam": ["beam", *m, "--num-prompts", "2", "--prompt-len", "8", "--beam-width", "2", "--max-tokens", "3",
                     "--rounds", "1", "--kv-cache-memory", "8MiB"],
            "quantization": ["quantization", *m, "--quality-model", model or "", "--output-len", "4", "--repeats", "1",
                             "--batches", "2", "--batch-output-len", "2", "--perplexity-tokens", "600",
                             "--kl-tokens", "256", "--no-hf", "--probe-mib", "64"],
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
            "fairness": ["fairness", *m, "--batch", "8", "--light-requests", "3", "--shared-light-requests", "2",
                         "--tokens", "4", "--heavy-concurrency", "2", "--kv-cache-memory", "64MiB"],
            "guided": ["guided", *m, "--requests", "4", "--max-num-seqs", "4", "--max-tokens", "24", "--rounds", "1"],
            "lora": ["lora", *m, "--requests", "4", "--max-num-seqs", "4", "--output-len", "4", "--rounds", "1"],
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
        "fairness": ["fairness"],
        "guided": ["guided"],
        "lora": ["lora"],
    }


BENCHES = ("seed", "throughput", "latency", "transports", "perplexity", "quantization", "step", "beam",
           "speculative", "parallel", "replicas", "liveview", "kvcache", "preemption", "slo", "soak", "fairness",
           "guided", "lora")


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
            start = time.perf_counter()
            codes[b] = run_bench([*argv[b], "--out", out])
            print(f"=== {b}: exit {codes[b]} in {time.perf_counter() - start:.1f} s", flush=True)
            if os.path.isfile(out):  # what produced it and when, for the report
                with open(out) as f:
                    r = json.load(f)
                r["command"] = argv[b]
                r["measured_at"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
                with open(out, "w") as f:
                    json.dump(r, f, indent=2)
    from minivllm.bench.markdown import render

    md = render(ns.out_dir, _argv(False, None))
    with open(ns.markdown, "w") as f:
        f.write(md)
    print(f"wrote {ns.markdown}")
    return max(codes.values(), default=0)
