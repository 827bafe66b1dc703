"""What the completion and chat handlers share: model names, prompt checks, errors, streaming."""

import asyncio
import json
from collections.abc import AsyncIterator
from http import HTTPStatus

from pydantic import BaseModel

from vllm.beam_search import BeamSearch, completion_outputs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.chat_utils import apply_chat_template, has_chat_template
from vllm.entrypoints.openai.protocol import (ChatMessage, ChatTemplateFields, ErrorInfo, ErrorResponse, ModelCard,
                                              ModelList)
from vllm.inputs import ProcessedPrompt, parse_prompt, tokens_prompt, truncated
from vllm.outputs import RequestOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams


class OpenAIServingError(Exception):
    """A request the server refuses, with the HTTP status and the message the client sees."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def response(self) -> ErrorResponse:
        return error_response(str(self), self.status, self.param)


def error_response(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    kind = {HTTPStatus.BAD_REQUEST: "BadRequestError", HTTPStatus.NOT_FOUND: "NotFoundError",
            HTTPStatus.UNAUTHORIZED: "AuthenticationError"}.get(status, "InternalServerError")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=int(status)))


class OpenAIServing:
    """The engine plus the names it is served under and its chat template (None: the
    tokenizer's); checks that are the same for every endpoint. A request's own chat template is
    refused unless `trust_request_chat_template`."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], chat_template: str | None = None,
                 trust_request_chat_template: bool = False) -> None:
        assert served_model_names
        self.engine = engine
        self.served_model_names = served_model_names
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        config = engine.config
        self.max_model_len = config.model.max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.tokenizer = engine.tokenizer

    def show_models(self) -> ModelList:
        root = self.engine.config.model.model
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=self.max_model_len)
                               for name in self.served_model_names])

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; a model that is not served is a 404."""
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise OpenAIServingError(f"The model `{requested}` does not exist.", HTTPStatus.NOT_FOUND,
                                     param="model")
        return requested

    def check_n(self, n: int) -> None:
        # The scheduler runs the n samples of a request side by side: more than max_num_seqs never fit.
        if isinstance(n, int) and n > self.max_num_seqs:
            raise OpenAIServingError(f"n={n} exceeds this server's max_num_seqs={self.max_num_seqs}",
                                     param="n")

    def truncate(self, prompt: ProcessedPrompt, num_tokens: int | None) -> ProcessedPrompt:
        """The prompt as the engine will run it under `truncate_prompt_tokens=num_tokens`, for
        the length checks."""
        return truncated(prompt, num_tokens, self.max_model_len)

    def tokenize(self, prompt: dict) -> ProcessedPrompt:
        try:
            return parse_prompt(prompt, self.tokenizer)
        except ValueError as e:
            raise OpenAIServingError(str(e), param="prompt") from None

    def chat_prompt(self, messages: list[ChatMessage], request: ChatTemplateFields,
                    add_special_tokens: bool = False, tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The text and token ids of the conversation through the chat template, which is
        given the `tools` the reply may call."""
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIServingError("chat_template in a request is refused: this server does not trust "
                                     "request templates (--trust-request-chat-template)", param="chat_template")
        template = request.chat_template or self.chat_template
        if not has_chat_template(self.tokenizer, template):
            raise OpenAIServingError("this model's tokenizer has no chat template (give one with --chat-template); "
                                     "use /v1/completions")
        try:
            conversation = [m.template_message() for m in messages]
            return apply_chat_template(
                self.tokenizer, conversation, tools=tools, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, add_special_tokens=add_special_tokens,
                chat_template=template, chat_template_kwargs=request.chat_template_kwargs)
        except ValueError as e:
            raise OpenAIServingError(str(e), param="messages") from None

    def max_tokens_for(self, prompt: ProcessedPrompt, requested: int | None) -> int:
        """`requested`, or all that max_model_len leaves; a prompt that leaves too little is a 400
        naming both lengths (vLLM's message)."""
        num_prompt = len(prompt.token_ids)
        if requested is None:
            if num_prompt >= self.max_model_len:
                raise OpenAIServingError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, "
                    f"your prompt has {num_prompt} tokens. Please reduce the length of the prompt.",
                    param="messages")
            return self.max_model_len - num_prompt
        if isinstance(requested, int) and num_prompt + requested > self.max_model_len:
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + requested} tokens ({num_prompt} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or "
                "completion.", param="max_tokens")
        return requested

    @staticmethod
    def sampling_params(make) -> SamplingParams:
        """Runs `make()`; its ValueError (which names the field) becomes a 400."""
        try:
            return make()
        except ValueError as e:
            raise OpenAIServingError(str(e)) from None

    def check_priority(self, priority: int) -> None:
        try:
            self.engine.config.scheduler.check_priority(priority)
        except ValueError as e:
            raise OpenAIServingError(str(e), param="priority") from None

    async def start(self, prompts: list[ProcessedPrompt], params: SamplingParams,
                    request_id: str, priority: int = 0) -> list[AsyncIterator[RequestOutput]]:
        """Adds one engine request per prompt and waits for each one's first output, so that a
        request the engine refuses (it can never run) is a 400 before any response starts."""
        streams = [self.engine.generate(p, params, f"{request_id}-{i}", priority)
                   for i, p in enumerate(prompts)]
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        error = next((f for f in firsts if isinstance(f, BaseException)), None)
        refused = next((f for f in firsts if not isinstance(f, BaseException)
                        and f.finished and f.error is not None), None)
        if error is None and refused is None:
            return [_prepend(first, stream) for first, stream in zip(firsts, streams)]
        await _close_all(streams)  # aborts the prompts that did start
        if isinstance(error, ValueError):
            raise OpenAIServingError(str(error)) from None
        if isinstance(error, StopAsyncIteration):
            raise OpenAIServingError("the request was aborted", HTTPStatus.SERVICE_UNAVAILABLE)
        if error is not None:
            raise error
        raise OpenAIServingError(refused.error)


    def start_beam_search(self, prompts: list[ProcessedPrompt], params: BeamSearchParams,
                          request_id: str, priority: int = 0) -> list[AsyncIterator[RequestOutput]]:
        """One stream per prompt that yields, once the search ends, a finished output with the
        best beams as its completions; a search that cannot run is a 400 at once."""
        config = self.engine.config.model
        try:
            searches = [BeamSearch([p.token_ids], params, self.tokenizer.eos_token_id, config.max_logprobs,
                                   config.max_model_len) for p in prompts]
        except ValueError as e:
            raise OpenAIServingError(str(e), param="n") from None
        return [self._beam_search(search, prompt, f"{request_id}-{i}", priority)
                for i, (search, prompt) in enumerate(zip(searches, prompts, strict=True))]

    async def _beam_search(self, search: BeamSearch, prompt: ProcessedPrompt,
                           request_id: str, priority: int) -> AsyncIterator[RequestOutput]:
        step = 0
        while not search.done:
            # A step's beams run side by side; a client that leaves cancels this, which aborts them.
            finals = await asyncio.gather(*(
                _last(self.engine.generate(tokens_prompt(tokens, prompt.cache_salt), search.step_params,
                                           f"{request_id}-{step}-{j}", priority))
                for j, tokens in enumerate(search.requests())))
            search.advance([final.outputs[0].logprobs[0] for final in finals])
            step += 1
        (output,) = search.results(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))
        yield RequestOutput(request_id=request_id, prompt=prompt.text, prompt_token_ids=prompt.token_ids,
                            outputs=completion_outputs(output, len(prompt.token_ids)), finished=True)


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's final output; one the engine refused or gave up on raises OpenAIServingError."""
    final = None
    async for out in stream:  # a cancelled consumer aborts the request (AsyncLLMEngine.generate)
        final = out
    if final is None or not final.finished:
        raise OpenAIServingError("the request was aborted", HTTPStatus.SERVICE_UNAVAILABLE)
    if final.error is not None:
        raise OpenAIServingError(final.error)
    return final


async def _close_all(streams: list[AsyncIterator]) -> None:
    for stream in streams:
        await stream.aclose()  # aborts a request that is still running


async def _prepend(first: RequestOutput, stream: AsyncIterator[RequestOutput]
                   ) -> AsyncIterator[RequestOutput]:
    try:
        yield first
        if not first.finished:
            async for out in stream:
                yield out
    finally:
        await stream.aclose()


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several requests' streams as (stream index, output) in arrival order; leaving
    early (or being cancelled) closes every stream, which aborts its request."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await stream.aclose()
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event."""
    data = payload.model_dump_json(exclude_unset=False) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stop_hold(params: SamplingParams) -> int:
    """Characters a stream holds back: a stop string may be split over several tokens."""
    if params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in params.stop), default=1) - 1


def text_delta(text: str, sent: int, finished: bool, hold: int) -> str:
    """The text not yet sent. While a sequence runs, its last `hold` characters stay back: they
    may be the start of a stop string that the engine will cut off."""
    end = len(text) if finished else max(sent, len(text) - hold)
    return text[sent:end]
