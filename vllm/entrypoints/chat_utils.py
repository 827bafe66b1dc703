"""A conversation through the tokenizer's chat template: the one place LLM.chat, the server's
chat completions and its /tokenize turn messages into a prompt."""

from jinja2 import TemplateError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer, conversation: list[dict], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False,
                        add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """The prompt's text and token ids. With `continue_final_message` the prompt ends inside the
    last message (the model continues it) instead of after it. Raises ValueError for a
    conversation the template refuses."""
    assert has_chat_template(tokenizer)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
    except TemplateError as e:  # the template's own raise_exception(...), e.g. roles out of order
        raise ValueError(f"the chat template refused the conversation: {e}") from None
    # The template writes the special tokens itself: by default tokenizing adds none.
    return text, tokenizer(text, add_special_tokens=add_special_tokens).input_ids
