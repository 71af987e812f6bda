"""Weights in transparent huge pages (model/hugepages.py): moved without changing a value, tied weights stay tied,
views keep sharing their storage, a released weight frees its mapping, small tensors share one mapping as storages
of their own, and the engine's output is unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.model import hugepages


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 128)
        self.head = nn.Linear(128, 4096, bias=False)
        self.head.weight = self.embed.weight  # tied, as the LM head of a tied checkpoint
        self.other = nn.Linear(1024, 1024)
        self.register_buffer("table", torch.randn(2, 512, 256))
        self.table_view = self.table[1]  # not a buffer: keeps its own (old) storage
        self.small = nn.Parameter(torch.randn(16))


@pytest.mark.skipif(not hugepages.enabled(), reason="transparent huge pages are off (or not Linux)")
def test_large_tensors_move_into_huge_pages_with_their_values_and_ties():
    torch.manual_seed(0)
    m = _Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    small_ptr = m.small.data_ptr()
    moved = hugepages.place_in_hugepages(m)
    # the bias (4 KiB) into the shared mapping; the 64-byte vector stays
    assert moved == 4096 * 128 * 4 + 1024 * 1024 * 4 + 2 * 512 * 256 * 4 + 1024 * 4
    assert m.head.weight is m.embed.weight and m.small.data_ptr() == small_ptr
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    for t in (m.embed.weight, m.other.weight, m.table):
        assert t.data_ptr() % hugepages.HUGE_PAGE == 0  # each mapping starts on a 2 MiB boundary
    assert hugepages.huge_page_bytes(m.other.weight) > 0  # the kernel backs it with huge pages
    # One mapping per weight: dropping one leaves the others readable.
    del m.other
    assert torch.equal(m.embed.weight, before["embed.weight"])


@pytest.mark.skipif(not hugepages.enabled(), reason="transparent huge pages are off (or not Linux)")
def test_what_is_placed_stays_and_empty_tensors_move_without_a_copy():
    m = _Tied()
    big = [m.embed.weight, m.other.weight, m.table, m.other.bias]
    assert hugepages.placed_bytes(m) == 0
    moved = hugepages.place_in_hugepages(m, copy=False)  # the loader's first call, on tensors about to be filled
    assert moved == hugepages.placed_bytes(m) == sum(t.nbytes for t in big)
    assert all(hugepages.in_hugepage_mapping(t) for t in big) and not hugepages.in_hugepage_mapping(m.small)
    ptrs = [t.data_ptr() for t in big]
    assert hugepages.place_in_hugepages(m) == 0 and [t.data_ptr() for t in big] == ptrs  # the final call: no move
    m.other.weight.data = torch.ones(1024, 1024)  # replaced after the load (as quantizing or sharding does)
    assert hugepages.place_in_hugepages(m) == 1024 * 1024 * 4 and torch.equal(m.other.weight, torch.ones(1024, 1024))
    assert hugepages.in_hugepage_mapping(m.other.weight) and m.embed.weight.data_ptr() == ptrs[0]


@pytest.mark.skipif(not hugepages.enabled(), reason="transparent huge pages are off (or not Linux)")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_loader_reads_a_float_checkpoint_straight_into_huge_pages(model_factory, monkeypatch, quantization):
    """The loader's first placement (copy=False, on the empty tensors) takes every parameter, which the load then fills
    where they are, so its last placement leaves them in place; quantized weights, made after the load, are what the
    last one moves."""
    from minivllm.model import loader

    calls: list[tuple[bool, int, dict[str, int]]] = []

    def place(model, copy=True):  # every tensor counts as large here: the tiny model's are all under 1 MiB
        moved = hugepages.place_in_hugepages(model, min_bytes=0, copy=copy)
        calls.append((copy, moved, {n: p.data_ptr() for n, p in model.named_parameters()}))
        return moved

    monkeypatch.setattr(loader, "place_in_hugepages", place)
    llm = LLM(model_factory("tiny-llama"), num_kv_blocks=64, quantization=quantization)
    assert [c[0] for c in calls] == [False, True] and calls[0][1] > 0
    assert calls[1][2] == {k: v for k, v in calls[0][2].items() if k in calls[1][2]}  # the parameters stayed put
    if quantization is None:
        assert set(calls[1][2]) == set(calls[0][2])
    else:
        assert calls[1][1] > 0  # the int8 weights and scales
    for p in llm.llm_engine.runner.model.parameters():
        assert hugepages.in_hugepage_mapping(p)


class _Small(nn.Module):
    """A quantized layer's shape: a large weight with small scales, norms and a bias beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.randint(0, 255, (2048, 1024), dtype=torch.uint8))
        self.register_buffer("scales", torch.randn(2048, 64).half())  # 256 KiB
        self.norm = nn.Parameter(torch.randn(2048))  # 8 KiB
        self.bias = nn.Parameter(torch.randn(1030))  # 4120 B: not a whole number of cache lines
        self.register_buffer("counts", torch.zeros(16, dtype=torch.int64))  # 128 B: stays
        self.scales_t = self.scales.t()  # a view of the scales (not a buffer)


