"""/v1/chat/completions: messages, the request, and the response whole or streamed."""

import json
import time
from typing import Any, Literal

from pydantic import Field, model_validator

from vllm.entrypoints.openai.protocol.base import OpenAIBaseModel, UsageInfo
from vllm.entrypoints.openai.protocol.sampling import PromptLogprobs, SamplingRequest
from vllm.entrypoints.openai.protocol.tools import (ChatCompletionTool, DeltaToolCall, FunctionDefinition,
                                                    NamedToolChoice, ToolCall)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it: the content as text, an earlier call's
        arguments as an object where they are one (templates write them out as JSON)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        return message

    def text(self) -> str:
        """The content as one string; of the content parts only text parts are supported."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: only text content parts are supported, got {part.get('type')!r}")
            texts.append(part["text"])
        return "\n".join(texts)


def _json_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


class ChatTemplateFields(OpenAIBaseModel):
    """How a conversation becomes a prompt: chat completions, and /tokenize with messages."""

    add_generation_prompt: bool = True
    # The prompt ends inside the last message, which the model then continues.
    continue_final_message: bool = False
    # A template of the request's own, refused unless the server trusts request templates.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: whatever max_model_len leaves
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    # None: "auto" with tools, else "none" (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat_fields(self):
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        elif self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool is None:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not one of the tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def named_tool(self) -> FunctionDefinition | None:
        """The function `tool_choice` names, if it names one of the tools."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next((t.function for t in self.tools or () if t.function.name == self.tool_choice.function.name),
                    None)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatCompletionTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(ChatCompletionTopLogprob):
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProb] | None = None


class AssistantMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
