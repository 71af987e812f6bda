"""Builds the engine's Speculator from EngineArgs: the n-gram proposer, or a draft model checked against
the target and given its own KV pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.spec_decode.draft_proposer import DraftModelProposer
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.speculator import Proposer, Speculator

if TYPE_CHECKING:
    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine


def build_speculator(args: EngineArgs, engine: LLMEngine) -> Speculator:
    """The speculator for args.speculative_model ('ngram' or a draft model directory)."""
    assert args.speculative_model is not None
    generator = engine.sampler.generator
    proposer: Proposer
    if args.speculative_model == "ngram":
        proposer = NgramProposer(args.prompt_lookup_min, args.prompt_lookup_max)
    else:
        cc = engine.cache_config
        # The draft's pool holds as many tokens as the target's (at a fraction of its bytes: a draft is small),
        # so it runs short no sooner than the target does; where it does, a sequence just proposes nothing.
        proposer = DraftModelProposer.build(
            args.speculative_model, engine.model_config, engine.tokenizer, engine.dtype, engine.device,
            cc.num_blocks, cc.block_size, cc.enable_prefix_caching, args.attention_backend, args.linear_backend,
            args.enforce_eager, generator)
    return Speculator(proposer, args.num_speculative_tokens, engine.max_model_len, args.speculative_adaptive)
