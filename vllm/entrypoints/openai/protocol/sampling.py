"""The sampling fields that completions and chat share (OpenAI's and vLLM's extras), and how
they become the engine's SamplingParams, BeamSearchParams or structured output."""

from typing import Any, Literal

from pydantic import Field, model_validator

from vllm.entrypoints.openai.protocol.base import OpenAIBaseModel, StreamOptions
from vllm.sampling_params import (BeamSearchParams, SamplingParams, StructuredOutputsParams,
                                  check_truncate_prompt_tokens)


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(OpenAIBaseModel):
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
    def _check_fields(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream=True")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
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
