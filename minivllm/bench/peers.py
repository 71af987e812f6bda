"""`minivllm bench peers`: llama.cpp and HF transformers beside us on the same weights, at every precision.

One checkpoint per preset (real config, random weights, bf16, so every engine's float32 copy holds the same
values). llama.cpp gets it through its own converter (F32, BF16) and quantizer (Q8_0, Q4_0: the types at our
modes' bits, as `PEER_TYPE` pairs them); HF transformers runs the checkpoint in float32 and bfloat16. Each
configuration runs in a fresh process that loads the model once, warms up, then measures: the seconds to
prefill one 512-token prompt (TTFT), and decode tok/s at each batch size after short prompts (the logits of every
row computed, in every engine). Each round runs the configurations in the reverse order of the one before
(ABBA) and starts with the bandwidth probe (bench/roofline.py: 2 threads, >= 8x the last-level cache); ratios
are of medians. With --pairs N, each mode then meets llama.cpp at one sequence in N pairs of alternating bursts,
both engines loaded at once (bench/paired.py): the ratio within each pair, where rounds minutes apart mix the
machine's phases; the probe then also reads memory beside each pair, and each engine's stream is taken against it.

The roofline column: bytes each engine's decode step reads (its own format's weights: the GGUF tensors for
llama.cpp, ours counted by decode_weight_bytes, HF's parameters) x tokens/s at one sequence = the bandwidth its
decode streams, as a share of the probe's median. A probe slower than a peer's decode is flagged: it measures
the wrong thing (issue 34 item 3).
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
from minivllm.bench.results import run_worker, save
from minivllm.bench.roofline import add_probe_mib_arg
from minivllm.config import cpu_count

MODES = ("fp32", "bf16", "int8", "w8a8", "int4", "w4a8")
PEER_TYPE = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "w8a8": "Q8_0", "int4": "Q4_0", "w4a8": "Q4_0",
             "w4a16": "Q4_0"}  # (w4a16: int4 under a bfloat16 model, quant_quality.W4A16; by name only)
# Same-file modes (issue 35): "gguf:TYPE" serves llama.cpp's own file of that type as it loads by default,
# "gguf:TYPE+METHOD" with --quantization METHOD on top (Q4_0+w4a8: int8 activations, as llama.cpp computes).
GGUF_TYPES = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K")


def peer_type(mode: str) -> str:
    """The llama.cpp file type a mode of ours is compared with."""
    return mode[5:].partition("+")[0] if mode.startswith("gguf:") else PEER_TYPE[mode]


def valid_mode(mode: str) -> bool:
    if mode.startswith("gguf:"):  # Q4 blocks run as int4 or w4a8; Q8_0's, and the K-quants converted to int8
        kind, _, method = mode[5:].partition("+")  # blocks, as int8 or w8a8; float files load as floats, any mode
        int8 = ("int8", "w8a8")
        native = {"Q4_0": ("int4", "w4a8"), "Q4_1": ("int4", "w4a8"), "Q8_0": int8, "Q4_K_M": int8, "Q5_K_M": int8,
                  "Q6_K": int8}
        return kind in GGUF_TYPES and method in ("", *native.get(kind, ("int4", "w4a8", "int8", "w8a8")))
    return mode in PEER_TYPE
HF_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
PREFILL = "prefill"
PROBE_PASSES = 3  # a paired probe reading: the median of this many passes (~0.1-0.3 s at 1 GiB)


def add_peers_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench peers`."""
    p.add_argument("--presets", default="smollm2-135m,llama-3.2-1b", help="model shapes (modelgen presets)")
    p.add_argument("--modes", default=",".join(MODES), help="our weight modes; llama.cpp at the same bits: "
                   + ", ".join(f"{m}={t}" for m, t in PEER_TYPE.items()) + "; or gguf:TYPE[+METHOD] (TYPE among "
                   + ", ".join(GGUF_TYPES) + "): llama.cpp's own file of that type served by us too")
    p.add_argument("--batches", default="1,64", help="sequences decoding together")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence before decode")
    p.add_argument("--prefill-len", type=int, default=512, help="the TTFT prompt (0: skip)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed at one sequence")
    p.add_argument("--batch-steps", type=int, default=8, help="decode steps timed at the larger batches")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each in the reverse order of the one before")
    p.add_argument("--threads", type=int, default=None, help="threads for every engine (default: all cores)")
    add_probe_mib_arg(p)
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    p.add_argument("--work-dir", default=None, help="where checkpoints and GGUF files go (deleted after each preset)")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG next to it)")
    p.add_argument("--pairs", type=int, default=0, help="also time b=1 in this many pairs of alternating bursts, "
                   "ours and llama.cpp loaded at once (bench/paired.py; 0: off)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one configuration in this process: JSON
    p.add_argument("--burst-worker", default=None, help=argparse.SUPPRESS)  # one engine serving bursts: JSON


def decode_steps(engine: Any, num_seqs: int, prompt_len: int, n: int) -> dict[str, float]:
    """Our engine: prefill num_seqs prompts, then time n all-decode steps; tokens the steps made per second."""
    from minivllm.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=n + 2, ignore_eos=True)
    for s in range(num_seqs):
        engine.add_request(f"{num_seqs}-{s}-{time.monotonic_ns()}",
                           {"prompt_token_ids": [(7 * i + 13 * s) % vocab for i in range(prompt_len)]}, params)
    seqs = [q for g in engine.groups.values() for q in g.seqs]
    t0 = time.perf_counter()
    while any(q.num_computed_tokens < q.num_prompt_tokens for q in seqs):
        engine.step()
    t1 = time.perf_counter()
    before = sum(q.num_output_tokens for q in seqs)
    running = len(engine.scheduler.running)
    for _ in range(n):
        engine.step()
    t2 = time.perf_counter()
    # The tokens the steps made (not num_seqs x n: a pool that admits fewer sequences must not look faster).
    made = sum(q.num_output_tokens for q in seqs) - before
    while engine.has_unfinished_requests():
        engine.step()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_tok_s": made / (t2 - t1), "running": running}


