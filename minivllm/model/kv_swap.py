"""The host tier of the KV cache: where preemption by swap keeps a sequence's blocks until it resumes.

One region per tensor of the runner's KV pool (`kv_pools`: the cache, and the scales of a quantized one),
each laid out block-major, [host_blocks, 2, layers, ...], so one block is one contiguous span: a swap
writes and reads whole spans, which an SSD and the page cache serve far better than the strided layout
of the pool. On CUDA the tier is pinned host memory; on CPU (or wherever --swap-dir is given) a
memory-mapped file, since there host RAM is already the pool's own memory and a swap only pays off on
other storage. The file's space is reserved when it is made (a disk that fills later is then no SIGBUS), and it
is unlinked as soon as it is mapped, so nothing is left behind whatever happens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import psutil
import torch

from minivllm.model.kv_quant import indexable

_ALIGN = 4096  # regions start on page boundaries


def block_bytes(pools: list[torch.Tensor]) -> int:
    """Bytes of one block across every pool tensor (each [2, layers, num_blocks, ...])."""
    return sum(p[:, :, 0].numel() * p.element_size() for p in pools)


def _fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def check_capacity(nbytes: int, pinned: bool, swap_dir: str) -> None:
    """A clear error when the tier (all ranks' together) cannot fit in free host memory or free disk."""
    if pinned:
        avail, where, fix = psutil.virtual_memory().available, "available host memory", "lower --swap-space"
    else:
        avail, where = shutil.disk_usage(swap_dir).free, f"free disk space in {swap_dir}"
        fix = "lower --swap-space or point --swap-dir at a larger disk"
    if nbytes > avail:
        raise ValueError(f"swap_space: the host KV tier needs {_fmt(nbytes)}, more than the {_fmt(avail)} of "
                         f"{where}; {fix}")


def uses_pinned_memory(device: torch.device, swap_dir: str | None) -> bool:
    """Pinned host memory on CUDA unless a swap directory was asked for; a file otherwise."""
    return device.type == "cuda" and swap_dir is None


class HostKVTier:
    """num_blocks host blocks shaped like the pool's; batched block copies between the two."""

    def __init__(self, pools: list[torch.Tensor], num_blocks: int, swap_dir: str | None) -> None:
        self.num_blocks = num_blocks
        shapes = [(num_blocks, *p.shape[:2], *p.shape[3:]) for p in pools]
        sizes = [num_blocks * p[:, :, 0].numel() * p.element_size() for p in pools]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        self.nbytes = total
        if uses_pinned_memory(pools[0].device, swap_dir):
            self.storage = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        else:
            fd, path = tempfile.mkstemp(prefix="minivllm-kv-swap-", dir=swap_dir)  # O_EXCL, mode 0600
            try:
                # Reserve every block now: a sparse file's pages are allocated when first written, and on a disk
                # that filled up since, that write is a SIGBUS that kills the server mid-step.
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                raise ValueError(f"swap_space: cannot reserve the host KV tier's {_fmt(total)} in "
                                 f"{os.path.dirname(path)} ({e.strerror}); lower --swap-space or point --swap-dir "
                                 "at a larger disk") from None
            os.close(fd)
            try:
                # shared=True: writes go to the file's pages, not to anonymous memory.
                self.storage = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            finally:
                os.unlink(path)
        self.regions = [self.storage[o:o + s].view(p.dtype).view(shape)
                        for p, o, s, shape in zip(pools, offsets, sizes, shapes, strict=True)]

    @torch.inference_mode()
    def swap_out(self, pools: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, pairs of (device block, host block): one gather per pool."""
        dev = torch.tensor([d for d, _ in pairs], device=pools[0].device)
        host = torch.tensor([h for _, h in pairs])
        for pool, region in zip(pools, self.regions, strict=True):
            indexable(region)[host] = indexable(pool)[:, :, dev].movedim(2, 0).cpu()

    @torch.inference_mode()
    def swap_in(self, pools: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks, pairs of (host block, device block): one scatter per pool."""
        host = torch.tensor([h for h, _ in pairs])
        dev = torch.tensor([d for _, d in pairs], device=pools[0].device)
        for pool, region in zip(pools, self.regions, strict=True):
            indexable(pool)[:, :, dev] = indexable(region)[host].movedim(0, 2).to(pool.device)

    def probe(self, pools: list[torch.Tensor], num_blocks: int) -> float:
        """Seconds per block moved, from a swap out and back in of blocks 0..num_blocks-1 (the same blocks, so
        nothing changes), timed after a warm-up round that faults their host pages in: preemption_mode=auto's
        first estimate of a swap's cost."""
        pairs = [(i, i) for i in range(num_blocks)]
        for _ in range(2):
            t0 = time.perf_counter()
            self.swap_out(pools, pairs)
            self.swap_in(pools, pairs)
            if pools[0].device.type == "cuda":
                torch.cuda.synchronize(pools[0].device)
            seconds = time.perf_counter() - t0
        return seconds / (2 * num_blocks)
