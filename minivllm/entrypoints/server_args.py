"""The server's own flags (`minivllm serve`'s front end; the engine's are EngineArgs) and the bounds they put on
uvicorn."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TypedDict

from minivllm.config import parse_size
from minivllm.entrypoints.tool_calls import TOOL_CALL_PARSERS

# Requests one WebSocket may have waiting behind the one it runs (each further one gets a 429), and the unread
# messages uvicorn holds for a connection.
WS_MAX_QUEUED = 4


def _arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ServerArgs:
    """Front-end flags of `minivllm serve` (the engine's own flags live in EngineArgs)."""

    host: str = _arg("127.0.0.1", "address to listen on")
    port: int = _arg(8000, "HTTP port")
    grpc_port: int | None = _arg(None, "also serve gRPC (InferenceService, grpc.health.v1, reflection) on this port, "
                                       "on the same engine (0: any free port)")
    api_key: str | None = field(default=None, repr=False, metadata={"help": (
        "when set, generation endpoints need 'Authorization: Bearer <key>' (default: $MINIVLLM_API_KEY, which keeps "
        "the key out of the process list); the key is never logged")})
    admin_api_key: str | None = field(default=None, repr=False, metadata={"help": (
        "when set, the live view (/dashboard, /ws/events) and runtime LoRA loading need this key instead of "
        "--api-key (default: $MINIVLLM_ADMIN_API_KEY); without it they need --api-key")})
    api_keys_file: str | None = _arg(
        None, "named API keys, one per client, each with its own bounds (JSON: "
        '{"clients": [{"name", "key", "max_concurrency", "max_queued", "may_prioritize"}]}); taken beside --api-key')
    metrics_need_key: bool = _arg(False, "/metrics takes the API key too (Prometheus then sends it: "
                                         "authorization.credentials in its scrape config); open by default")
    max_live_viewers: int = _arg(4, "live views (/ws/events) open at once; more are refused (1013)")
    allowed_origins: str | None = _arg(None, "CORS: comma-separated origins whose browser scripts may call the API, "
                                             "or *; off by default")
    served_model_name: str | None = _arg(None, "model name in the OpenAI API (default: the model directory's name)")
    max_body_size: str = _arg("4MiB", "largest request body accepted (413 beyond)")
    log_level: str = _arg("info", "log level of the server and engine")
    replicas: int | None = _arg(None, "serve N engine replicas on Ray Serve behind this front (least-loaded routing; "
                                      "needs the [ray] extra); engine flags apply to each replica")
    ray_address: str | None = _arg(None, "with --replicas: join the Ray cluster at HOST:PORT (or ray://..., auto) "
                                         "instead of starting a local one")
    allow_runtime_lora_updating: bool = _arg(False, "with --enable-lora: allow POST /v1/load_lora_adapter and "
                                                    "/v1/unload_lora_adapter (loading opens a server-side directory "
                                                    "a client names)")
    enable_auto_tool_choice: bool = _arg(False, 'allow tool_choice "auto" (the model decides whether to call a tool; '
                                                "needs --tool-call-parser)")
    tool_call_parser: str | None = _arg(
        None, "how tool calls are read from a reply under tool_choice auto: hermes (<tool_call>{...}</tool_call>: "
        "Hermes, Qwen2.5/3, SmolLM3 and the embedded model), llama3_json (Llama 3.x JSON calls), mistral "
        "([TOOL_CALLS]...), pythonic (Llama 3.2/4: [f(a=1), g(b=2)])")

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get("MINIVLLM_API_KEY") or None
        if self.admin_api_key is None:
            self.admin_api_key = os.environ.get("MINIVLLM_ADMIN_API_KEY") or None
        if self.max_live_viewers < 0:
            raise ValueError(f"max_live_viewers must be >= 0, got {self.max_live_viewers}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grpc_port is not None and not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in [0, 65535], got {self.grpc_port}")
        if self.grpc_port is not None and self.grpc_port == self.port != 0:
            raise ValueError(f"grpc_port and port are both {self.port}; give gRPC a port of its own")
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.ray_address is not None and self.replicas is None:
            raise ValueError("ray_address needs replicas: give --replicas N to deploy on that cluster")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"enable_auto_tool_choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
        if parse_size(self.max_body_size, "max_body_size") <= 0:
            raise ValueError(f"max_body_size must be positive, got {self.max_body_size!r}")

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice auto replies, None when auto is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def origins(self) -> list[str]:
        """--allowed-origins as a list (empty: CORS off)."""
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]


class UvicornLimits(TypedDict):
    ws_max_size: int
    ws_max_queue: int


def uvicorn_limits(args: ServerArgs) -> UvicornLimits:
    """uvicorn's bounds on WebSocket input: a message over --max-body-size closes its connection (1009, "message
    too big") before it is buffered whole, and a connection holds at most WS_MAX_QUEUED unread messages."""
    return {"ws_max_size": parse_size(args.max_body_size, "max_body_size"), "ws_max_queue": WS_MAX_QUEUED}
