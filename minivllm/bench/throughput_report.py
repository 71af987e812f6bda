"""Markdown and PNG of a `bench throughput` result (presentation only; the measuring is throughput.py)."""

from __future__ import annotations

import os
from typing import Any


def report(r: dict[str, Any]) -> str:
    """Markdown summary of a throughput run."""
    return "\n".join(main_report(r) + step_split_report(r) + concurrency_report(r) + ablation_report(r))


def main_report(r: dict[str, Any]) -> list[str]:
    """Markdown: engines side by side, rooflines, batch 1, the whole run's step split, the decode profile."""
    c, o = r["ceilings"], r["ours"]
    lines = [
        f"### Offline throughput: {r['num_requests']} requests, {r['prompt_tokens']} prompt + "
        f"{r['output_tokens']} output tokens ({r['architecture']}, {r['dtype']}, {r['threads']} threads)",
        "",
        f"Machine, measured in this run: peak GEMM {c['peak_flops'] / 1e9:.0f} GFLOP/s (aten/MKL "
        f"{c['mkl_gemm_flops'] / 1e9:.0f}), model-shaped GEMM (M=64) {c['model_gemm_flops'] / 1e9:.0f} GFLOP/s, "
        f"memory bandwidth {c['bandwidth'] / 1e9:.1f} GB/s.",
        "",
        "| engine | time (s) | output tok/s | ratio |",
        "|---|---|---|---|",
        f"| Mini-vLLM | {o['elapsed_s']:.1f} | {o['output_tok_s']:.1f} | "
        f"{r.get('speedup_vs_hf', float('nan')):.2f}x |",
    ]
    if "portable" in r:
        p = r["portable"]
        ratio = r["hf"]["elapsed_s"] / p["elapsed_s"] if "hf" in r else float("nan")
        lines.append(f"| Mini-vLLM, portable paths (torch attention, aten GEMMs) | {p['elapsed_s']:.1f} | "
                     f"{p['output_tok_s']:.1f} | {ratio:.2f}x |")
    if "sampled" in r:
        sm = r["sampled"]
        lines.append(f"| Mini-vLLM, sampled (temperature 0.8, top-p 0.95) | {sm['elapsed_s']:.1f} | "
                     f"{sm['output_tok_s']:.1f} | {sm['ratio_to_greedy']:.2f} of greedy |")
    if "hf" in r:
        h = r["hf"]
        lines.append(f"| HF transformers generate (batch {r['num_requests']}) | {h['elapsed_s']:.1f} | "
                     f"{h['output_tok_s']:.1f} | 1.00x |")
    lines += ["", f"Roofline for the whole workload: {o['roofline_s']:.1f} s → Mini-vLLM reaches "
              f"{100 * o['roofline_fraction']:.0f}% of it."]
    d = r.get("decode_at_batch")
    if d:
        lines.append(f"Pure decode at {d['batch']} concurrent sequences: median step {d['median_step_ms']:.1f} ms "
                     f"({d['tok_s']:.0f} tok/s) vs roofline {d['roofline_step_ms']:.1f} ms → "
                     f"{100 * d['roofline_fraction']:.0f}%.")
    b1 = f"Batch-1 decode: Mini-vLLM {o['batch1_decode_tok_s']:.1f} tok/s"
    if "hf" in r:
        b1 += (f", HF {r['hf']['batch1_decode_tok_s']:.1f} tok/s → {r['batch1_speedup_vs_hf']:.2f}x; "
               f"greedy outputs identical to HF for {r['hf']['identical_outputs']}/{r['num_requests']} requests")
    if "portable" in r:
        b1 += (f". The portable run's outputs are identical to the fast run's for "
               f"{r['portable']['identical_outputs']}/{r['num_requests']} requests")
    lines += [b1 + ".", "", "Step-time split over the whole run:", "",
              "| step phase | ms/step | share |", "|---|---|---|"]
    for k, v in r["step_split"].items():
        lines.append(f"| {k} | {v['ms_per_step']:.2f} | {100 * v['share']:.1f}% |")
    p = r.get("decode_profile")
    if p:
        lines += ["", f"Inside one pure-decode step at {p['batch']} sequences ({p['step_ms']:.1f} ms): "
                  + (f"the native decode stack {p['stack_ms']:.1f} ms (every layer in one call), "
                     if p.get("stack_ms") else "")
                  + f"GEMMs {p['gemm_ms']:.1f} ms, paged attention {p['attention_ms']:.1f} ms, everything else "
                  f"{p['other_ms']:.1f} ms. Same step by thread count: " + ", ".join(
                      f"{n} thread(s) {ms:.1f} ms" for n, ms in p["step_ms_by_threads"].items()) + "."]
    return lines


def step_split_report(r: dict[str, Any]) -> list[str]:
    """Markdown: the engine's phases in a pure-decode step at the profiled concurrency."""
    p = r.get("decode_profile") or {}
    if "phases_ms" not in p:
        return []
    ph = p["phases_ms"]
    total = sum(ph.values())
    lines = ["", f"Step-time split of a pure-decode step at {p['batch']} concurrent sequences "
             f"(target: non-model time ≤ 10% of the step): **non-model {100 * p['non_model_share']:.1f}%**.",
             "", "| phase | ms/step | share |", "|---|---|---|"]
    return lines + [f"| {k}{' (the model: forward + logits)' if k == 'forward' else ''} | {v:.2f} | "
                    f"{100 * v / total:.1f}% |" for k, v in ph.items()]


