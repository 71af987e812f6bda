"""Chat templates of the families make-model writes, in the shape their checkpoints ship them (the turn markers,
the system prompt's place, tools, and thinking switches), shortened where the real ones carry long prose."""

from __future__ import annotations

# Qwen3: ChatML; tools listed in the system turn and called as <tool_call> JSON (hermes); earlier assistant turns
# lose their <think> blocks; enable_thinking=false writes an empty thinking block for the model.
QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + call.function.name + "
    "'\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# SmolLM3: ChatML with a metadata system block naming the reasoning mode (/think, /no_think); thinking off writes
# the empty block, as Qwen3's does.
SMOLLM3 = (
    "{%- set thinking = enable_thinking is not defined or enable_thinking %}"
    "{{- '<|im_start|>system\\n## Metadata\\n\\nReasoning Mode: ' + ('/think' if thinking else '/no_think') + "
    "'\\n\\n## Custom Instructions\\n\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{%- if tools %}{{- '\\n\\n### Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>\\n\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}"
    "</tool_call>' }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if not thinking %}{{- '<think>\\n\\n</think>\\n' }}{%- endif %}{%- endif %}"
)

# Gemma 2/3: <start_of_turn>user / model turns after <bos>; a system prompt opens the first user turn.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set first = messages[0].content + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set first = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + (message.content or '') + "
    "'<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Phi-4-mini: <|role|>content<|end|>; tools as JSON inside <|tool|> ... <|/tool|> in the system turn.
PHI4 = (
    "{%- if tools and messages[0].role != 'system' %}{{- '<|system|>You are a helpful assistant.<|tool|>' + "
    "(tools | tojson) + '<|/tool|><|end|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{{- '<|system|>' + message.content + '<|tool|>' + (tools | tojson) + '<|/tool|><|end|>' }}"
    "{%- else %}{{- '<|' + message.role + '|>' + (message.content or '') + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- else %}{{- eos_token }}{%- endif %}"
)

# OLMo 2 (instruct): <|system|>, <|user|>, <|assistant|> blocks; an assistant turn ends with EOS.
OLMO2 = (
    "{{ bos_token if bos_token is not none else '' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|assistant|>\\n' + (message.content or '') + eos_token + '\\n' }}"
    "{%- else %}{{- '<|' + message.role + '|>\\n' + message.content + '\\n' }}{%- endif %}"
    "{%- if loop.last and add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)

# Granite 3.x: <|start_of_role|>role<|end_of_role|>content<|end_of_text|>; tools in an available_tools turn.
GRANITE = (
    "{%- if tools %}{{- '<|start_of_role|>available_tools<|end_of_role|>\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}{{- '<|end_of_text|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + (message.content or '') + '<|end_of_text|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)

CHAT_TEMPLATES = {"qwen3": QWEN3, "smollm3": SMOLLM3, "gemma": GEMMA, "phi4": PHI4, "olmo2": OLMO2,
                  "granite": GRANITE}