def _our_engine(spec: dict[str, Any]) -> Any:
    """Our engine on the spec's model and mode, warmed up (every weight touched, buffers allocated)."""
    from minivllm.bench.quant_quality import mode_engine_kwargs
    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine

    batches, mode = spec["batches"], spec["mode"]
    if mode.startswith("gguf:"):  # the file as it loads, or with --quantization on top
        method = mode.partition("+")[2]
        kwargs: dict[str, Any] = {"quantization": method} if method else {}
    else:
        kwargs = mode_engine_kwargs(mode)
    engine = LLMEngine(EngineArgs(model=spec["model"], kv_cache_memory="1GiB", num_threads=spec["threads"],
                                  max_model_len=max(spec["prefill_len"], spec["prompt_len"] + spec["steps"]) + 16,
                                  max_num_seqs=max(batches), enable_prefix_caching=False, **kwargs))
    decode_steps(engine, 1, 8, 4)
    return engine


def _ours(spec: dict[str, Any]) -> dict[str, Any]:
    from minivllm.bench.quantization import decode_weight_bytes

    engine = _our_engine(spec)
    batches = spec["batches"]
    out: dict[str, Any] = {"bytes": decode_weight_bytes(engine.runner.model)}
    if spec["prefill_len"]:
        out[PREFILL] = decode_steps(engine, 1, spec["prefill_len"], 0)["prefill_s"]
    for b in batches:
        out[str(b)] = decode_steps(engine, b, spec["prompt_len"], spec["steps"] if b == 1 else spec["batch_steps"]
                                   )["decode_tok_s"]
    return out


def _llama_cpp(spec: dict[str, Any]) -> dict[str, Any]:
    session = llamacpp.Session(spec["model"], spec["threads"])
    try:
        session.decode_tok_s(1, 8, 4)  # warm-up: the mapped file paged in
        out: dict[str, Any] = {"bytes": llamacpp.streamed_bytes(spec["model"])}
        if spec["prefill_len"]:
            out[PREFILL] = session.prefill_s(spec["prefill_len"])
        for b in spec["batches"]:
            out[str(b)] = session.decode_tok_s(b, spec["prompt_len"], spec["steps"] if b == 1 else spec["batch_steps"])
    finally:
        session.close()
    return out


