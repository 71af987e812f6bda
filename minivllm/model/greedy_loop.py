"""GreedyLoop: a draft model's greedy proposal round (catch-up forward, then k - 1 forwards each fed the argmax
of the last) as one native call, csrc/greedy_loop.c, on the model's DecodeStack.

From Python each of a round's forwards cost ~1 ms around the draft's 0.13 ms of native layers (input packing,
attention metadata, the LM head's module call, the argmax), so a round of the shipped draft cost half a target
step and the adaptive rule proposed one token where the draft's acceptance pays for four. It is taken where the
stack would run every forward anyway (the shape classes of the round's row counts all native, one KV group, no
LoRA) and the embedding is a plain lookup; everything else keeps the Python loop.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from minivllm.model import cpu_kernels
from minivllm.model.decode_stack import DecodeStack, Proj, proj_table
from minivllm.model.kernel_plan import shape_class

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _GreedyHead(ctypes.Structure):  # csrc/greedy_loop.c's greedy_head_t
    _fields_ = [("embed", _p), ("embed_bf16", _i64), ("head", Proj), ("logits", _p), ("sampled", _p),
                ("slots", _p), ("positions", _p), ("tokens", _p)]


class GreedyLoop:
    """Greedy proposal rounds of one model on its decode stack."""

    def __init__(self, stack: DecodeStack, embed: torch.Tensor, head: cpu_kernels.GemvWeights, sinks: int) -> None:
        lib = cpu_kernels.load_library()
        assert lib is not None
        self._fn = lib.greedy_round_f32
        self.stack, self.sinks = stack, sinks
        self._keep = (embed, head)
        self.table = _GreedyHead(embed=embed.data_ptr(), embed_bf16=int(embed.dtype == torch.bfloat16),
                                 head=proj_table(head))
        self.vocab, self.hidden = head.n, stack.hidden
        self._rows = 0  # the work buffers' capacity in rows
        self._h = self._logits = self._sampled = torch.empty(0)
        self._slots = self._positions = self._tokens = torch.empty(0, dtype=torch.int64)

    @staticmethod
    def build(model: Any, sinks: int) -> GreedyLoop | None:
        """The loop for a runner's model, or None where its forwards would not all run on the decode stack."""
        stack: DecodeStack | None = getattr(model, "decode_stack", None)
        spec = getattr(model, "spec", None)
        if stack is None or stack.num_groups != 1 or spec is None or spec.embed_scale != 1.0:
            return None
        embed = model.embed_tokens.weight.detach()
        head = model.lm_head
        if embed.dtype not in (torch.float32, torch.bfloat16) or not embed.is_contiguous() \
                or not hasattr(head, "gemv_weights") or getattr(head, "weight", True) is None:
            return None  # (a plain Linear whose float weight was dropped for oneDNN's packed copy)
        return GreedyLoop(stack, embed, head.gemv_weights(), sinks)

    def runs(self, row_counts: list[int]) -> bool:
        """Whether forwards of these row counts all run on the stack (its plan may change as the engine runs)."""
        return all(self.stack.native_classes[shape_class(m)] for m in row_counts)

    def _reserve(self, rows: int) -> None:
        if rows > self._rows:
            self._rows = max(rows, 2 * self._rows)
            n = self._rows
            self._h = torch.empty(n, self.hidden)
            self._logits, self._sampled = torch.empty(n, self.vocab), torch.empty(n, self.hidden)
            self._slots, self._positions = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
            self._tokens = torch.empty(n, dtype=torch.int64)
            t = self.table
            t.logits, t.sampled, t.slots = self._logits.data_ptr(), self._sampled.data_ptr(), self._slots.data_ptr()
            t.positions, t.tokens = self._positions.data_ptr(), self._tokens.data_ptr()

    def round(self, tokens: np.ndarray, positions: np.ndarray, tables0: torch.Tensor, last: np.ndarray,
              steps: np.ndarray, tables: torch.Tensor) -> np.ndarray:
        """A catch-up forward over decode rows (tokens, positions [R] int64; tables0 [R, B] int64, each row its
        sequence's block table), whose rows `last` [S] give each sequence's first proposal; then sequence j
        proposes steps[j] tokens in all (steps non-increasing, each >= 1) reading tables [S, B]. Returns the
        proposals [S, steps[0]] (row j valid up to steps[j]); their K/V is written up to the next-to-last."""
        rows, seqs, kmax = len(tokens), len(last), int(steps[0])
        self._reserve(max(rows, seqs))
        self.stack.reserve(max(rows, seqs), int(positions.max()) + kmax)
        self.stack.step.sinks = self.sinks
        out = np.empty((seqs, kmax), np.int64)
        self._fn(*self.stack.native_args(), ctypes.addressof(self.table),
                 rows, tokens.ctypes.data, positions.ctypes.data, tables0.data_ptr(), tables0.stride(0),
                 last.ctypes.data, seqs, steps.ctypes.data, tables.data_ptr(), tables.stride(0), self._h.data_ptr(),
                 self.stack.residual.data_ptr(), out.ctypes.data)  # (the stack's own residual rows, reserved above)
        return out
