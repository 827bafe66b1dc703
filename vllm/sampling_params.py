"""Per-request sampling parameters, with vLLM's names, defaults and validation."""

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

# Below this temperature sampling is treated as greedy, as in vLLM.
_SAMPLING_EPS = 1e-5


def _is_int(value: object) -> bool:
    # bool is a subclass of int in Python; `top_k=True` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _token_id(key: object) -> int | None:
    """A logit_bias key as a token id, or None when it is not one."""
    if _is_int(key):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return None


def _check(name: str, value: object, ok: Callable[[object], bool], allowed: str) -> None:
    if not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_truncate_prompt_tokens(value: object) -> None:
    """Raises ValueError unless `value` is a truncate_prompt_tokens (the server checks it before
    it cuts a prompt for its length check, ahead of the rest of the sampling parameters)."""
    _check("truncate_prompt_tokens", value, lambda v: v is None or (_is_int(v) and (v == -1 or v >= 1)),
           "None, -1 or an integer >= 1")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint the output must follow, a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a regular
    expression, one of the strings in `choice`, or an EBNF `grammar` (root rule `root`). JSON
    may hold any whitespace between its tokens unless `disable_any_whitespace`, which writes it
    compact (a small model may otherwise write whitespace until max_tokens)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must give exactly one of json, regex, choice, grammar, "
                             f"json_object, got {given or 'none'}")
        _check("structured_outputs.json", self.json, lambda v: v is None or isinstance(v, (str, dict)),
               "a JSON schema (a dict or its JSON text)")
        for name in ("regex", "grammar"):
            _check(f"structured_outputs.{name}", getattr(self, name), lambda v: v is None or isinstance(v, str),
                   "a string")
        _check("structured_outputs.choice", self.choice, lambda v: v is None or (
            isinstance(v, (list, tuple)) and v and all(isinstance(c, str) and c for c in v)),
            "a non-empty list of non-empty strings")
        _check("structured_outputs.json_object", self.json_object, lambda v: v in (None, True, False),
               "True, False or None")
        _check("structured_outputs.disable_any_whitespace", self.disable_any_whitespace,
               lambda v: isinstance(v, bool), "True or False")


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    `temperature=0` is greedy. `top_k=0` (or -1, stored as 0), `top_p=1` and `min_p=0` disable
    those filters; penalties at their defaults (0, 0, 1) do nothing. A `seed` gives the request
    its own random stream, so its tokens do not depend on which other requests share a step,
    nor on how its prompt was chunked. After `__post_init__`: `stop` is a list of strings,
    `stop_token_ids` a list of ints, `best_of == n`, floats are Python floats, and `logit_bias`
    maps int ids to biases clipped to [-100, 100] (JSON gives its keys as strings).

    `structured_outputs` (a grammar's mask), `allowed_token_ids`, `bad_words` and `logit_bias`
    change the logits before the penalties, in vLLM's order; the engine compiles the grammar,
    checks the ids against the model's vocabulary and tokenizes `bad_words`
    (`update_from_tokenizer`).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Keep only the prompt's last k tokens (-1: the last max_model_len - 1); None: the whole prompt.
    truncate_prompt_tokens: int | None = None
    # Set by the engine from `bad_words` (update_from_tokenizer), not by users.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_floats()
        if self.top_k == -1:
            self.top_k = 0
        _check("top_k", self.top_k, lambda v: _is_int(v) and v >= 0,
               "0 or -1 (disabled) or an integer >= 1")
        _check("seed", self.seed, lambda v: v is None or _is_int(v), "None or an integer")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            _check(name, getattr(self, name), lambda v: v is None or (_is_int(v) and v >= 0),
                   "None or an integer >= 0")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            _check(name, getattr(self, name), lambda v: isinstance(v, bool), "True or False")
        self._normalise_stops()
        self._normalise_token_constraints()

    def _check_counts(self) -> None:
        _check("n", self.n, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        if self.best_of is None:
            self.best_of = self.n
        _check("best_of", self.best_of, lambda v: _is_int(v) and v >= self.n,
               f"None or an integer >= n ({self.n})")
        if self.best_of > self.n:
            raise ValueError(f"best_of > n is not supported (all n samples are returned), "
                             f"got best_of={self.best_of}, n={self.n}")
        _check("max_tokens", self.max_tokens, lambda v: v is None or (_is_int(v) and v >= 1),
               "None or an integer >= 1")
        limit = math.inf if self.max_tokens is None else self.max_tokens
        _check("min_tokens", self.min_tokens, lambda v: _is_int(v) and 0 <= v <= limit,
               f"an integer in [0, max_tokens={self.max_tokens}]")

    def _check_floats(self) -> None:
        ranges = {  # name -> (test, allowed range as shown to the user)
            "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
            "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
            "repetition_penalty": (lambda v: v > 0.0, "> 0"),
            "temperature": (lambda v: v >= 0.0, ">= 0"),
            "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
            "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
        }
        for name, (in_range, allowed) in ranges.items():
            value = getattr(self, name)
            _check(name, value, lambda v, in_range=in_range: _is_number(v) and in_range(v), f"a number {allowed}")
            setattr(self, name, float(value))

    def _normalise_stops(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _check("stop", stop, lambda v: v is None or (
            isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v)),
            "None, a non-empty string or a list of non-empty strings")
        self.stop = list(stop or [])
        _check("stop_token_ids", self.stop_token_ids, lambda v: v is None or (
            isinstance(v, (list, tuple)) and all(_is_int(t) and t >= 0 for t in v)),
            "None or a list of integers >= 0")
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _normalise_token_constraints(self) -> None:
        if self.logit_bias is not None:
            _check("logit_bias", self.logit_bias, lambda v: isinstance(v, dict) and all(
                _token_id(t) is not None and _is_number(b) for t, b in v.items()),
                "None or a dict of token ids (integers >= 0, or their decimal strings) to finite numbers")
            self.logit_bias = {_token_id(t): min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}
        _check("allowed_token_ids", self.allowed_token_ids, lambda v: v is None or (
            isinstance(v, (list, tuple)) and v and all(_is_int(t) and t >= 0 for t in v)),
            "None or a non-empty list of integers >= 0")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        _check("bad_words", self.bad_words, lambda v: v is None or (
            isinstance(v, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in v)),
            "None or a list of strings that are not blank")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        _check("structured_outputs", self.structured_outputs,
               lambda v: v is None or isinstance(v, StructuredOutputsParams), "None or a StructuredOutputsParams")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenizes `bad_words`: each word as it would start the text and, where the tokenizer
        gives a word after a space other ids of the same count, also as it would follow a space
        (as vLLM does), so the word is banned in both places."""
        if not self.bad_words:
            return
        sequences = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(alone)
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                sequences.append(spaced)
        self._bad_words_token_ids = sequences

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """`bad_words` as token id sequences; empty until `update_from_tokenizer`."""
        return self._bad_words_token_ids or []

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def update_from_generation_config(self, generation_config: dict,
                                      model_eos_token_id: int | None = None) -> None:
        """Adds the generation config's EOS ids other than the tokenizer's (`model_eos_token_id`,
        which ends requests on its own) to `stop_token_ids`, unless `ignore_eos`, as vLLM does:
        a request that ends on one reports it as its `stop_reason`."""
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None or self.ignore_eos:
            return
        extra = ({eos_ids} if isinstance(eos_ids, int) else set(eos_ids)) - {model_eos_token_id}
        self.stop_token_ids = sorted(extra | set(self.stop_token_ids))

    def clone(self) -> "SamplingParams":
        """A deep copy, so editing the copy's lists leaves this request alone."""
        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (LLM.beam_search, and `use_beam_search` on the server).
    `length_penalty` divides a beam's log-probability by its length (prompt included) to that
    power when beams are ranked; see vllm/beam_search.py."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            _check(name, getattr(self, name), lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        _check("temperature", self.temperature, lambda v: _is_number(v) and v >= 0, "a number >= 0")
        _check("length_penalty", self.length_penalty, _is_number, "a number")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check(name, getattr(self, name), lambda v: isinstance(v, bool), "True or False")
