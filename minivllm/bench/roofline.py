"""Machine ceilings (matmul FLOP/s, memory bandwidth) and a model's roofline, measured in-process."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from minivllm.config import ModelConfig
from minivllm.model.kernel_plan import best_time


@dataclass
class MachineCeilings:
    """What this machine can do, measured now (the speed drifts: compare only within one run)."""

    threads: int
    peak_flops: float  # best large square GEMM: aten (MKL), oneDNN prepacked or our own, whichever is fastest
    mkl_gemm_flops: float  # aten's large square GEMM (what `x @ w` gets)
    model_gemm_flops: float  # the model's own projection shape at M=64 tokens, the faster of oneDNN's and ours
    bandwidth: float  # bytes/s: median of the streaming-read probe's passes (measure_bandwidth)
    bandwidth_min: float = 0.0  # the probe's spread: slowest and fastest pass
    bandwidth_max: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Plain dict for JSON."""
        return asdict(self)


def measure_ceilings(hidden: int = 576, intermediate: int = 1536, dtype: torch.dtype = torch.float32,
                     probe_mib: int | None = None) -> MachineCeilings:
    """Best-of-N matmul throughput and memory bandwidth on this machine, with the current thread count (the
    bandwidth probe's buffer: probe_mib(), unless a smoke run asks for less)."""
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    mkl = 2 * n**3 / best_time(lambda: a @ b, 5)
    peak = mkl
    x, w = torch.randn(64, hidden, dtype=dtype), torch.randn(intermediate, hidden, dtype=dtype)
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.linear
    if torch.backends.mkldnn.is_available():
        from minivllm.model.layers import Linear

        big, small = Linear(n, n, bias=False), Linear(hidden, intermediate, bias=False)
        assert big.weight is not None and small.weight is not None  # not packed yet
        with torch.no_grad():
            big.weight.copy_(b)
            small.weight.copy_(w)
        big.pack()
        small.pack()
        peak = max(peak, 2 * n**3 / best_time(lambda: big(a), 5))
        linear = lambda x_, _w: small(x_)  # noqa: E731
    reps = 50
    model_gemm = 2 * 64 * hidden * intermediate * reps / best_time(lambda: [linear(x, w) for _ in range(reps)], 5)
    from minivllm.model import cpu_kernels

    if dtype == torch.float32 and cpu_kernels.available():  # our own GEMM (csrc/gemm_f32.c) where it is faster
        big_panels, small_panels = cpu_kernels.GemmPanels(b, None), cpu_kernels.GemmPanels(w, None)
        peak = max(peak, 2 * n**3 / best_time(lambda: big_panels(a), 5))
        model_gemm = max(model_gemm, 2 * 64 * hidden * intermediate * reps
                         / best_time(lambda: [small_panels(x) for _ in range(reps)], 5))
    median, lo, hi = measure_bandwidth(probe_mib)
    return MachineCeilings(torch.get_num_threads(), peak, mkl, model_gemm, median, lo, hi)


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (0 where sysfs does not say)."""
    import glob

    llc = 0
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(f).read().strip()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        llc = max(llc, int(text.rstrip("KMG")) * unit)
    return llc


def add_probe_mib_arg(p: argparse.ArgumentParser, when: str = "") -> None:
    """The benches' --probe-mib flag (when: what it depends on, e.g. "with --roofline: ")."""
    p.add_argument("--probe-mib", type=int, default=None,
                   help=f"{when}the bandwidth probe's buffer in MiB (default: 1 GiB or 8x the last-level cache; a "
                        "smaller one reads from cache, for smoke runs only: 1 GiB at 1 thread is ~4 s here)")


def probe_mib() -> int:
    """The bandwidth probe's buffer: 1 GiB, or 8x the last-level cache where that is larger (a VM may report
    its host's whole L3: 480 MiB was seen here), so every pass streams from memory."""
    return max(1024, 8 * last_level_cache_bytes() // 2**20)


def measure_bandwidth(mib: int | None = None, passes: int = 9, threads: int | None = None
                      ) -> tuple[float, float, float]:
    """Memory read bandwidth (median, min, max over passes, bytes/s) with the engine's thread count."""
    return bandwidth_stats(bandwidth_passes(mib, passes, threads))


def bandwidth_stats(rates: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of probe passes."""
    rates = sorted(rates)
    return rates[len(rates) // 2], rates[0], rates[-1]


def bandwidth_passes(mib: int | None = None, passes: int = 9, threads: int | None = None) -> list[float]:
    """Memory read bandwidth of each pass (bytes/s) with the engine's thread count (bandwidth_reader's passes)."""
    return bandwidth_reader(mib, threads)(passes)


def bandwidth_reader(mib: int | None = None, threads: int | None = None) -> Callable[[int], list[float]]:
    """The probe's buffer, allocated, filled and read once; the function returned reads it in n passes and gives
    each pass's rate (bytes/s). Paired bursts (bench/paired.py) keep one and read it beside each pair.

    The buffer (probe_mib(): 1 GiB, or 8x the last-level cache) is far beyond that cache and larger than
    the models it bounds, it sits in huge pages as the weights do, every pass reads all of it, and the reader
    is the native kernel (csrc/membw.c: 8 independent vector accumulators per thread, so enough loads are in
    flight; a single dependent chain, or one thread, measures latency instead of bandwidth). A pass reads the
    buffer in both of the kernel's patterns (a sequential stream per thread, interleaved rows), in alternating
    order, and counts the faster: which one streams faster is the machine's (on a Zen 4 EPYC the interleaved one
    alone read 24 GB/s, below what both engines' decodes streamed; the sequential one 30). Without a C
    compiler, torch's sum stands in."""
    from minivllm.model import cpu_kernels, hugepages

    threads = threads or torch.get_num_threads()
    numel = (mib or probe_mib()) * 2**20 // 4
    # From huge pages where the weights are (model/hugepages.py): 4 KiB pages streamed at 0.7-0.8 of that here.
    buf = hugepages.hugepage_buffer(numel * 4).view(torch.float32) if hugepages.enabled() else torch.empty(numel)
    buf.fill_(1.0)
    reads: list[Callable[[], object]] = [buf.sum]
    if cpu_kernels.available():
        reads = [functools.partial(cpu_kernels.stream_read, buf, threads, seq) for seq in (True, False)]
    for read in reads:
        read()

    def run(passes: int) -> list[float]:
        rates = []
        for i in range(passes):
            best = float("inf")
            for read in (reads if i % 2 == 0 else reads[::-1]):
                t = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - t)
            rates.append(buf.numel() * 4 / best)
        return rates

    return run


