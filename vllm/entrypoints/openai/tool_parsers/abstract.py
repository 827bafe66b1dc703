"""What a tool parser gives: the reply's content and its calls, from the whole text or from the
text so far (streaming), by the same two rules so that both agree."""

from vllm.entrypoints.openai.protocol import ToolCall


class ToolParser:
    """Finds the tool calls in a model's reply. A parser names two things of a text: how much of
    its start is surely content (`content_end`), and the calls written after that content
    (`calls`). The content is the text before the calls; a reply whose text after the content
    holds no valid call is all content."""

    # The reply is decoded with its special tokens: a model's call markers may be special tokens.
    keeps_special_tokens = False

    def content_end(self, text: str, finished: bool) -> int:
        """Characters at the start of `text` that are content whatever comes next (while the
        reply runs, a partial call marker at its end is held back)."""
        raise NotImplementedError

    def calls(self, text: str, finished: bool) -> list[ToolCall]:
        """The valid calls complete in `text` (a call still being written is not yet complete;
        at the end, the parser may accept one left open)."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; content None when it is empty."""
        calls = self.calls(text, finished=True)
        content = text[:self.content_end(text, finished=True)] if calls else text
        return content or None, calls
