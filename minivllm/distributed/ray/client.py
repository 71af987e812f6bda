"""RayEngineClient: what the routes see in place of an AsyncLLMEngine when `minivllm serve --replicas N`
serves N Ray Serve replicas (distributed/ray/replica.py) behind one front.

The routes keep their code: they tokenize and validate here (the same InputProcessor rules and limits
as the replicas, built from one replica's description), `submit` routes the call to a replica and
waits for it to accept (so 429 and 400 are answered before a response starts), and the outputs arrive
on ordinary AsyncStreams. A replica that dies before any output of a call was sent gets the call
routed once more, to another replica; after that, the call's unfinished requests fail with a 503 that
names the replica. The board's reports give /health, the gauges and the replicas' metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from minivllm.distributed.ray.metrics import ReplicaCollector, RouterMetrics
from minivllm.distributed.ray.router import set_unhealthy
from minivllm.engine.async_stream import (
    AsyncStream,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestTimeoutError,
)
from minivllm.engine.input_processor import EngineRequest, InputProcessor, Prompt, RequestLimits, RequestSpec
from minivllm.engine.lora_registry import LoadedLoRA
from minivllm.engine.stats import SchedulerSnapshot, StatLogger
from minivllm.pooler_config import PoolerConfig
from minivllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

REFRESH_S = 0.5  # how often the front reads the board


@dataclass(slots=True, eq=False)
class _Call:
    """One API call's requests, routed together to one replica."""

    requests: list[EngineRequest]
    streams: list[AsyncStream]
    done: list[bool]
    replica: str | None = None
    gen: Any = None  # the DeploymentResponseGenerator of the current attempt
    task: asyncio.Task[None] | None = None
    sent: bool = False  # some output reached a stream (a retry would repeat it)
    retried: bool = False
    aborted: set[int] = field(default_factory=set)


