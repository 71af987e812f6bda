"""Tensor-parallel ranks 1..N-1: processes spawned by rank 0's ModelRunner that only run the model.

Rank 0 (the engine's process) schedules, prepares each step's inputs and broadcasts them; every rank runs
the same forward on its shard (the collectives inside it join the shards), and rank 0 alone samples. The
process group uses gloo on CPU and NCCL on CUDA over a TCP rendezvous on 127.0.0.1. One tensor-parallel
engine per process at a time: starting another shuts the previous group down.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

# A rank that cannot join (a crash while loading) fails rank 0's start-up after this long, not never.
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _init(rank: int, size: int, address: str, device: torch.device) -> None:
    dist.init_process_group(_backend(device), init_method=address, rank=rank, world_size=size, timeout=JOIN_TIMEOUT)


def worker_main(rank: int, size: int, address: str, threads: int, runner_kwargs: dict[str, Any]) -> None:
    """A rank > 0: join the group, build this rank's shard, then run whatever rank 0 broadcasts."""
    from minivllm.model.parallel import ParallelConfig
    from minivllm.model.runner import ModelRunner

    torch.set_num_threads(threads)
    device = runner_kwargs["device"]
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    _init(rank, size, address, device)
    runner = ModelRunner(**runner_kwargs, parallel=ParallelConfig(rank, size))
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            op, args = box[0]
            if op == "stop":
                break
            getattr(runner, op)(*args)
    dist.destroy_process_group()


class TensorParallelGroup:
    """Rank 0's handle: the spawned ranks and the command broadcast."""

    _active: TensorParallelGroup | None = None

    def __init__(self, size: int, threads: int, runner_kwargs: dict[str, Any]) -> None:
        if TensorParallelGroup._active is not None:
            TensorParallelGroup._active.shutdown()
        if dist.is_initialized():
            raise RuntimeError("tensor parallelism: this process already belongs to a torch.distributed group")
        address = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(r, size, address, threads, runner_kwargs), daemon=True,
                                  name=f"minivllm-tp{r}") for r in range(1, size)]
        for p in self.procs:
            p.start()
        _init(0, size, address, runner_kwargs["device"])
        self.alive = True
        TensorParallelGroup._active = self
        atexit.register(self.shutdown)

    def command(self, op: str, *args: Any) -> None:
        """Every other rank runs runner.<op>(*args) (rank 0 runs it itself, right after)."""
        dist.broadcast_object_list([(op, args)], src=0)

    def shutdown(self) -> None:
        """Stop the ranks and leave the group (idempotent)."""
        if not self.alive:
            return
        self.alive = False
        try:
            self.command("stop")
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - a rank already gone: terminate what is left
            logger.warning("tensor parallelism: shutdown: %s", e)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if TensorParallelGroup._active is self:
            TensorParallelGroup._active = None
