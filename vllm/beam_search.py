"""Beam search over the engine (vLLM's rule and scoring), for LLM.beam_search and the server.

Each step extends every live beam by one token: the engine runs each beam as a request for one
token with the top 2 x beam_width logprobs. The prefix cache holds the beams' shared full KV
blocks, so a step computes each beam's tokens since its last full block (up to a block each, not
one token: keeping beams as forked running sequences would avoid that). Of a prompt's candidates,
those that end with EOS are finished; of the rest, the beam_width best go on. At the end the
finished and the live beams compete by score.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` include the prompt; `logprobs` has one dict per generated token (the
    token's and its rivals'); `text` is the generated text, set when the search ends."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """The beam's log-probability over its length to the power `length_penalty` (its EOS does not
    count toward the length)."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One search over several prompts, run by whoever drives the engine:

        while not search.done:
            outputs = <run each of search.requests() for one token with search.step_params>
            search.advance(<each output's logprobs of its one token>)
        search.results(decode)

    Raises ValueError if the search cannot run: more logprobs than `max_logprobs`, or a prompt
    that leaves no room for `max_tokens` in `max_model_len`.
    """

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                 max_logprobs: int, max_model_len: int) -> None:
        num_logprobs = 2 * params.beam_width
        if num_logprobs > max_logprobs:
            raise ValueError(f"beam_width={params.beam_width} needs {num_logprobs} logprobs a step, over "
                             f"max_logprobs={max_logprobs} (an engine argument)")
        for prompt in prompts:
            if len(prompt) + params.max_tokens > max_model_len:
                raise ValueError(f"a prompt of {len(prompt)} tokens and max_tokens={params.max_tokens} "
                                 f"do not fit max_model_len={max_model_len}")
        self.params = params
        self.eos_token_id = eos_token_id
        self.step_params = SamplingParams(max_tokens=1, logprobs=num_logprobs, temperature=params.temperature)
        self._prompt_lengths = [len(prompt) for prompt in prompts]
        self._live = [[BeamSearchSequence(tokens=list(prompt))] for prompt in prompts]
        self._finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._steps = 0

    @property
    def done(self) -> bool:
        return self._steps == self.params.max_tokens or not any(self._live)

    def requests(self) -> list[list[int]]:
        """The token ids of every live beam, prompt by prompt: this step's requests."""
        return [beam.tokens for group in self._live for beam in group]

    def request_prompts(self) -> list[int]:
        """For each of `requests()`, the index of the prompt its beam continues."""
        return [i for i, group in enumerate(self._live) for _ in group]

    def advance(self, logprobs: list[dict[int, Logprob]]) -> None:
        """Takes the logprobs each of `requests()` got for its next token, in that order."""
        assert not self.done and len(logprobs) == len(self.requests())
        tops = iter(logprobs)
        for live, finished in zip(self._live, self._finished, strict=True):
            candidates = []
            for beam, top in zip(live, tops):
                for token, entry in top.items():
                    ends = token == self.eos_token_id and not self.params.ignore_eos
                    candidate = BeamSearchSequence(
                        tokens=[*beam.tokens, token], logprobs=[*beam.logprobs, top],
                        cum_logprob=beam.cum_logprob + entry.logprob,
                        finish_reason="stop" if ends else None, stop_reason=token if ends else None)
                    (finished if ends else candidates).append(candidate)
            live[:] = sorted(candidates, key=self._score, reverse=True)[:self.params.beam_width]
        self._steps += 1

    def results(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        """Each prompt's best beams, with their generated text (`decode` of the generated ids,
        without a final EOS unless `include_stop_str_in_output`)."""
        assert self.done
        outputs = []
        for prompt_length, live, finished in zip(self._prompt_lengths, self._live, self._finished, strict=True):
            for beam in live:
                beam.finish_reason = "length"
            best = sorted(finished + live, key=self._score, reverse=True)[:self.params.beam_width]
            for beam in best:
                generated = beam.tokens[prompt_length:]
                if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    generated = generated[:-1]
                beam.text = decode(generated)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam, self.eos_token_id, self.params.length_penalty)


def completion_outputs(output: BeamSearchOutput, prompt_length: int) -> list[CompletionOutput]:
    """A prompt's beams as the completions of one request (as the server returns them)."""
    return [CompletionOutput(index=i, text=beam.text, token_ids=beam.tokens[prompt_length:],
                             cumulative_logprob=beam.cum_logprob, logprobs=beam.logprobs,
                             finish_reason=beam.finish_reason, stop_reason=beam.stop_reason)
            for i, beam in enumerate(output.sequences)]
