"""The engine's nested, frozen config (issue 32, item 5): built once from EngineArgs, passed whole to the engine and
its runner (and a draft model's runner, derived from it); every flag in one section, and the CLI grouped by them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from minivllm.config import ARG_SECTIONS, EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine_config import EngineConfig

SECTION_FIELDS = ("model", "cache", "scheduler", "parallel", "speculative", "lora", "observability", "serving")


def test_every_flag_belongs_to_one_section_of_the_config():
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    placed = [n for fields in ARG_SECTIONS.values() for n in fields]
    assert sorted(placed) == sorted(names)  # each field once: none missing, none twice, no stale name
    assert tuple(ARG_SECTIONS) == SECTION_FIELDS
    assert [f.name for f in dataclasses.fields(EngineConfig)] == ["model_config", *SECTION_FIELDS]


def test_the_cli_is_grouped_by_the_sections_and_builds_the_same_config(model_factory):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, positional_model=True)
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for section, fields in ARG_SECTIONS.items():
        assert groups[f"engine: {section}"] == set(fields), section
    path = model_factory("tiny-llama")
    ns = parser.parse_args([path, "--max-model-len", "64", "--swap-space", "1GiB", "--preemption-mode", "swap",
                            "--max-num-seqs", "7", "--enable-lora", "--lora-modules", f"a={path}", "--max-n", "3",
                            "--speculative-model", "ngram", "--num-speculative-tokens", "2"])
    cfg = EngineArgs.from_cli_args(ns).create_engine_config()
    assert cfg.model.max_model_len == 64 and cfg.model.dtype == torch.float32 and cfg.model.path == path
    assert cfg.cache.swap_space == 1 << 30 and cfg.cache.preemption_mode == "swap"
    assert cfg.scheduler.max_num_seqs == 7 and cfg.scheduler.max_num_batched_tokens == 512  # the CPU default
    assert cfg.lora is not None and cfg.lora.modules == (("a", path),)
    assert cfg.speculative is not None and cfg.speculative.num_speculative_tokens == 2
    assert cfg.serving.max_n == 3 and cfg.parallel.size == 1 and cfg.model_config.path == path
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.block_size = 8  # type: ignore[misc]


def test_the_engine_and_its_runners_read_one_config(model_factory, tmp_path):
    path = model_factory("tiny-llama")
    cfg = EngineArgs(model=path, num_kv_blocks=64, speculative_model=path, num_speculative_tokens=2,
                     quantization="int8").create_engine_config()
    engine = LLMEngine(cfg)
    assert engine.config is cfg and engine.runner.config is cfg  # passed whole, not copied field by field
    assert engine.cache_config.num_blocks == 64 and engine.scheduler_config is cfg.scheduler
    assert engine.speculator is not None
    draft = engine.speculator.proposer.runner.config  # type: ignore[attr-defined]
    assert draft.model.path == path and draft.model.quantization is None and draft.parallel.size == 1
    assert (draft.model.dtype, draft.model.device, draft.cache.block_size) == (cfg.model.dtype, cfg.model.device,
                                                                             cfg.cache.block_size)
    out = LLMEngine(EngineArgs(model=path, num_kv_blocks=64))  # EngineArgs still build an engine (resolved inside)
    assert out.config.model.max_model_len == cfg.model.max_model_len


def test_what_needs_the_checkpoint_is_refused_while_resolving(model_factory):
    args = EngineArgs(model=model_factory("tiny-llama"), max_model_len=10**6)
    with pytest.raises(ValueError, match="max_model_len 1000000 exceeds the model's context length"):
        args.create_engine_config()
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_model_len"):
        EngineArgs(model=args.model, max_model_len=256, max_num_batched_tokens=64,
                   enable_chunked_prefill=False).create_engine_config()
