"""Builds the engine's Speculator from its speculative settings (engine_config.SpeculativeSettings): the n-gram
proposer, the suffix proposer, or a draft model checked against the target and given its own KV pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.spec_decode.draft_proposer import DraftModelProposer
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.proposer import Proposer
from minivllm.spec_decode.speculator import Speculator
from minivllm.spec_decode.suffix_proposer import SuffixProposer

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine_config import SpeculativeSettings


def build_speculator(spec: SpeculativeSettings, engine: LLMEngine) -> Speculator:
    """The speculator for spec.model ('ngram', 'suffix' or a draft model directory)."""
    generator = engine.sampler.generator
    proposer: Proposer
    if spec.model == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.model == "suffix":
        proposer = SuffixProposer(spec.num_speculative_tokens, *spec.suffix)
    else:
        cc = engine.cache_config
        # The draft's pool holds as many tokens as the target's (at a fraction of its bytes: a draft is small),
        # so it runs short no sooner than the target does; where it does, a sequence just proposes nothing.
        proposer = DraftModelProposer.build(spec.model, engine.config, engine.tokenizer, cc.num_blocks,
                                            cc.enable_prefix_caching, generator)
    return Speculator(proposer, spec.num_speculative_tokens, engine.max_model_len, spec.adaptive)
