"""`minivllm bench replicas`: Ray Serve replicas against one server, on the seed's workload.

One Ray cluster (`ray start --head`, stopped at the end) holds every replicated variant, each its own
Serve application behind its own front (`minivllm serve --replicas N --ray-address ...`); a plain
server runs beside them. `bench serve` drives them all on the same requests in ABBA order:

- throughput: 1 replica with 1 engine thread, 2 replicas with 1 thread each, 1 replica with 2 threads,
  and one server with 2 threads (no Ray), on the seed's workload (50 clients, 30 new tokens);
- the router's added latency: one request at a time (a short prompt, a few tokens, whole answers)
  against the plain server and the 1-replica, 2-thread deployment (the same engine), so the
  difference per percentile is what the front → Ray → replica → front path adds.

The cluster declares more logical CPUs than the machine has, so that every variant's replicas are
placed at once (an idle replica computes nothing); the figures are per variant, run one at a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from minivllm.bench.results import save
from minivllm.utils import free_port

VARIANTS = {"server": "--num-threads 2",
            "1 replica x 1 thread": "--replicas 1 --num-threads 1",
            "2 replicas x 1 thread": "--replicas 2 --num-threads 1",
            "1 replica x 2 threads": "--replicas 1 --num-threads 2"}
BASE = "1 replica x 1 thread"
LATENCY_PAIR = ("server", "1 replica x 2 threads")


def add_replicas_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench replicas`."""
    p.add_argument("--model", default=None, help="model directory (default: make --preset in a cache dir)")
    p.add_argument("--preset", default="gpt2", help="preset to make when --model is not given (the seed's gpt2)")
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--output-len", type=int, default=30)
    p.add_argument("--input-len-min", type=int, default=8)
    p.add_argument("--input-len-max", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="1GiB", help="per replica")
    p.add_argument("--rounds", type=int, default=2, help="runs per variant, in ABBA order")
    p.add_argument("--latency-requests", type=int, default=100, help="one at a time, per latency run")
    p.add_argument("--latency-output-len", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of: {', '.join(VARIANTS)} (the router's latency pair, "
                        f"{' and '.join(LATENCY_PAIR)}, always runs)")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG plot next to it)")


def _ray_cli() -> list[str]:
    exe = shutil.which("ray")
    return [exe] if exe else [sys.executable, "-m", "ray.scripts.scripts"]


