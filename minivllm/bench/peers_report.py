"""`bench peers` results as markdown tables (with issue 34's targets marked met or not) and a PNG of the ratios."""

from __future__ import annotations

import statistics
from typing import Any

from minivllm.bench.peers import HF_DTYPE, PREFILL, peer_type
from minivllm.bench.results import ratio_bars

# Issue 34's targets against llama.cpp at the same bits: item 2 at every size, item 3 at 1B class (>= 0.4B
# parameters): (mode, point) -> the ratio to reach; a prefill ratio is llama.cpp's seconds over ours.
SMALL_TARGETS = {("w4a8", "1"): 1.4, ("w4a8", PREFILL): 1.1, ("int4", "1"): 1.0, ("w4a16", "1"): 1.0}
ROOFLINE_MODES = ("fp32", "bf16", "w8a8", "w4a8")
LARGE_TARGET, ROOFLINE_TARGET, LARGE_PARAMS = 1.2, 0.85, 0.4e9
SAME_FILE_TARGET = 1.1  # issue 35: llama.cpp's own GGUF file served by us, every point


def targets(mode: str, point: str, params: float) -> float | None:
    """The ratio to llama.cpp this mode must reach at this point (None: no target)."""
    if mode.startswith("gguf:"):
        return SAME_FILE_TARGET
    if params >= LARGE_PARAMS and mode in ROOFLINE_MODES and point != PREFILL:
        return max(LARGE_TARGET, SMALL_TARGETS.get((mode, point), 0.0))
    return SMALL_TARGETS.get((mode, point))


def _median(runs: dict[str, Any], key: str, point: str) -> float | None:
    cell = runs.get(key, {}).get(point)
    return None if cell is None else cell["median"]


def ratio(mine: float | None, theirs: float | None, point: str) -> float | None:
    """Ours over theirs in speed: tok/s ratio, or for the prefill their seconds over ours."""
    if mine is None or theirs is None or mine <= 0 or theirs <= 0:
        return None
    return theirs / mine if point == PREFILL else mine / theirs


def _fmt(x: float | None, point: str) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} s" if point == PREFILL else f"{x:.1f}"


def _points(results: dict[str, Any]) -> list[str]:
    return [str(b) for b in results["batches"]] + ([PREFILL] if results["prefill_len"] else [])


def _point_name(point: str, results: dict[str, Any]) -> str:
    return f"prefill {results['prefill_len']} (TTFT)" if point == PREFILL else f"b={point} tok/s"


