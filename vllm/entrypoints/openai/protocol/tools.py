"""Tool calls in chat completions: the tools a request offers, the calls a reply makes (whole
or streamed), and a `tool_choice` that names one function."""

from typing import Any, Literal

from pydantic import Field

from vllm.entrypoints.openai.protocol.base import OpenAIBaseModel, random_id


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed tool call: its first delta has the id and the name, later ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """`tool_choice` naming the function the reply must call."""

    type: Literal["function"] = "function"
    function: NamedFunction
