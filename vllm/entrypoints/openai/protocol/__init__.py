"""Pydantic models of the OpenAI API's requests and responses, with vLLM's extra sampling fields.

Requests accept fields they do not know (as OpenAI's and vLLM's servers do) and log them as
ignored; fields the API defines but this server does not implement are refused by name. One
module per endpoint; every model is importable from here, as from vLLM's `protocol` module.
"""

from vllm.entrypoints.openai.protocol.base import (ErrorInfo, ErrorResponse, ModelCard, ModelList, OpenAIBaseModel,
                                                   StreamOptions, UsageInfo, random_id)
from vllm.entrypoints.openai.protocol.sampling import (JsonSchemaFormat, PromptLogprob, PromptLogprobs, ResponseFormat,
                                                       SamplingRequest, prompt_logprobs_of)
from vllm.entrypoints.openai.protocol.completion import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                         CompletionResponseChoice)
from vllm.entrypoints.openai.protocol.tools import (ChatCompletionTool, DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                                    FunctionDefinition, NamedFunction, NamedToolChoice, ToolCall)
from vllm.entrypoints.openai.protocol.chat import (AssistantMessage, ChatCompletionLogProb, ChatCompletionLogProbs,
                                                   ChatCompletionRequest, ChatCompletionResponse,
                                                   ChatCompletionResponseChoice, ChatCompletionStreamChoice,
                                                   ChatCompletionStreamResponse, ChatCompletionTopLogprob, ChatMessage,
                                                   ChatTemplateFields, DeltaMessage)
from vllm.entrypoints.openai.protocol.tokenization import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                                           TokenizeResponse)

__all__ = [
    "random_id", "OpenAIBaseModel", "ErrorInfo", "ErrorResponse", "StreamOptions", "UsageInfo", "ModelCard",
    "ModelList", "JsonSchemaFormat", "ResponseFormat", "SamplingRequest", "PromptLogprob", "prompt_logprobs_of",
    "PromptLogprobs", "CompletionRequest", "CompletionLogProbs", "CompletionResponseChoice", "CompletionResponse",
    "FunctionCall", "ToolCall", "DeltaFunctionCall", "DeltaToolCall", "FunctionDefinition", "ChatCompletionTool",
    "NamedFunction", "NamedToolChoice", "ChatMessage", "ChatTemplateFields", "ChatCompletionRequest",
    "ChatCompletionTopLogprob", "ChatCompletionLogProb", "ChatCompletionLogProbs", "AssistantMessage",
    "ChatCompletionResponseChoice", "ChatCompletionResponse", "DeltaMessage", "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse", "TokenizeRequest", "TokenizeResponse", "DetokenizeRequest",
    "DetokenizeResponse",
]
