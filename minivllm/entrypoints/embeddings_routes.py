"""POST /v1/embeddings (OpenAI's shape) on a server started with --runner pooling: a string, a list of strings, token
ids or a list of token-id lists; float or base64 (little-endian float32, as OpenAI's client decodes it) vectors; and
`dimensions` where the checkpoint is matryoshka (the first d components, normalized again when the model
normalizes). Every input is one engine request, prefill-only, batched by the scheduler with the rest."""

from __future__ import annotations

import base64
import math
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

from minivllm.engine.input_processor import Prompt
from minivllm.engine.lora_registry import LoadedLoRA
from minivllm.entrypoints.api_schema import OPENAI_GENERATION_ERRORS, responses
from minivllm.entrypoints.openai_routes import completion_prompts
from minivllm.entrypoints.serving import APIError, ServerState, new_request_id
from minivllm.sampling_params import RequestOutputKind, SamplingParams

router = APIRouter()
MAX_INPUTS = 2048  # OpenAI's own bound on one call's inputs


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    model_config = ConfigDict(strict=True, extra="ignore")  # (`user` and the like: ignored, as vLLM does)

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class EmbeddingList(BaseModel):
    """The vectors, one per input in order, with the tokens they took."""

    object: str
    data: list[dict[str, Any]]
    model: str
    usage: dict[str, int]


def _truncate(values: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    if dimensions is None:
        return values
    values = values[:dimensions]
    if normalize:  # a matryoshka prefix of a unit vector is shorter: scale it back to length 1
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        values = [v / norm for v in values]
    return values


def _encode(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


async def embed(st: ServerState, prompts: list[Prompt], dimensions: int | None, lora: LoadedLoRA | None = None,
                request: Request | None = None) -> list[tuple[list[float], int]]:
    """(vector, prompt tokens) per prompt, in order (APIError naming what this server or model cannot do); shared
    with gRPC's Embed."""
    pooler = st.pooler
    if pooler is None:
        raise APIError(400, "this server generates: start it with --runner pooling to serve embeddings", "model")
    if dimensions is not None:
        try:
            pooler.check_dimensions(dimensions, pooler.size)
        except ValueError as e:
            raise APIError(400, str(e), "dimensions") from None
    if len(prompts) > MAX_INPUTS:
        raise APIError(400, f"input: at most {MAX_INPUTS} inputs per request, got {len(prompts)}", "input")
    params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
    streams = await st.submit(await st.prepare(new_request_id("embd"), prompts, params, lora=lora, request=request,
                                               pooling=True))
    outs = await st.wait_finals(request, streams)
    return [(_truncate(o.embedding or [], dimensions, pooler.normalize), len(o.prompt_token_ids)) for o in outs]


@router.post("/v1/embeddings", responses=responses(EmbeddingList, *OPENAI_GENERATION_ERRORS))
async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    """One embedding per input."""
    st: ServerState = request.app.state.server
    t0 = request.state.t0
    lora = st.check_model(body.model)
    vectors = await embed(st, completion_prompts(body.input, "input"), body.dimensions, lora, request)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, (v, _) in enumerate(vectors)]
    tokens = sum(n for _, n in vectors)
    st.count("/v1/embeddings", "success", t0)
    return JSONResponse({"object": "list", "data": data, "model": lora.name if lora is not None else st.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
