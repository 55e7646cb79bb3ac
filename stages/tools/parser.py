"""Reading tool calls out of generated text: verl's hermes format
(verl/experimental/agent_loop/tool_parser.py, after vLLM's hermes parser):

    <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>

Calls are found only when both tags occur; each `<tool_call>...</tool_call>` span (non-greedy,
across lines) is one call, its JSON an object with `name` and `arguments`; the content is the text
with the spans removed. verl drops a span whose JSON cannot be read; here it is kept as a call
with `error="bad_json"` (so the model is told, and the error counted) unless keep_malformed=False.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable

from stages.tools.base import ToolConfigError

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call as generated: verl's FunctionCall (`name`, `arguments` as JSON text) plus, for a
    span that could not be read, error="bad_json" and what was wrong (`detail`; `arguments` then
    holds the span's raw text and `name` is None unless it could be read)."""

    name: str | None
    arguments: str
    error: str | None = None
    detail: str = ""


def parse_hermes(text: str, keep_malformed: bool = True) -> tuple[str, list[ToolCall]]:
    """(content, calls) of one assistant turn's text, as verl's HermesToolParser reads it."""
    if TOOL_CALL_START not in text or TOOL_CALL_END not in text:
        return text, []
    calls = []
    for span in _TOOL_CALL.findall(text):
        call = _read_call(span)
        if call.error is None or keep_malformed:
            calls.append(call)
    return _TOOL_CALL.sub("", text), calls


def _read_call(span: str) -> ToolCall:
    try:
        value = json.loads(span)
    except json.JSONDecodeError as exc:
        return ToolCall(None, span, "bad_json", f"the tool call is not valid JSON: {exc}")
    if not isinstance(value, dict):
        return ToolCall(None, span, "bad_json", f"the tool call must be a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, span, "bad_json", 'the tool call has no "name"')
    if "arguments" not in value:
        return ToolCall(name, span, "bad_json", 'the tool call has no "arguments"')
    return ToolCall(name, json.dumps(value["arguments"], ensure_ascii=False))


# verl's multi_turn.format names; "gpt-oss" is not provided here. "qwen": the name verl's SGLang
# multi-turn configs give (SGLang's Qwen 2.5 detector): the same <tool_call>{"name", "arguments"}</tool_call>
PARSERS: dict[str, Callable[..., tuple[str, list[ToolCall]]]] = {"hermes": parse_hermes, "qwen": parse_hermes}


def get_parser(name: str) -> Callable[..., tuple[str, list[ToolCall]]]:
    """The parser for `actor_rollout_ref.rollout.multi_turn.format`."""
    if name not in PARSERS:
        raise ToolConfigError(f"tool-call format {name!r} is not supported (supported: {sorted(PARSERS)})")
    return PARSERS[name]
