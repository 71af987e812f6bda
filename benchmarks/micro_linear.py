"""aten (MKL) F.linear vs oneDNN prepacked linear on a SmolLM2-135M's full set of projections.

Both run alternately in one process (the machine drifts ±30%); prints medians and the ratio.
    python benchmarks/micro_linear.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from minivllm.model.layers import Linear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # qkv, o, gate_up, down per layer, then the head
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k, dtype=dtype) * 0.05 for n, k in shapes]
        packed = []
        for w in weights:
            lin = Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data = w
            lin.pack()
            packed.append(lin)
        params = sum(w.numel() for w in weights)
        for m in (1, 8, 64, 512):
            xs = {k: torch.randn(m, k, dtype=dtype) for k in (576, 1536)}
            runs = {
                "aten": lambda xs=xs, weights=weights: [F.linear(xs[w.shape[1]], w) for w in weights],
                "onednn": lambda xs=xs, packed=packed: [lin(xs[lin.in_features]) for lin in packed],
            }
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            a, o = statistics.median(times["aten"]), statistics.median(times["onednn"])
            print(f"{str(dtype):15s} M={m:4d}: aten {1e3 * a:7.1f} ms ({2 * m * params / a / 1e9:5.0f} GFLOP/s)"
                  f"  onednn {1e3 * o:7.1f} ms ({2 * m * params / o / 1e9:5.0f} GFLOP/s)  ratio {a / o:.2f}x")


if __name__ == "__main__":
    main()