def measure_ceilings_for(mc: ModelConfig, dtype: torch.dtype = torch.float32, probe_mib: int | None = None
                         ) -> MachineCeilings:
    """measure_ceilings with the model's own projection shape (hidden x intermediate)."""
    return measure_ceilings(mc.hidden_size, mc.hf_config.get("intermediate_size") or 4 * mc.hidden_size, dtype,
                            probe_mib)


@dataclass
class ModelCost:
    """FLOPs and bytes of a model per token, from its config."""

    body_params: int  # matmul weights applied to every token (all layers)
    head_params: int  # lm_head, applied only to tokens whose logits are sampled
    weight_bytes: int  # all weights read once per step (body + head + norms)
    kv_bytes_per_token: int
    attn_flops_per_ctx_token: int  # per query token, per context token

    @staticmethod
    def from_config(mc: ModelConfig, dtype: torch.dtype) -> ModelCost:
        """Count from the architecture (Llama-family or GPT-2 shapes)."""
        cfg = mc.hf_config
        h, d = mc.hidden_size, mc.head_dim
        q, kv = mc.num_heads * d, mc.num_kv_heads * d
        if mc.architecture == "GPT2LMHeadModel":
            inter = cfg.get("n_inner") or 4 * h
            per_layer = h * 3 * h + h * h + 2 * h * inter
        else:
            inter = cfg["intermediate_size"]
            per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
        body = per_layer * mc.num_layers
        head = mc.vocab_size * h
        elt = torch.empty((), dtype=dtype).element_size()
        return ModelCost(body, head, (body + head) * elt, mc.kv_bytes_per_token(dtype),
                         4 * mc.num_layers * mc.num_heads * d)

    def step_roofline(self, num_tokens: int, num_sampled: int, context_tokens: int, m: MachineCeilings) -> float:
        """Lower bound on one step's time: max(compute at peak FLOP/s, bytes at peak bandwidth)."""
        flops = 2 * self.body_params * num_tokens + 2 * self.head_params * num_sampled
        flops += self.attn_flops_per_ctx_token * context_tokens
        bytes_ = self.weight_bytes + self.kv_bytes_per_token * context_tokens
        return max(flops / m.peak_flops, bytes_ / m.bandwidth)

    def workload_roofline(self, prompt_lens: list[int], output_len: int, m: MachineCeilings) -> float:
        """Lower bound for prefilling every prompt then decoding output_len tokens for all at once."""
        flops = 2 * self.body_params * sum(prompt_lens) + 2 * self.head_params * len(prompt_lens)
        flops += self.attn_flops_per_ctx_token * sum(n * n // 2 for n in prompt_lens)
        total = max(flops / m.peak_flops, self.weight_bytes / m.bandwidth)
        ctx = sum(prompt_lens)
        for _ in range(output_len - 1):
            ctx += len(prompt_lens)
            total += self.step_roofline(len(prompt_lens), len(prompt_lens), ctx, m)
        return total

    def serving_roofline(self, prompt_lens: list[int], output_lens: list[int], batch: int, m: MachineCeilings
                         ) -> dict[str, float | str]:
        """Lower bound on serving these requests with at most `batch` running at once: every token's FLOPs
        at peak FLOP/s, or the weights read once per step at peak bandwidth (each step yields at most
        `batch` tokens), whichever is larger."""
        # The last output token is sampled, never fed back: p + o - 1 tokens go through the model.
        fed = [p + o - 1 for p, o in zip(prompt_lens, output_lens, strict=True)]
        flops = 2 * self.body_params * sum(fed) + 2 * self.head_params * sum(output_lens)
        flops += self.attn_flops_per_ctx_token * sum(n * (n + 1) // 2 for n in fed)
        steps = -(-sum(output_lens) // batch)
        compute_s, memory_s = flops / m.peak_flops, steps * self.weight_bytes / m.bandwidth
        seconds = max(compute_s, memory_s)
        return {"batch": batch, "compute_s": compute_s, "memory_s": memory_s, "seconds": seconds,
                "output_tok_s": sum(output_lens) / seconds, "bound": "compute" if compute_s >= memory_s else "memory"}
