"""EngineClient: everything a front end (HTTP routes, gRPC, the live view) may use of an engine.

Two implementations: AsyncLLMEngine (the engine on a thread of this process) and RayEngineClient (Ray Serve
replicas behind one front). The front ends are typed against this protocol alone, so none reaches into an
engine; the type checker proves both implementations complete where each is handed to `build_app`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from minivllm.engine.async_stream import AsyncStream
    from minivllm.engine.input_processor import EngineRequest, Prompt, RequestSpec
    from minivllm.engine.lora_registry import LoadedLoRA
    from minivllm.engine.stats import SchedulerSnapshot, StatLogger
    from minivllm.engine.step_trace import StepTracer
    from minivllm.pooler_config import PoolerConfig


class EngineClient(Protocol):
    """Add requests and stream their outputs, abort them, report health and gauges, manage adapters."""

    stat_loggers: list[StatLogger]  # the server's metrics insert themselves here
    death_callbacks: list[Callable[[], object]]  # run on the event loop once the engine can serve no more

    # ---- what the front ends read ----
    @property
    def model_path(self) -> str:
        """The model directory (or file) the engine loaded."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output."""
        ...

    @property
    def max_num_seqs(self) -> int:
        """Most sequences running in one step."""
        ...

    @property
    def max_waiting(self) -> int:
        """Most requests waiting before new ones are refused with 429."""
        ...

    @property
    def num_speculative_tokens(self) -> int:
        """Tokens proposed per speculating sequence and step (0: speculative decoding off)."""
        ...

    @property
    def reasoning_parser(self) -> str | None:
        """How the model's thinking is told from its answer (--reasoning-parser)."""
        ...

    @property
    def pooler(self) -> PoolerConfig | None:
        """--runner pooling: how prompts become embeddings; None when the engine generates."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (chat templates, tokenize/detokenize)."""
        ...

    @property
    def client_stall_timeout_s(self) -> float:
        """A client that takes no output for this long while outputs pile up is dropped."""
        ...

    @property
    def is_running(self) -> bool:
        """Whether the engine can serve (what /health reports)."""
        ...

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine cannot serve, None while it can."""
        ...

    @property
    def snapshot(self) -> SchedulerSnapshot:
        """Running, waiting and KV usage as of the last step."""
        ...

    def expert_load(self) -> dict[int, list[int]]:
        """A mixture of experts' tokens routed to each expert since start-up, per MoE layer ({} otherwise, or where
        each replica reports its own)."""
        ...

    @property
    def tracer(self) -> StepTracer | None:
        """The live view's feed of step records; None where no single engine is followed (replicas)."""
        ...

    # ---- lifecycle ----
    def start(self) -> None:
        """Start serving: called on the event loop that consumes the streams."""
        ...

    def shutdown(self) -> None:
        """Stop serving (any thread)."""
        ...

    # ---- requests ----
    def process_requests(self, request_id: str, prompts: list[Prompt], spec: RequestSpec) -> list[EngineRequest]:
        """One call's requests (ids request_id-0, -1, ...) tokenized and validated against every limit, without
        queueing (any thread); ValueError naming the problem."""
        ...

    def check_room(self, n: int) -> None:
        """QueueFullError when n more requests would find the waiting queue full (checked before costly preparation
        such as grammar compilation; submit checks again)."""
        ...

    async def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncStream]:
        """Queue one call's requests together; one stream of outputs each (QueueFullError past max_waiting)."""
        ...

    def abort_stream(self, stream: AsyncStream) -> None:
        """Abort the request of this stream unless it finished; its KV blocks are freed before the next step."""
        ...

    # ---- LoRA adapters ----
    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves adapters (--enable-lora)."""
        ...

    @property
    def max_lora_bytes(self) -> int | None:
        """The largest adapter weights file the engine's slots can hold (None: LoRA off)."""
        ...

    @property
    def loras(self) -> dict[str, LoadedLoRA]:
        """The adapters served, by name."""
        ...

    async def add_lora(self, name: str, path: str, adapter: Any = None) -> LoadedLoRA:
        """Load an adapter (read from `path`, or the LoRAAdapter already read from it) under a name."""
        ...

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter (KeyError if unknown, ValueError while requests use it)."""
        ...
