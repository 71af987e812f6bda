"""SLO-aware scheduling (issue 19): priority classes, TTFT deadlines, class-aware admission and preemption, the
deadline-miss metric, and bad input at every API. Time is scripted: the scheduler's clock is a fake one that
moves a fixed second per step, so every deadline is a number of steps and nothing asserts on the wall clock."""

from __future__ import annotations

import asyncio
import json
import math
import random

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import free_port, in_process_server, metrics, wait_idle
from websockets.sync.client import connect

from minivllm import EngineArgs
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.stats import SchedulerSnapshot
from minivllm.engine_config import SchedulerConfig
from minivllm.entrypoints.api_server import build_app
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc
from minivllm.entrypoints.server_args import ServerArgs
from minivllm.sampling_params import SamplingParams
from minivllm.slo import TtftSlo, priority_class, resolve_priority

INTERACTIVE, BATCH, BACKGROUND = 0, 1, 2
_arrival = iter(range(10**9))


# ---- the scheduler alone ---------------------------------------------------------------------------------
def _seq(rid: str, n: int, priority: int = 0, deadline: float = math.inf) -> Sequence:
    """A sequence with a prompt of n tokens unique to it (no prefix-cache hits) and a TTFT deadline."""
    k = next(_arrival)
    seq = Sequence(rid, [1000 * (k + 1) + i for i in range(n)], SamplingParams(), k, priority)
    seq.ttft_deadline = deadline
    return seq


def _sched(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8, block_size: int = 4) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_seqs, budget, True), BlockManager(num_blocks, block_size))
    s.clock = lambda: 0.0
    return s


