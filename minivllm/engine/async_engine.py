"""AsyncLLMEngine: the engine loop on its own thread, an async stream of outputs per request.

Why a thread, not a process: the forward pass runs in oneDNN/ATen and the native kernels, which all release the GIL,
so the event loop only competes for the GIL during the step's short Python parts (~2% of a step). A thread shares the
tokenizer and needs no serialization of outputs; the measured event-loop lag and server/offline throughput ratio are
in BENCHMARKS.md (`minivllm bench serve`).

Why the model is built on the engine thread (`from_engine_args`): libgomp cuts its spin-wait to ~1000 iterations once
it manages more threads than there are cores, and every thread that ever ran a parallel region keeps a pool. With the
model loaded on the main thread and stepped on another, two pools exist and each of the hundreds of parallel regions
per step pays a futex wake-up: a 2-thread decode step measured 70 ms instead of 50 ms here. Built and stepped on one
thread, there is one pool.

Threading contract: requests are tokenized and validated on the caller's thread (they only read immutable engine
state); everything that mutates the engine (add, abort, step) happens on the engine thread, fed through one locked
inbox. Outputs go back with one `call_soon_threadsafe` per step."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch

from minivllm.config import EngineArgs, cpu_count
from minivllm.engine.async_stream import (
    Abort,
    AsyncStream,
    Call,
    ClientStalledError,
    EngineDeadError,
    EngineInbox,
    Item,
    QueueFullError,
    RequestFailedError,
    RequestTimeoutError,
    failure_text,
    settle,
)
from minivllm.engine.engine_readout import EngineReadout
from minivllm.engine.input_processor import EngineRequest, Prompt, RequestSpec, duplicate_request_id
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.lora_registry import LoadedLoRA
from minivllm.engine.request_lifecycle import TIMEOUT_REASON
from minivllm.engine.stats import IterationStats, LoggingStatLogger, SchedulerSnapshot, StatLogger
from minivllm.engine.step_trace import StepTracer
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine(EngineReadout):
    """Serves an LLMEngine to asyncio code: add requests, stream their outputs, abort them."""

    # A stream whose consumer has not taken an output for client_stall_timeout_s while more than this many wait
    # is dropped: its client stopped reading (the transport's buffers are full), and outputs would pile up.
    MAX_UNREAD = 16

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], stat_loggers: Sequence[StatLogger] = (),
                 batch_wait_ms: float = 0.0, max_waiting: int = 512, num_threads: int | None = None,
                 idle_tick_s: float = 1.0, client_stall_timeout_s: float = 30.0) -> None:
        """engine: an LLMEngine, or a factory that builds one on the engine thread (see the module doc);
        a factory runs now, and its errors are raised here."""
        self.stat_loggers, self.client_stall_timeout_s = list(stat_loggers), client_stall_timeout_s
        self.death_callbacks: list[Callable[[], object]] = []  # run on the event loop once the engine loop died
        self.batch_wait_s, self.max_waiting = batch_wait_ms / 1000.0, max_waiting
        self.num_threads, self.idle_tick_s = num_threads or cpu_count(), idle_tick_s
        self._inbox, self._snapshot = EngineInbox(), SchedulerSnapshot(0, 0, 0.0)
        self._streams: dict[str, AsyncStream] = {}  # event-loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_ready = threading.Event()
        self.dead_error: BaseException | None = None
        self.tracer = StepTracer()  # the live view's feed; costs nothing while nobody subscribes
        self._thread = threading.Thread(target=self._thread_main, args=(engine,), name="minivllm-engine", daemon=True)
        self.engine: LLMEngine
        if isinstance(engine, LLMEngine):
            self.engine = engine
            engine.log_stats = True
            return
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: Sequence[StatLogger] | None = None) -> AsyncLLMEngine:
        """Build the engine on its own thread from EngineArgs (the periodic log line is on by default)."""
        loggers = [LoggingStatLogger()] if stat_loggers is None else list(stat_loggers)
        return cls(lambda: LLMEngine(args, log_stats=True), loggers, args.batch_wait_ms, args.max_waiting,
                   args.num_threads, client_stall_timeout_s=args.client_stall_timeout)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start serving: call from the event loop that will consume the streams."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()
        self._loop_ready.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step."""
        self._inbox.stop()
        self._loop_ready.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """Whether the engine loop is alive and serving (what /health reports)."""
        return self._loop is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def snapshot(self) -> SchedulerSnapshot:
        """Gauges as of the last step (waiting includes requests not yet handed to the engine)."""
        return self._snapshot

    # ---- requests (event-loop thread) -----------------------------------------------------------
    def process_requests(self, request_id: str, prompts: list[Prompt], spec: RequestSpec) -> list[EngineRequest]:
        """Tokenize and validate one call's requests (ValueError names the problem) without queueing."""
        return self.engine.input_processor.process_call(request_id, prompts, spec)

    # ---- LoRA adapters (run on the engine thread: slots belong to it) ----------------------------------
    async def add_lora(self, name: str, path: str, adapter: Any = None) -> LoadedLoRA:
        """Load an adapter under a name between two steps; ValueError naming the problem."""
        return await self.call_engine(lambda eng: eng.add_lora(name, path, adapter))

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter between two steps (KeyError if unknown, ValueError while requests use it)."""
        await self.call_engine(lambda eng: eng.remove_lora(name))

    async def call_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the engine thread between two steps (LoRA slots belong to it): its result or exception."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({type(self.dead_error).__name__})")
        future = asyncio.get_running_loop().create_future()
        self._inbox.put([Call(fn, future)])
        return await future

    def check_room(self, n: int) -> None:
        """QueueFullError when n more requests would pass max_waiting; EngineDeadError when the loop is down."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({type(self.dead_error).__name__})")
        # Exact on this thread: every request in flight has a stream; the running count lags by at most
        # one step, which only overstates the queue for a moment.
        waiting = len(self._streams) - self._snapshot.num_running - self._snapshot.num_swapped
        if waiting + n > self.max_waiting:  # (a call larger than the queue: process_requests' 400)
            raise QueueFullError(f"server overloaded: {waiting} requests are waiting (max_waiting="
                                 f"{self.max_waiting}); retry later")

    def add_requests(self, requests: Sequence[EngineRequest]) -> list[AsyncStream]:
        """Queue requests together (they reach the engine in the same step); one stream each."""
        self.check_room(len(requests))
        seen: set[str] = set()
        for r in requests:  # the stream map must stay one stream per id
            if r.request_id in self._streams or r.request_id in seen:
                raise ValueError(duplicate_request_id(r.request_id))
            seen.add(r.request_id)
        streams = [AsyncStream(r.request_id, r.prompt_token_ids) for r in requests]
        for s in streams:
            self._streams[s.request_id] = s
        self._inbox.put(requests)
        return streams

    async def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncStream]:
        """add_requests as the servers call it (a replica router's submit waits for its replica to accept)."""
        return self.add_requests(requests)

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int | str = 0,
                          arrival_time: float | None = None, ttft_slo_ms: float | None = None) -> AsyncStream:
        """Validate and queue one request; its outputs arrive on the returned stream."""
        req = self.engine.process_request(request_id, prompt, params, priority, arrival_time, ttft_slo_ms)
        return self.add_requests([req])[0]

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op once it finished); its KV blocks are freed before the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        stream.finished = True
        self._inbox.put([Abort(request_id)])

    def abort_stream(self, stream: AsyncStream) -> None:
        """Abort the request of this stream, unless it finished (its id may already serve a newer request)."""
        if self._streams.get(stream.request_id) is stream:
            self.abort(stream.request_id)

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int | str = 0,
                       ttft_slo_ms: float | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; leaving early (cancel, break) aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority, ttft_slo_ms=ttft_slo_ms)
        try:
            async for out in stream:
                yield out
        finally:
            self.abort(request_id)

    # ---- event-loop side of the engine thread -----------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], failed: list[tuple[str, BaseException]]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]
                elif stream.num_unread > self.MAX_UNREAD and now - stream.last_read > self.client_stall_timeout_s:
                    del self._streams[out.request_id]
                    self._inbox.put([Abort(out.request_id)])  # its KV blocks are freed before the next step
                    stream.fail(ClientStalledError(
                        f"the client did not read its stream for {now - stream.last_read:.0f} s "
                        f"({stream.num_unread} outputs unread; client_stall_timeout={self.client_stall_timeout_s:g} "
                        "s); the request was aborted"))
        for rid, error in failed:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(error)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)

    def _post(self, outputs: list[RequestOutput], failed: Sequence[tuple[str, BaseException]] = ()) -> None:
        assert self._loop is not None
        if outputs or failed:
            try:
                self._loop.call_soon_threadsafe(self._deliver, outputs, list(failed))
            except RuntimeError:  # the event loop closed under us (server shutdown)
                pass

    def _post_failed(self) -> None:
        """The requests a fault failed in the last step (step_guard.py, timeouts): each stream gets its error."""
        failed = self.engine.take_failed_requests()
        if failed:
            self._post([], [(rid, (RequestTimeoutError if why.startswith(TIMEOUT_REASON) else RequestFailedError)(why))
                            for rid, why in failed.items()])

    # ---- the engine thread -------------------------------------------------------------------------
    def _apply(self, items: list[Item]) -> None:
        eng = self.engine
        for item in items:
            if isinstance(item, Abort):
                eng.abort_request(item.request_id)
            elif isinstance(item, Call):
                try:
                    result, error = item.fn(eng), None
                except Exception as e:
                    result, error = None, e
                assert self._loop is not None  # set by start(), before the engine thread runs
                self._loop.call_soon_threadsafe(settle, item.future, result, error)
            else:
                try:
                    eng.add_engine_request(item)
                except ValueError as e:  # validated already; only a duplicate id can get here
                    self._post([], [(item.request_id, e)])

    def _coalesce(self) -> None:
        """--batch-wait-ms: an idle engine (with static batching: one between batches) waits up to that long
        after the oldest waiting request's arrival for more to join its first step, until a batch is full."""
        sched = self.engine.scheduler
        if sched.running or not sched.waiting:
            return
        deadline = min(s.group.arrival_time for s in sched.waiting if s.group is not None) + self.batch_wait_s
        while ((left := deadline - time.time()) > 0 and not self._inbox.stopped
               and len(sched.waiting) < sched.config.max_num_seqs):
            self._apply(self._inbox.take(left))

    def _record(self, stats: IterationStats | None) -> None:
        """Hand the step's stats to the event loop, where the front end's loggers record them: the engine
        thread produces stats objects and never calls into the server's metrics (vLLM v1's direction)."""
        self._snapshot = snap = self.engine.snapshot(self._inbox.adds)
        if self._loop is None:
            return
        try:
            if self.tracer.active and stats is not None:  # a live view is watching
                self._loop.call_soon_threadsafe(self.tracer.publish, self.tracer.record(self.engine, stats))
            if self.stat_loggers:
                self._loop.call_soon_threadsafe(self._log_stats, stats, snap)
        except RuntimeError:  # the event loop closed under us (server shutdown)
            pass

    def _log_stats(self, stats: IterationStats | None, snap: SchedulerSnapshot) -> None:
        """On the event-loop thread: every stat logger records one step's stats (or an idle tick)."""
        for sl in self.stat_loggers:
            try:
                sl.record(stats, snap)
            except Exception:  # a broken metrics sink must not stop serving
                logger.exception("stat logger %r failed", sl)

    def _thread_main(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        # OpenMP thread counts are per calling thread: set them on the thread that runs the model.
        torch.set_num_threads(self.num_threads)
        if not isinstance(engine, LLMEngine):
            try:
                self.engine = engine()
                self.engine.log_stats = True
            except BaseException as e:
                self._build_error = e
                return
            finally:
                self._built.set()
        self._loop_ready.wait()
        if not self._inbox.stopped:
            self._run()

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._inbox.stopped:
                items = self._inbox.take(None if eng.has_unfinished_requests() else self.idle_tick_s)
                self._apply(items)
                if self.batch_wait_s > 0:
                    self._coalesce()
                if not eng.has_unfinished_requests():
                    self._record(eng.take_stats() if items else None)
                    continue
                try:
                    outputs = eng.step()
                except Exception as e:
                    self._fail_step(e)
                    continue
                self._record(eng.take_stats())
                self._post(outputs)
                self._post_failed()
        except BaseException as e:
            logger.exception("engine loop died")
            self.dead_error = e
            loop = self._loop
            if loop is not None and not loop.is_closed():
                died = EngineDeadError(f"the engine loop died ({type(e).__name__}; the server's log has the details)")
                loop.call_soon_threadsafe(self._fail_all, died)
                for callback in self.death_callbacks:
                    loop.call_soon_threadsafe(callback)

    def _fail_step(self, error: Exception) -> None:
        """A step raised: abort the requests it held, fail their streams, keep serving the rest."""
        failed = self.engine.take_failed_step()
        if not failed:  # not tied to any request (e.g. in the scheduler): retrying would fail forever
            raise error
        logger.exception("engine step failed; aborting %d request(s) in it: %s", len(failed), failed[:8])
        for rid in failed:
            self.engine.abort_request(rid)  # if this raises too, the engine state is broken: the loop dies
        self._record(self.engine.take_stats())
        err = RequestFailedError(f"internal error in an engine step: {failure_text(error)}")
        self._post([], [(rid, err) for rid in failed])
        self._post_failed()