def _serve_ns(argv: list[str]) -> argparse.Namespace:
    from minivllm.bench.serve import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def run_replicas(ns: argparse.Namespace) -> int:
    """`minivllm bench replicas`."""
    from minivllm.bench.serve import _start_server, _stop_servers, _variants, run_serve
    from minivllm.bench.throughput import resolve_model

    chosen = [n.strip() for n in ns.variants.split(",") if n.strip()]
    if any(n not in VARIANTS for n in chosen) or len(set(chosen)) != len(chosen):
        raise ValueError(f"--variants: each of {', '.join(VARIANTS)} at most once, got {ns.variants!r}")
    chosen = [n for n in VARIANTS if n in chosen or n in LATENCY_PAIR]
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("bench replicas needs Ray Serve: pip install -e '.[ray]'") from None
    path = resolve_model(ns.model, ns.preset)
    port = free_port()
    address = f"127.0.0.1:{port}"
    # A cluster on this machine's loopback for the bench only: no token (the fronts inherit this setting).
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    cpus = 2 * sum(int(VARIANTS[n].split()[-1]) for n in chosen)
    subprocess.run([*_ray_cli(), "start", "--head", "--port", str(port), "--num-cpus", str(cpus),
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    common = ["--model", path, "--transport", "http", "--no-stream", "--no-offline", "--kv-cache-memory",
              ns.kv_cache_memory, "--max-num-seqs", str(ns.max_num_seqs)]

    def variants(names: list[str]) -> list[str]:
        out = []
        for name in names:
            flags = VARIANTS[name] + (f" --ray-address {address}" if "--replicas" in VARIANTS[name] else "")
            out += ["--variant", f"{name}={flags}"]
        return out

    result: dict[str, Any] = {"model": path, "variants": {n: VARIANTS[n] for n in chosen},
                              "base": BASE if BASE in chosen else LATENCY_PAIR[0], "latency_pair": list(LATENCY_PAIR)}
    procs: list[Any] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            throughput = _serve_ns([
                *common, *variants(chosen), "--concurrency", str(ns.concurrency), "--num-requests",
                str(ns.num_requests), "--input-len-min", str(ns.input_len_min), "--input-len-max",
                str(ns.input_len_max), "--output-len", str(ns.output_len), "--rounds", str(ns.rounds),
                "--out", os.path.join(tmp, "throughput.json")])
            latency = _serve_ns([
                *common, *variants(list(LATENCY_PAIR)), "--concurrency", "1", "--num-requests",
                str(ns.latency_requests), "--input-len-min", "8", "--input-len-max", "16", "--output-len",
                str(ns.latency_output_len), "--rounds", str(ns.rounds), "--out", os.path.join(tmp, "latency.json")])
            # Every variant's server started once for both workloads (a deployment's start is ~30 s of Ray's), its
            # queue sized for the larger one.
            sizing = argparse.Namespace(**{**vars(throughput), "num_requests": max(ns.num_requests,
                                                                                   ns.latency_requests)})
            servers: dict[str, tuple[str, str | None]] = {}
            for name, flags in _variants(variants(chosen)[1::2]).items():
                port = free_port()
                _start_server(path, port, None, sizing, flags, procs)
                servers[name] = (f"http://127.0.0.1:{port}", None)
            codes = [run_serve(throughput, servers), run_serve(latency, servers)]
            import json

            for name in ("throughput", "latency"):
                with open(os.path.join(tmp, f"{name}.json")) as f:
                    result[name] = json.load(f)
    finally:
        _stop_servers(procs)
        subprocess.run([*_ray_cli(), "stop", "--force"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    print(report(result))
    save(result, ns.out, plot)
    return max(codes)


def _col(r: dict[str, Any], variant: str) -> dict[str, Any]:
    return r["server"][f"{variant}/http"]


def _cpu_per_request(s: dict[str, Any]) -> str:
    """CPU ms of the process behind the port per successful request: the whole engine for a plain server,
    the routing alone for a front of replicas (its engines run in the replicas' processes)."""
    cpu = s.get("event_loop_lag", {}).get("server_cpu_s")
    return f"{1000 * cpu / s['successes']:.2f} ms" if cpu is not None and s["successes"] else "–"


def report(r: dict[str, Any]) -> str:
    """Throughput per variant (ratio to 1 replica x 1 thread), then the router's added latency."""
    t = r["throughput"]
    base = _col(t, r["base"])["output_tok_per_s"]
    names = list(r["variants"])
    lines = [f"{t['mode']}, {t['num_requests']} requests, prompts {t['input_len'][0]}–{t['input_len'][1]} tokens, "
             f"{t['output_len'][0]} tokens out (ignore_eos), whole answers over the seed's `/generate`; "
             f"{len(t['order']) // len(names)} run(s) per column in ABBA order", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, f: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(f(_col(t, n)) for n in names) + " |")

    row("flags", lambda s: "")
    lines[-1] = "| flags | " + " | ".join(f"`{r['variants'][n]}`" for n in names) + " |"
    row("requests/s", lambda s: f"{s['req_per_s']:.2f}")
    row("output tok/s", lambda s: f"{s['output_tok_per_s']:.1f}" + (
        f" (runs {', '.join(f'{x:.0f}' for x in s['runs_tok_per_s'])})" if "runs_tok_per_s" in s else ""))
    row(f"**tok/s / {r['base']}**", lambda s: f"**{s['output_tok_per_s'] / base:.2f}**")
    row("end-to-end p50 / p99", lambda s: f"{s['e2e_ms']['p50']:.0f} / {s['e2e_ms']['p99']:.0f} ms")
    row("successes / failures", lambda s: f"{s['successes']} / {s['failures']}")
    row("server process CPU per request", _cpu_per_request)
    lat = r["latency"]
    a, b = (_col(lat, n)["e2e_ms"] for n in r["latency_pair"])
    lines += ["", f"Router's added latency: {lat['num_requests']} requests one at a time (prompts "
              f"{lat['input_len'][0]}–{lat['input_len'][1]} tokens, {lat['output_len'][0]} tokens out, whole "
              f"answers), `{r['latency_pair'][0]}` vs `{r['latency_pair'][1]}` (the same engine and threads):", "",
              "| | p50 | p95 | p99 |", "|---|---|---|---|"]
    for name, d in zip(r["latency_pair"], (a, b), strict=True):
        lines.append(f"| {name} | {d['p50']:.1f} ms | {d['p95']:.1f} ms | {d['p99']:.1f} ms |")
    lines.append(f"| **added by the router** | **{b['p50'] - a['p50']:+.1f} ms** | {b['p95'] - a['p95']:+.1f} ms | "
                 f"**{b['p99'] - a['p99']:+.1f} ms** |")
    name_a, name_b = r["latency_pair"]
    lines += ["", f"CPU of the process behind the port, per request one at a time: `{name_a}` "
              f"{_cpu_per_request(_col(lat, name_a))} (its engine included), `{name_b}`'s front "
              f"{_cpu_per_request(_col(lat, name_b))} (routing only: the engine runs in the replica)."]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: str) -> None:
    """Output tok/s per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["variants"])
    vals = [_col(r["throughput"], n)["output_tok_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(names)), vals, color="tab:blue")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("output tok/s")
    ax.set_title("Ray Serve replicas vs one server (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def verdict(r: dict[str, Any]) -> str:
    """What the run shows, in ratios from this run (the replica line where its three variants ran)."""
    t = r["throughput"]
    tok = {n: _col(t, n)["output_tok_per_s"] for n in r["variants"]}
    wide, plain = tok["1 replica x 2 threads"], tok["server"]
    lat = r["latency"]
    a, b = (_col(lat, n)["e2e_ms"] for n in r["latency_pair"])
    e2e = [_col(t, n)["e2e_ms"]["p50"] for n in r["variants"]]
    runs = [x for n in ("1 replica x 2 threads", "server") for x in _col(t, n).get("runs_tok_per_s", [])]
    spread = (max(runs) - min(runs)) / min(runs) if runs else 0.0
    drift = ": the gap is within the runs' spread" if abs(wide / plain - 1) <= spread else ""
    lines = []
    if "2 replicas x 1 thread" in tok and BASE in tok:
        two, one = tok["2 replicas x 1 thread"], tok[BASE]
        lines.append(f"- 2 replicas x 1 thread: **{two / one:.2f}x** one replica of 1 thread, **{two / wide:.2f}x** "
                     f"one replica of 2 threads on the same 2 cores, **{two / plain:.2f}x** the plain server. Two "
                     "engines of one thread each use the cores better than one engine of two: each step's serial parts "
                     "(scheduling, sampling, the Python between kernels) and the OpenMP barriers inside it do not get "
                     "faster with a second thread, while a second engine runs them side by side.")
    lines.append(f"- 1 replica x 2 threads vs the plain server (the same engine and flags): **{wide / plain:.2f}x** "
                 f"(runs {_runs(t, '1 replica x 2 threads')} vs {_runs(t, 'server')} tok/s{drift}); the "
                 f"router adds {b['p50'] - a['p50']:+.1f} ms at p50 and {b['p99'] - a['p99']:+.1f} ms at p99 per "
                 "request (front → Serve router → replica → front over Ray, two messages for a whole answer), against "
                 f"end-to-end latencies of {min(e2e) / 1000:.1f}–{max(e2e) / 1000:.1f} s (p50) under the seed's load.")
    return "\n".join(lines)


def _runs(t: dict[str, Any], variant: str) -> str:
    return "/".join(f"{x:.0f}" for x in _col(t, variant).get("runs_tok_per_s", [_col(t, variant)["output_tok_per_s"]]))