def _advance(s: Scheduler, out) -> None:
    """What the engine does after the forward: count computed tokens, append a token when sampled."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        s.bm.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1)


def _ids(pairs) -> list[str]:
    return [q.request_id for q, _ in pairs]


def test_waiting_order_is_class_then_earliest_deadline_then_arrival():
    s = _sched(budget=1000)
    seqs = [_seq("batch-late", 4, BATCH, 50.0), _seq("i-none", 4, INTERACTIVE), _seq("i-late", 4, INTERACTIVE, 9.0),
            _seq("bg", 4, BACKGROUND, 1.0), _seq("i-soon", 4, INTERACTIVE, 2.0), _seq("batch-soon", 4, BATCH, 5.0),
            _seq("i-soon-2", 4, INTERACTIVE, 2.0)]
    for q in seqs:
        s.add(q)
    # Within a class the earliest deadline first (equal deadlines: first come), no deadline after every deadline.
    expected = ["i-soon", "i-soon-2", "i-late", "i-none", "batch-soon", "batch-late", "bg"]
    assert [q.request_id for q in reversed(s.waiting)] == expected
    assert _ids(s.schedule().scheduled) == expected  # admission pops in that order
    s.finish(seqs[0], SequenceStatus.FINISHED_ABORTED)  # removal by bisection finds it among float keys
    assert seqs[0] not in s.running


def test_victim_is_lowest_class_then_most_slack_then_cheapest_then_newest():
    s = _sched()
    now = 100.0

    def running(*seqs: Sequence, computed: dict[str, int] | None = None, started: tuple[str, ...] = ()):
        for q in seqs:
            q.num_computed_tokens = (computed or {}).get(q.request_id, 4)
            if q.request_id in started:
                q.token_ids.append(7)  # it has its first token: its TTFT deadline is behind it
        s.running = sorted(seqs, key=lambda q: q.sort_key)

    def victim(start: int = 0, worse_than: int = -1) -> str | None:
        j = s._pick_victim(now, start, worse_than)
        return None if j is None else s.running[j].request_id

    running(_seq("i", 8, INTERACTIVE), _seq("b", 8, BATCH), _seq("bg", 8, BACKGROUND))
    assert victim() == "bg"  # the lowest class first
    assert victim(worse_than=BACKGROUND) is None and victim(worse_than=INTERACTIVE) == "bg"
    # Within a class, the most slack: a request past its first token (or without a deadline) has all of it.
    running(_seq("soon", 8, BATCH, now + 1), _seq("later", 8, BATCH, now + 50), _seq("met", 8, BATCH, now + 0.5),
            started=("met",))
    assert victim() == "met"
    running(_seq("soon", 8, BATCH, now + 1), _seq("later", 8, BATCH, now + 50))
    assert victim() == "later"
    running(_seq("soon", 8, BATCH, now + 1), _seq("none", 8, BATCH))
    assert victim() == "none"
    # Equal slack: the cheapest to restore (fewest computed tokens), then the newest.
    running(_seq("old-cheap", 8, BATCH), _seq("new-dear", 8, BATCH), computed={"old-cheap": 2, "new-dear": 8})
    assert victim() == "old-cheap"
    running(_seq("old", 8, BATCH), _seq("new", 8, BATCH))
    assert victim() == "new"
    # Sequences scheduled earlier in the step (before `start`) are never victims.
    running(_seq("a", 8, BATCH), _seq("b", 8, BATCH), computed={"a": 1, "b": 8})
    assert victim() == "a" and victim(start=1) == "b"


def test_a_better_class_takes_a_seat_from_a_worse_one():
    s = _sched(max_seqs=2)
    b0, b1 = _seq("b0", 8, BATCH), _seq("b1", 8, BATCH)
    s.add(b0)
    s.add(b1)
    _advance(s, s.schedule())
    vip = _seq("vip", 8, INTERACTIVE, deadline=1.0)
    s.add(vip)
    out = s.schedule()
    # The newest of equals gives up its seat; the interactive request runs ahead of the remaining batch decode.
    assert out.preempted == [b1] and b1.status == SequenceStatus.WAITING and not b1.block_table
    assert [(q.request_id, n) for q, n in out.scheduled] == [("vip", 8), ("b0", 1)]
    assert s.stats.num_preemptions == 1
    # Same class: no seat is taken from anyone, the newcomer waits.
    b2 = _seq("b2", 8, BATCH)
    s.add(b2)
    _advance(s, out)
    out = s.schedule()
    assert not out.preempted and _ids(out.scheduled) == ["vip", "b0"]
    s.bm.check_invariants(s.running + s.waiting)


def test_a_better_class_takes_blocks_from_worse_ones_only_when_that_makes_room():
    # 12 blocks of 4 tokens; three batch requests hold 3 blocks each after their prefill (and their next token
    # still fits their last block).
    s = _sched(num_blocks=12, max_seqs=8)
    batch = [_seq(f"b{i}", 11, BATCH) for i in range(3)]
    for q in batch:
        s.add(q)
    _advance(s, s.schedule())
    assert s.bm.num_free_blocks == 3
    vip = _seq("vip", 20, INTERACTIVE, deadline=5.0)  # needs 5 blocks
    s.add(vip)
    out = s.schedule()
    assert out.preempted == [batch[2]]  # one victim was enough (the newest: all equally cheap and started)
    assert _ids(out.scheduled)[0] == "vip" and "b2" not in _ids(out.scheduled)
    s.bm.check_invariants(s.running + s.waiting)

    # The pool held by the better class itself: preempting every worse one would not make room, so nobody is.
    s = _sched(num_blocks=12, max_seqs=8)
    big, small = _seq("i-big", 32, INTERACTIVE), _seq("b-small", 4, BATCH)
    s.add(big)
    s.add(small)
    _advance(s, s.schedule())
    assert s.bm.num_free_blocks == 3  # then i-big's next token takes one more
    s.add(_seq("i-new", 16, INTERACTIVE))  # 4 blocks: 2 free + the batch request's 1 would not do
    out = s.schedule()
    assert not out.preempted and _ids(out.scheduled) == ["i-big", "b-small"]


def test_a_better_class_takes_the_budget_ahead_of_a_worse_class_prefill():
    def first_steps(newcomer_priority: int) -> list[tuple[str, int]]:
        s = _sched(budget=16, num_blocks=200)
        long_batch = _seq("long", 120, BATCH)
        s.add(long_batch)
        _advance(s, s.schedule())  # its prefill runs in 16-token chunks
        s.add(_seq("new", 10, newcomer_priority, deadline=1.0))
        return [(q.request_id, n) for q, n in s.schedule().scheduled]

    # An interactive arrival's prompt goes first; the batch chunk takes what is left, not whole steps ahead.
    assert first_steps(INTERACTIVE) == [("new", 10), ("long", 6)]
    # A same-class arrival waits behind the running chunk (vLLM v1's order: running first).
    assert first_steps(BATCH) == [("long", 16)]


def test_mixed_stream_never_livelocks_and_victims_wait_a_step():
    """Random arrivals of all three classes into a small pool and few seats: every request finishes, the block
    accounting holds after every step, and a preempted sequence is never scheduled in the step that preempted it."""
    rng = random.Random(0)
    s = _sched(num_blocks=24, budget=24, max_seqs=4)
    clock = [0.0]
    s.clock = lambda: clock[0]
    pending = [(rng.randrange(0, 60), _seq(f"r{i}", rng.randrange(2, 20), rng.choice((0, 1, 1, 2)),
                                           rng.choice((math.inf, 4.0, 30.0)))) for i in range(40)]
    lengths = {q.request_id: rng.randrange(1, 12) for _, q in pending}
    step, done, preemptions = 0, 0, 0
    while done < len(pending):
        for at, q in pending:
            if at == step:
                q.ttft_deadline += clock[0]
                s.add(q)
        clock[0] += 1.0
        out = s.schedule()
        assert not {id(q) for q in out.preempted} & {id(q) for q, _ in out.scheduled}
        preemptions += len(out.preempted)
        _advance(s, out)
        for q in list(s.running):
            if q.num_output_tokens >= lengths[q.request_id]:
                s.finish(q, SequenceStatus.FINISHED_LENGTH)
                done += 1
        s.bm.check_invariants(s.running + s.waiting)
        step += 1
        assert step < 2000, "no progress"
    assert preemptions > 0 and s.bm.num_used == 0


# ---- the engine, scripted in steps ----------------------------------------------------------------------------
SLO_STEPS = 2  # the interactive requests' TTFT SLO, in steps of the fake clock
BATCH_PROMPTS = [[(37 * i + 11 * k) % 900 + 20 for k in range(24)] for i in range(3)]
INTERACTIVE_AT = {4: [[5, 6, 7, 8]], 12: [[9, 10, 11]]}  # arrival step → prompts


@pytest.fixture(scope="module")
def engine(model_factory):
    args = EngineArgs(model=model_factory("tiny-llama"), num_threads=1, max_num_seqs=2, num_kv_blocks=64,
                      check_invariants=True)
    return LLMEngine(args, log_stats=True)


def _drive(engine: LLMEngine, classes: bool, batch: list[int] | None = None):
    """Three long batch requests at step 0 (two seats), interactive ones arriving at steps 4 and 12 with a TTFT
    SLO of SLO_STEPS; the clock moves one second per step. With classes=False every request is priority 0
    (FCFS, as without classes). Returns ({request: TTFT in steps}, {request: output ids}, the run's stats)."""
    clock = [1000.0]
    engine.scheduler.clock = lambda: clock[0]
    engine.block_manager.reset_prefix_cache()
    engine.take_stats()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    added: dict[str, int] = {}
    ttft: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    step = 0
    while step == 0 or engine.has_unfinished_requests():
        if step == 0:
            for i in batch if batch is not None else range(len(BATCH_PROMPTS)):
                engine.add_request(f"batch{i}", {"prompt_token_ids": BATCH_PROMPTS[i]}, params,
                                   priority="batch" if classes else 0, arrival_time=clock[0])
                added[f"batch{i}"] = step
        for j, prompt in enumerate(INTERACTIVE_AT.get(step, []) if batch is None else []):
            rid = f"i{step}-{j}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, params.clone(max_tokens=4),
                               priority="interactive" if classes else 0, arrival_time=clock[0],
                               ttft_slo_ms=SLO_STEPS * 1000)
            added[rid] = step
        clock[0] += 1.0
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in ttft:
                ttft[out.request_id] = step + 1 - added[out.request_id]
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 500
    return ttft, outputs, engine.take_stats()