def _bursts(spec: dict[str, Any]) -> int:
    """A paired-burst worker (bench/paired.py): the engine loaded and warm, one b=1 decode of `steps` steps a burst."""
    from minivllm.bench.paired import serve_bursts

    if spec["engine"] == "probe":  # the bandwidth probe's buffer kept; a burst: the median of PROBE_PASSES passes
        from minivllm.bench.roofline import bandwidth_reader, probe_mib

        mib = spec.get("mib") or probe_mib()
        read = bandwidth_reader(mib, spec["threads"])
        return serve_bursts(lambda: statistics.median(read(PROBE_PASSES)), {"mib": mib})
    if spec["engine"] == "ours":
        from minivllm.bench.quantization import decode_weight_bytes

        engine = _our_engine(spec)
        return serve_bursts(lambda: decode_steps(engine, 1, spec["prompt_len"], spec["steps"])["decode_tok_s"],
                            {"bytes": decode_weight_bytes(engine.runner.model)})
    session = llamacpp.Session(spec["model"], spec["threads"])
    try:
        session.decode_tok_s(1, 8, 4)
        return serve_bursts(lambda: session.decode_tok_s(1, spec["prompt_len"], spec["steps"]),
                            {"bytes": llamacpp.streamed_bytes(spec["model"])})
    finally:
        session.close()