@pytest.mark.skipif(not hugepages.enabled(), reason="transparent huge pages are off (or not Linux)")
def test_small_tensors_share_one_mapping_each_its_own_storage_on_a_cache_line():
    torch.manual_seed(1)
    m = _Small()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    counts_ptr = m.counts.data_ptr()
    moved = hugepages.place_in_hugepages(m)
    small = [m.norm, m.bias, m.scales]  # as the module lists them: parameters, then buffers
    assert moved == m.qweight.nbytes + sum(t.nbytes for t in small) == hugepages.placed_bytes(m)
    assert m.counts.data_ptr() == counts_ptr and not hugepages.in_hugepage_mapping(m.counts)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert m.qweight.data_ptr() % hugepages.HUGE_PAGE == 0
    ptrs = [t.data_ptr() for t in small]
    assert ptrs[0] % hugepages.HUGE_PAGE == 0 and all(p % hugepages.ALIGN == 0 for p in ptrs)
    assert ptrs == sorted(ptrs) and ptrs[2] - ptrs[0] < hugepages.HUGE_PAGE  # packed, in the model's order
    assert len({t.untyped_storage().data_ptr() for t in small}) == 3  # each its own storage
    assert hugepages.huge_page_bytes(m.scales) > 0 and ptrs[1] - ptrs[0] == m.norm.nbytes
    assert ptrs[2] - ptrs[1] == -(-m.bias.nbytes // hugepages.ALIGN) * hugepages.ALIGN
    assert m.scales_t.data_ptr() != m.scales.data_ptr()  # (a non-buffer view keeps its old storage, as before)
    # as the quantized checkpoint's writer saves them (model/quantized_checkpoint.py)
    from safetensors.torch import save

    assert save({"scales": m.scales, "norm": m.norm.detach(), "bias": m.bias.detach()})
    del m.norm  # the others stay readable while the mapping lives
    assert torch.equal(m.bias, before["bias"]) and hugepages.place_in_hugepages(m) == 0


def test_nothing_moves_when_turned_off(monkeypatch):
    monkeypatch.setenv("MINIVLLM_HUGEPAGES", "0")
    m = _Tied()
    ptr = m.embed.weight.data_ptr()
    assert hugepages.place_in_hugepages(m) == 0 and m.embed.weight.data_ptr() == ptr


def test_engine_output_is_the_same_with_and_without_huge_pages(model_factory, monkeypatch):
    path = model_factory("tiny-llama")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(path, num_kv_blocks=64, quantization="int8")
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]

    placed = run()
    monkeypatch.setenv("MINIVLLM_HUGEPAGES", "0")
    assert run() == placed


@pytest.mark.skipif(not (hugepages.enabled() and torch.backends.mkldnn.is_available()),
                    reason="transparent huge pages are off (or not Linux), or no oneDNN")
def test_packed_onednn_weights_are_collapsed_into_huge_pages_where_they_lie(monkeypatch):
    """oneDNN's packed weights are opaque (place_in_hugepages cannot move them): MADV_COLLAPSE backs their 2 MiB-
    aligned interior with huge pages in place, the values unchanged; turned off, nothing is collapsed."""
    from minivllm.model.layers import Linear

    torch.manual_seed(0)
    lin = Linear(768, 3072)  # 9 MiB packed
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    lin.pack()
    x = torch.randn(52, 768)
    before = lin(x)
    done = hugepages.collapse_in_place([lin.packed])
    if done == 0:
        pytest.skip("this kernel does not collapse (MADV_COLLAPSE needs Linux 6.1+)")
    assert done >= 3 * hugepages.HUGE_PAGE and done % hugepages.HUGE_PAGE == 0  # 9 MiB hold 3-4 aligned pages
    assert hugepages.huge_page_bytes(lin.packed) >= done
    assert torch.equal(lin(x), before)
    monkeypatch.setenv("MINIVLLM_HUGEPAGES", "0")
    assert hugepages.collapse_in_place([lin.packed]) == 0


@pytest.mark.skipif(not hugepages.enabled(), reason="transparent huge pages are off (or not Linux)")
def test_the_native_gemms_panels_are_among_the_copies_the_runner_collapses():
    """Linear.kernel_copies (what the runner hands collapse_in_place once the plan is made) holds the panels of
    csrc/gemm_f32.c where the plan runs it, and collapsing them changes no output."""
    from minivllm.model import cpu_kernels
    from minivllm.model.kernel_plan import plan_kernels
    from minivllm.model.layers import Linear

    if not cpu_kernels.available():
        pytest.skip("no native kernels on this machine")
    torch.manual_seed(0)
    lin = Linear(768, 3072)  # 9 MiB of panels
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    lin.allow_panels = True
    plan_kernels([lin], "native")
    lin.release_unused()
    assert lin._panels is not None
    panels = lin._panels.panels
    assert any(t is panels for t in lin.kernel_copies())
    x = torch.randn(52, 768)
    before = lin(x)
    done = hugepages.collapse_in_place(lin.kernel_copies())
    if done == 0:
        pytest.skip("this kernel does not collapse (MADV_COLLAPSE needs Linux 6.1+)")
    assert hugepages.huge_page_bytes(panels) >= done >= 3 * hugepages.HUGE_PAGE
    assert torch.equal(lin(x), before)
