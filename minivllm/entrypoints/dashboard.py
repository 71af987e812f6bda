"""The live view (SPEC §7): `GET /dashboard` (HTML, JS and CSS from the package: no build step, no CDN)
and `WS /ws/events`, which streams the engine's step records (engine/step_trace.py) to the page. Both take the
admin key (or the API key) when one is set (auth.py): the page is opened as /dashboard?token=<key> and hands the
key to its WebSocket as a subprotocol; at most --max-live-viewers feeds run at once. A mixture of experts' server
adds the tokens routed to each expert of each sparse layer (the counters /metrics reads) to the hello and to a
steps message at most every EXPERT_LOAD_PERIOD seconds: the page draws them as a heat map."""

from __future__ import annotations

import asyncio
import json
import os
import time

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.responses import FileResponse, Response

from minivllm.entrypoints.auth import key_subprotocol

router = APIRouter()
STATIC = os.path.join(os.path.dirname(__file__), "static")
_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_MAX_BATCH = 64  # records per WebSocket message when a viewer is behind
# Seconds between expert-load snapshots on a feed: a large mixture's table (48 layers x 128 experts) in every
# steps message would cost more than the records.
EXPERT_LOAD_PERIOD = 0.5


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return FileResponse(os.path.join(STATIC, "dashboard.html"), media_type="text/html")


@router.get("/dashboard/{name}", include_in_schema=False)
async def dashboard_file(name: str) -> Response:
    if name not in _FILES:
        return Response(f"no file {name}", status_code=404)
    return FileResponse(os.path.join(STATIC, name), media_type=_FILES[name])


@router.websocket("/ws/events")
async def events(ws: WebSocket) -> None:
    """A hello with the engine's shape, then lists of step records as steps run."""
    state = ws.app.state.server
    tracer = state.engine.tracer
    await ws.accept(subprotocol=key_subprotocol(ws.scope))
    if tracer is not None and tracer.active >= state.args.max_live_viewers:
        # Each viewer costs the engine thread a record per step and the loop a copy of it: a bounded few.
        await ws.send_json({"type": "error", "message": f"{tracer.active} live views are open, the server's limit "
                                                        "(--max-live-viewers); close one and retry"})
        await ws.close(1013)  # try again later
        return
    if tracer is None:  # a front of Ray replicas: each replica has its own engine and no feed here
        await ws.send_json({"type": "error", "message": "the live view follows one engine; it is not available "
                                                        "through --replicas (open a replica's own server)"})
        await ws.close(1011)
        return
    eng = state.engine
    load = eng.expert_load()  # {} for a dense model
    await ws.send_json({"type": "hello", "model": state.model_name, "max_num_seqs": state.max_num_seqs,
                        "max_model_len": state.max_model_len, "expert_load": load})
    load_sent = time.monotonic()
    sub = tracer.subscribe()

    async def until_closed() -> None:
        while True:
            await ws.receive_text()  # the page sends nothing; this returns on close

    closed = asyncio.ensure_future(until_closed())
    try:
        while not closed.done():
            get = asyncio.ensure_future(sub.queue.get())
            await asyncio.wait({get, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                break
            records = [get.result()]
            while len(records) < _MAX_BATCH and not sub.queue.empty():
                records.append(sub.queue.get_nowait())
            msg = {"type": "steps", "records": records, "dropped": sub.dropped, "running": eng.is_running}
            last = records[-1]
            drained = last.get("num_running") == 0 and last.get("num_waiting") == 0  # (the final counts, unthrottled)
            if load and (drained or time.monotonic() - load_sent >= EXPERT_LOAD_PERIOD):
                msg["expert_load"], load_sent = eng.expert_load(), time.monotonic()
            await ws.send_text(json.dumps(msg))
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        closed.cancel()
        tracer.unsubscribe(sub)
