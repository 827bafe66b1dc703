"""Prompt forms accepted by `generate` and `add_request`, as in vLLM."""

from typing import TypedDict, Union


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = Union[str, TextPrompt, TokensPrompt]


def parse_prompt(prompt: PromptType, tokenizer) -> tuple[str | None, list[int]]:
    """Returns (prompt text or None, prompt token ids); raises ValueError on malformed prompts."""
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer(_checked_text(prompt)).input_ids
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        token_ids = list(ids)
        vocab = len(tokenizer)
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    elif isinstance(prompt, dict) and "prompt" in prompt:
        text = prompt["prompt"]
        token_ids = tokenizer(_checked_text(text)).input_ids
    else:
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                         f"got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty (it has no tokens)")
    return text, token_ids


def _checked_text(text) -> str:
    if not isinstance(text, str):
        raise ValueError(f"a prompt's text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid Unicode: {e.reason} at character {e.start} "
                         f"({text[e.start:e.end]!r})") from None
    return text
