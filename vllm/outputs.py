"""What `generate` and `step` return, with vLLM's class and field names."""

from dataclasses import dataclass, field

from vllm.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: int | str | None = None  # the stop token id that ended it, if any

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None
    # Prompt tokens found in the prefix cache (not computed) when the request was first scheduled.
    num_cached_tokens: int = 0
    # Why the engine refused the request (finish_reason "length" without any output) or gave up
    # on it (finish_reason "error": its steps kept failing), else None.
    error: str | None = field(default=None)
