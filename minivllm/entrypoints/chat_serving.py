"""The chat pipeline the chat-shaped APIs share (OpenAI chat completions, the Responses API, Anthropic Messages):
each API translates its own request into chat-template messages, tools and a tool choice, and this turns them into a
prompt, a tool plan and the sampling parameters that plan needs; the reply then goes back through chat_utils'
chat_message / ChoiceStream, and each API writes those fields in its own shape."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from minivllm.entrypoints.chat_utils import chat_prompt
from minivllm.entrypoints.serving import ServerState, bad_request
from minivllm.entrypoints.tool_calls import ChatTool, ToolChoice, ToolPlan, plan_tools, template_messages
from minivllm.entrypoints.tool_parsers import TOOL_PARSERS
from minivllm.sampling_params import GuidedDecodingParams, SamplingParams


@dataclass(slots=True)
class ChatTurn:
    """One conversation ready for the engine: its rendered prompt ({"prompt", "prompt_token_ids"}) and how the
    reply uses tools."""

    prompt: dict[str, Any]
    plan: ToolPlan

    @property
    def text(self) -> str | None:
        """The rendered prompt (the reasoning parsers read whether it opened a thinking block)."""
        return self.prompt.get("prompt")


def tool_plan(st: ServerState, tools: list[ChatTool] | None, choice: ToolChoice | None, parallel: bool | None,
              guided: GuidedDecodingParams | None, format_field: str = "response_format") -> ToolPlan:
    """How the request uses tools (400 naming the field when tools, tool_choice and the server do not fit; a forced
    call is already constrained, so it takes no output format besides)."""
    if not tools and choice in (None, "none"):
        return ToolPlan("none", None)
    try:
        plan = plan_tools(tools, choice, parallel, st.auto_tool_parser)
        if plan.constraint is not None and guided is not None:
            raise ValueError(f"tool_choice: a required or named tool call is already constrained; drop "
                             f"{format_field} from this request")
    except ValueError as e:
        raise bad_request(e) from None
    return plan


async def render_chat(st: ServerState, messages: list[dict[str, Any]], plan: ToolPlan,
                      template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> ChatTurn:
    """The conversation through the checkpoint's chat template (400 when the template refuses it); rendered and
    tokenized on a worker thread, since a long conversation would stall every stream."""
    try:
        if any("tool_calls" in m for m in messages):  # earlier calls' arguments as objects for the template
            messages = template_messages(messages)
        prompt = await asyncio.to_thread(chat_prompt, st.tokenizer, messages, add_generation_prompt, None,
                                         plan.tools, template_kwargs)
    except ValueError as e:
        raise bad_request(e) from None
    return ChatTurn(prompt, plan)


def for_tools(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """params as the plan needs them: a parser whose call markers are special tokens ([TOOL_CALLS],
    <|python_tag|>) must see them in the reply."""
    if plan.parser is not None and TOOL_PARSERS[plan.parser].keeps_special_tokens and params.skip_special_tokens:
        return params.clone(skip_special_tokens=False)
    return params
