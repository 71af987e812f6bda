"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora and
--allow-runtime-lora-updating: loading opens a server-side path a client names, so it is off unless asked for, as
vLLM keeps it behind VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import PlainTextResponse

from minivllm.entrypoints.api_schema import GENERATION_ERRORS, responses
from minivllm.entrypoints.serving import APIError, ServerState, bad_request
from minivllm.model.lora import read_adapter

router = APIRouter()
_OK: dict[int | str, dict[str, Any]] = {200: {"description": "Done (vLLM's plain-text answer)",
             "content": {"text/plain": {"schema": {"type": "string"}}}}}


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (lora_int_id is accepted, as vLLM's clients send it, and not needed)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


def _allowed(st: ServerState) -> None:
    if not st.engine.lora_enabled:
        raise APIError(400, "LoRA adapters are off: start the server with --enable-lora", "lora_name")
    if not st.args.allow_runtime_lora_updating:
        raise APIError(400, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating "
                            "(or name adapters at start-up with --lora-modules)", "lora_name")


@router.post("/v1/load_lora_adapter", responses={**_OK, **responses(None, *GENERATION_ERRORS)})
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Load a PEFT adapter from a directory on the server; requests then name it as their model."""
    st: ServerState = request.app.state.server
    _allowed(st)
    if body.lora_name == st.model_name:
        raise APIError(400, f"lora_name: {body.lora_name!r} is the base model's name", "lora_name")
    try:
        # Disk I/O off the loop and the engine; a file larger than any adapter the model holds is not read.
        adapter = await asyncio.to_thread(read_adapter, body.lora_path, st.engine.max_lora_bytes)
        await st.engine.add_lora(body.lora_name, body.lora_path, adapter)
    except ValueError as e:
        raise bad_request(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses={**_OK, **responses(None, *GENERATION_ERRORS, 404)})
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Unload an adapter no request is running with."""
    st: ServerState = request.app.state.server
    _allowed(st)
    try:
        await st.engine.remove_lora(body.lora_name)
    except KeyError:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name") from None
    except ValueError as e:
        raise bad_request(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
