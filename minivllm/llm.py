"""Offline entry point: LLM(model).generate(prompts, SamplingParams)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from minivllm.config import EngineArgs
from minivllm.engine.input_processor import Prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.chat_utils import chat_prompt
from minivllm.lora_request import LoRARequest
from minivllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """Batch generation over the engine: all prompts are queued, then stepped to completion."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | str | Sequence[int | str] | None = None,
                 ttft_slo_ms: float | Sequence[float | None] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts. `priority` (an int, lower
        is sooner, or a class name: interactive, batch, background), `ttft_slo_ms` (a TTFT deadline after
        arrival) and `lora_request` (the adapter, with LLM(enable_lora=True)) apply to every prompt, or come one
        per prompt."""
        if self.llm_engine.pooler is not None:
            raise ValueError("generate: this LLM was built with runner='pooling' (embeddings); call embed(), or build "
                             "it with runner='generate'")
        return self._generate(prompts, sampling_params, use_tqdm, priority, ttft_slo_ms, lora_request)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (vLLM's entry point; needs LLM(model, runner="pooling")): one vector per prompt, in
        order, pooled and normalized as the checkpoint's sentence-transformers config (or pooler_config) says."""
        if self.llm_engine.pooler is None:
            raise ValueError("embed: this LLM generates; build it with LLM(model, runner='pooling') to embed")
        outs = self._generate(prompts, SamplingParams(max_tokens=1), use_tqdm, None, None, lora_request)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding or []))
                for o in outs]

    def _generate(self, prompts: Prompt | Sequence[Prompt],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
                  priority: int | str | Sequence[int | str] | None, ttft_slo_ms: float | Sequence[float | None] | None,
                  lora_request: LoRARequest | Sequence[LoRARequest | None] | None) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        # Offline callers want finished results only: no per-step outputs to build.
        final = {id(p): p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]
        priorities = _per_prompt(priority, 0, len(prompts), "priority")
        slos = _per_prompt(ttft_slo_ms, None, len(prompts), "ttft_slo_ms")
        loras = _per_prompt(lora_request, None, len(prompts), "lora_request")
        engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in prompts]
        added = []
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
                engine.add_request(rid, prompt, p, priority=priorities[i], ttft_slo_ms=slos[i], lora_request=loras[i])
                added.append(rid)
        except Exception:
            for rid in added:
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to several,
        through the tokenizer's chat template (with extra template variables, as Qwen3's enable_thinking, and the
        tools shown to the model)."""
        # one conversation (its first item a message) or several (mypy cannot narrow the union by its first item)
        conversations = cast(list[list[dict[str, str]]],
                             [messages] if messages and isinstance(messages[0], dict) else messages)
        tok = self.get_tokenizer()
        prompts = [chat_prompt(tok, conv, add_generation_prompt, chat_template, tools, chat_template_kwargs)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[RequestOutput]:
        """Beam search (vLLM's entry point): each output carries params.beam_width completions, best first."""
        return self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        wanted = set(ids)
        out_tokens = 0
        failed: dict[str, str] = {}
        with bar:
            while len(done) + len(failed) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s", refresh=False)
                failed.update((rid, why) for rid, why in engine.take_failed_requests().items() if rid in wanted)
        if failed:  # the others ran to the end; a fault (engine/step_guard.py) failed only these
            raise RuntimeError(f"{len(failed)} of {len(ids)} requests failed: " + "; ".join(
                f"{rid}: {why}" for rid, why in list(failed.items())[:4]))
        return [done[i] for i in ids]


def _per_prompt(value: Any, default: Any, n: int, name: str) -> list[Any]:
    """One value for all n prompts (a scalar, or None for the default), or a sequence of exactly n."""
    if value is None or isinstance(value, int | float | str | LoRARequest):
        return [default if value is None else value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name}: got {len(values)} values for {n} prompts")
    return values
