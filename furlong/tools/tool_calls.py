"""Tool calls in Qwen3's (Hermes-style) format, and tool results as tokens through the chat template.

A model turn calls tools with blocks of JSON between tags:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12345 * 6789"}}
    </tool_call>

`parse_tool_calls` reads every such block of a turn's text (a block that is not a JSON object with a
string "name" and an object "arguments" becomes a call with `error` set, answered with that error).

`tool_result_ids` renders the results as the chat template renders "tool" messages after an
assistant turn (Qwen3: a user turn of <tool_response> blocks, then the generation prompt of the
next assistant turn) and returns only what follows the assistant turn's end token, which the model
itself produced: the template is rendered without and with the tool messages, and the tokens of the
difference are the tool tokens. The template and its kwargs (--apply-chat-template-kwargs, e.g.
enable_thinking) are the tokenizer's, so the tokens are what a full re-render of the conversation
would give after that point.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None     # why the block could not be read as a call


def parse_tool_calls(text: str) -> list[ToolCall]:
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            calls.append(ToolCall(name="", error="tool call is not valid JSON"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                not isinstance(obj.get("arguments", {}), dict):
            calls.append(ToolCall(name="", error='tool call needs {"name": str, "arguments": {...}}'))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=obj.get("arguments", {})))
    return calls


def tool_result_ids(tokenizer: Any, calls: list[ToolCall], results: list[str],
                    chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
    """(token ids, text) of the tool messages `results` answering `calls`, to append after the assistant
    turn that made them (module docstring)."""
    kwargs = chat_template_kwargs or {}
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": c.name or "unknown", "arguments": c.arguments}} for c in calls]}
    base = [{"role": "user", "content": "x"}, assistant]
    tools = [{"role": "tool", "name": c.name or "unknown", "content": r} for c, r in zip(calls, results)]
    without = tokenizer.apply_chat_template(base, tokenize=False, add_generation_prompt=False, **kwargs)
    with_tools = tokenizer.apply_chat_template(base + tools, tokenize=False, add_generation_prompt=True, **kwargs)
    end_token = tokenizer.eos_token or ""
    end = without.rindex(end_token) + len(end_token) if end_token and end_token in without else len(without)
    if not with_tools.startswith(without[:end]):
        raise ValueError("chat template: the tool messages change what precedes them (not append-only)")
    text = with_tools[end:]
    return tokenizer(text, add_special_tokens=False)["input_ids"], text
