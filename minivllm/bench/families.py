"""`minivllm bench families`: each new family's decode speed at a real size, against a Llama of the same shapes and
against llama.cpp on the same weights.

Per family preset (real config, random weights, a bf16 checkpoint): our decode tok/s at one sequence and at 64, in
the asked modes (fp32, w8a8, int8, w4a8, int4); the same for its Llama twin (presets.llama_twin: the same hidden size,
MLP, layers, heads, head_dim and vocabulary, so the same parameter count but for the family's extra norms); llama.cpp's
f32, Q8_0 or Q4_0 (the type at each mode's bits) of the family's own weights (its converter and quantizer,
bench/llamacpp.py) where its converter takes the checkpoint.
Decode only: the prompts (16 tokens at b=1, 8 at 64) are prefilled first, then `steps` steps are timed. Every
configuration runs in a fresh process (these models are GBs; nothing carries over) and each round runs the
configurations in the reverse order of the one before (ABBA), medians reported; ratios are the median of each
round's ratio (runs of one round are adjacent: paired_ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

from minivllm.bench import llamacpp
from minivllm.bench.peers import decode_steps
from minivllm.bench.results import ratio_bars, run_worker, save
from minivllm.config import cpu_count

FAMILY_PRESETS = ("qwen3-0.6b", "gemma3-1b", "olmo2-1b", "granite-3-2b", "gemma2-2b", "smollm3-3b", "phi4-mini")
LLAMA_CPP_TYPES = {"fp32": "f32", "w8a8": "Q8_0", "int8": "Q8_0", "w4a8": "Q4_0", "int4": "Q4_0"}
# ^ our mode → llama.cpp's type at the same bits


def add_families_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench families`."""
    p.add_argument("--presets", default=",".join(FAMILY_PRESETS), help="family presets (real sizes)")
    p.add_argument("--modes", default="fp32,w4a8", help="our weight modes (llama.cpp beside them: f32, Q8_0 or Q4_0)")
    p.add_argument("--batches", default="1,64", help="sequences decoding together")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed at one sequence")
    p.add_argument("--batch-steps", type=int, default=4, help="decode steps timed at the larger batches")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each in the reverse order of the one before")
    p.add_argument("--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--work-dir", default=None, help="where the checkpoints go (deleted after each family)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one measurement in this process: JSON args


def _ours(model: str, mode: str, batches: list[int], steps: list[int], threads: int) -> dict[str, Any]:
    """Our engine, loaded once: per batch size, prefill every sequence, then time its all-decode steps."""
    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, dtype="float32", quantization=None if mode == "fp32" else mode,
                                  kv_cache_memory="512MiB", max_model_len=256, max_num_seqs=max(batches),
                                  num_threads=threads, enable_prefix_caching=False))
    return {str(b): decode_steps(engine, b, 16 if b == 1 else 8, n) for b, n in zip(batches, steps, strict=True)}


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["engine"] == "ours":
        return _ours(spec["model"], spec["mode"], spec["batches"], spec["steps"], spec["threads"])
    return {str(b): llamacpp.decode_speed(spec["model"], b, 16 if b == 1 else 8, n, spec["threads"])
            for b, n in zip(spec["batches"], spec["steps"], strict=True)}


def _prepare(preset: str, root: str, with_llama_cpp: bool, modes: list[str]) -> dict[str, str]:
    """The family's checkpoint, its Llama twin's, and (where the converter takes it) its GGUF files."""
    from minivllm.config import ModelConfig
    from minivllm.modelgen.make_model import make_model
    from minivllm.modelgen.presets import llama_twin

    paths = {"family": make_model(preset, os.path.join(root, preset), dtype="bfloat16"),
             "llama": make_model(llama_twin(preset), os.path.join(root, preset + "-llama"), dtype="bfloat16")}
    if with_llama_cpp:
        arch = ModelConfig.from_pretrained(paths["family"]).architecture
        f32 = llamacpp.convert(paths["family"], os.path.join(root, preset + "-f32.gguf"), architecture=arch)
        paths["llama.cpp f32"] = f32
        for ftype in sorted({LLAMA_CPP_TYPES[m] for m in modes} - {"f32"}):  # only the types a mode compares with
            paths[f"llama.cpp {ftype}"] = llamacpp.quantize(f32, os.path.join(root, f"{preset}-{ftype.lower()}.gguf"),
                                                            ftype)
    return paths


