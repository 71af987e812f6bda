"""Weights in transparent huge pages.

A decode step at one sequence streams every weight once, so its speed is the memory bandwidth the weights are
read at. Read from 4 KiB pages, every 4 KiB costs a TLB miss, and under a hypervisor's nested paging a miss walks
two page tables: on this project's 2-core VMs one buffer streamed at 20-25 GB/s from 4 KiB pages and 27-32 GB/s
from 2 MiB pages, alternating in one process (llama.cpp's f32 decode streams ~33 GB/s there; ours, with
weights in torch's 4 KiB-page allocations, 23). Linux backs an anonymous mapping advised MADV_HUGEPAGE with 2 MiB
pages where transparent huge pages are "madvise" or "always" (the common defaults); elsewhere, or with
MINIVLLM_HUGEPAGES=0, nothing moves.

place_in_hugepages moves a loaded model's large tensors into such mappings, 2 MiB-aligned: each tensor object is
re-pointed in place (Tensor.set_), so tied weights stay tied and every module keeps its own parameters; it runs
before any kernel takes a weight's address.
"""

from __future__ import annotations

import mmap
import os
import sys

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 20  # smaller tensors (norms, biases) stay where they are: they are read from cache anyway


def enabled() -> bool:
    """Whether this process can advise huge pages (Linux with THP not "never"), and MINIVLLM_HUGEPAGES != 0."""
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("MINIVLLM_HUGEPAGES") == "0":
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def hugepage_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes in an anonymous mapping advised MADV_HUGEPAGE, starting on a 2 MiB boundary
    (the mapping lives as long as the tensor or any view of it)."""
    # Whole huge pages from the aligned start to past the end (the tail gets one too); untouched slack costs nothing.
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds a reference to mm
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


def place_in_hugepages(model: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move the model's CPU parameters and buffers whose storage holds >= min_bytes into huge-page mappings, one
    per storage (a weight released later, as the kernel plan drops a layout, frees its own); the bytes moved (0
    when not enabled). Tensors sharing a storage (views, tied weights) keep sharing it."""
    if not enabled():
        return 0
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized:
                tensors.setdefault(id(t), t)
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors.values():
        if t.untyped_storage().nbytes() >= min_bytes:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    moved = 0
    with torch.no_grad():
        for group in by_storage.values():
            old = group[0].untyped_storage()
            new = hugepage_buffer(old.nbytes())
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),), (1,)))
            storage, base = new.untyped_storage(), new.storage_offset()  # base: 2 MiB-aligned, so every dtype fits
            for t in group:
                t.set_(storage, base // t.element_size() + t.storage_offset(), t.size(), t.stride())
            moved += old.nbytes()
    return moved


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding t that the kernel backs with huge pages now (/proc/self/smaps; 0 if unknown)."""
    addr = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
