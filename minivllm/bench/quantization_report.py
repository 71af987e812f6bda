"""`bench quantization`'s presentation: the issue's targets checked, a markdown report and a PNG."""

from __future__ import annotations

from typing import Any


def _row(result: dict[str, Any], mode: str) -> dict[str, Any] | None:
    return next((r for r in result["speed"] if r["mode"] == mode), None)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the figure this run measured and whether it is met (None: a mode was not run)."""
    out: list[dict[str, Any]] = []
    fp32 = _row(result, "fp32")

    def add(name: str, figure: float | None, goal: float, higher: bool = True, fmt: str = "{:.2f}") -> None:
        met = None if figure is None else (figure >= goal if higher else figure <= goal)
        out.append({"target": name, "figure": figure, "goal": goal, "met": met,
                    "shown": "-" if figure is None else fmt.format(figure)})

    add("fp32 b=1 decode >= 85% of the fp32 bandwidth roofline",
        None if fp32 is None else fp32["b1_roofline_frac"], 0.85, fmt="{:.0%}")
    # w4a8 carries int4's goal: the same weight bytes with int8 activations, llama.cpp Q4_0's kind of decode.
    for mode, goal in (("int8", 2.5), ("int4", 3.5), ("w4a8", 3.5)):
        r = _row(result, mode)
        add(f"{mode} b=1 >= {goal}x fp32 b=1", None if r is None or fp32 is None else r["b1_tok_s"] / fp32["b1_tok_s"],
            goal, fmt="{:.2f}x")
    w, big = _row(result, "w8a8"), "64"
    ratio = None
    if w and fp32 and big in w["batches"] and big in fp32["batches"]:
        ratio = w["batches"][big]["tok_s"] / fp32["batches"][big]["tok_s"]
    add("w8a8 at 64 sequences >= 1.7x fp32 at 64", ratio, 1.7, fmt="{:.2f}x")
    q = result["quality"]["rows"]
    for mode, goal in (("int8", 0.01), ("w8a8", 0.01), ("int4", 0.05), ("w4a8", 0.05)):
        rel = q[mode]["perplexity"] / q["fp32"]["perplexity"] - 1 if mode in q and "fp32" in q else None
        add(f"{mode} perplexity +<= {goal:.0%}", rel, goal, higher=False, fmt="{:+.2%}")
    return out


def report(result: dict[str, Any]) -> str:
    """The markdown tables: speed, quality, targets."""
    fp32 = _row(result, "fp32")
    bw = result["bandwidth"]
    batches = list(result["speed"][0]["batches"])
    lines = [
        f"Memory bandwidth probe (1 GiB streamed read, {result['threads']} threads, {bw.get('passes', 9)} passes "
        "spread over the speed rounds): median "
        f"**{bw['median'] / 1e9:.1f} GB/s** (spread {bw['min'] / 1e9:.1f}-{bw['max'] / 1e9:.1f}).", "",
        "| mode | weights read per step | b=1 tok/s (incl. prefill) | vs fp32 | b=1 decode step | b=1 roofline "
        "| of roofline | " + " | ".join(f"{b} seqs tok/s" for b in batches) + " | kernels (1 / few / many tokens) |",
        "|---|---|---|---|---|---|---|" + "---|" * len(batches) + "---|",
    ]
    for r in result["speed"]:
        ratio = f"{r['b1_tok_s'] / fp32['b1_tok_s']:.2f}x" if fp32 else "-"
        cells = []
        for b in batches:
            t = r["batches"][b]["tok_s"]
            cells.append(f"{t:.0f}" + (f" ({t / fp32['batches'][b]['tok_s']:.2f}x)" if fp32 else ""))
        k = r["kernels"]["quantized"] or r["kernels"]["linear"]
        lines.append(f"| {r['mode']} | {r['weight_bytes'] / 1e6:.0f} MB | **{r['b1_tok_s']:.1f}** | {ratio} | "
                     f"{r['b1_decode_step_s'] * 1e3:.2f} ms | {r['b1_roofline_tok_s']:.0f} tok/s | "
                     f"{r['b1_roofline_frac']:.0%} | " + " | ".join(cells) + f" | {' / '.join(k.values())} |")
    if "hf_fp32" in result:
        h = result["hf_fp32"]
        ratio = f"{h['b1_tok_s'] / fp32['b1_tok_s']:.2f}x" if fp32 else "-"
        lines.append(f"| HF transformers fp32 | - | {h['b1_tok_s']:.1f} | {ratio} | "
                     f"{1e3 / h['b1_decode_tok_s']:.2f} ms | - | - |" + " - |" * len(batches) + " - |")
    q, qs = result["quality"], result["quality_speed_model"]
    ref = q["rows"].get("fp32", {}).get("perplexity")
    lines += ["", f"Quality: held-out perplexity of the embedded model ({q['rows'][next(iter(q['rows']))]['tokens']:,} "
              "scored tokens), KL divergence of next-token distributions from our fp32 and top-1 agreement with it, "
              f"on the embedded model and on the speed model ({qs['rows'][next(iter(qs['rows']))]['tokens']:,} "
              "tokens of random ids: random weights, so only KL and top-1 mean anything)"
              + (f"; HF transformers fp32 on the same windows: perplexity {q['hf_fp32_perplexity']:.3f}."
                 if "hf_fp32_perplexity" in q else "."), "",
              "| mode | perplexity | vs fp32 | KL (embedded) | top-1 (embedded) | KL (speed model) | "
              "top-1 (speed model) |", "|---|---|---|---|---|---|---|"]
    for mode, r in q["rows"].items():
        s = qs["rows"][mode]
        rel = f"{r['perplexity'] / ref - 1:+.2%}" if ref else "-"
        lines.append(f"| {mode} | {r['perplexity']:.3f} | {rel} | {r['kl']:.2e} | {r['top1']:.1%} | "
                     f"{s['kl']:.2e} | {s['top1']:.1%} |")
    if "load_s" in result:
        lines += ["", "Load time of the speed model (float32 activations, one process): "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in result["load_s"].items()) + "."]
    beaten = [r["mode"] for r in result["speed"] if r["b1_roofline_frac"] > 1]
    if beaten:  # a ceiling something runs above is a wrong ceiling: say so rather than report > 100%
        lines += ["", f"**Warning**: {', '.join(beaten)} ran above its bandwidth roofline; the probe measured less "
                  "than this machine can stream, so every roofline fraction above is too high."]
    lines += ["", "| target | this run | met |", "|---|---|---|"]
    for t in result["targets"]:
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(f"| {t['target']} | {t['shown']} | {met} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: str) -> None:
    """Three panels: b=1 tok/s against each mode's roofline, throughput per batch, perplexity per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["speed"]
    modes = [r["mode"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    xs = range(len(modes))
    a.bar(xs, [r["b1_tok_s"] for r in rows], color="C0", label="measured (incl. prefill)")
    a.scatter(xs, [r["b1_roofline_tok_s"] for r in rows], color="k", marker="_", s=400, label="bandwidth roofline")
    if "hf_fp32" in result:
        a.axhline(result["hf_fp32"]["b1_tok_s"], color="grey", ls="--", label="HF fp32")
    a.set_xticks(list(xs), modes)
    a.set_ylabel("output tok/s at batch 1")
    a.legend(fontsize=8)
    batches = list(rows[0]["batches"])
    width = 0.8 / max(len(batches), 1)
    for i, bs in enumerate(batches):
        b.bar([x + i * width for x in xs], [r["batches"][bs]["tok_s"] for r in rows], width, label=f"{bs} seqs")
    b.set_xticks([x + width * (len(batches) - 1) / 2 for x in xs], modes)
    b.set_ylabel("offline output tok/s")
    b.legend(fontsize=8)
    q = result["quality"]["rows"]
    c.bar(range(len(q)), [r["perplexity"] for r in q.values()], color="C2")
    c.set_xticks(range(len(q)), list(q))
    c.set_ylabel("held-out perplexity (embedded model)")
    lo = min(r["perplexity"] for r in q.values())
    c.set_ylim(lo * 0.95, max(r["perplexity"] for r in q.values()) * 1.02)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
