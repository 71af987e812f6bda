"""One engine replica of `minivllm serve --replicas N`: the Ray Serve deployment class that wraps an
AsyncLLMEngine, and the board its replicas report their metrics and health to.

A replica serves one call per front-end API call: `generate(requests)` streams tagged messages back
to the router (ray_client.RayEngineClient) over Ray Serve's streaming handle. The first message says
whether the engine accepted the requests (or why not: queue full, bad request, engine dead), so the
front can answer 429/400 or route elsewhere before it commits to a response; then one message per
output. Cancelling the call (the client went away) aborts the requests, freeing their KV blocks.

Why a board actor: a DeploymentHandle routes each call to one replica of its choosing and cannot
address a given replica, so the front cannot scrape them; each replica pushes its Prometheus families,
pid and engine state every PUSH_PERIOD_S instead, and the front reads all of them in one call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from minivllm.config import EngineArgs
from minivllm.engine.async_engine import AsyncLLMEngine, AsyncStream, EngineDeadError, QueueFullError
from minivllm.engine.async_stream import RequestTimeoutError
from minivllm.engine.input_processor import EngineRequest
from minivllm.engine.stats import LoggingStatLogger
from minivllm.entrypoints.metrics import FRONT_FAMILIES, ServerMetrics
from minivllm.gc_utils import freeze_startup_heap

logger = logging.getLogger(__name__)

PUSH_PERIOD_S = 1.0
# A replica that has not reported for this long is dead to the front (Ray replaces it; its entry goes).
STALE_AFTER_S = 4.0

# (family name, help, type, unit, [(sample name, labels, value)]): picklable, unlike prometheus objects.
Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """Where replicas report (pid, engine state, metrics); the front reads every live replica at once."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}

    def push(self, replica_id: str, report: dict[str, Any]) -> None:
        """One replica's latest report (replaces its previous one)."""
        report["seen"] = time.time()
        self._reports[replica_id] = report

    def gone(self, replica_id: str) -> None:
        """A replica that shut down cleanly."""
        self._reports.pop(replica_id, None)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Reports of the replicas heard from within STALE_AFTER_S (older ones are dropped)."""
        now = time.time()
        for rid in [r for r, rep in self._reports.items() if now - rep["seen"] > STALE_AFTER_S]:
            del self._reports[rid]
        return self._reports


def families(metrics: ServerMetrics) -> list[Family]:
    """The engine's metric families of a replica (the front counts HTTP and its own loop itself)."""
    out: list[Family] = []
    for m in metrics.registry.collect():
        if m.name in FRONT_FAMILIES or m.name.startswith("process_"):  # process_*: the front reports its own
            continue
        out.append((m.name, m.documentation, m.type, m.unit, [(s.name, dict(s.labels), s.value) for s in m.samples]))
    return out


