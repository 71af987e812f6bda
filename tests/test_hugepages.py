"""Weights in transparent huge pages (model/hugepages.py): moved without changing a value, tied weights stay tied,
views keep sharing their storage, a released weight frees its mapping, and the engine's output is unchanged."""

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
    assert moved == 4096 * 128 * 4 + 1024 * 1024 * 4 + 2 * 512 * 256 * 4  # the small bias and vector stay
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
    big = [m.embed.weight, m.other.weight, m.table]
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
