"""/v1/completions: one or several prompts, n samples each, whole or streamed."""

from collections.abc import AsyncIterator

from vllm.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest,
                                              CompletionResponse, CompletionResponseChoice, UsageInfo,
                                              prompt_logprobs_of, random_id)
from vllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing,
                                                    merge_streams, sse, stop_hold, text_delta)
from vllm.inputs import ProcessedPrompt
from vllm.logprobs import Logprob
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """The response, or its server-sent events when `request.stream`; raises
        OpenAIServingError for a request that is refused."""
        model = self.model_name(request.model)
        self.check_n(request.n)
        self.check_priority(request.priority)
        prompts = [self.truncate(self.tokenize(p), request.truncate_prompt_tokens) for p in request.prompts()]
        max_tokens = [self.max_tokens_for(p, request.max_tokens) for p in prompts]
        # echo with logprobs reports the prompt's logprobs too, as OpenAI does.
        echoed = request.logprobs if request.echo else None
        prompt_logprobs = max((k for k in (echoed, request.prompt_logprobs) if k is not None), default=None)
        params = self.sampling_params(lambda: request.sampling_params(
            max(max_tokens), request.logprobs, prompt_logprobs))
        request_id = random_id("cmpl")
        if request.use_beam_search:
            search = self.sampling_params(lambda: request.beam_search_params(max(max_tokens)))
            streams = self.start_beam_search(prompts, search, request_id, request.priority)
        else:
            streams = await self.start(prompts, params, request_id, request.priority)
        if request.stream:
            return self._stream(request, request_id, model, prompts, params, streams)
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async for i, out in merge_streams(streams):
            finals[i] = out
        return self._response(request, request_id, model, finals)

    def _response(self, request: CompletionRequest, request_id: str, model: str,
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        num_prompt = num_completion = 0
        for i, final in enumerate(finals):
            num_prompt += len(final.prompt_token_ids)
            for out in final.outputs:
                num_completion += len(out.token_ids)
                text, logprobs = out.text, None
                if request.echo:
                    text = (final.prompt or self.tokenizer.decode(final.prompt_token_ids)) + text
                if request.logprobs is not None:
                    logprobs = self._logprobs(out.token_ids, out.logprobs, request.logprobs,
                                              final.prompt_logprobs if request.echo else None,
                                              final.prompt_token_ids)
                choices.append(CompletionResponseChoice(
                    index=i * request.n + out.index, text=text, logprobs=logprobs,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                    prompt_logprobs=None if request.prompt_logprobs is None else prompt_logprobs_of(
                        final.prompt_logprobs, final.prompt_token_ids, request.prompt_logprobs)))
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                          total_tokens=num_prompt + num_completion)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(self, request: CompletionRequest, request_id: str, model: str,
                      prompts: list[ProcessedPrompt], params: SamplingParams,
                      streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        hold = stop_hold(params)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        num_completion = 0
        async for i, out in merge_streams(streams):
            for completion in out.outputs:
                index = i * request.n + completion.index
                if index not in sent_text and request.echo:
                    prompt_text = prompts[i].text or self.tokenizer.decode(prompts[i].token_ids)
                    yield sse(self._chunk(request_id, model, index, prompt_text))
                start_text, start_tok = sent_text.get(index, 0), sent_tokens.get(index, 0)
                finished = completion.finish_reason is not None
                delta = text_delta(completion.text, start_text, finished, hold)
                new_tokens = completion.token_ids[start_tok:]
                if not delta and not new_tokens and not finished:
                    continue
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(new_tokens, completion.logprobs[start_tok:],
                                              request.logprobs, None, [], start_text)
                sent_text[index] = start_text + len(delta)
                sent_tokens[index] = len(completion.token_ids)
                num_completion += len(new_tokens)
                yield sse(self._chunk(request_id, model, index, delta, logprobs,
                                      completion.finish_reason, completion.stop_reason))
        if request.include_usage:
            num_prompt = sum(len(p.token_ids) for p in prompts)
            usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                              total_tokens=num_prompt + num_completion)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
        yield SSE_DONE

    @staticmethod
    def _chunk(request_id: str, model: str, index: int, text: str, logprobs=None,
               finish_reason: str | None = None, stop_reason=None) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=model, choices=[CompletionResponseChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=stop_reason)])

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                  prompt_logprobs: list | None, prompt_token_ids: list[int],
                  offset: int = 0) -> CompletionLogProbs:
        """OpenAI's completion logprobs: per token its text, logprob, top alternatives, offset.
        With echo the prompt's tokens come first (the first has no logprob)."""
        result = CompletionLogProbs()
        positions = list(zip(token_ids, logprobs))
        if prompt_logprobs is not None:
            positions = list(zip(prompt_token_ids, prompt_logprobs)) + positions
        for token_id, entry in positions:
            text = (entry[token_id].decoded_token if entry is not None
                    else self.tokenizer.decode([token_id]))
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(entry[token_id].logprob)
            top = {lp.decoded_token: lp.logprob for lp in entry.values()
                   if lp.rank is not None and lp.rank <= num_top}
            result.top_logprobs.append(top)
        return result
