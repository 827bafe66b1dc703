"""Pydantic models of the OpenAI API's requests and responses, with vLLM's extra sampling fields.

Requests accept fields they do not know (as OpenAI's and vLLM's servers do) and log them as
ignored; fields the API defines but this server does not implement are refused by name.
"""

import json
import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_ignored_fields(self):
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(self.model_extra))
        return self


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(OpenAIBaseModel):
    """The sampling fields shared by completions and chat (OpenAI's and vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0  # with --scheduling-policy priority: lower is served first
    cache_salt: str | None = Field(default=None, min_length=1)  # prefix-cache blocks shared with this salt only
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as fit)
    prompt_logprobs: int | None = None  # per prompt position, the top k and the prompt's token
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs (the fields of
    # StructuredOutputsParams) or its older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Beam search instead of sampling: n beams; of the fields above it uses max_tokens,
    # ignore_eos, temperature and include_stop_str_in_output.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream=True")
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and k < 1:
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an integer >= 1, got {k}")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream=True")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None, *,
                        forced_output: StructuredOutputsParams | None = None,
                        keep_special_tokens: bool = False) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range. A `forced_output`
        (a tool call's schema) takes the place of the request's own structured output, which
        it may not have; with `keep_special_tokens` the text keeps them (a tool parser's markers)."""
        structured_outputs = self._structured_outputs()
        if forced_output is not None:
            if structured_outputs is not None:
                raise ValueError("a tool_choice that forces a call cannot be combined with a structured output")
            structured_outputs = forced_output
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, stop=self.stop,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens and not keep_special_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=structured_outputs, truncate_prompt_tokens=self.truncate_prompt_tokens)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one structured output the request asks for, if any; raises ValueError naming
        the fields when it asks in more than one way."""
        given: dict[str, StructuredOutputsParams] = {}
        if self.structured_outputs is not None:
            try:
                given["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # a field StructuredOutputsParams does not have
                raise ValueError(f"structured_outputs: {e}") from None
        guided = {kind: getattr(self, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")}
        for kind, value in guided.items():
            if value is not None:
                given[f"guided_{kind}"] = StructuredOutputsParams(**{kind: value})
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given["response_format"] = StructuredOutputsParams(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            given["response_format"] = StructuredOutputsParams(json=fmt.json_schema.schema_)
        if len(given) > 1:
            raise ValueError(f"give one structured output, got {', '.join(given)}")
        return next(iter(given.values()), None)

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """Raises ValueError naming the field when a value is out of range."""
        if self._structured_outputs() is not None:
            raise ValueError("use_beam_search cannot follow a structured output")
        return BeamSearchParams(
            beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
            temperature=0.0 if self.temperature is None else self.temperature,
            length_penalty=self.length_penalty, include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _refuse_unsupported(request: BaseModel, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(request, name) not in (None, {}, []):
            raise ValueError(f"{name} is not supported by this server")


# ---------------------------------------------------------------- /v1/completions

class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion_fields(self):
        _refuse_unsupported(self, ("suffix",))
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}): every sample is returned, "
                             f"got best_of={self.best_of}")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[dict]:
        """The request's prompts as engine prompts (one request may carry several)."""
        p = self.prompt
        if isinstance(p, str):
            prompts = [{"prompt": p}]
        elif all(isinstance(x, int) for x in p):
            prompts = [{"prompt_token_ids": p}]
        else:
            prompts = [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": x} for x in p]
        if self.cache_salt is not None:
            for prompt in prompts:
                prompt["cache_salt"] = self.cache_salt
        return prompts


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob, as its server writes it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first has none): token id -> its logprob.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def prompt_logprobs_of(entries: list | None, token_ids: list[int], num_top: int) -> PromptLogprobs | None:
    """The prompt logprobs of an output, each position's top `num_top` and its prompt token."""
    if entries is None:
        return None
    return [None if entry is None else {
        t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
        for t, lp in entry.items() if t == token or (lp.rank is not None and lp.rank <= num_top)}
        for token, entry in zip(token_ids, entries, strict=True)]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- /v1/chat/completions

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


class ChatCompletionRequest(_SamplingRequest, ChatTemplateFields):
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


# ---------------------------------------------------------------- /tokenize, /detokenize

class TokenizeRequest(ChatTemplateFields):
    """A prompt, or a conversation for the chat template (vLLM's two tokenize requests, told
    apart by which of the two fields they give)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # None: a prompt's, yes; messages', no (the template writes them)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check_one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
