"""A chat reply's content and tool calls under each `tool_choice`, whole or streamed.

    "none"     the text is the content
    named      the text is the named function's arguments, forced to its parameters' schema
    "required" the text is a JSON list of {"name", "parameters"} calls, forced by a schema
    "auto"     the server's tool parser finds the calls in free text (--tool-call-parser)

A stream sends the same content and calls as the whole reply: a named call's arguments as they
come, the other calls each in one delta once complete.
"""

import json
from typing import Any

from vllm.entrypoints.openai.protocol import (ChatCompletionRequest, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                              FunctionCall, ToolCall)
from vllm.entrypoints.openai.tool_parsers import ToolParser
from vllm.sampling_params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_tool_output(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The structured output that makes the reply a call, for a named or required tool_choice."""
    named = request.named_tool
    if named is not None:
        return StructuredOutputsParams(json=named.parameters or ANY_OBJECT)
    if request.tool_choice != "required":
        return None
    one_call = [{"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                "parameters": tool.function.parameters or ANY_OBJECT},
                 "required": ["name", "parameters"]} for tool in request.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one_call}}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


class Reply:
    """One choice's reply: `whole(text)` for a response, `delta(text, finished)` for each event
    of a stream (`text` is all the reply's text so far that may be sent)."""

    calls_finish = False  # a reply with calls finishes with "tool_calls"

    def __init__(self) -> None:
        self.sent = 0  # characters of the text handled
        self.has_calls = False

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return text, []

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return DeltaMessage(content=new) if new else None

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason is not None and self.calls_finish and self.has_calls else reason


class NamedToolReply(Reply):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.call = ToolCall(function=FunctionCall(name=name, arguments=""))

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return None, [ToolCall(function=FunctionCall(name=self.name, arguments=text))]

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        if self.has_calls and not new:
            return None
        first = not self.has_calls
        self.has_calls = True
        return DeltaMessage(tool_calls=[DeltaToolCall(
            index=0, id=self.call.id if first else None, type="function" if first else None,
            function=DeltaFunctionCall(name=self.name if first else None, arguments=new))])


class RequiredToolReply(Reply):
    calls_finish = True

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut short (max_tokens): no call is complete
            return text, []
        calls = [ToolCall(function=FunctionCall(name=item["name"],
                                                arguments=json.dumps(item["parameters"], ensure_ascii=False)))
                 for item in items]
        self.has_calls = bool(calls)
        return None, calls

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        if not finished:
            return None
        content, calls = self.whole(text)
        return _calls_delta(content, calls, 0)


class AutoToolReply(Reply):
    calls_finish = True

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()
        self.parser = parser
        self.num_calls = 0

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.parser.extract(text)
        self.has_calls = bool(calls)
        return content, calls

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        end = self.parser.content_end(text, finished)
        content = text[self.sent:end]
        self.sent = max(self.sent, end)
        calls = self.parser.calls(text, finished)
        if finished and not calls and not self.num_calls:  # no call after all: the rest is content
            content += text[self.sent:]
            self.sent = len(text)
        new_calls = calls[self.num_calls:]
        message = _calls_delta(content or None, new_calls, self.num_calls)
        self.num_calls = max(self.num_calls, len(calls))
        self.has_calls = self.num_calls > 0
        return message


def _calls_delta(content: str | None, calls: list[ToolCall], first_index: int) -> DeltaMessage | None:
    if not content and not calls:
        return None
    deltas = [DeltaToolCall(index=first_index + i, id=call.id, type="function",
                            function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
              for i, call in enumerate(calls)]
    return DeltaMessage(content=content, tool_calls=deltas or None)


def reply_for(request: ChatCompletionRequest, parser: ToolParser | None) -> Reply:
    """How the replies to `request` are read (the server checked that "auto" has a parser)."""
    if request.named_tool is not None:
        return NamedToolReply(request.named_tool.name)
    if request.tool_choice == "required":
        return RequiredToolReply()
    if request.tool_choice == "auto" and parser is not None:
        return AutoToolReply(parser)
    return Reply()
