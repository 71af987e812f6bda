"""Tensor-parallel ranks 1..N-1: processes spawned by rank 0's ModelRunner that only run the model.

Rank 0 (the engine's process) schedules, prepares each step's inputs and broadcasts them; every rank runs
the same forward on its shard (the collectives inside it join the shards), and rank 0 alone samples. The
process group uses gloo on CPU and NCCL on CUDA over a TCP rendezvous on 127.0.0.1. One tensor-parallel
engine per process at a time: starting another shuts the previous group down. Ranks are spawned without the
caller's main module (_without_main): a rank needs only minivllm, so a script piped on stdin, a notebook, or a
script with no `if __name__ == "__main__":` guard builds a tensor-parallel engine as it builds any other.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.distributed.shm_comm import GlooComm, ShmComm, set_comm, shm_supported
from minivllm.utils import free_port

logger = logging.getLogger(__name__)

# A rank that cannot join (a crash while loading) fails rank 0's start-up after this long, not never.
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _init(store: dist.TCPStore, rank: int, size: int, device: torch.device) -> None:
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size, timeout=JOIN_TIMEOUT)


def _connect(rank: int, size: int, shm_path: str | None, peers_dead: Any = None) -> GlooComm:
    """This rank's communicator: shared memory where supported (rank 0 created the file), else gloo. The file
    is unlinked once every rank has it open, so nothing is left in /dev/shm whatever happens later."""
    comm = GlooComm() if shm_path is None else ShmComm(shm_path, rank, size, peers_dead)
    set_comm(comm)
    dist.barrier()
    if rank == 0 and shm_path is not None:
        os.unlink(shm_path)
    return comm


def worker_main(rank: int, size: int, port: int, threads: int, runner_kwargs: dict[str, Any],
                shm_path: str | None = None) -> None:
    """A rank > 0: join the group, build this rank's shard, then run whatever rank 0 broadcasts."""
    from minivllm.engine_config import ParallelConfig
    from minivllm.model.runner import ModelRunner

    torch.set_num_threads(threads)
    device = runner_kwargs["config"].model.device
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=JOIN_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    _init(store, rank, size, device)
    comm = _connect(rank, size, shm_path)
    runner = ModelRunner(**runner_kwargs, parallel=ParallelConfig(rank, size))
    with torch.inference_mode():
        while True:
            op, args = comm.broadcast_object(None)
            if op == "stop":
                break
            getattr(runner, op)(*args)
    set_comm(None)
    dist.destroy_process_group()


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """While ranks start: the main module hidden from multiprocessing's spawn, which would otherwise run it again
    in every rank (a script's top level builds the engine again: ranks spawning ranks) or, for a script piped on
    stdin, fail to find '<stdin>'. The ranks' target and arguments come from minivllm alone."""
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {k: main.__dict__.pop(k) for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__spec__ = None  # spawn reads it unconditionally
    try:
        yield
    finally:
        del main.__spec__
        main.__dict__.update(saved)


class TensorParallelGroup:
    """Rank 0's handle: the spawned ranks and the command broadcast."""

    _active: TensorParallelGroup | None = None

    def __init__(self, size: int, threads: int, runner_kwargs: dict[str, Any]) -> None:
        if TensorParallelGroup._active is not None:
            TensorParallelGroup._active.shutdown()
        if dist.is_initialized():
            raise RuntimeError("tensor parallelism: this process already belongs to a torch.distributed group")
        port = free_port()
        device = runner_kwargs["config"].model.device
        shm_path = None
        if shm_supported(device) and os.environ.get("MINIVLLM_TP_COMM", "shm") == "shm":
            shm_path = ShmComm.create(size)  # every rank maps it in _connect
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(r, size, port, threads, runner_kwargs, shm_path),
                                  daemon=True,
                                  name=f"minivllm-tp{r}") for r in range(1, size)]
        with _without_main():
            for p in self.procs:
                p.start()
        self._wait_joined(store, size)
        _init(store, 0, size, device)
        self.comm = _connect(0, size, shm_path, self.dead_rank)
        self.alive = True
        TensorParallelGroup._active = self
        atexit.register(self.shutdown)

    def _wait_joined(self, store: dist.TCPStore, size: int) -> None:
        """Until every rank has reached the rendezvous; a rank that exits first is an error now, not a
        two-minute wait."""
        keys = [f"joined/{r}" for r in range(1, size)]
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while not store.check(keys):
            for r, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    raise RuntimeError(
                        f"tensor parallelism: rank {r} exited with code {p.exitcode} while starting (its output is "
                        "above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallelism: ranks did not join within {JOIN_TIMEOUT}")
            time.sleep(0.05)

    def dead_rank(self) -> str | None:
        """'rank N exited with code C' for the first rank that is gone, else None."""
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return f"rank {r} exited with code {p.exitcode}"
        return None

    def command(self, op: str, *args: Any) -> None:
        """Every other rank runs runner.<op>(*args) (rank 0 runs it itself, right after)."""
        self.comm.broadcast_object((op, args))

    def shutdown(self) -> None:
        """Stop the ranks and leave the group (idempotent)."""
        if not self.alive:
            return
        self.alive = False
        try:
            self.command("stop")
        except Exception as e:  # noqa: BLE001 - a rank already gone: the others are terminated below
            logger.warning("tensor parallelism: shutdown: %s", e)
        set_comm(None)
        self.comm.close()
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            logger.warning("tensor parallelism: leaving the group: %s", e)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if TensorParallelGroup._active is self:
            TensorParallelGroup._active = None
