"""The start-up heap kept out of the cyclic garbage collector's way (vLLM freezes its engine's heap the same way).

Why: once torch, transformers, FastAPI and a model are loaded, ~300k objects live in the GC's oldest generation, and
a full collection walks all of them: ~180-210 ms here (gpt2 server, Zen 5), holding the GIL, so the engine thread
cannot run its step's Python meanwhile. A server collects that way every ~500 requests (two full collections,
389 ms, while serving 1020 seed requests). Objects alive after start-up live as long as the process, so they are
moved to the permanent generation (`gc.freeze`); what serving allocates is still collected as before, and a full
collection then walks only that.

The price: a reference cycle among frozen objects that later becomes garbage stays until `gc.unfreeze` (freed
objects outside cycles go by reference counting as ever). Hence only at a long-lived owner's start (the server
process, an engine replica) or around a bounded run (`frozen_heap`: the serving bench's offline engine), never per
engine in a process that makes many. (The offline `LLM` does not freeze: 800 requests of gpt2 through
`LLM.generate` ran no full collection at all; the server's came from the HTTP side's surviving objects.)
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> int:
    """Collect the start-up garbage, then freeze what is left; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """freeze_startup_heap for a bounded run (a benchmark's offline engine), unfrozen after it; yields the objects
    frozen. A heap already frozen (a server's) stays as it is, and the run adds nothing (yields 0)."""
    if gc.get_freeze_count():
        yield 0
        return
    try:
        yield freeze_startup_heap()
    finally:
        gc.unfreeze()
