"""/v1/completions: the request, its prompts for the engine, and the response."""

import time
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from vllm.entrypoints.openai.protocol.base import OpenAIBaseModel, UsageInfo
from vllm.entrypoints.openai.protocol.sampling import PromptLogprobs, SamplingRequest


def _refuse_unsupported(request: BaseModel, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(request, name) not in (None, {}, []):
            raise ValueError(f"{name} is not supported by this server")


class CompletionRequest(SamplingRequest):
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
