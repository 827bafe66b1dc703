"""Hermes-style tool calls (Hermes 2 Pro and 3, Qwen2.5 and later): each call is a JSON object
with "name" and "arguments" between `<tool_call>` and `</tool_call>`, after any content."""

import json
import re

from vllm.entrypoints.openai.protocol import FunctionCall, ToolCall
from vllm.entrypoints.openai.tool_parsers.abstract import ToolParser

START, END = "<tool_call>", "</tool_call>"
_CLOSED = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


class HermesToolParser(ToolParser):
    keeps_special_tokens = True  # Hermes models' markers are added tokens

    def content_end(self, text: str, finished: bool) -> int:
        start = text.find(START)
        if start >= 0:
            return start
        if finished:
            return len(text)
        for k in range(min(len(START) - 1, len(text)), 0, -1):  # a marker may be half written
            if text.endswith(START[:k]):
                return len(text) - k
        return len(text)

    def calls(self, text: str, finished: bool) -> list[ToolCall]:
        bodies = [m.group(1) for m in _CLOSED.finditer(text)]
        if finished:  # the last call may stop at the end of the reply without its closing marker
            tail_start = text.rfind(START)
            if tail_start >= 0 and text.find(END, tail_start) < 0:
                bodies.append(text[tail_start + len(START):])
        return [call for call in map(_call, bodies) if call is not None]


def _call(body: str) -> ToolCall | None:
    """The call one block holds, or None if it is not {"name": str, "arguments": {...}}."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(function=FunctionCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False)))