def test_interactive_ttft_stays_within_its_slo_while_batch_waits(engine):
    ttft, outputs, stats = _drive(engine, classes=True)
    interactive = {r: t for r, t in ttft.items() if r.startswith("i")}
    assert len(interactive) == 2 and all(t <= SLO_STEPS for t in interactive.values()), interactive
    # Batch requests made way (preempted for the seats) and still all finished.
    assert stats.num_preemptions >= 2
    assert {r for r in outputs if r.startswith("batch")} == {"batch0", "batch1", "batch2"}
    assert max(ttft[f"batch{i}"] for i in range(3)) > SLO_STEPS  # the third waited for a seat
    assert stats.deadline_misses == []
    assert sorted(stats.first_token_classes) == ["batch"] * 3 + ["interactive"] * 2

    # The same load first come, first served (no classes): the interactive requests wait for a seat and miss.
    fcfs_ttft, fcfs_outputs, fcfs_stats = _drive(engine, classes=False)
    assert all(fcfs_ttft[r] > SLO_STEPS for r in interactive), fcfs_ttft
    assert fcfs_stats.deadline_misses == ["interactive", "interactive"]  # once each, at the first token
    assert fcfs_stats.num_preemptions == 0

    # Preemption loses nothing: every greedy output equals the request's output when run alone.
    for i in range(3):
        _, alone, _ = _drive(engine, classes=True, batch=[i])
        assert outputs[f"batch{i}"] == alone[f"batch{i}"] == fcfs_outputs[f"batch{i}"]
    for r in interactive:
        assert outputs[r] == fcfs_outputs[r]


