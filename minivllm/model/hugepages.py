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
before any kernel takes a weight's address. The loader first calls it with copy=False on the model's freshly
allocated (empty) tensors, so the checkpoint is read straight into huge pages, one pass over the weights fewer
(the copy was 6.7 s of one 12 s load of a 1.1B float model; most of it first touches of fresh memory, which
under this project's hypervisor run at 0.8-15 GB/s whichever page size: loads of that model then read 6.5-7.4 s
against 6.6-10.4 s); the final call moves only what the load replaced (quantized or sharded weights).
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 20  # smaller tensors (norms, biases) stay where they are: they are read from cache anyway
_MAPPINGS: dict[int, tuple[int, int]] = {}  # id(mmap) -> [start, end) of each live mapping made here


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
    _MAPPINGS[id(mm)] = (whole.data_ptr(), whole.data_ptr() + length)
    weakref.finalize(mm, _MAPPINGS.pop, id(mm), None)  # gone with the last tensor viewing it
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


def in_hugepage_mapping(t: torch.Tensor) -> bool:
    """Whether t's storage lies in a mapping hugepage_buffer made (and still alive)."""
    ptr = t.untyped_storage().data_ptr()
    return any(lo <= ptr < hi for lo, hi in list(_MAPPINGS.values()))  # (a snapshot: finalizers may pop meanwhile)


def place_in_hugepages(model: nn.Module, min_bytes: int = MIN_BYTES, copy: bool = True) -> int:
    """Move the model's CPU parameters and buffers whose storage holds >= min_bytes into huge-page mappings, one
    per storage (a weight released later, as the kernel plan drops a layout, frees its own); the bytes moved (0
    when not enabled). Tensors sharing a storage (views, tied weights) keep sharing it; storages already in such
    a mapping stay. copy=False re-points empty tensors (just allocated, to be filled) without reading them."""
    if not enabled():
        return 0
    moved = 0
    with torch.no_grad():
        for group in _storages(model, min_bytes).values():
            if in_hugepage_mapping(group[0]):
                continue
            old = group[0].untyped_storage()
            new = hugepage_buffer(old.nbytes())
            if copy:
                new.copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),), (1,)))
            storage, base = new.untyped_storage(), new.storage_offset()  # base: 2 MiB-aligned, so every dtype fits
            for t in group:
                t.set_(storage, base // t.element_size() + t.storage_offset(), t.size(), t.stride())
            moved += old.nbytes()
    return moved


def placed_bytes(model: nn.Module) -> int:
    """Bytes of the model's tensors that lie in huge-page mappings made here (a mapping's storage spans its
    alignment slack too: each storage counts its largest tensor)."""
    return sum(max(t.nbytes for t in g) for g in _storages(model, 0).values() if in_hugepage_mapping(g[0]))


def _storages(model: nn.Module, min_bytes: int) -> dict[int, list[torch.Tensor]]:
    """The model's plain CPU parameters and buffers by storage, those of storages holding >= min_bytes."""
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized:
                tensors.setdefault(id(t), t)
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors.values():
        if t.untyped_storage().nbytes() >= min_bytes:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return by_storage


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