def report(results: dict[str, Any]) -> str:
    """Per preset: a speed table (ours, llama.cpp, HF, ratios, targets) and a roofline table at one sequence."""
    lines: list[str] = []
    for preset, runs in results["presets"].items():
        params = results.get("params", {}).get(preset, 0)
        lines += [f"**{preset}** ({params / 1e9:.2f}B parameters)", "",
                  "| ours | point | ours | llama.cpp | vs llama.cpp | HF | vs HF | target (vs llama.cpp) |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode in results["modes"]:
            peer = peer_type(mode)
            for point in _points(results):
                mine = _median(runs, f"ours|{mode}", point)
                cpp = _median(runs, f"llama.cpp|{peer}", point)
                hf = _median(runs, f"hf|{mode}", point) if mode in HF_DTYPE else None
                r_cpp, r_hf = ratio(mine, cpp, point), ratio(mine, hf, point)
                goal = targets(mode, point, params)
                verdict = "-" if goal is None else \
                    f">= {goal:.1f}x: " + ("not measured" if r_cpp is None else "met" if r_cpp >= goal else "NOT MET")
                lines.append(f"| {mode} | {_point_name(point, results)} | {_fmt(mine, point)} | {peer} "
                             f"{_fmt(cpp, point)} | {_x(r_cpp)} | {_fmt(hf, point)} | {_x(r_hf)} | {verdict} |")
        lines += ["", *roofline_lines(results, runs, params), "", *paired_lines(results, preset, params)]
    return "\n".join(lines).rstrip()


def paired_lines(results: dict[str, Any], preset: str, params: float) -> list[str]:
    """b=1 in paired bursts (bench/paired.py): each mode's median ratio over adjacent pairs, with its quartiles;
    with the probe read around each pair, each engine's stream as a share of it (item 3's roofline, same seconds)."""
    paired = results.get("paired", {}).get(preset)
    if not paired:
        return []
    lines = [f"Paired bursts at one sequence (both engines loaded at once, alternating bursts of {results['steps']} "
             "steps, ABBA; the ratio within each adjacent pair):", "",
             "| ours | llama.cpp | pairs | ours tok/s (median) | llama.cpp tok/s (median) | median pair ratio | "
             "quartiles | target |", "|---|---|---|---|---|---|---|---|"]
    shares: list[str] = []
    for mode, r in paired.items():
        goal = targets(mode, "1", params)
        verdict = "-" if goal is None else f">= {goal:.1f}x: " + ("met" if r["ratio"] >= goal else "NOT MET")
        lines.append(f"| {mode} | {peer_type(mode)} | {r['pairs']} | {statistics.median(r['ours']):.1f} | "
                     f"{statistics.median(r['peer']):.1f} | **{r['ratio']:.2f}x** | {r['q1']:.2f}-{r['q3']:.2f}x | "
                     f"{verdict} |")
        if "ours_of_probe" in r:
            shares.append(_share_line(mode, r, params))
    if shares:
        lines += ["", "The same bursts against the bandwidth probe read in a third process before and after each pair "
                  "(each burst's stream, tok/s x the bytes its step reads, over the mean of the two readings around "
                  "its pair; median and quartiles over the pairs):", "",
                  "| ours | probe around the pairs (median, range) | ours streams (median) | ours of the probe | "
                  "llama.cpp of the probe | target (ours) |", "|---|---|---|---|---|---|", *shares]
    return [*lines, ""]


def _share_line(mode: str, r: dict[str, Any], params: float) -> str:
    ours, peer, probe = r["ours_of_probe"], r["peer_of_probe"], r["probe"]
    goal = "-"
    if mode in ROOFLINE_MODES and params >= LARGE_PARAMS:
        goal = f">= {ROOFLINE_TARGET:.0%}: " + ("met" if ours["median"] >= ROOFLINE_TARGET else "NOT MET")
    if peer["median"] > 1.0:  # a peer's decode above the probe: the probe measures the wrong thing
        goal += " (the probe reads below llama.cpp's decode: no measure)"
    stream = statistics.median(r["ours"]) * r["ours_bytes"]
    return (f"| {mode} | {statistics.median(probe) / 1e9:.1f} GB/s ({min(probe) / 1e9:.1f}-{max(probe) / 1e9:.1f}) "
            f"| {stream / 1e9:.1f} GB/s | **{ours['median']:.0%}** ({ours['q1']:.0%}-{ours['q3']:.0%}) | "
            f"{peer['median']:.0%} ({peer['q1']:.0%}-{peer['q3']:.0%}) | {goal} |")


def roofline_lines(results: dict[str, Any], runs: dict[str, Any], params: float) -> list[str]:
    """Each engine's decode at one sequence as the bandwidth it streams, against the probe's median."""
    probe = runs.get("probe")
    if probe is None or "1" not in _points(results):
        return []
    bw = probe["median"]["median"]
    lo, hi = min(probe["min"]["runs"]), max(probe["max"]["runs"])
    lines = [f"Bandwidth probe ({probe['mib']['median']:.0f} MiB streamed per pass, {results['threads']} threads): "
             f"median {bw / 1e9:.1f} GB/s, passes {lo / 1e9:.1f}-{hi / 1e9:.1f} GB/s.", "",
             "| engine | weights | bytes per step | b=1 tok/s | streams | of the probe | target |",
             "|---|---|---|---|---|---|---|"]
    fastest = ours_fastest = 0.0
    for key in sorted(k for k in runs if "|" in k):
        engine, mode = key.split("|")
        tok_s, nbytes = _median(runs, key, "1"), _median(runs, key, "bytes")
        if tok_s is None or nbytes is None:
            continue
        stream = tok_s * nbytes
        if engine != "ours":
            fastest = max(fastest, stream)
        else:
            ours_fastest = max(ours_fastest, stream)
        goal = "-"
        if engine == "ours" and mode in ROOFLINE_MODES and params >= LARGE_PARAMS:
            # A decode above the probe's fastest pass means the probe read the machine in a slower phase than the
            # decode ran in (the two are minutes apart; this machine drifts by a third): no fraction of it is a measure.
            goal = f">= {ROOFLINE_TARGET:.0%}: " + ("not measured (above the probe)" if stream > hi else
                                                    "met" if stream / bw >= ROOFLINE_TARGET else "NOT MET")
        lines.append(f"| {engine} | {mode} | {nbytes / 1e6:.0f} MB | {tok_s:.1f} | {stream / 1e9:.1f} GB/s | "
                     f"{stream / bw:.0%} | {goal} |")
    check = "below a peer's decode: the probe measures the wrong thing" if fastest > bw else \
        f"above every peer's decode ({fastest / 1e9:.1f} GB/s at most)"
    if ours_fastest > hi:
        check += (f"; its fastest pass is below one of ours ({ours_fastest / 1e9:.1f} GB/s): the machine ran faster "
                  "during that decode than during the probe, so fractions above the probe are not measures (the "
                  "paired ratios are)")
    return [*lines, "", f"Probe check: the probe's median is {check}."]


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def plot(results: dict[str, Any], png: str) -> None:
    """Ours over llama.cpp and over HF, per preset, mode and point."""
    labels, cpp, hf = [], [], []
    for preset, runs in results["presets"].items():
        for mode in results["modes"]:
            for point in _points(results):
                mine = _median(runs, f"ours|{mode}", point)
                labels.append(f"{preset}\n{mode} {point}")
                cpp.append(ratio(mine, _median(runs, f"llama.cpp|{peer_type(mode)}", point), point) or 0.0)
                hf.append(ratio(mine, _median(runs, f"hf|{mode}", point), point) or 0.0)
    ratio_bars(png, labels, {"vs llama.cpp (same bits)": cpp, "vs HF transformers": hf}, "speed ratio (ours / peer)",
               fontsize=5)
