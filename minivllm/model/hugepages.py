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

The smaller tensors (from 4 KiB: W4A8's group scales of a 2048-wide projection are 256 KiB, norms 8 KiB) share one
mapping, packed in the model's order, each still its own storage (torch.save of one would otherwise carry the
whole mapping, and the placement's next call groups tensors by storage); a mapping each would cost a 2 MiB page a
tensor. In 4 KiB pages a stream of them restarts at every page (the hardware prefetcher stops at a page's end) and
walks the nested page tables: a 1B W4A8 decode's o and qkv projections streamed 22-24 GB/s with their scales in
4 KiB pages and 24-26 in huge pages, the whole step 1.02x (median of 5 pairs of processes, 0.97-1.03; a Sapphire
Rapids-class Xeon).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import time
import weakref
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 20  # a mapping of its own from here (its memory freed with it); smaller ones share one
SHARED_MIN_BYTES = 4 << 10  # smaller still (counters, tiny vectors) stay where they are: a page holds them anyway
ALIGN = 64  # each shared tensor starts on a cache line
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
    return hugepage_buffers([nbytes])[0]


def float_buffer(numel: int) -> torch.Tensor:
    """An uninitialised float32 tensor of numel: in a mapping of its own advised MADV_HUGEPAGE where enabled and at
    least MIN_BYTES (a weight layout made after loading: csrc/gemm_f32.c's panels, a 1B model's only copy where they
    are its one layout), else torch's."""
    if enabled() and numel * 4 >= MIN_BYTES:
        return hugepage_buffer(numel * 4).view(torch.float32)
    return torch.empty(numel)


def hugepage_buffers(sizes: list[int]) -> list[torch.Tensor]:
    """uint8 tensors of these sizes (each > 0) packed in one anonymous mapping advised MADV_HUGEPAGE, the first on a
    2 MiB boundary and each on a cache line; each its own storage (the mapping lives as long as any of them)."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    # Whole huge pages from the aligned start to past the end (the tail gets one too); untouched slack costs nothing.
    length = -(-end // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    start = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    _MAPPINGS[id(mm)] = (start, start + length)
    weakref.finalize(mm, _MAPPINGS.pop, id(mm), None)  # gone with the last tensor in it
    skip = -start % HUGE_PAGE
    # frombuffer: a storage of its own over those bytes, holding a reference to mm
    return [torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=skip + o)
            for n, o in zip(sizes, offsets, strict=True)]


def in_hugepage_mapping(t: torch.Tensor) -> bool:
    """Whether t's storage lies in a mapping hugepage_buffers made (and still alive)."""
    ptr = t.untyped_storage().data_ptr()
    return any(lo <= ptr < hi for lo, hi in list(_MAPPINGS.values()))  # (a snapshot: finalizers may pop meanwhile)


def place_in_hugepages(model: nn.Module, min_bytes: int = MIN_BYTES, copy: bool = True) -> int:
    """Move the model's CPU parameters and buffers whose storage holds >= min_bytes into huge-page mappings, one
    per storage (a weight released later, as the kernel plan drops a layout, frees its own), and those from
    SHARED_MIN_BYTES up to min_bytes into one mapping they share; the bytes moved (0 when not enabled). Tensors
    sharing a storage (views, tied weights) keep sharing it; storages already in such a mapping stay. copy=False
    re-points empty tensors (just allocated, to be filled) without reading them."""
    if not enabled():
        return 0
    groups = [g for g in _storages(model, max(1, min(min_bytes, SHARED_MIN_BYTES))).values()
              if not in_hugepage_mapping(g[0])]  # (an empty storage has nothing to move)
    large = [g for g in groups if g[0].untyped_storage().nbytes() >= min_bytes]
    small = [g for g in groups if g[0].untyped_storage().nbytes() < min_bytes]
    with torch.no_grad():
        for group in large:
            _move(group, hugepage_buffer(group[0].untyped_storage().nbytes()), copy)
        if small:
            for group, new in zip(small, hugepage_buffers([g[0].untyped_storage().nbytes() for g in small]),
                                  strict=True):
                _move(group, new, copy)
    return sum(g[0].untyped_storage().nbytes() for g in groups)


def _move(group: list[torch.Tensor], new: torch.Tensor, copy: bool) -> None:
    """Re-point the tensors of one storage at `new` (its size, cache-line aligned, offset 0 in its own storage)."""
    old = group[0].untyped_storage()
    if copy:
        new.copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),), (1,)))
    storage = new.untyped_storage()
    for t in group:
        t.set_(storage, t.storage_offset(), t.size(), t.stride())


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


def collapse_in_place(tensors: list[torch.Tensor], what: str = "") -> int:
    """Back the memory of tensors allocated elsewhere (oneDNN's packed weights: opaque, so place_in_hugepages cannot
    move them) with huge pages where they lie: MADV_COLLAPSE (Linux 6.1+) on each one's 2 MiB-aligned interior.
    The bytes collapsed (0 when not enabled, or where the kernel cannot).

    oneDNN's GEMM at a batched decode's 52 rows reads its packed weights cold, a layer after another: on a Zen 5
    EPYC (2 cores, 32 MiB L3) GPT-2's projections ran 360-380 GFLOP/s cold against 460-480 hot, and with the packed
    copies collapsed a 50-sequence decode step went 52.0 / 49.3 / 49.0 -> 49.0 / 47.4 / 47.5 ms (alternating
    processes). The collapse copies the pages once: ~1 s for GPT-2's 390 MB of packed weights (logged as `what`)."""
    if not enabled() or _madvise is None:
        return 0
    done, t0 = 0, time.perf_counter()
    for t in tensors:
        ptr, nbytes = _span(t)
        lo, hi = -(-ptr // HUGE_PAGE) * HUGE_PAGE, (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
        if hi > lo and _madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done += hi - lo
    if done and what:
        logger.info("%s: %.2f GB collapsed into huge pages in %.1f s", what, done / 1e9, time.perf_counter() - t0)
    return done


MADV_COLLAPSE = 25  # <linux/mman.h>; Python's mmap module names it from 3.14 only


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise() if sys.platform == "linux" else None


def _address(t: torch.Tensor) -> int:
    return int(torch.ops.mkldnn.data_ptr(t)) if t.is_mkldnn else t.data_ptr()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Where t's memory starts and how many bytes it holds (a strided tensor's whole storage)."""
    if t.is_mkldnn:
        return _address(t), int(torch.ops.mkldnn._nbytes(t))
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding t that the kernel backs with huge pages now (/proc/self/smaps; 0 if unknown)."""
    addr = _address(t)
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
