"""The start-up heap frozen out of the cyclic GC's full collections (minivllm/gc_utils.py), and the server doing it
before it serves."""

from __future__ import annotations

import gc

import pytest

from minivllm.config import EngineArgs
from minivllm.entrypoints.server_args import ServerArgs
from minivllm.gc_utils import freeze_startup_heap, frozen_heap


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the suite collects as before


def test_frozen_heap_takes_the_live_objects_out_of_the_oldest_generation_and_gives_them_back():
    before = len(gc.get_objects(generation=2))
    with frozen_heap() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > frozen - 10  # (a frozen object freed by refcount leaves)
        assert len(gc.get_objects(generation=2)) < before // 10  # what a full collection walks now
        new = [[i] for i in range(100)]  # what serving allocates is still tracked (frozen objects are not listed)
        assert any(o is new for o in gc.get_objects())
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= frozen  # all back under the collector


def test_a_cycle_made_after_the_freeze_is_still_collected():
    freeze_startup_heap()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = gc.get_freeze_count()
    del a, b
    assert gc.collect() >= 2  # both nodes (and their __dict__s) found unreachable
    assert gc.get_freeze_count() == alive


def test_run_server_freezes_the_start_up_heap_before_it_serves(monkeypatch):
    import uvicorn

    from minivllm.entrypoints import api_server

    seen: dict = {}

    def run(self) -> None:  # instead of serving: what the heap looks like when uvicorn would start
        seen["frozen"] = gc.get_freeze_count()
        seen["engine_objects_frozen"] = not any(o is self.config.app.state.server.engine for o in gc.get_objects())
        self.config.app.state.server.engine.shutdown()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    api_server.run_server(EngineArgs(kv_cache_memory="16MiB", num_threads=1), ServerArgs(port=1))
    assert seen["frozen"] > 1000
    assert seen["engine_objects_frozen"]  # the engine is frozen with the rest: no full collection walks it


def test_a_run_inside_a_frozen_heap_leaves_it_frozen():
    owner = freeze_startup_heap()
    with frozen_heap() as frozen:
        assert frozen == 0
    assert gc.get_freeze_count() >= owner - 10  # the owner's freeze stands

