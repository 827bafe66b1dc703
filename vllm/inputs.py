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
        text, token_ids = prompt, tokenizer(prompt).input_ids
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        vocab = len(tokenizer)
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    elif isinstance(prompt, dict) and "prompt" in prompt:
        text = prompt["prompt"]
        token_ids = tokenizer(text).input_ids
    else:
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                         f"got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("the prompt is empty (it has no tokens)")
    return text, token_ids
