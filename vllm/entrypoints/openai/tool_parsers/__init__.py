"""How models write tool calls into their text, for `tool_choice="auto"`: chosen with
`vllm serve --enable-auto-tool-choice --tool-call-parser NAME`."""

from vllm.entrypoints.openai.tool_parsers.abstract import ToolParser
from vllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "ToolParser"]
