"""`minivllm bench throughput` runs end to end (tiny model, few tokens) and reports consistent figures."""

from __future__ import annotations

import json
import math
import os
import statistics

import pytest
import torch

from minivllm.cli import main

ON_CUDA = torch.cuda.is_available()  # the rooflines are the CPU's: a GPU engine may pass them


def test_bench_throughput_smoke(model_factory, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", model_factory("tiny-llama"), "--num-requests", "4",
               "--input-len-min", "20", "--input-len-max", "60", "--output-len", "6", "--batch1-output-len", "4",
               "--kv-cache-memory", "8MiB", "--ablation-requests", "6", "--concurrency-levels", "1,4",
               "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert r["output_tokens"] == 4 * 6
    # Same greedy tokens as HF and as the portable paths: the comparison is apples to apples.
    assert r["hf"]["identical_outputs"] == 4 and r["portable"]["identical_outputs"] == 4
    ours, hf = r["ours"], r["hf"]
    # The reported figures are the raw ones' ratios, and nothing beats the CPU roofline.
    assert ours["roofline_fraction"] == pytest.approx(ours["roofline_s"] / ours["elapsed_s"])
    assert ON_CUDA or 0 < ours["roofline_fraction"] <= 1
    assert r["speedup_vs_hf"] == pytest.approx(hf["elapsed_s"] / ours["elapsed_s"])
    assert ours["output_tok_s"] == pytest.approx(r["output_tokens"] / ours["elapsed_s"])
    assert set(r["step_split"]) == {"schedule", "prepare", "forward", "sample", "update"}
    assert r["decode_profile"]["batch"] == 4
    sampled = r["sampled"]
    assert sampled["ratio_to_greedy"] == pytest.approx(sampled["output_tok_s"] / ours["output_tok_s"])
    p = r["decode_profile"]
    assert 0 < p["non_model_share"] < 1 and p["phases_ms"]["forward"] > 0
    assert [x["concurrency"] for x in r["concurrency_sweep"]] == [1, 4]
    for x in r["concurrency_sweep"]:
        assert x["output_tok_s"] > 0 and (ON_CUDA or x["output_tok_s"] <= x["roofline_tok_s"])
    ab = r["ablations"]
    assert set(ab) == {"continuous-8", "static-batching", "contiguous-cache", "no-chunked-prefill", "no-prefix-caching",
                       "no-kv-cache", "full engine (mixed)", "full engine (shared-prefix)", "full engine (small)"}
    for name, x in ab.items():
        if not name.startswith("full"):
            # Every mode computes the same greedy tokens as the full engine, only at another cost.
            assert x["identical_outputs"] == 6
            full = ab[f"full engine ({x['workload']})"]
            assert x["ratio_to_full"] == pytest.approx(x["output_tok_s"] / full["output_tok_s"])
    assert ab["static-batching"]["ratio_to_control"] == pytest.approx(
        ab["static-batching"]["output_tok_s"] / ab["continuous-8"]["output_tok_s"])
    # A contiguous cache reserves max_model_len per sequence: far more of its memory holds nothing.
    assert ab["contiguous-cache"]["kv_waste"] > ab["full engine (mixed)"]["kv_waste"] + 0.1
    assert 0 <= ab["full engine (shared-prefix)"]["kv_waste"] < ab["no-prefix-caching"]["kv_waste"] + 0.05
    assert ab["contiguous-cache"]["peak_kv_slots"] <= ab["full engine (mixed)"]["pool_slots"]


def test_bench_step_smoke(model_factory, tmp_path):
    """`bench step`: mixed-sampling decode steps; the shares are the raw figures' ratios, every phase and
    every output-side part was really timed."""
    out = tmp_path / "step.json"
    rc = main(["bench", "step", "--model", model_factory("tiny-llama"), "--batches", "8,16", "--steps", "3",
               "--input-len-min", "4", "--input-len-max", "12", "--kv-cache-memory", "8MiB", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [m["batch"] for m in r["batches"]] == [8, 16]
    for m in r["batches"]:
        assert m["non_model_share"] == pytest.approx(m["non_model_ms"] / m["step_ms"])
        assert m["non_model_ms"] == pytest.approx(m["step_ms"] - m["forward_ms"])
        assert all(v > 0 for v in m["phases_ms"].values()), m["phases_ms"]
        # Rows 5 and 6 of each eight ask for logprobs, every row is detokenized and streamed.
        assert all(v > 0 for v in m["output_side_ms"].values()), m["output_side_ms"]
        assert sum(m["output_side_ms"].values()) <= m["phases_ms"]["update"] * 1.05


def test_bench_latency_smoke(model_factory, tmp_path):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", model_factory("tiny-llama"), "--prompt-lens", "64,16",
               "--output-len", "5", "--repeats", "2", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [x["prompt_len"] for x in r["rows"]] == [16, 64]
    for x in r["rows"]:
        # Measured above its floors (the floors are ceilings' consequences: nothing beats them on the CPU).
        assert ON_CUDA or (x["ttft_ms"] >= x["ttft_floor_ms"] > 0 and x["tpot_ms"] >= x["tpot_floor_ms"] > 0)
    assert (tmp_path / "latency.png").stat().st_size > 0


def test_bench_embeddings_smoke(model_factory, tmp_path):
    out = tmp_path / "embeddings.json"
    rc = main(["bench", "embeddings", "--model", model_factory("tiny-qwen3"), "--single", "2", "--rounds", "1",
               "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [x["batch"] for x in r["rows"]] == [1, 16, 64]
    for x in r["rows"]:  # both sides embed the same ids the same way
        assert x["ours_seq_per_s"] > 0 and x["hf_seq_per_s"] > 0 and x["max_abs_diff"] < 1e-4
    assert (tmp_path / "embeddings.png").stat().st_size > 0


def test_bench_serve_smoke_over_grpc_and_http(model_factory, tmp_path):
    """The real server started by the bench, two endpoints in ABBA order, the offline engine around them."""
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--model", model_factory("tiny-llama"), "--transport", "grpc,http",
               "--concurrency", "3", "--num-requests", "6", "--input-len-min", "8", "--input-len-max", "16",
               "--output-len", "4", "--output-len-max", "6", "--server-threads", "1", "--threads", "1",
               "--kv-cache-memory", "64MiB", "--roofline", "--probe-mib", "64", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["order"] == ["grpc", "http", "http", "grpc"]
    # Where the offline engine's time goes: its steps split by kind against their rooflines, and a decode step
    # at the served batch (3 clients: at most 3 running) split into the decode stack, GEMMs, attention and the rest.
    prof = r["offline_profile"]
    decode, prefill = prof["steps"]["decode"], prof["steps"]["with prefill"]
    assert decode["steps"] > 0 and prefill["steps"] > 0 and prefill["tokens_per_step"] > decode["tokens_per_step"]
    assert decode["tokens_per_step"] <= 3 and decode["roofline_s"] > 0 and prefill["roofline_s"] > 0
    d = prof["decode_step"]
    assert d["batch"] == 3 and d["step_ms"] > 0
    # (a step the native decode stack runs is one call: its GEMMs and attention are inside stack_ms)
    assert d["gemm_ms"] + d["attention_ms"] + d["stack_ms"] + d["other_ms"] == pytest.approx(d["step_ms"])
    assert d["stack_ms"] >= 0 and (d["stack_ms"] == 0 or d["attention_ms"] == 0)
    assert d["other_ms"] > 0  # (profiled and plain steps alternate; a tiny model's step is mostly the rest)
    # Item 5's verdicts follow the figures: a target of 0 is always met, one of 100x never.
    from minivllm.bench.serve_report import report, served_verdict

    assert all("**met" in line for line in served_verdict(r, 0.0, 0.0, "http")[:2])
    assert all("**not met" in line for line in served_verdict(r, 100.0, 100.0, "http")[:2])
    for t in ("grpc", "http"):
        s = r["server"][t]
        assert s["successes"] == 12 and s["failures"] == 0  # 6 requests x 2 rounds
        assert 4 * 12 <= s["output_tokens"] <= 6 * 12 and s["ttft_ms"]["p50"] > 0
        offline = statistics.mean(r["offline_tok_per_s"])
        assert r["server_vs_offline"][t] == pytest.approx(s["output_tok_per_s"] / offline)
    # The offline engine before the first served run and after each one, then once more with the profile: each
    # served run is also taken against the two offline runs around it.
    off = r["offline_tok_per_s"]
    assert len(off) == 6
    for t in ("grpc", "http"):
        runs = r["runs"][t]
        ratios = sorted(x["output_tok_per_s"] / statistics.mean(x["offline_around"]) for x in runs)
        assert all(x["offline_around"][0] in off and x["offline_around"][1] in off for x in runs)
        assert r["server_vs_offline_paired"][t] == {"median": pytest.approx(statistics.median(ratios)),
                                                   "ratios": pytest.approx(ratios)}
    assert [x["offline_around"] for x in r["runs"]["grpc"]] == [off[0:2], off[3:5]]  # order grpc http http grpc
    assert "server / offline, paired" in report(r)
    assert "paired (each served run over the mean" in served_verdict(r, 0.0, 0.0, "http")[1]
    assert r["server"]["grpc"]["output_tokens"] == r["server"]["http"]["output_tokens"]  # the same requests
    assert (tmp_path / "serve.png").stat().st_size > 0


@pytest.fixture(scope="module")
def bench_all_quick(model_factory, tmp_path_factory):
    """`bench all --quick` once (~3 min here): (its markdown, its results directory), for the tests below, which
    read the runs they check from it rather than running the same benches again."""
    d = tmp_path_factory.mktemp("bench-all")
    md, results = d / "BENCHMARKS.md", d / "results"
    rc = main(["bench", "all", "--quick", "--model", model_factory("tiny-llama"), "--out-dir", str(results),
               "--markdown", str(md)])
    assert rc == 0
    return md.read_text(), results


def test_bench_serve_variants_static_batching_served_the_same_way(bench_all_quick):
    """Two real servers, continuous and static batching, on the same requests in ABBA order, with rooflines (the
    seed's workload in `bench all --quick`: 4 clients, 8 requests, 5 tokens, static batches of 2)."""
    r = json.loads((bench_all_quick[1] / "seed.json").read_text())
    assert r["order"] == ["continuous/http", "static/http", "static/http", "continuous/http"]
    for k in ("continuous/http", "static/http"):
        assert r["server"][k]["successes"] == 16 and r["server"][k]["failures"] == 0
        assert r["server"][k]["output_tokens"] == 16 * 5
    rf = r["roofline"]["columns"]
    assert rf["continuous/http"]["batch"] == 4 and rf["static/http"]["batch"] == 2
    # Ceilings measured before and after the runs; the roofline takes the better of each.
    first, second = r["roofline"]["measured"]
    for k in ("peak_flops", "bandwidth"):
        assert r["roofline"]["ceilings"][k] == max(first[k], second[k]) > 0
    assert rf["continuous/http"]["output_tok_s"] >= rf["static/http"]["output_tok_s"] > 0


def test_bench_all_quick_regenerates_the_markdown(bench_all_quick, tmp_path):
    """Every bench runs (tiny sizes) and the markdown gets each section, rendered from the JSON alone."""
    text, results = bench_all_quick
    md = tmp_path / "BENCHMARKS.md"
    for heading in ("The seed's serving workload", "Offline throughput", "Step-time split at", "Throughput vs "
                    "concurrency", "Ablations", "Single-request latency", "Transports",
                    "default model's quality", "Engine overhead: a decode step with mixed sampling",
                    "Beam search: inside the step vs as a driver", "Speculative decoding (`bench speculative`)",
                    "Scale-out: Ray Serve replicas vs one server", "added by the router",
                    "KV cache storage at one budget", "Preemption: swap vs recompute", "SLO-aware scheduling",
                    "Soak: a real server under constant load", "Fairness between clients"):
        assert heading in text, heading
    beam = json.loads((results / "beam.json").read_text())
    assert beam["same_beams"] == 2  # the driver and the engine's own beam search agree
    assert beam["driver_over_in_engine"] == pytest.approx(beam["mean_s"]["driver"] / beam["mean_s"]["in-engine"])
    assert "**Machine**" in text and "peak GEMM" in text and "xychart-beta" in text
    assert "zero errors: **met**" in text and "p95 latency below the static-batching p50" in text
    for name in ("seed", "throughput", "latency", "transports", "perplexity", "quantization"):
        assert (results / f"{name}.json").is_file() and (results / f"{name}.png").stat().st_size > 0
    assert main(["bench", "all", "--render-only", "--out-dir", str(results), "--markdown", str(md)]) == 0
    assert md.read_text() == text  # the same, from the files alone


def test_bench_quantization_smoke(bench_all_quick):
    """Every mode runs on one model, the figures are consistent with each other and the targets are judged (the
    run of `bench all --quick`: tiny-llama as its own quality model, 4 tokens, batch 2, 600 perplexity tokens)."""
    out = bench_all_quick[1] / "quantization.json"
    assert out.with_suffix(".png").stat().st_size > 0
    r = json.loads(out.read_text())
    size = {row["mode"]: row["weight_bytes"] for row in r["speed"]}
    assert size["int4"] == size["w4a8"] < size["int8"] == size["w8a8"] < size["bf16"] < size["fp32"]
    assert size["fp32"] == pytest.approx(2 * size["bf16"], rel=0.01)
    bw = r["bandwidth"]
    assert 0 < bw["min"] <= bw["median"] <= bw["max"] and bw["passes"] == 9 + 3  # before, and in the one round
    for row in r["speed"]:
        assert row["b1_tok_s"] > 0 and row["batches"]["2"]["tok_s"] > 0
        assert row["b1_roofline_tok_s"] == pytest.approx(bw["median"] / row["weight_bytes"])
    q = r["quality"]["rows"]
    assert q["fp32"]["kl"] == 0 and q["fp32"]["top1"] == 1
    assert 0 < q["int8"]["kl"] < q["int4"]["kl"] and q["int4"]["top1"] < 1
    assert {t["target"].split()[0] for t in r["targets"]} == {"fp32", "int8", "int4", "w8a8", "w4a8"}


def test_bandwidth_probe_streams_beyond_the_last_level_cache():
    """The roofline's bandwidth: every float of a buffer far larger than the LLC is read (the native probe
    returns their sum), passes report a spread around the median."""
    from minivllm.bench.roofline import last_level_cache_bytes, measure_bandwidth, probe_mib
    from minivllm.model import cpu_kernels

    llc = last_level_cache_bytes()
    assert llc > 0 or not os.path.isdir("/sys/devices/system/cpu/cpu0/cache")
    assert probe_mib() * 2**20 >= max(1 << 30, 8 * llc)  # the default buffer dwarfs the cache
    if cpu_kernels.available():
        buf = torch.ones(3 * 2**20 + 77)
        for sequential in (True, False):  # both of the probe's patterns read every float once, at 1-3 threads
            for threads in (1, 2, 3):
                assert cpu_kernels.stream_read(buf, threads, sequential) == buf.numel(), (sequential, threads)
    median, lo, hi = measure_bandwidth(mib=64, passes=3)
    assert 0 < lo <= median <= hi


def test_bench_peers_smoke_and_its_verdicts(tmp_path):
    """`bench peers` measures every engine in its own process (HF here; llama.cpp is an optional extra) and the
    report marks each target met, not met or not measured, and checks the probe against the peers' decode."""
    from minivllm.bench.peers import peer_type, valid_mode
    from minivllm.bench.peers_report import report
    from minivllm.bench.quant_quality import mode_engine_kwargs

    out = tmp_path / "peers.json"
    rc = main(["bench", "peers", "--presets", "tiny-llama", "--modes", "fp32,w4a8", "--batches", "1,4",
               "--steps", "2", "--batch-steps", "1", "--prefill-len", "16", "--rounds", "1", "--no-llama-cpp",
               "--probe-mib", "64", "--work-dir", str(tmp_path / "w"), "--out", str(out)])
    assert rc == 0 and (tmp_path / "peers.png").stat().st_size > 0
    r = json.loads(out.read_text())
    runs = r["presets"]["tiny-llama"]
    assert set(runs) == {"probe", "ours|fp32", "ours|w4a8", "hf|fp32"}
    for key in ("ours|fp32", "ours|w4a8", "hf|fp32"):
        assert all(runs[key][p]["median"] > 0 for p in ("1", "4", "prefill", "bytes")), key
    assert runs["ours|w4a8"]["bytes"]["median"] < runs["ours|fp32"]["bytes"]["median"] / 4
    assert "| w4a8 | b=1 tok/s |" in report(r) and ">= 1.4x: not measured" in report(r)
    # Verdicts on known figures: a 1B-class model, ours at 1.3x llama.cpp's Q4_0 at b=1, 0.9x its prefill speed.
    fake = {"batches": [1], "prefill_len": 512, "threads": 2, "modes": ["w4a8"], "params": {"big": 1.2e9},
            "presets": {"big": {
                "probe": {"median": {"median": 30e9}, "min": {"runs": [29e9]}, "max": {"runs": [31e9]},
                          "mib": {"median": 1024}},
                "ours|w4a8": {"1": {"median": 39.0}, "prefill": {"median": 4.0}, "bytes": {"median": 7.7e8}},
                "llama.cpp|Q4_0": {"1": {"median": 30.0}, "prefill": {"median": 3.6}, "bytes": {"median": 1.1e9}}}}}
    text = report(fake)
    assert "| 1.30x |" in text and ">= 1.4x: NOT MET" in text and "0.90x" in text and ">= 1.1x: NOT MET" in text
    assert "| ours | w4a8 | 770 MB | 39.0 | 30.0 GB/s | 100% | >= 85%: met |" in text
    assert "below a peer's decode: the probe measures the wrong thing" in text  # llama.cpp streams 33 GB/s
    assert "below one of ours" not in text  # (30.03 GB/s: above the median, within the probe's passes)
    # Ours above the probe's fastest pass: the fraction is no measure, and the check says so.
    fake["presets"]["big"]["ours|w4a8"]["1"]["median"] = 45.0  # 34.6 GB/s against a 30 GB/s probe (31 its fastest pass)
    text = report(fake)
    assert "| 116% | >= 85%: not measured (above the probe) |" in text
    assert "its fastest pass is below one of ours (34.6 GB/s)" in text
    # int4 under a bfloat16 model (w4a16, asked for by name) meets int4's target against Q4_0 on its own row.
    assert valid_mode("w4a16") and peer_type("w4a16") == "Q4_0" and not valid_mode("w4a4")
    assert mode_engine_kwargs("w4a16") == {"dtype": "bfloat16", "quantization": "int4", "quantization_group_size": 32}
    big = fake["presets"]["big"]
    big["ours|w4a16"], big["ours|int4"] = {"1": {"median": 33.0}}, {"1": {"median": 25.0}}
    fake["modes"] = ["w4a16", "int4"]
    text = report(fake)
    assert "| w4a16 | b=1 tok/s | 33.0 | Q4_0 30.0 | 1.10x | - | - | >= 1.0x: met |" in text
    assert "| int4 | b=1 tok/s | 25.0 | Q4_0 30.0 | 0.83x | - | - | >= 1.0x: NOT MET |" in text


def test_bench_peers_paired_bursts_beside_llama_cpp(tmp_path):
    """--pairs N: ours and llama.cpp loaded at once in two worker processes decode one sequence in alternating
    bursts (ABBA); N rates each, the median of the pairs' ratios between its quartiles, a table with its verdict.
    A worker that cannot load ends the pairing with a clear error naming it and what it printed."""
    from minivllm.bench import llamacpp
    from minivllm.bench.paired import BurstWorker
    from minivllm.bench.peers_report import report

    if why := llamacpp.available():
        pytest.skip(why)
    out = tmp_path / "peers.json"
    rc = main(["bench", "peers", "--presets", "tiny-llama", "--modes", "gguf:Q8_0", "--batches", "1", "--steps", "4",
               "--prefill-len", "0", "--rounds", "0", "--no-hf", "--pairs", "3", "--probe-mib", "64",
               "--work-dir", str(tmp_path / "w"), "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    p = r["paired"]["tiny-llama"]["gguf:Q8_0"]
    assert p["pairs"] == 3 and len(p["ours"]) == len(p["peer"]) == 3 and min(p["ours"] + p["peer"]) > 0
    ratios = sorted(a / b for a, b in zip(p["ours"], p["peer"], strict=True))
    assert p["ratio"] == pytest.approx(ratios[1]) and p["q1"] <= p["ratio"] <= p["q3"]
    assert f"| gguf:Q8_0 | Q8_0 | 3 | {statistics.median(p['ours']):.1f} |" in report(r)
    # The probe read around each pair (a third process): each burst's stream over the mean of its two readings.
    assert len(p["probe"]) == 3 and min(p["probe"]) > 0 and p["ours_bytes"] > 0 and p["peer_bytes"] > 0
    shares = sorted(a * p["ours_bytes"] / b for a, b in zip(p["ours"], p["probe"], strict=True))
    assert p["ours_of_probe"]["median"] == pytest.approx(shares[1])
    assert f"| gguf:Q8_0 | {statistics.median(p['probe']) / 1e9:.1f} GB/s (" in report(r)
    # Verdicts on known figures: a 1B-class w4a8 at 80% of the probe around its pairs, then at 90%; a peer above it.
    fake = {"batches": [1], "prefill_len": 0, "steps": 32, "modes": ["w4a8"], "params": {"big": 1.2e9},
            "presets": {"big": {}}, "paired": {"big": {"w4a8": {
                "ratio": 1.3, "q1": 1.2, "q3": 1.4, "pairs": 2, "ours": [40.0, 40.0], "peer": [30.0, 30.0],
                "probe": [40e9, 40e9], "ours_bytes": 8e8, "peer_bytes": 7e8,
                "ours_of_probe": {"median": 0.8, "q1": 0.8, "q3": 0.8},
                "peer_of_probe": {"median": 0.525, "q1": 0.5, "q3": 0.55}}}}}
    assert "| w4a8 | 40.0 GB/s (40.0-40.0) | 32.0 GB/s | **80%** (80%-80%) | 52% (50%-55%) | >= 85%: NOT MET |" \
        in report(fake)
    fake["paired"]["big"]["w4a8"]["ours_of_probe"]["median"] = 0.9
    fake["paired"]["big"]["w4a8"]["peer_of_probe"]["median"] = 1.05
    assert ">= 85%: met (the probe reads below llama.cpp's decode: no measure) |" in report(fake)
    with pytest.raises(RuntimeError, match="(?s)llama.cpp worker ended: .*could not load .*missing.gguf"):
        BurstWorker({"engine": "llama.cpp", "model": str(tmp_path / "missing.gguf"), "threads": 1, "prompt_len": 4,
                     "steps": 2}, "llama.cpp")


def test_bench_replicas_verdict_with_every_variant_or_the_latency_pair_alone():
    """`bench all --quick` runs the router's latency pair only (each Ray deployment costs ~30 s): the verdict then
    judges the pair; with every variant it judges the replicas too. Unknown variant names are refused."""
    import argparse

    from minivllm.bench import replicas

    def col(tok: float) -> dict:
        return {"output_tok_per_s": tok, "runs_tok_per_s": [tok], "e2e_ms": {"p50": 1000.0, "p95": 1100.0,
                                                                              "p99": 1200.0}}

    def result(names: list[str]) -> dict:
        tok = {"server": 100.0, "1 replica x 1 thread": 60.0, "2 replicas x 1 thread": 120.0,
               "1 replica x 2 threads": 95.0}
        lat = {"server": 10.0, "1 replica x 2 threads": 14.0}
        return {"variants": {n: replicas.VARIANTS[n] for n in names},
                "latency_pair": list(replicas.LATENCY_PAIR),
                "throughput": {"server": {f"{n}/http": col(tok[n]) for n in names}},
                "latency": {"server": {f"{n}/http": {"e2e_ms": {"p50": lat[n], "p95": lat[n], "p99": lat[n] + 1}}
                                       for n in replicas.LATENCY_PAIR}}}

    full = replicas.verdict(result(list(replicas.VARIANTS)))
    assert "2 replicas x 1 thread: **2.00x** one replica of 1 thread" in full and "**1.20x** the plain server" in full
    pair = replicas.verdict(result(list(replicas.LATENCY_PAIR)))
    assert "2 replicas" not in pair and "**0.95x**" in pair and "router adds +4.0 ms at p50" in pair
    ns = argparse.Namespace(variants="server,3 replicas")
    with pytest.raises(ValueError, match="--variants"):
        replicas.run_replicas(ns)


def test_bench_families_ratios_pair_the_runs_of_one_round():
    """`bench families` compares runs of one round (adjacent in time) and takes the median of those ratios: the
    machine's drift between rounds cancels, where the ratio of the two medians mixes rounds; a round one side lost
    (a failed worker) pairs nothing."""
    from minivllm.bench.families import paired_ratio, report

    ours = {"runs": [60.0, 120.0, 90.0, 200.0], "rounds": [0, 1, 2, 3], "median": 105.0}
    twin = {"runs": [50.0, 100.0, 300.0], "rounds": [0, 1, 3], "median": 100.0}
    assert paired_ratio(ours, twin) == pytest.approx(1.2)  # rounds 0, 1, 3: 1.2, 1.2, 0.67; not 105 / 100
    assert paired_ratio(ours, None) is None and paired_ratio(ours, {"runs": [], "rounds": []}) is None
    old = {"runs": [50.0, 100.0, 75.0, 100.0]}  # written before rounds were recorded: by position
    assert paired_ratio(ours, old) == pytest.approx(1.2)
    table = report({"families": {"qwen3-moe-1b": {"family|w4a8|1": ours, "llama|w4a8|1": twin}}})
    assert "| qwen3-moe-1b | w4a8 | 1 | 105.00 | 100.00 | 1.20x | - | - |" in table


@pytest.mark.skipif(not (os.uname().sysname == "Linux" and os.uname().machine == "x86_64"), reason="x86-64 Linux")
def test_llama_cpps_amx_request_is_refused_and_nothing_else():
    """On AMX CPUs llama.cpp runs without AMX tiles (they raised SIGILL on our VMs) but with its repacked layouts:
    bench/llamacpp.py's seccomp filter fails arch_prctl(ARCH_REQ_XCOMP_PERM) with EPERM and lets every other call
    through (another arch_prctl, other syscalls). In a child process: the filter lasts for a process's life."""
    import subprocess
    import sys

    code = """
import ctypes, os
from minivllm.bench import llamacpp
libc = ctypes.CDLL(None, use_errno=True)
before = libc.syscall(158, 0x1022, ctypes.byref(ctypes.c_ulong()))  # ARCH_GET_XCOMP_PERM
assert llamacpp._without_amx()
denied = libc.syscall(158, 0x1023, 18)  # ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
errno = ctypes.get_errno()
after = libc.syscall(158, 0x1022, ctypes.byref(ctypes.c_ulong()))
print(before, denied, errno, after, len(os.listdir(".")) > 0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, denied_rc, denied_errno, after, listed = out.stdout.split()
    assert (int(denied_rc), int(denied_errno)) == (-1, 1)  # EPERM
    assert after == before and listed == "True"


def test_bench_speculative_compares_each_engine_with_itself_detached(tmp_path):
    """`bench speculative` on the embedded model (n-gram and suffix, one k, 1 and 2 streams, a 4-sequence batch):
    every ratio is the median over pairs of runs side by side of the engine's tok/s over its own with the speculator
    detached (engines' plain decodes differ by their memory placement), --pairs pairs a round at more than one stream,
    one at one; every greedy output equals the one without speculation."""
    from minivllm.bench.speculative_report import report, verdict

    out = tmp_path / "spec.json"
    rc = main(["bench", "speculative", "--draft", "none", "--ks", "2", "--streams", "1,2", "--output-len", "8",
               "--prompt-len", "16", "--rounds", "2", "--pairs", "2", "--large-batch", "4", "--large-pairs", "3",
               "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and all(r["lossless"].values()) and set(r["ratio"]) == {"ngram k=2", "suffix k=2"}
    def pairs(col: str) -> int:  # rounds x pairs at 2 streams, rounds at 1; --large-pairs at the large batch
        return 3 if col.endswith("sequences") else 4 if col.endswith("2 stream(s)") else 2

    for name, cols in r["ratio"].items():
        assert set(cols) == set(r["mean_tok_s"]["off"]), name  # (every column: streams and the large batch)
        for col, ratio in cols.items():
            on, off = r["tok_s"][name][col], r["detached_tok_s"][name][col]
            assert len(on) == len(off) == pairs(col)  # measured beside each other, every round
            each = r["pair_ratios"][name][col]
            assert each == pytest.approx([a / b for a, b in zip(on, off, strict=True)])
            assert ratio == pytest.approx(statistics.median(each))
    # The plain engine twice per pair, side by side: the A/A ratio, the floor the verdict judges against (the large
    # batch's too).
    cols = list(r["mean_tok_s"]["off"])
    assert set(r["aa_ratio"]) == set(cols) and "code, 4 sequences" in cols
    for col in cols:
        assert len(r["aa_tok_s"][col]) == pairs(col)
        each = [a / b for a, b in zip(r["tok_s"]["off"][col], r["aa_tok_s"][col], strict=True)]
        assert r["aa_ratio"][col] == pytest.approx(statistics.median(each))
    # Each cell's tokens proposed in its attached runs, beside its ratio (the stats' total over the cells)
    assert set(r["proposed_tokens"]) == {"ngram k=2", "suffix k=2"}
    for name, cells in r["proposed_tokens"].items():
        assert set(cells) == set(cols) and sum(cells.values()) <= r["acceptance"][name]["draft_tokens"]
    text = report(r)
    assert "| tokens proposed (attached runs) | ngram " in text
    each = r["pair_ratios"]["ngram k=2"]["code, 2 stream(s)"]
    lo, hi = min(each), max(each)
    assert f" [{lo:.2f}-{hi:.2f}])" in text and "median of its cell's pairs" in text
    floor = {s: min(min(a, 1 / a) for c, a in r["aa_ratio"].items() if c.endswith(f", {s} stream(s)")) for s in (1, 2)}
    assert "never below the A/A spread (the lowest of the plain engine against itself, per stream count: " \
        f"1 {floor[1]:.2f}x, 2 {floor[2]:.2f}x)" in verdict(r)
    # Every pair at more than one stream pooled per proposer (three tasks' cells): their geometric mean beside the A/A
    # pairs', a loss only where it lies two standard errors of the difference below.
    # At the large batch each engine's pairs pooled the same way, the plain engine's A/A beside them.
    large = verdict(r).split("at the large batch")[1]
    for name in ("ngram k=2", "suffix k=2", "off"):
        logs = [math.log(x) for x in r["pair_ratios"][name]["code, 4 sequences"]]
        mean = math.exp(statistics.mean(logs))
        assert f"{name} {mean:.3f}x ± {mean * statistics.stdev(logs) / math.sqrt(3):.3f} (3 pairs)" in large
    pooled = verdict(r).split("pooled (geometric mean, ± one")[1]
    for name, label in (("ngram k=2", "ngram"), ("off", "off")):
        logs = [math.log(x) for c, v in r["pair_ratios"][name].items() if c.endswith(" 2 stream(s)") for x in v]
        assert len(logs) == 3 * 4
        mean = math.exp(statistics.mean(logs))
        assert f"{label} {mean:.3f}x ± {mean * statistics.stdev(logs) / math.sqrt(12):.3f} (12 pairs)" in pooled