class RayEngineClient:
    """Routes the server's calls to Ray Serve replicas; see the module doc."""

    def __init__(self, handle: Any, board: Any, info: dict[str, Any], tokenizer: Any, metrics: RouterMetrics,
                 collector: ReplicaCollector) -> None:
        self.handle = handle.options(stream=True)
        self.board = board
        self.metrics, self.collector = metrics, collector
        self.model_path: str = info["model_path"]
        self.max_model_len: int = info["max_model_len"]
        self.max_num_seqs: int = info["max_num_seqs"]
        self.max_waiting: int = info["max_waiting"]
        self.num_speculative_tokens: int = info["num_speculative_tokens"]
        self.reasoning_parser: str | None = info.get("reasoning_parser")
        self.pooler: PoolerConfig | None = info.get("pooler")
        self.client_stall_timeout_s: float = info["client_stall_timeout_s"]
        self.tokenizer = tokenizer
        bs = info["block_size"]
        self.input_processor = InputProcessor(tokenizer, info["vocab_size"], self.max_model_len, info["kv_cache_mode"],
                                              lambda n: -(-n // bs), info["num_blocks"], info["pool"],
                                              info.get("ttft_slo_ms"), limits=RequestLimits(*info["limits"]),
                                              # Guided requests compile here; each replica attaches the matchers.
                                              structured=StructuredOutputManager(tokenizer, info["vocab_size"],
                                                                                 frozenset(info["eos_token_ids"])),
                                              reasoning_parser=self.reasoning_parser)
        self.stat_loggers: list[StatLogger] = []  # build_app adds the server's metrics; the replicas feed their own
        # The front never exits for a replica: Serve restarts a dead one, and routing goes around it meanwhile.
        self.death_callbacks: list[Callable[[], object]] = []
        self.dead_error: BaseException | None = None
        self.reports: dict[str, dict[str, Any]] = {}
        self._snapshot = SchedulerSnapshot(0, 0, 0.0)
        self._calls: dict[int, tuple[_Call, int]] = {}  # id(stream) → (call, index)
        self._refresher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- what the routes read (AsyncLLMEngine's surface) ----------------------------------------------
    @property
    def is_running(self) -> bool:
        """At least one replica reports a running engine."""
        return self.dead_error is None and any(r.get("running") for r in self.reports.values())

    @property
    def snapshot(self) -> SchedulerSnapshot:
        """The replicas' gauges summed (KV usage: their mean)."""
        return self._snapshot

    def expert_load(self) -> dict[int, list[int]]:
        """None here: each replica's engine reports its own (ReplicaCollector labels them by replica)."""
        return {}

    @property
    def tracer(self) -> None:
        """No live view: each replica has its own engine (open a replica's own server to follow it)."""
        return None

    # The front routes by load, not by adapter: --enable-lora with --replicas is refused at start-up.
    lora_enabled = False
    max_lora_bytes = None

    @property
    def loras(self) -> dict[str, LoadedLoRA]:
        """None served."""
        return {}

    async def add_lora(self, name: str, path: str, adapter: Any = None) -> LoadedLoRA:
        """Refused: replicas serve no adapters."""
        raise ValueError("LoRA adapters are not served through --replicas")

    async def remove_lora(self, name: str) -> None:
        """Refused: replicas serve no adapters."""
        raise ValueError("LoRA adapters are not served through --replicas")

    def process_requests(self, request_id: str, prompts: list[Prompt], spec: RequestSpec) -> list[EngineRequest]:
        """Tokenize and validate as a replica would (ValueError names the problem); the front sets deadlines
        (with the replicas' --ttft-slo-ms, and the request's timeout), as requests arrive here. Replicas serve no
        LoRA adapters (the front lists none, so `lora` is always None here)."""
        return self.input_processor.process_call(request_id, prompts, spec)

    def start(self) -> None:
        """Start reading the board (call on the server's event loop)."""
        if self._refresher is None:
            self._loop = asyncio.get_running_loop()
            self._refresher = asyncio.ensure_future(self._refresh_loop())

    def shutdown(self) -> None:
        """Stop reading the board and cancel every call, whose replicas then abort their requests (any
        thread: the server calls it from a worker thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for call, _ in list(self._calls.values()):
            self._cancel(call)

    # ---- health -------------------------------------------------------------------------------------
    def update(self, reports: dict[str, dict[str, Any]]) -> None:
        """Take the board's reports: health, gauges, the replicas' metrics, the router's dead list."""
        self.reports = reports
        live = [r for r in reports.values() if r.get("running")]
        self._snapshot = SchedulerSnapshot(sum(r["num_running"] for r in live), sum(r["num_waiting"] for r in live),
                                           sum(r["kv_cache_usage"] for r in live) / max(1, len(live)))
        set_unhealthy(frozenset(rid for rid, r in reports.items() if not r.get("running")))
        self.collector.update(reports)
        self.metrics.on_reports(reports)
        if live:
            self.dead_error = None
        else:
            dead = "; ".join(f"{rid}: {r.get('dead_error')}" for rid, r in reports.items()) or "none reporting"
            self.dead_error = EngineDeadError(f"no healthy replica ({dead})")

    async def _refresh_loop(self) -> None:
        while True:
            try:
                self.update(await self.board.snapshot.remote())
            except Exception as e:  # noqa: BLE001 - the board (or the cluster) is gone
                self.dead_error = EngineDeadError(f"the Ray cluster is unreachable ({type(e).__name__})")
            await asyncio.sleep(REFRESH_S)

    # ---- calls --------------------------------------------------------------------------------------
    def check_room(self, n: int) -> None:
        """The replicas' queues are theirs: the front learns they are full when one refuses (submit's 429)."""
        if not self.is_running:
            raise EngineDeadError(str(self.dead_error or "no healthy replica"))

    async def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncStream]:
        """Route the requests (one call) to a replica and wait until it accepts them; one stream each.
        QueueFullError (429), ValueError (400) or EngineDeadError (503) when no replica takes them."""
        if not self.is_running:
            raise EngineDeadError(str(self.dead_error or "no healthy replica"))
        streams = [AsyncStream(r.request_id, r.prompt_token_ids) for r in requests]
        call = _Call(list(requests), streams, [False] * len(streams))
        try:
            await self._open(call)
        except BaseException:
            self._cancel(call)  # e.g. cancelled (the client left) after a replica accepted
            raise
        for i, s in enumerate(streams):
            self._calls[id(s)] = (call, i)
        call.task = asyncio.ensure_future(self._pump(call))
        return streams

    async def _open(self, call: _Call) -> None:
        """Route the call; one retry when its replica dies or its engine is dead before accepting."""
        for attempt in (0, 1):
            t0 = time.perf_counter()
            gen = self.handle.generate.remote(call.requests)
            call.gen = gen
            try:
                (first,) = await gen.__anext__()
            except ray.exceptions.RayError as e:
                if attempt == 0:
                    self.metrics.on_retry("replica_died")
                    continue
                self.metrics.on_failure("no_replica")
                raise EngineDeadError("no replica could take the request: the last one failed "
                                      f"({type(e).__name__})") from None
            if first[0] == "accepted":
                call.replica = first[1]
                self.metrics.on_routed(first[1], time.perf_counter() - t0)
                return
            _, status, message, retry_after = first
            if status == 429:
                raise QueueFullError(message, retry_after)
            if status == 400:
                raise ValueError(message)
            if attempt == 0:
                self.metrics.on_retry("replica_rejected")
                continue
            self.metrics.on_failure("no_replica")
            raise EngineDeadError(message)

    async def _pump(self, call: _Call) -> None:
        """Deliver the call's outputs; on a replica failure retry once if nothing was sent, else fail."""
        try:
            while True:
                try:
                    async for batch in call.gen:
                        self._deliver(call, batch)
                    return
                except ray.exceptions.RayError as e:
                    if all(call.done):  # every request had its answer; the call's end was lost, not its work
                        return
                    if call.sent or call.retried:
                        logger.warning("replica %s failed a call after output was sent: %r", call.replica, e)
                        self.metrics.on_failure("replica_died")
                        self._fail(call, EngineDeadError(
                            f"replica {call.replica} died while serving this request ({type(e).__name__}); it "
                            "was not retried since part of its output had been sent"))
                        return
                    call.retried = True
                    self.metrics.on_retry("replica_died")
                    logger.warning("replica %s failed a call before any output (%s); routing it again",
                                   call.replica, type(e).__name__)
                    try:
                        await self._open(call)
                    except Exception as e2:  # noqa: BLE001 - handed to the streams
                        self._fail(call, EngineDeadError(f"replica {call.replica} died and routing the request "
                                                         f"again failed: {e2}"))
                        return
        finally:
            for s in call.streams:
                self._calls.pop(id(s), None)

    def _deliver(self, call: _Call, batch: list[tuple[Any, ...]]) -> None:
        for msg in batch:
            i = msg[1]
            if call.done[i]:
                continue
            if msg[0] == "out":
                call.streams[i].put(msg[2])
                call.sent = True
                call.done[i] = msg[2].finished
            else:  # ("failed", i, status, message)
                call.done[i] = True
                error = {503: EngineDeadError, 504: RequestTimeoutError}.get(msg[2], RequestFailedError)
                call.streams[i].put(error(msg[3]))

    def _fail(self, call: _Call, error: BaseException) -> None:
        for i, s in enumerate(call.streams):
            if not call.done[i]:
                call.done[i] = True
                s.put(error)

    def abort_stream(self, stream: AsyncStream) -> None:
        """Abort a stream's request; once every unfinished request of its call is aborted, the call is
        cancelled and its replica aborts them (freeing their KV blocks)."""
        entry = self._calls.get(id(stream))
        if entry is None or entry[0].streams[entry[1]] is not stream:
            return
        call, i = entry
        if call.done[i]:  # its last output (or error) is already delivered: nothing runs to abort
            return
        stream.finished = True
        call.aborted.add(i)
        if all(call.done[j] or j in call.aborted for j in range(len(call.streams))):
            self._cancel(call)

    def _cancel(self, call: _Call) -> None:
        if call.gen is not None:
            call.gen.cancel()
        if call.task is not None:
            call.task.cancel()
        for s in call.streams:
            self._calls.pop(id(s), None)