def _hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, HF_DTYPE[spec["mode"]])).eval()
    vocab = model.config.vocab_size
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embed
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"bytes": params - (0 if tied else embed.numel() * embed.element_size())}

    def run(num_seqs: int, prompt_len: int, steps: int) -> tuple[float, float]:
        ids = torch.tensor([[(7 * i + 13 * s) % vocab for i in range(prompt_len)] for s in range(num_seqs)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            past = model(ids, use_cache=True, logits_to_keep=1).past_key_values
            t1 = time.perf_counter()
            for step in range(steps):
                nxt = torch.tensor([[(31 * step + s) % vocab] for s in range(num_seqs)])
                past = model(nxt, past_key_values=past, use_cache=True).past_key_values
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    run(1, 8, 4)  # warm-up
    if spec["prefill_len"]:
        out[PREFILL] = run(1, spec["prefill_len"], 0)[0]
    for b in spec["batches"]:
        n = spec["steps"] if b == 1 else spec["batch_steps"]
        out[str(b)] = b * n / run(b, spec["prompt_len"], n)[1]
    return out


def _probe(spec: dict[str, Any]) -> dict[str, Any]:
    from minivllm.bench.roofline import measure_bandwidth, probe_mib

    mib = spec.get("mib") or probe_mib()
    median, lo, hi = measure_bandwidth(mib, threads=spec["threads"])
    return {"median": median, "min": lo, "max": hi, "mib": mib}


WORKERS = {"ours": _ours, "llama.cpp": _llama_cpp, "hf": _hf, "probe": _probe}


def _prepare(preset: str, root: str, modes: list[str], with_llama_cpp: bool) -> dict[str, str]:
    """The preset's checkpoint and its GGUF files at the types our modes pair with."""
    from minivllm.modelgen.make_model import make_model

    paths = {"hf": make_model(preset, os.path.join(root, preset), dtype="bfloat16")}
    if with_llama_cpp:
        types = {peer_type(m) for m in modes}
        f32 = llamacpp.convert(paths["hf"], os.path.join(root, preset + "-F32.gguf"), "f32")
        paths["F32"] = f32
        if "BF16" in types:
            paths["BF16"] = llamacpp.convert(paths["hf"], os.path.join(root, preset + "-BF16.gguf"), "bf16")
        for t in sorted(types - {"F32", "BF16"}):
            paths[t] = llamacpp.quantize(f32, os.path.join(root, f"{preset}-{t}.gguf"), t)
    return paths


def configurations(modes: list[str], paths: dict[str, str], with_hf: bool) -> list[tuple[str, str, str]]:
    """(engine, mode or type, model path) for every process of a round: each of our modes, each llama.cpp type
    once (int8 and w8a8 share Q8_0), HF's float dtypes."""
    configs = [("ours", m, paths[peer_type(m)] if m.startswith("gguf:") else paths["hf"]) for m in modes]
    for t in dict.fromkeys(peer_type(m) for m in modes):
        if t in paths:
            configs.append(("llama.cpp", t, paths[t]))
    configs += [("hf", m, paths["hf"]) for m in modes if with_hf and m in HF_DTYPE]
    return configs


def run_peers(ns: argparse.Namespace) -> int:
    """Run the bench; print a table and write JSON (and a PNG)."""
    from minivllm.bench.peers_report import plot, report

    threads = ns.threads or cpu_count()
    if ns.worker:
        spec = json.loads(ns.worker)
        print(json.dumps(WORKERS[spec["engine"]](spec)))
        return 0
    if ns.burst_worker:
        return _bursts(json.loads(ns.burst_worker))
    modes = ns.modes.split(",")
    unknown = [m for m in modes if not valid_mode(m)]
    if unknown:
        raise SystemExit(f"bench peers: unknown mode(s) {', '.join(unknown)}; choose among {', '.join(PEER_TYPE)}")
    skip = "--no-llama-cpp" if ns.no_llama_cpp else llamacpp.available()
    if skip:
        print(skip)
    batches = [int(b) for b in ns.batches.split(",")]
    root = ns.work_dir or os.path.join(os.path.expanduser("~/.cache/minivllm"), "bench-peers")
    common = {"batches": batches, "prompt_len": ns.prompt_len, "prefill_len": ns.prefill_len, "steps": ns.steps,
              "batch_steps": ns.batch_steps, "threads": threads}
    results: dict[str, Any] = {**common, "rounds": ns.rounds, "modes": modes, "presets": {}}
    for preset in ns.presets.split(","):
        t0 = time.time()
        paths = _prepare(preset, root, modes, skip is None)
        print(f"{preset}: checkpoint and GGUF files ready in {time.time() - t0:.0f} s", flush=True)
        results.setdefault("params", {})[preset] = _params(paths["hf"])
        configs = configurations(modes, paths, not ns.no_hf)
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(ns.rounds):
            probe = run_worker("peers", {"engine": "probe", "threads": threads, "mib": ns.probe_mib}, "probe")
            if probe:
                runs.setdefault("probe", []).append(probe)
                print(f"  round {r} probe: {probe['median'] / 1e9:.1f} GB/s", flush=True)
            for engine, mode, path in (configs if r % 2 == 0 else configs[::-1]):
                out = run_worker("peers", {**common, "engine": engine, "mode": mode, "model": path}, f"{engine} {mode}")
                if out is not None:
                    runs.setdefault(f"{engine}|{mode}", []).append(out)
                    print(f"  round {r} {engine} {mode}: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in out.items() if k != "bytes"), flush=True)
        results["presets"][preset] = _medians(runs)
        if ns.pairs and skip is None:
            probe = {"engine": "probe", "threads": threads, "mib": ns.probe_mib}
            results.setdefault("paired", {})[preset] = _paired(common, modes, paths, ns.pairs, probe)
        shutil.rmtree(root, ignore_errors=True)
        if ns.out:  # after each preset: a run of an hour keeps what it measured
            save(results, ns.out, None)
    results["command"] = ["peers", *sys.argv[sys.argv.index("peers") + 1:]] if "peers" in sys.argv else ["peers"]
    results["measured_at"] = time.strftime("%Y-%m-%d")
    print(report(results))
    save(results, ns.out, plot)
    return 0


def _paired(common: dict[str, Any], modes: list[str], paths: dict[str, str], pairs: int, probe: dict[str, Any]
            ) -> dict[str, Any]:
    """Each mode against llama.cpp on its file in paired bursts at one sequence, the probe read around each pair
    (bench/paired.py)."""
    from minivllm.bench.paired import paired_bursts

    out: dict[str, Any] = {}
    for mode in modes:
        t = peer_type(mode)
        if t not in paths:
            continue
        model = paths[t] if mode.startswith("gguf:") else paths["hf"]
        ours = {**common, "engine": "ours", "mode": mode, "model": model}
        try:
            out[mode] = paired_bursts(ours, {**common, "engine": "llama.cpp", "mode": t, "model": paths[t]}, pairs,
                                      probe)
        except RuntimeError as e:
            print(f"  paired {mode} failed: {e}", flush=True)
            continue
        r = out[mode]
        share = f"; of the probe around each pair: ours {r['ours_of_probe']['median']:.0%}, llama.cpp " \
            f"{r['peer_of_probe']['median']:.0%}" if "ours_of_probe" in r else ""
        print(f"  paired {mode} vs llama.cpp {t}: median ratio {r['ratio']:.3f} (quartiles {r['q1']:.3f}-"
              f"{r['q3']:.3f}, {pairs} pairs){share}", flush=True)
    return out


def _params(path: str) -> int:
    """The checkpoint's matmul parameters (every layer's projections and the LM head)."""
    import torch

    from minivllm.bench.roofline import ModelCost
    from minivllm.config import ModelConfig

    cost = ModelCost.from_config(ModelConfig.from_pretrained(path), torch.float32)
    return cost.body_params + cost.head_params


def _medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration: each measured point's median over rounds, with the rounds kept."""
    out: dict[str, Any] = {}
    for key, outs in runs.items():
        points = {k for o in outs for k in o}
        out[key] = {k: {"median": statistics.median(o[k] for o in outs if k in o),
                        "runs": [o[k] for o in outs if k in o]} for k in sorted(points)}
    return out
