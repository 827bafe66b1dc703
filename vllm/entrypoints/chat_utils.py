"""A conversation through a chat template: the one place LLM.chat, the server's chat completions
and its /tokenize turn messages into a prompt."""

import inspect
import os
from typing import Any

from jinja2 import TemplateError


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: the template in a file, or given inline (Jinja always has braces)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")


def has_chat_template(tokenizer, chat_template: str | None = None) -> bool:
    return bool(chat_template or getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer, conversation: list[dict], *, tools: list[dict] | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        add_special_tokens: bool = False,
                        chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """The prompt's text and token ids, through `chat_template` (default: the tokenizer's).

    `tools` are the functions the reply may call (OpenAI's tool definitions), for templates
    that write them into the prompt. With `continue_final_message` the prompt ends inside the
    last message (the model continues it) instead of after it. `chat_template_kwargs` are more
    variables for the template (such as `enable_thinking`); they cannot replace the arguments of
    the call itself. Raises ValueError for a conversation or variables the template refuses.
    """
    assert has_chat_template(tokenizer, chat_template)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    variables = dict(chat_template_kwargs or {})
    reserved = sorted(set(variables) & _call_arguments(tokenizer))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}: "
                         "they are arguments of the chat template call itself")
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **variables)
    except TemplateError as e:  # a syntax error, or the template's own raise_exception(...)
        raise ValueError(f"the chat template refused the conversation: {e}") from None
    # The template writes the special tokens itself: by default tokenizing adds none.
    return text, tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def _call_arguments(tokenizer) -> set[str]:
    """The named parameters of the tokenizer's `apply_chat_template` (a template variable of the
    same name would be taken as the argument)."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
