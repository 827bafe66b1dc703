"""Structured outputs on the engine's side: one grammar matcher (xgrammar) per sample that asks
for one.

Before each step the engine asks for the bitmask of the tokens each sampling sample's grammar
allows next (`masks`); the step carries them to the runner, whose sampler removes every other
token (logits_processors.apply_token_masks). After the step, each committed token advances its
sample's matcher (`accept`); a failed step commits nothing, so no matcher ever goes back. When
the grammar is complete, only the stop tokens remain allowed, and accepting one ends it.
"""

import json
import re

import torch

from vllm.core.scheduler_output import SchedulerOutput
from vllm.sampling_params import StructuredOutputsParams

_INSTALL = "structured outputs need xgrammar: pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi"


class StructuredOutputManager:
    """The matchers of the samples with structured outputs, by sample id. `stop_token_ids` end
    a complete grammar (the engine's EOS ids)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler = None  # made on first use: it reads the whole vocabulary
        self._matchers: dict[str, object] = {}

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of `params`; raises ValueError naming what the compiler refused."""
        compiler = self._get_compiler()
        try:
            any_whitespace = not params.disable_any_whitespace
            if params.json is not None:
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
            if params.json_object:
                if any_whitespace:
                    return compiler.compile_builtin_json_grammar()
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if params.regex is not None:
                return compiler.compile_regex(params.regex)
            if params.choice is not None:
                # A JSON string literal is an EBNF string literal too.
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as e:  # xgrammar's errors for a schema, regex or grammar it cannot parse
            # "[time] file.cc:line: message": the message is what the user can act on.
            message = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(e).strip().splitlines()[0])
            raise ValueError(f"structured_outputs: {message}") from None

    def add(self, sample_id: str, grammar) -> None:
        import xgrammar

        self._matchers[sample_id] = xgrammar.GrammarMatcher(grammar)

    def remove(self, sample_id: str) -> None:
        self._matchers.pop(sample_id, None)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def masks(self, step: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Per sampling sample of `step` with a grammar: the packed bitmask of the tokens it
        allows next, (ceil(vocab / 32),) int32, bit j of word i for token 32 i + j."""
        if not self._matchers:
            return {}
        ids = [rid for s in step.scheduled if s.sample for rid in (s.request_id, *(f for f, _ in s.forks))
               if rid in self._matchers]
        if not ids:
            return {}
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(ids), self._vocab_size)  # (S, ceil(V / 32)) int32
        for row, rid in enumerate(ids):
            self._matchers[rid].fill_next_token_bitmask(bitmask, row)
        return dict(zip(ids, bitmask.unbind(0), strict=True))

    def accept(self, sample_id: str, token: int) -> bool:
        """Advances the sample's grammar by its new token; True once the grammar is complete.
        Raises ValueError if the grammar does not allow the token."""
        matcher = self._matchers[sample_id]
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the request's structured output")
        return matcher.is_terminated()

    def _get_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise ValueError(_INSTALL) from None
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler
