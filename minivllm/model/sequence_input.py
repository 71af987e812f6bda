"""SequenceInput: what the runner needs of one scheduled sequence in a step (plain data; the model knows no
requests). The engine builds one per scheduled entry (a verification: one per token) and knows from each how many
logits rows the runner returns for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SequenceInput:
    """What the runner needs of one scheduled sequence (plain data; the model knows no requests)."""

    token_ids: list[int]  # tokens to compute this step
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    block_table: list[int]  # covers start_pos + len(token_ids) tokens
    sample: bool  # whether the logits of the last token are wanted
    all_logits: bool = False  # logits of every token of the chunk (prompt logprobs), not just the last
    lora: int = -1  # LoRA slot of its adapter (-1: the base model)
    group_tables: tuple[list[int], ...] = ()  # its block tables in the window KV groups after the first

    @property
    def num_logits_rows(self) -> int:
        """The logits rows execute returns for it: every token's (all_logits), the last one's (sample), or none."""
        return len(self.token_ids) if self.all_logits else int(self.sample)
