"""`minivllm bench serve`: the load generator (bench/loadgen.py) against a server — a running one
(`--base-url`), or `minivllm serve` started here in a subprocess — over one or more endpoints on the
same requests, and the offline engine on the same requests in the same run as the baseline.

Reports per endpoint: req/s, output tok/s, TTFT / TPOT / ITL / end-to-end p50/p95/p99, failures by
cause, and the server's event-loop lag (its own timer probe, read from /metrics). Several endpoints
run in ABBA order, and the offline engine before the first run and after each one (the server idle), since the
machine's speed drifts over minutes: each served run is also taken against the mean of the offline runs just
before and after it (server_vs_offline_paired: their median), where two offline runs minutes apart differed by
15% on this project's VMs. Writes JSON (--out) and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import IO, Any

import httpx

from minivllm.bench import serve_baseline as baseline
from minivllm.bench.loadgen import ENDPOINT_NAMES, ENDPOINTS, RequestSpec, make_client, make_workload, run_load
from minivllm.bench.results import save
from minivllm.bench.roofline import add_probe_mib_arg
from minivllm.bench.serve_report import plot, report
from minivllm.config import cpu_count
from minivllm.utils import free_port


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench serve`."""
    p.add_argument("--model", default=None, help="model directory to serve (and whose tokenizer makes the prompts; "
                                                   "default: make --preset in a cache dir)")
    p.add_argument("--preset", default="smollm2-135m", help="preset to make when --model is not given")
    p.add_argument("--base-url", default=None,
                   help="a running server (e.g. http://127.0.0.1:8000); default: start `minivllm serve` here")
    p.add_argument("--grpc-target", default=None, help="the running server's gRPC address host:port (with --base-url)")
    p.add_argument("--api-key", default=None, help="the running server's API key")
    p.add_argument("--transport", "--endpoint", dest="transport", default="openai",
                   help="comma-separated, each run on the same requests: openai (/v1/completions), http (the "
                        "seed's /generate), grpc (InferenceService)")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="ask for whole answers (no TTFT / ITL then) instead of streams")
    p.add_argument("--rounds", type=int, default=None,
                   help="measured runs per endpoint, in ABBA order against drift (default: 1, or 2 for several)")
    p.add_argument("--concurrency", type=int, default=32, help="closed loop: clients, one request in flight each")
    p.add_argument("--request-rate", type=float, default=None,
                   help="open loop instead: Poisson arrivals at this many requests/s")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--input-len-min", type=int, default=32)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128, help="tokens out (the minimum with --output-len-max)")
    p.add_argument("--output-len-max", type=int, default=None, help="tokens out uniform in [output-len, this]")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (then output lengths are the model's)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--threads", type=int, default=None, help="offline engine threads (default: all cores)")
    p.add_argument("--server-threads", type=int, default=None, help="the started server's threads (default: all)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the started server's (default: --concurrency)")
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra flag for the started server (repeat), e.g. --server-arg=--batch-wait-ms=5")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="serve the same requests from another server started with these extra flags (repeat); "
                        "e.g. --variant 'static=--batching static --max-num-seqs 8 --batch-wait-ms 20'. With "
                        "variants, every (variant, endpoint) pair is a column, run in ABBA order")
    p.add_argument("--roofline", action="store_true",
                   help="measure the machine's ceilings here and report each column's roofline throughput")
    add_probe_mib_arg(p, "with --roofline: ")
    p.add_argument("--no-offline", action="store_true", help="skip the offline engine baseline")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG plot next to it)")


def _start_server(path: str, port: int, grpc_port: int | None, ns: argparse.Namespace, extra: list[str],
                  procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]]) -> None:
    """Start `minivllm serve` and wait until it is healthy. The process is added to procs before the
    wait, so that the caller's _stop_servers() stops it whatever happens."""
    # Prefix caching off: the endpoints replay the same prompts, and the second would find them cached.
    cmd = [sys.executable, "-m", "minivllm", "serve", path, "--port", str(port), "--kv-cache-memory",
           ns.kv_cache_memory, "--max-num-seqs", str(ns.max_num_seqs or max(ns.concurrency, 1)),
           "--log-level", "warning", "--max-waiting", str(ns.num_requests + 16), "--no-enable-prefix-caching",
           *ns.server_arg]
    if grpc_port is not None:
        cmd += ["--grpc-port", str(grpc_port)]
    if ns.server_threads:
        cmd += ["--num-threads", str(ns.server_threads)]
    cmd += extra  # a variant's flags come last, so they win
    log = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the server runs, and a full pipe blocks it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    procs.append((proc, log))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited: {log.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise RuntimeError("server did not become healthy in 300 s")


def _stop_servers(procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]]) -> None:
    """Terminate every started server (kill one that does not exit in 30 s) and close its log. All are
    signalled first, so that their shutdowns (a front of Ray replicas takes seconds) overlap."""
    for proc, _ in procs:
        proc.terminate()
    for proc, log in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _scrape_lag(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith("minivllm:event_loop_lag") or s.name == "process_cpu_seconds_total":
                out[s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else "")] = s.value
    return out