def test_deadline_miss_counted_at_abort_if_no_first_token_came(engine):
    clock = [50.0]
    engine.scheduler.clock = lambda: clock[0]
    engine.take_stats()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(2):  # both seats, for 20 steps
        engine.add_request(f"hog{i}", {"prompt_token_ids": BATCH_PROMPTS[i]}, params, arrival_time=clock[0])
    engine.step()
    engine.add_request("late", {"prompt_token_ids": [5, 6]}, params, arrival_time=clock[0], ttft_slo_ms=3000)
    engine.add_request("early", {"prompt_token_ids": [7, 8]}, params, arrival_time=clock[0], ttft_slo_ms=60000)
    for _ in range(5):
        clock[0] += 1.0
        engine.step()
    engine.abort_request("late")  # 5 s after arrival, never served: a miss
    engine.abort_request("early")  # aborted before its deadline: not a miss
    for rid in ("hog0", "hog1"):
        engine.abort_request(rid)
    stats = engine.take_stats()
    assert stats.deadline_misses == ["interactive"]
    assert {f.request_id: f.priority_class for f in stats.finished}["late"] == "interactive"


def test_class_defaults_from_ttft_slo_ms(model_factory):
    engine = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), num_threads=1, num_kv_blocks=16,
                                  ttft_slo_ms="interactive=250, batch=30000"))
    req = engine.process_request("a", [5, 6], priority="interactive", arrival_time=10.0)
    assert req.priority == 0 and req.ttft_deadline == pytest.approx(10.25)
    assert engine.process_request("b", [5], priority="batch", arrival_time=10.0).ttft_deadline == pytest.approx(40.0)
    assert engine.process_request("c", [5], priority=7, arrival_time=10.0).ttft_deadline == math.inf
    assert engine.process_request("d", [5], priority="batch", arrival_time=10.0,
                                  ttft_slo_ms=100).ttft_deadline == pytest.approx(10.1)  # the request's own wins


# ---- configuration and bad input ------------------------------------------------------------------------------
def test_classes_and_slo_flag_parse():
    assert [resolve_priority(v) for v in ("interactive", "batch", "background", " Batch ", 5, -3, "2")] == \
        [0, 1, 2, 1, 5, -3, 2]
    assert [priority_class(p) for p in (-5, 0, 1, 2, 9)] == ["interactive", "interactive", "batch", "background",
                                                             "background"]
    assert TtftSlo.parse("interactive=500,batch=30000").per_class == (0.5, 30.0, None)
    assert TtftSlo.parse("250").per_class == (0.25, None, None) == TtftSlo.parse(250).per_class
    assert TtftSlo.parse(None).per_class == (None, None, None)
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--ttft-slo-ms", "background=9000"])
    assert EngineArgs.from_cli_args(ns).ttft_slo_ms == "background=9000"


