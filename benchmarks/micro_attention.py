"""Decode attention backends on the KV layout of a SmolLM2-135M at 64 concurrent sequences.

30 layers with their own pools (600 MB of KV, so it streams from DRAM as in the engine); the
portable torch backend (gather blocks + SDPA) and the compiled cpu_native kernel run alternately.
    python benchmarks/micro_attention.py [--threads 2] [--seqs 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm.model.attention import ATTENTION_BACKENDS, Attention, AttentionMetadata


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    b = args.seqs
    lens = torch.randint(32 + 1, 256 + 128, (b,))
    nblocks = (lens + bs - 1) // bs
    pool = int(nblocks.sum()) + 8
    perm = torch.randperm(pool)
    tables = torch.zeros(b, int(nblocks.max()), dtype=torch.int64)
    off = 0
    for i in range(b):
        tables[i, :nblocks[i]] = perm[off:off + nblocks[i]]
        off += int(nblocks[i])
    md = AttentionMetadata(
        slot_mapping=torch.zeros(b, dtype=torch.int64), num_decodes=b, decode_block_tables=tables,
        decode_positions=lens - 1, max_decode_seq_len=int(lens.max()), prefills=[])
    layers = []
    for _ in range(args.layers):
        layer = Attention(heads, head_dim, kv_heads, head_dim**-0.5)
        layer.k_cache = torch.randn(pool, bs, kv_heads, head_dim)
        layer.v_cache = torch.randn(pool, bs, kv_heads, head_dim)
        layers.append(layer)
    q = torch.randn(b, heads, head_dim)
    backends = {name: cls() for name, cls in ATTENTION_BACKENDS.items()}
    times: dict[str, list[float]] = {name: [] for name in backends}
    outs = {name: torch.empty(b, heads, head_dim) for name in backends}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            t = time.perf_counter()
            for layer in layers:
                backend.decode(layer, q, md, outs[name])
            times[name].append(time.perf_counter() - t)
    kv_bytes = int(lens.sum()) * kv_heads * head_dim * 4 * 2 * args.layers
    err = (outs["torch"] - outs["cpu_native"]).abs().max().item()
    base = statistics.median(times["torch"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:10s}: {1e3 * med:7.1f} ms per step ({args.layers} layers, "
              f"{kv_bytes / med / 1e9:5.1f} GB/s of KV) speedup {base / med:.2f}x")
    print(f"max |torch - cpu_native| = {err:.2e}")


if __name__ == "__main__":
    main()
