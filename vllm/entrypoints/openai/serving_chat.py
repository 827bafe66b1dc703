"""/v1/chat/completions: the conversation through the tokenizer's chat template, whole or streamed."""

from collections.abc import AsyncIterator

from vllm.entrypoints.openai.protocol import (AssistantMessage, ChatCompletionLogProb,
                                              ChatCompletionLogProbs, ChatCompletionRequest,
                                              ChatCompletionResponse, ChatCompletionResponseChoice,
                                              ChatCompletionStreamChoice,
                                              ChatCompletionStreamResponse, ChatCompletionTopLogprob,
                                              DeltaMessage, UsageInfo, prompt_logprobs_of, random_id)
from vllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, OpenAIServingError, merge_streams, sse,
                                                    stop_hold)
from vllm.entrypoints.openai.tool_calls import AutoToolReply, Reply, forced_tool_output, reply_for
from vllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllm.inputs import ProcessedPrompt
from vllm.logprobs import Logprob
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    """Chat completions. The reply's role is `response_role` after a generation prompt, else
    that of the message it continues (vLLM's rule). Tool calls: see tool_calls.py; "auto" needs
    a `tool_parser` (a name in TOOL_PARSERS), and with `exclude_tools_when_tool_choice_none` the
    template is not given the tools of a request whose tool_choice is "none"."""

    def __init__(self, *args, response_role: str = "assistant", tool_parser: str | None = None,
                 exclude_tools_when_tool_choice_none: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role
        self.tool_parser = TOOL_PARSERS[tool_parser] if tool_parser is not None else None
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none

    def _role(self, request: ChatCompletionRequest) -> str:
        return self.response_role if request.add_generation_prompt else request.messages[-1].role

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or its server-sent events when `request.stream`; raises
        OpenAIServingError for a request that is refused."""
        model = self.model_name(request.model)
        self.check_n(request.n)
        self.check_priority(request.priority)
        if request.tool_choice == "auto" and self.tool_parser is None:
            raise OpenAIServingError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                     "to be set", param="tool_choice")
        prompt = self.truncate(self._apply_chat_template(request), request.truncate_prompt_tokens)
        max_tokens = self.max_tokens_for(prompt, request.requested_max_tokens)
        forced, reply = forced_tool_output(request), self._reply(request)
        keep_special_tokens = isinstance(reply, AutoToolReply) and reply.parser.keeps_special_tokens
        params = self.sampling_params(lambda: request.sampling_params(
            max_tokens, request.num_logprobs, request.prompt_logprobs, forced_output=forced,
            keep_special_tokens=keep_special_tokens))
        request_id = random_id("chatcmpl")
        if request.use_beam_search and forced is not None:
            raise OpenAIServingError("use_beam_search cannot force a tool call", param="tool_choice")
        if request.use_beam_search:
            search = self.sampling_params(lambda: request.beam_search_params(max_tokens))
            streams = self.start_beam_search([prompt], search, request_id, request.priority)
        else:
            streams = await self.start([prompt], params, request_id, request.priority)
        if request.stream:
            return self._stream(request, request_id, model, prompt, params, streams)
        final = None
        async for _, out in merge_streams(streams):
            final = out
        return self._response(request, request_id, model, final)

    def _reply(self, request: ChatCompletionRequest) -> Reply:
        return reply_for(request, self.tool_parser() if self.tool_parser is not None else None)

    def _apply_chat_template(self, request: ChatCompletionRequest) -> ProcessedPrompt:
        tools = None
        if request.tools and not (request.tool_choice == "none" and self.exclude_tools_when_tool_choice_none):
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        text, ids = self.chat_prompt(request.messages, request, tools=tools)
        salt = {"cache_salt": request.cache_salt} if request.cache_salt is not None else {}
        return self.tokenize({"prompt": text, "prompt_token_ids": ids, **salt})

    def _response(self, request: ChatCompletionRequest, request_id: str, model: str,
                  final: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for out in final.outputs:
            reply = self._reply(request)
            content, calls = reply.whole(out.text)
            choices.append(ChatCompletionResponseChoice(
                index=out.index, message=AssistantMessage(role=self._role(request), content=content, tool_calls=calls),
                logprobs=self._logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0)
                if request.logprobs else None,
                finish_reason=reply.finish_reason(out.finish_reason), stop_reason=out.stop_reason))
        num_prompt = len(final.prompt_token_ids)
        num_completion = sum(len(out.token_ids) for out in final.outputs)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=UsageInfo(
            prompt_tokens=num_prompt, completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion), prompt_logprobs=None if request.prompt_logprobs is None
            else prompt_logprobs_of(final.prompt_logprobs, final.prompt_token_ids, request.prompt_logprobs))

    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str,
                      prompt: ProcessedPrompt, params: SamplingParams,
                      streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        def chunk(index: int, delta: DeltaMessage, **fields) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=[
                ChatCompletionStreamChoice(index=index, delta=delta, **fields)]))

        for index in range(request.n):  # the role comes first, as OpenAI sends it
            yield chunk(index, DeltaMessage(role=self._role(request), content=""))
        hold = stop_hold(params)
        replies = [self._reply(request) for _ in range(request.n)]
        sent_tokens = [0] * request.n
        async for _, out in merge_streams(streams):
            for completion in out.outputs:
                i = completion.index
                finished = completion.finish_reason is not None
                text = completion.text
                # While it runs, a stop string may be forming at the end of the text: held back.
                delta = replies[i].delta(text if finished or not hold else text[:-hold], finished)
                new_tokens = completion.token_ids[sent_tokens[i]:]
                if delta is None and not new_tokens and not finished:
                    continue
                logprobs = None
                if request.logprobs:
                    logprobs = self._logprobs(new_tokens, completion.logprobs[sent_tokens[i]:],
                                              request.top_logprobs or 0)
                sent_tokens[i] = len(completion.token_ids)
                yield chunk(i, delta or DeltaMessage(content=""), logprobs=logprobs,
                            finish_reason=replies[i].finish_reason(completion.finish_reason),
                            stop_reason=completion.stop_reason)
        if request.include_usage:
            num_prompt, num_completion = len(prompt.token_ids), sum(sent_tokens)
            yield sse(ChatCompletionStreamResponse(
                id=request_id, model=model, choices=[], usage=UsageInfo(
                    prompt_tokens=num_prompt, completion_tokens=num_completion,
                    total_tokens=num_prompt + num_completion)))
        yield SSE_DONE

    @staticmethod
    def _logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int) -> ChatCompletionLogProbs:
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            chosen = entry[token_id]
            top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top),
                         key=lambda lp: lp.rank)
            content.append(ChatCompletionLogProb(
                token=chosen.decoded_token, logprob=chosen.logprob,
                bytes=list(chosen.decoded_token.encode()),
                top_logprobs=[ChatCompletionTopLogprob(token=lp.decoded_token, logprob=lp.logprob,
                                                       bytes=list(lp.decoded_token.encode()))
                              for lp in top]))
        return ChatCompletionLogProbs(content=content)
