"""--runner pooling: the engine serves embeddings. Requests are prefill-only and batched by the same scheduler as
generation (chunked prefill, the token budget, preemption); the runner hands back final hidden states instead of
logits (every token's for MEAN / CLS pooling, the last one's for LAST), and this processor pools them per request
across its chunks. When a prompt's last chunk is done the request finishes with its vector: nothing is sampled and no
KV is kept (its blocks go back to the pool; prefix caching is off in this mode, since a cached prefix's tokens would
miss the mean).

The per-sequence partial sums are this feature's own state (a StepHook): a sequence preempted or aborted mid-prompt
drops them, and its prefill, restarted, pools from the first token again."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from minivllm.engine.hooks import StepHook
from minivllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from minivllm.pooler_config import PoolerConfig

if TYPE_CHECKING:
    from minivllm.engine.request_lifecycle import RequestLifecycle
    from minivllm.engine.scheduler import SchedulerOutput
    from minivllm.engine.step_guard import Span
    from minivllm.model.runner import SequenceInput

logger = logging.getLogger(__name__)


class PoolingProcessor(StepHook):
    """Pools each prompt's hidden states as its chunks are computed, and finishes it with the vector."""

    def __init__(self, config: PoolerConfig, requests: RequestLifecycle | None = None) -> None:
        self.config = config
        self.requests = requests  # set by the engine once its request lifecycle exists
        self._partial: dict[int, torch.Tensor] = {}  # seq_id → MEAN: the float32 sum so far; CLS: the first state
        logger.info("runner pooling: %s pooling, %snormalized (%s)", config.pooling_type,
                    "" if config.normalize else "not ", config.source)

    def sequence_finished(self, seq: Sequence) -> None:
        self._partial.pop(seq.seq_id, None)

    def process(self, sched: SchedulerOutput, inputs: list[SequenceInput], spans: list[Span], hidden: torch.Tensor
                ) -> list[SequenceGroup]:
        """After the forward: pool every scheduled chunk's rows; finish the prompts that are complete (the groups
        touched, whose outputs carry their vectors)."""
        assert self.requests is not None
        kind = self.config.pooling_type
        touched: list[SequenceGroup] = []
        for (seq, n), (i0, _, r0, r1) in zip(sched.scheduled, spans, strict=True):
            rows = hidden[r0:r1]
            key = seq.seq_id
            if kind == "MEAN":
                part = rows.sum(0, dtype=torch.float32)
                self._partial[key] = part if key not in self._partial else self._partial[key] + part
            elif kind == "CLS" and inputs[i0].start_pos == 0:
                self._partial[key] = rows[0].float()
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                continue  # more chunks to come
            if kind == "LAST":
                vector = rows[-1].float()
            else:
                vector = self._partial.pop(key)
                if kind == "MEAN":
                    vector = vector / seq.num_prompt_tokens
            if self.config.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            group = seq.group
            assert group is not None
            group.embedding = vector.cpu().tolist()
            self.requests.finish(seq, SequenceStatus.FINISHED_STOPPED)
            touched.append(group)
        return touched