def run_families(ns: argparse.Namespace) -> int:
    """Run the bench; print a table and write JSON."""
    threads = ns.threads or cpu_count()
    if ns.worker:
        print(json.dumps(_worker(json.loads(ns.worker))))
        return 0
    skip = None if not ns.no_llama_cpp else "--no-llama-cpp"
    skip = skip or llamacpp.available()
    if skip:
        print(skip)
    modes, batches = ns.modes.split(","), [int(b) for b in ns.batches.split(",")]
    root = ns.work_dir or os.path.join(os.path.expanduser("~/.cache/minivllm"), "bench-families")
    results: dict[str, Any] = {"threads": threads, "steps": ns.steps, "batch_steps": ns.batch_steps,
                               "rounds": ns.rounds, "families": {}}
    for preset in ns.presets.split(","):
        os.makedirs(root, exist_ok=True)
        t0 = time.time()
        try:
            paths = _prepare(preset, root, skip is None, modes)
        except (RuntimeError, ValueError, OSError) as e:
            print(f"{preset}: llama.cpp conversion failed ({e}); ours only", flush=True)
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
            paths = _prepare(preset, root, False, modes)
        print(f"{preset}: checkpoints ready in {time.time() - t0:.0f} s", flush=True)
        configs = []  # one process each, measuring every batch size on one load
        for mode in modes:
            configs.append(("family", mode))
            configs.append(("llama", mode))
            if f"llama.cpp {LLAMA_CPP_TYPES[mode]}" in paths:
                configs.append((f"llama.cpp {LLAMA_CPP_TYPES[mode]}", mode))
        runs: dict[str, list[float]] = {}
        rounds: dict[str, list[int]] = {}  # the round of each run (a failed worker leaves its round out)
        steps = [ns.steps if b == 1 else ns.batch_steps for b in batches]
        for r in range(ns.rounds):
            for who, mode in (configs if r % 2 == 0 else configs[::-1]):
                spec = {"engine": "llama.cpp" if who.startswith("llama.cpp") else "ours", "model": paths[who],
                        "mode": mode, "batches": batches, "steps": steps, "threads": threads}
                out = run_worker("families", spec, f"{spec['engine']} {spec['model']} {spec['mode']}")
                if out is None:
                    continue
                for batch in batches:
                    key = f"{who}|{mode}|{batch}"
                    runs.setdefault(key, []).append(out[str(batch)]["decode_tok_s"])
                    rounds.setdefault(key, []).append(r)
                    print(f"  round {r} {key}: {out[str(batch)]['decode_tok_s']:.2f} tok/s", flush=True)
        results["families"][preset] = {k: {"runs": v, "rounds": rounds[k], "median": statistics.median(v)}
                                       for k, v in runs.items()}
        shutil.rmtree(root, ignore_errors=True)
        if ns.out:  # after each family: a run of hours keeps what it measured
            save(results, ns.out, None)
    results["command"] = ["families", *(a for a in sys.argv[sys.argv.index("families") + 1:])] \
        if "families" in sys.argv else ["families"]
    results["measured_at"] = time.strftime("%Y-%m-%d")
    print(report(results))
    save(results, ns.out, plot)
    return 0


def plot(results: dict[str, Any], png: str) -> None:
    """Ratios to the Llama twin and to llama.cpp, per family, mode and batch."""
    labels, twin, cpp = [], [], []
    for preset, runs in results["families"].items():
        for key in sorted(k for k in runs if k.startswith("family|")):
            _, mode, batch = key.split("|")
            labels.append(f"{preset}\n{mode} b={batch}")
            t = paired_ratio(runs[key], runs.get(f"llama|{mode}|{batch}"))
            c = paired_ratio(runs[key], runs.get(f"llama.cpp {LLAMA_CPP_TYPES[mode]}|{mode}|{batch}"))
            twin.append(t or 0.0)
            cpp.append(c or 0.0)
    ratio_bars(png, labels, {"vs Llama twin": twin, "vs llama.cpp": cpp}, "decode tok/s ratio")


def report(results: dict[str, Any]) -> str:
    """A markdown table: tok/s and ratios per family, mode and batch."""
    lines = ["| family | mode | batch | ours tok/s | Llama twin tok/s | vs twin | llama.cpp tok/s | vs llama.cpp |",
             "|---|---|---|---|---|---|---|---|"]
    for preset, runs in results["families"].items():
        for key in sorted(k for k in runs if k.startswith("family|")):
            _, mode, batch = key.split("|")
            ours = runs[key]["median"]
            twin, cpp = runs.get(f"llama|{mode}|{batch}"), runs.get(f"llama.cpp {LLAMA_CPP_TYPES[mode]}|{mode}|{batch}")
            lines.append(f"| {preset} | {mode} | {batch} | {ours:.2f} | {_f(twin)} | {_ratio(runs[key], twin)} | "
                         f"{_f(cpp)} | {_ratio(runs[key], cpp)} |")
    return "\n".join(lines)


def paired_ratio(ours: dict[str, Any], other: dict[str, Any] | None) -> float | None:
    """The median over rounds of ours / other within each round both ran in: runs minutes apart drift +-30% on
    these VMs (a 16-step b=1 run of the mixture's twin measured 75-115 tok/s in five rounds), the runs of one round
    are adjacent (ABBA), so their ratio carries less of the drift than the ratio of the two medians.
    Results written before rounds were recorded pair runs by position."""
    if not other:
        return None
    mine = dict(zip(ours.get("rounds", range(len(ours["runs"]))), ours["runs"], strict=True))
    theirs = dict(zip(other.get("rounds", range(len(other["runs"]))), other["runs"], strict=True))
    ratios = [mine[r] / theirs[r] for r in mine if r in theirs and theirs[r]]
    return statistics.median(ratios) if ratios else None


def _f(x: dict[str, Any] | None) -> str:
    return "-" if x is None else f"{x['median']:.2f}"


def _ratio(ours: dict[str, Any], other: dict[str, Any] | None) -> str:
    r = paired_ratio(ours, other)
    return "-" if r is None else f"{r:.2f}x"