def concurrency_report(r: dict[str, Any]) -> list[str]:
    """Markdown table of the throughput-vs-concurrency sweep."""
    sw = r.get("concurrency_sweep")
    if not sw:
        return []
    lines = ["", "Throughput vs concurrency: at most C sequences running, 2C requests (at least 4) with prompt "
             f"lengths spread evenly over the workload's range, {sw[0]['output_len']} tokens out each; the "
             "roofline is the same requests' "
             "prefill and decode FLOPs at peak, or one weight read per step of at most C tokens, whichever is "
             "slower:", "",
             "| concurrency | output tok/s | vs C=1 | roofline at C (tok/s) | fraction of roofline |",
             "|---|---|---|---|---|"]
    one = sw[0]["output_tok_s"]
    lines += [f"| {x['concurrency']} | {x['output_tok_s']:.1f} | {x['output_tok_s'] / one:.2f}x | "
              f"{x['roofline_tok_s']:.0f} ({x['roofline_bound']}-bound) | "
              f"{100 * x['output_tok_s'] / x['roofline_tok_s']:.0f}% |"
              for x in sw]
    return lines


def ablation_report(r: dict[str, Any]) -> list[str]:
    """Markdown table of the ablations: ratio to the full engine, KV memory waste, longest step."""
    ab = r.get("ablations")
    if not ab:
        return []
    lines = ["", "Ablations: each technique switched off, in the same process on the same requests as the full "
             "engine (run before and after; its mean is the 1.00). Every engine of a workload has the same KV pool: "
             "the sum of every request's final size, enough for the paged engine to hold them all at once. KV "
             "waste: share of the allocated KV slots, step-averaged, that held no token. Longest step: one run's.",
             "",
             "| engine | workload | output tok/s | ratio to full | KV waste | peak KV slots | longest step | "
             "outputs identical |", "|---|---|---|---|---|---|---|---|"]
    for name, x in ab.items():
        ident = f"{x['identical_outputs']}" if "identical_outputs" in x else "–"
        ratio = f"**{x['ratio_to_full']:.2f}**" if "ratio_to_full" in x else "1.00"
        if "ratio_to_control" in x:
            ratio += f" ({x['ratio_to_control']:.2f} of its control)"
        desc = x.get("what", name)
        # Recomputing everything keeps no KV between steps: its blocks are scratch, "waste" means nothing.
        waste = "–" if x.get("args", {}).get("kv_cache_mode") == "none" else f"{100 * x['kv_waste']:.1f}%"
        lines.append(f"| {desc} | {x['workload']} | {x['output_tok_s']:.1f} | {ratio} | {waste} | "
                     f"{x['peak_kv_slots']} | {x['longest_step_ms']:.0f} ms | {ident} |")
    fulls = {k: v for k, v in ab.items() if k.startswith("full engine")}
    for k, v in fulls.items():
        lines.append(f"\n{k}: {v['requests']} requests, {v['output_tokens']} tokens out; pool {v['pool_slots']} slots, "
                     f"max_model_len {v['max_model_len']}; full-engine runs "
                     + ", ".join(f"{t:.1f}" for t in v["runs_output_tok_s"]) + " tok/s.")
    return lines


def plot(r: dict[str, Any], path: str) -> None:
    """Engines side by side, throughput vs concurrency against the roofline, and the ablation ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + bool(r.get("concurrency_sweep")) + bool(r.get("ablations"))
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8))
    axes = list(axes) if panels > 1 else [axes]
    names, vals = ["Mini-vLLM"], [r["ours"]["output_tok_s"]]
    for key, label in (("portable", "portable paths"), ("sampled", "sampled"), ("hf", "HF generate")):
        if key in r:
            names.append(label)
            vals.append(r[key]["output_tok_s"])
    ax = axes.pop(0)
    ax.bar(names, vals, color="tab:blue")
    ax.set_title(f"offline output tok/s ({r['num_requests']} requests)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7, rotation=15)
    if r.get("concurrency_sweep"):
        ax = axes.pop(0)
        sw = r["concurrency_sweep"]
        cs = [x["concurrency"] for x in sw]
        ax.plot(cs, [x["output_tok_s"] for x in sw], "o-", label="Mini-vLLM")
        ax.plot(cs, [x["roofline_tok_s"] for x in sw], "k--", label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent sequences")
        ax.set_title("output tok/s vs concurrency", fontsize=9)
        ax.legend(fontsize=7)
    if r.get("ablations"):
        ax = axes.pop(0)
        ab = {k: v for k, v in r["ablations"].items() if "ratio_to_full" in v}
        ax.barh(list(ab), [v["ratio_to_full"] for v in ab.values()], color="tab:orange")
        ax.axvline(1.0, color="k", ls="--")
        ax.set_title("ablations: throughput / full engine", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"minivllm bench throughput: {os.path.basename(r['model'])} ({r['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