@pytest.mark.parametrize("spec, words", [
    ("interactive=0", ["ttft_slo_ms", "positive"]), ("batch=-5", ["ttft_slo_ms", "positive"]),
    ("-1", ["ttft_slo_ms", "positive"]), ("urgent=5", ["ttft_slo_ms", "unknown class 'urgent'", "interactive"]),
    ("interactive=fast", ["ttft_slo_ms", "not a number"]), ("interactive=5,interactive=6", ["twice"]),
    ("interactive:500", ["ttft_slo_ms", "cannot parse"]), ("interactive=5,", ["not CLASS=MS"]),
    ("interactive=nan", ["positive"]),
])
def test_bad_ttft_slo_flag_is_a_clear_error(spec, words):
    with pytest.raises(ValueError) as e:
        EngineArgs(ttft_slo_ms=spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_deadline_or_class_at_the_offline_api(engine, model_factory):
    for bad in (0, -5, float("nan"), float("inf"), True, "soon"):
        with pytest.raises(ValueError, match="ttft_slo_ms: a TTFT deadline must be a positive number"):
            engine.add_request("x", [5, 6], ttft_slo_ms=bad)
    for bad in ("urgent", 1.5, None, True):
        with pytest.raises(ValueError, match="priority: .* neither an integer"):
            engine.add_request("x", [5, 6], priority=bad)
    assert not engine.has_unfinished_requests()
    from minivllm import LLM

    llm = LLM(model_factory("tiny-llama"), num_threads=1, num_kv_blocks=32)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate([[5, 6], [7, 8]], greedy, use_tqdm=False, priority=["batch", "interactive"],
                        ttft_slo_ms=[None, 500])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert len(llm.generate([5, 6], greedy, use_tqdm=False, priority="background")) == 1
    with pytest.raises(ValueError, match="ttft_slo_ms"):
        llm.generate([[5, 6], [7, 8]], greedy, use_tqdm=False, ttft_slo_ms=[100, 0])
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[5, 6]], greedy, use_tqdm=False, priority=["vip"])
    with pytest.raises(ValueError, match="priority: got 2 values for 1 prompts"):
        llm.generate([[5, 6]], greedy, use_tqdm=False, priority=[0, 1])
    assert not llm.llm_engine.has_unfinished_requests()