def _lag(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Event-loop lag over the measured window from the probe histogram: count, mean, p99 and max bucket."""
    name = "minivllm:event_loop_lag_seconds"
    if name + "_count" not in after:  # not our server
        return {}
    n = after[name + "_count"] - before[name + "_count"]
    mean = (after[name + "_sum"] - before[name + "_sum"]) / n if n else 0.0
    buckets = sorted((float(k.split("le=")[1].rstrip("}")), after[k] - before[k])
                     for k in after if k.startswith(name + "_bucket"))
    p99 = next((le for le, c in buckets if c >= 0.99 * n), float("inf"))
    worst = next((le for le, c in buckets if c >= n), float("inf"))
    out = {"probes": n, "mean_s": mean, "p99_le_s": p99, "max_le_s": worst}
    if "process_cpu_seconds_total" in after:  # the server process's CPU time over the run (a front: routing only)
        out["server_cpu_s"] = after["process_cpu_seconds_total"] - before["process_cpu_seconds_total"]
    return out


def _order(endpoints: list[str], rounds: int) -> list[str]:
    """ABBA…: each endpoint runs early and late as often as the others, so drift cancels in the means."""
    out: list[str] = []
    for r in range(rounds):
        out += endpoints if r % 2 == 0 else endpoints[::-1]
    return out


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One endpoint's runs: rates and percentiles averaged, counts summed."""
    if len(runs) == 1:
        return runs[0]
    mean = statistics.mean
    out: dict[str, Any] = {k: mean(r[k] for r in runs) for k in ("elapsed_s", "req_per_s", "output_tok_per_s")}
    out.update({k: sum(r[k] for r in runs) for k in ("requests", "successes", "failures", "output_tokens")})
    out["failure_causes"] = dict(sum((Counter(r["failure_causes"]) for r in runs), Counter()))
    out["first_failure"] = next((r["first_failure"] for r in runs if r["first_failure"]), "")
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        out[k] = {q: mean(r[k][q] for r in runs) for q in runs[0][k]}
    lags = [r["event_loop_lag"] for r in runs if r.get("event_loop_lag")]
    if lags:
        out["event_loop_lag"] = {"probes": sum(x["probes"] for x in lags), "mean_s": mean(x["mean_s"] for x in lags),
                                 "p99_le_s": max(x["p99_le_s"] for x in lags),
                                 "max_le_s": max(x["max_le_s"] for x in lags)}
        if all("server_cpu_s" in x for x in lags):
            out["event_loop_lag"]["server_cpu_s"] = sum(x["server_cpu_s"] for x in lags)
    out["runs_tok_per_s"] = [r["output_tok_per_s"] for r in runs]
    if all("client_cpu_s" in r for r in runs):
        out["client_cpu_s"] = sum(r["client_cpu_s"] for r in runs)
    return out


def _variants(specs: list[str]) -> dict[str, list[str]]:
    """--variant NAME=FLAGS → {name: flags}; no variant means one server with the base flags."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip() or name.strip() in out or "/" in name:
            raise ValueError(f"--variant: expected a new NAME=FLAGS (no '/' in NAME), got {spec!r}")
        out[name.strip()] = shlex.split(flags)
    return out or {"": []}


def run_serve(ns: argparse.Namespace, servers: dict[str, tuple[str, str | None]] | None = None) -> int:
    """`minivllm bench serve`. servers: each variant's (URL, gRPC target), started by the caller and left running
    (`bench replicas` runs two workloads on the same servers: a Ray deployment takes ~30 s to start)."""
    from minivllm.bench.throughput import resolve_model
    from minivllm.engine.tokenizer import get_tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report
    endpoints = [t.strip() for t in ns.transport.split(",") if t.strip()]
    if not endpoints or any(t not in ENDPOINTS for t in endpoints) or len(set(endpoints)) != len(endpoints):
        raise ValueError(f"--transport: expected distinct names among {', '.join(ENDPOINTS)}, got {ns.transport!r}")
    if ns.base_url and "grpc" in endpoints and not ns.grpc_target:
        raise ValueError("--transport grpc with --base-url needs --grpc-target host:port")
    variants = _variants(ns.variant)
    if ns.base_url and ns.variant:
        raise ValueError("--variant starts its own servers; it cannot be used with --base-url")
    # A column is one (variant, endpoint) pair; its key is the endpoint alone when there is one server.
    columns = {(f"{v}/{t}" if v else t): (v, t) for v in variants for t in endpoints}
    keys = list(columns)
    rounds = ns.rounds or (2 if len(keys) > 1 else 1)
    path = resolve_model(ns.model, ns.preset)
    tokenizer = get_tokenizer(path)
    out_len = (ns.output_len, ns.output_len_max or ns.output_len)
    requests = make_workload(tokenizer, ns.num_requests, (ns.input_len_min, ns.input_len_max), out_len, ns.seed)
    mode = (f"open loop, Poisson arrivals at {ns.request_rate} req/s" if ns.request_rate
            else f"closed loop, {ns.concurrency} clients")
    result: dict[str, Any] = {
        "model": path, "mode": mode, "concurrency": None if ns.request_rate else ns.concurrency,
        "request_rate": ns.request_rate, "num_requests": ns.num_requests, "stream": ns.stream,
        "input_len": [ns.input_len_min, ns.input_len_max], "output_len": list(out_len), "ignore_eos": ns.ignore_eos,
        "threads": ns.threads or cpu_count(), "server_threads": ns.server_threads or cpu_count(),
        "endpoints": keys, "labels": {k: _label(*columns[k]) for k in keys},
        "variants": {v: " ".join(f) for v, f in variants.items() if v},
        "order": _order(keys, rounds), "base_url": ns.base_url,
    }
    if ns.roofline:
        result["roofline"] = baseline.roofline(path, requests, tokenizer, ns, variants, columns)
    # The offline engine runs the base flags, so it is a baseline only for a single server of those flags.
    run_offline = not ns.no_offline and not ns.base_url and not ns.variant
    offline = []
    if run_offline:
        offline.append(baseline.offline(path, requests, tokenizer, ns)["tok_per_s"])
        print(f"offline engine: {offline[-1]:.1f} tok/s", flush=True)
    procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
    addrs: dict[str, tuple[str, str | None]] = {}
    max_conn = (ns.concurrency if not ns.request_rate else ns.num_requests) + 4

    async def one_run(key: str, reqs: list[RequestSpec], desc: str | None, **load: Any) -> dict[str, Any]:
        variant, endpoint = columns[key]
        url, target = addrs[variant]
        client = make_client(endpoint, url, target, ns.stream, ns.ignore_eos, max_conn, ns.api_key)
        try:
            return await run_load(client, reqs, desc=desc, **load)
        finally:
            await client.aclose()

    load = {"rate": ns.request_rate, "seed": ns.seed} if ns.request_rate else {"concurrency": ns.concurrency}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    try:
        for v, flags in variants.items():
            if ns.base_url:
                addrs[v] = (ns.base_url.rstrip("/"), ns.grpc_target)
                continue
            if servers is not None:
                addrs[v] = servers[v]
                continue
            port, grpc_port = free_port(), (free_port() if "grpc" in endpoints else None)
            _start_server(path, port, grpc_port, ns, flags, procs)
            addrs[v] = (f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}")
        for k in keys:  # warm-up: every client path once
            asyncio.run(one_run(k, [RequestSpec(r.prompt, 8) for r in requests[:4]], None, concurrency=4))
        for k in result["order"]:
            url = addrs[columns[k][0]][0]
            before = _scrape_lag(url)
            cpu0 = time.process_time()
            summary = asyncio.run(one_run(k, requests, f"{k} ({len(runs[k]) + 1}/{rounds})", **load))
            # The load generator shares this machine's cores with the server: its CPU time is the server's loss.
            summary["client_cpu_s"] = time.process_time() - cpu0
            summary["event_loop_lag"] = _lag(before, _scrape_lag(url))
            runs[k].append(summary)
            print(f"{k}: {summary['output_tok_per_s']:.1f} tok/s, {summary['successes']} ok, "
                  f"{summary['failures']} failed", flush=True)
            if run_offline:  # the server idle meanwhile: the next run's offline run before it, this one's after
                offline.append(baseline.offline(path, requests, tokenizer, ns)["tok_per_s"])
                summary["offline_around"] = offline[-2:]
                print(f"offline engine: {offline[-1]:.1f} tok/s", flush=True)
    finally:
        _stop_servers(procs)
    result["runs"] = runs
    result["server"] = {k: _merge(rs) for k, rs in runs.items()}
    if ns.roofline:  # measured again after the runs; the better measurement sets the roofline
        result["roofline"] = baseline.roofline(path, requests, tokenizer, ns, variants, columns, result["roofline"])
    if run_offline:
        # The second offline run also records where its time goes (the profile of "the rest").
        again = baseline.offline(path, requests, tokenizer, ns, profile=ns.roofline)
        offline.append(again["tok_per_s"])
        print(f"offline engine (again): {offline[-1]:.1f} tok/s", flush=True)
        if ns.roofline:
            result["offline_profile"] = {"steps": baseline.step_split(again["steps"], result["roofline"], path),
                                         "decode_step": again["decode_profile"]}
        result["offline_tok_per_s"] = offline
        result["server_vs_offline"] = {k: s["output_tok_per_s"] / statistics.mean(offline)
                                       for k, s in result["server"].items()}
        result["server_vs_offline_paired"] = {k: paired_ratios(rs) for k, rs in runs.items()}
    print(report(result))
    save(result, ns.out, plot)
    return 0 if not any(s["failures"] for s in result["server"].values()) else 1


def paired_ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each served run over the mean of the offline runs just before and after it: their median and range."""
    ratios = sorted(r["output_tok_per_s"] / statistics.mean(r["offline_around"]) for r in runs)
    return {"median": statistics.median(ratios), "ratios": ratios}


def _label(variant: str, endpoint: str) -> str:
    return ENDPOINT_NAMES[endpoint] + (f" ({variant})" if variant else "")
