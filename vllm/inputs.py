"""Prompt forms accepted by `generate` and `add_request`, as in vLLM, and the checked,
tokenized form the engine queues."""

from dataclasses import dataclass
from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache blocks are shared only with the same salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt checked and tokenized once, by `parse_prompt`: `add_request` takes it as is, so
    a caller that checks prompts before queuing them (`LLM.generate`, the server's length
    checks) does not tokenize them again."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


def tokens_prompt(token_ids: list[int], cache_salt: str | None = None) -> TokensPrompt:
    prompt = TokensPrompt(prompt_token_ids=token_ids)
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def truncated(prompt: ProcessedPrompt, num_tokens: int | None, max_model_len: int) -> ProcessedPrompt:
    """`prompt` with only its last `num_tokens` tokens (`truncate_prompt_tokens`: -1 keeps as many
    as leave room for one output token; None keeps all). The text, if any, stays as given."""
    if num_tokens is None:
        return prompt
    keep = max_model_len - 1 if num_tokens == -1 else num_tokens
    if len(prompt.token_ids) <= keep:
        return prompt
    return ProcessedPrompt(prompt.text, prompt.token_ids[-keep:], prompt.cache_salt)


def parse_prompt(prompt: PromptType | ProcessedPrompt, tokenizer) -> ProcessedPrompt:
    """Checks and tokenizes `prompt` (a ProcessedPrompt is returned as is); raises ValueError on
    malformed prompts."""
    if isinstance(prompt, ProcessedPrompt):
        return prompt
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer(checked_text(prompt)).input_ids
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        token_ids = checked_token_ids(list(ids), tokenizer, "prompt_token_ids")
    elif isinstance(prompt, dict) and "prompt" in prompt:
        text = prompt["prompt"]
        token_ids = tokenizer(checked_text(text)).input_ids
    else:
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                         f"got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty (it has no tokens)")
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return ProcessedPrompt(text, token_ids, salt)


def checked_text(text) -> str:
    """`text`, checked to be a string the tokenizer can encode; raises ValueError otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"a prompt's text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid Unicode: {e.reason} at character {e.start} "
                         f"({text[e.start:e.end]!r})") from None
    return text


def checked_token_ids(ids: list, tokenizer, name: str) -> list[int]:
    """`ids`, checked to be ids of the tokenizer's vocabulary; raises ValueError naming `name` and
    the first ids outside it otherwise."""
    vocab = len(tokenizer)
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{name} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return ids