def test_metrics_export_misses_and_latencies_by_class(engine):
    ttft, _, stats = _drive(engine, classes=False)
    m = ServerMetrics("tiny")
    m.record(stats, SchedulerSnapshot(0, 0, 0.0))
    got = {(s.name, s.labels.get("class")): s.value
           for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    # Without classes every request is interactive: the two late ones missed, each counted once.
    assert got["minivllm:request_deadline_miss_total", "interactive"] == 2
    assert got["minivllm:request_deadline_miss_total", "batch"] == got["minivllm:request_deadline_miss_total",
                                                                         "background"] == 0
    assert got["minivllm:time_to_first_token_by_class_seconds_count", "interactive"] == len(ttft) == 5
    assert got["minivllm:request_queue_time_by_class_seconds_count", "interactive"] == 5
    assert got["minivllm:request_queue_time_by_class_seconds_count", "background"] == 0


# ---- the servers ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_factory):
    """An in-process HTTP + gRPC server whose classes have default deadlines."""
    args = EngineArgs(model=model_factory("tiny-llama"), num_threads=1, kv_cache_memory="64MiB",
                      ttft_slo_ms="interactive=60000,batch=600000")
    engine = AsyncLLMEngine.from_engine_args(args, stat_loggers=[])
    port = free_port()
    with in_process_server(build_app(engine, ServerArgs(grpc_port=port))) as url:
        yield url, f"127.0.0.1:{port}"


HTTP_BAD = [
    ("/generate", {"prompt": "a", "ttft_slo_ms": 0}, ["ttft_slo_ms", "positive"]),
    ("/generate", {"prompt": "a", "ttft_slo_ms": -20}, ["ttft_slo_ms", "positive"]),
    ("/generate", {"prompt": "a", "ttft_slo_ms": False}, ["ttft_slo_ms"]),
    ("/generate", {"prompt": "a", "priority": "urgent"}, ["priority", "urgent", "interactive, batch, background"]),
    ("/generate", {"prompt": "a", "priority": True}, ["priority"]),
    ("/batch_generate", {"prompts": ["a", "b"], "ttft_slo_ms": 0}, ["ttft_slo_ms"]),
    ("/batch_generate", {"prompts": ["a"], "priority": "later"}, ["priority"]),
    ("/v1/completions", {"prompt": "a", "ttft_slo_ms": -1}, ["ttft_slo_ms"]),
    ("/v1/completions", {"prompt": "a", "priority": "vip"}, ["priority"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ttft_slo_ms": 0}, ["ttft_slo_ms"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": "x"}, ["priority"]),
]


@pytest.mark.parametrize("path, body, words", HTTP_BAD)
def test_http_bad_deadline_or_class_is_a_400(server, path, body, words):
    url, _ = server
    r = httpx.post(url + path, json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert all(w in r.json()["error"]["message"] for w in words), r.text


def test_every_api_takes_a_class_name_and_a_deadline(server):
    url, target = server
    before = metrics(url)
    slo = {"ttft_slo_ms": 30000}
    r = httpx.post(url + "/generate", json={"prompt": "a", "max_new_tokens": 2, "priority": "batch", **slo}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_generated"] == 2
    r = httpx.post(url + "/batch_generate", json={"prompts": ["a", "b"], "max_new_tokens": 2, "priority": 2},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["generated_texts"]) == 2
    for path, body in (("/v1/completions", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(url + path, json={**body, "max_tokens": 2, "priority": "background", **slo}, timeout=60)
        assert r.status_code == 200, r.text
    with connect(url.replace("http", "ws") + "/ws/generate") as ws:
        ws.send(json.dumps({"prompt": "a", "max_new_tokens": 2, "priority": "interactive", **slo}))
        while "finish_reason" not in (msg := json.loads(ws.recv(timeout=60))):
            pass
        ws.send(json.dumps({"prompt": "a", "ttft_slo_ms": -1}))
        err = json.loads(ws.recv(timeout=30))
        assert err["error"]["code"] == 400 and "ttft_slo_ms" in err["error"]["message"]
    assert msg["finish_reason"] == "length"

    async def grpc_calls() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            ok = await stub.Generate(pb.GenerateRequest(prompt="a", max_new_tokens=2, priority_class="batch",
                                                        ttft_slo_ms=30000))
            assert ok.tokens_generated == 2
            ok = await stub.BatchGenerate(pb.BatchGenerateRequest(prompts=["a"], max_new_tokens=2,
                                                                  priority_class="background"))
            assert len(ok.generated_texts) == 1
            codes = []
            for bad in (pb.GenerateRequest(prompt="a", priority_class="urgent"),
                        pb.GenerateRequest(prompt="a", ttft_slo_ms=0),
                        pb.GenerateRequest(prompt="a", priority=1, priority_class="batch"),
                        pb.BatchGenerateRequest(prompts=["a"], ttft_slo_ms=-3)):
                call = stub.BatchGenerate if isinstance(bad, pb.BatchGenerateRequest) else stub.Generate
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(bad)
                assert any(w in e.value.details() for w in ("ttft_slo_ms", "priority")), e.value.details()
                codes.append(e.value.code())
            return codes

    assert asyncio.run(grpc_calls()) == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    after = wait_idle(url)  # the finished requests' stats are recorded before the gauges show idle
    # Counted by class: /generate's batch request and /batch_generate's two background ones at least.
    key = 'minivllm:request_queue_time_by_class_seconds_count{{class="{}"}}'
    assert after[key.format("batch")] - before[key.format("batch")] >= 2
    assert after[key.format("background")] - before[key.format("background")] >= 5
    assert after[key.format("interactive")] - before[key.format("interactive")] >= 1
    for cls in ("interactive", "batch", "background"):
        assert f'minivllm:request_deadline_miss_total{{class="{cls}"}}' in after


def test_a_swapped_better_class_resumes_before_a_worse_class_is_admitted_ahead():
    """Swapped work resumes before waiting work is admitted: a waiting batch request must not jump ahead of a
    running background one (taking the last seat) while an interactive sequence waits in the host tier."""
    from minivllm.engine.swap_manager import SwapManager

    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(2, 64, True, preemption_mode="swap"), bm, SwapManager(16, 1, bm))
    s.clock = lambda: 0.0
    vip, bg = _seq("vip", 8, INTERACTIVE), _seq("bg", 8, BACKGROUND)
    s.add(vip)
    s.add(bg)
    _advance(s, s.schedule())
    s.running.remove(vip)
    s._preempt(vip)  # as the pool would have it: vip's KV goes to the host tier
    assert vip.status == SequenceStatus.SWAPPED
    s.swap.take()
    s.add(_seq("b", 8, BATCH))
    out = s.schedule()
    assert not out.preempted and _ids(out.scheduled) == ["bg", "vip"], _ids(out.scheduled)
    assert [q.request_id for q in s.waiting] == ["b"] and not s.swapped
