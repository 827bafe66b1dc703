"""/tokenize and /detokenize (vLLM's)."""

from pydantic import Field, model_validator

from vllm.entrypoints.openai.protocol.base import OpenAIBaseModel
from vllm.entrypoints.openai.protocol.chat import ChatMessage, ChatTemplateFields


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