def _serve_grpc_on_loopback() -> None:
    """On a loopback-only local cluster (launch.py), bind the inter-deployment gRPC server Serve starts in each
    replica once it is constructed to 127.0.0.1 rather than every interface ("[::]", fixed in Ray Serve): the
    replicas and the front share this machine, and nothing else should reach them."""
    import ray._private.ray_constants as ray_constants
    import ray.serve._private.replica as serve_replica

    if ray_constants.ENABLE_RAY_CLUSTER or getattr(serve_replica.add_port_to_grpc_server, "loopback", False):
        return
    add_port = serve_replica.add_port_to_grpc_server

    def add_loopback_port(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return add_port(server, f"127.0.0.1:{port}" if host in ("[::]", "0.0.0.0", "") else address)

    add_loopback_port.loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_loopback_port


class EngineReplica:
    """The deployment's class: one AsyncLLMEngine per replica process (see the module doc)."""

    async def __init__(self, engine_args: EngineArgs, model_name: str, board: Any) -> None:  # type: ignore[misc]
        # (an async constructor: Ray Serve awaits it in the replica)
        _serve_grpc_on_loopback()
        self.metrics = ServerMetrics(model_name)
        self.engine = AsyncLLMEngine.from_engine_args(engine_args, [LoggingStatLogger(), self.metrics])
        self.metrics.watch_experts(self.engine.expert_load)
        self.engine.start()
        freeze_startup_heap()  # the replica process lives as long as its engine (minivllm/gc_utils.py)
        self.replica_id = serve.get_replica_context().replica_tag
        self.board = board
        self.pid = os.getpid()
        self.node = socket.gethostname()
        self._pusher = asyncio.ensure_future(self._push_loop())
        logger.info("replica %s (pid %d) serving %s", self.replica_id, self.pid, engine_args.model)

    def describe(self) -> dict[str, Any]:
        """What the front needs to validate requests as this replica would (same model, same flags)."""
        eng = self.engine.engine
        cc, sv = eng.cache_config, eng.config.serving
        return {"model_path": self.engine.model_path, "max_model_len": self.engine.max_model_len,
                "max_num_seqs": self.engine.max_num_seqs, "max_waiting": self.engine.max_waiting,
                "num_speculative_tokens": self.engine.num_speculative_tokens,
                "vocab_size": eng.model_config.vocab_size, "kv_cache_mode": eng.config.cache.kv_cache_mode,
                "block_size": cc.block_size, "num_blocks": cc.num_blocks, "pool": eng.input_processor.pool,
                "ttft_slo_ms": sv.ttft_slo_ms, "limits": dataclasses.astuple(eng.input_processor.limits),
                "eos_token_ids": sorted(eng.eos_token_ids), "replica": self.replica_id, "pid": self.pid,
                "reasoning_parser": sv.reasoning_parser, "pooler": self.engine.pooler,
                "client_stall_timeout_s": self.engine.client_stall_timeout_s}

    def _report(self) -> dict[str, Any]:
        snap = self.engine.snapshot
        return {"pid": self.pid, "node": self.node, "running": self.engine.is_running,
                "dead_error": repr(self.engine.dead_error) if self.engine.dead_error else None,
                "num_running": snap.num_running, "num_waiting": snap.num_waiting,
                "kv_cache_usage": snap.kv_cache_usage, "families": families(self.metrics)}

    async def _push_loop(self) -> None:
        while True:
            try:
                self.board.push.remote(self.replica_id, self._report())
            except Exception:  # the board is the front's: if it is gone, so is the front
                logger.exception("replica %s could not report", self.replica_id)
            await asyncio.sleep(PUSH_PERIOD_S)

    def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose engine loop died is unhealthy (Ray replaces it)."""
        if not self.engine.is_running:
            raise RuntimeError(f"the engine loop is not running ({self.engine.dead_error!r})")

    async def generate(self, requests: list[EngineRequest]) -> AsyncIterator[list[tuple[Any, ...]]]:
        """Queue requests together and stream batches of messages: first ("accepted", replica) or
        ("rejected", status, message, retry_after), then ("out", index, RequestOutput) and ("failed",
        index, status, message), as many as are ready per item (one Ray object per engine step, not
        per request)."""
        try:
            streams = self.engine.add_requests(requests)
        except QueueFullError as e:
            yield [("rejected", 429, str(e), e.retry_after_s)]
            return
        except EngineDeadError as e:
            yield [("rejected", 503, str(e), None)]
            return
        except ValueError as e:
            yield [("rejected", 400, str(e), None)]
            return
        yield [("accepted", self.replica_id)]
        try:
            async for msgs in _tagged(streams):
                yield msgs
        finally:  # done, cancelled (the client left) or failed: nothing stays in the engine
            for s in streams:
                self.engine.abort_stream(s)

    def __del__(self) -> None:
        # Ray Serve calls this on a graceful shutdown or scale-down (not when the process is killed).
        try:
            self._pusher.cancel()
            self.board.gone.remote(self.replica_id)
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
        self.engine.shutdown()


async def _tagged(streams: list[AsyncStream]) -> AsyncIterator[list[tuple[Any, ...]]]:
    """Outputs of a call's streams as they come, tagged with the stream's index and batched by what is
    ready; a failed stream becomes ("failed", index, status, message) and the others go on."""
    queue: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait(("out", i, out))
        except EngineDeadError as e:
            queue.put_nowait(("failed", i, 503, str(e)))
        except RequestTimeoutError as e:  # dropped unstarted (504 only tags it across Ray; the front answers 503)
            queue.put_nowait(("failed", i, 504, str(e)))
        except Exception as e:  # noqa: BLE001 - a failed step: this request only
            queue.put_nowait(("failed", i, 500, str(e)))
        queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            left -= ready.count(None)
            msgs = [m for m in ready if m is not None]
            if msgs:
                yield msgs
    finally:
        for t in tasks:
            t.cancel()
