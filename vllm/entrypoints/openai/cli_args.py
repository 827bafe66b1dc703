"""The flags of `vllm serve`: the server's own, then every engine argument (from AsyncEngineArgs,
the one definition `LLM(...)` also takes)."""

import argparse
import json

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None,
                        help="the model to serve (the same as --model)")
    server = parser.add_argument_group("server arguments")
    server.add_argument("--host", default=None, help="address to listen on (default: all)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--api-key", default=None,
                        help="require this key as `Authorization: Bearer KEY` on /v1 routes "
                        "(default: the VLLM_API_KEY environment variable, if set)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model name(s) the API answers to; the first is used in "
                        "responses (default: the model argument)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level")
    server.add_argument("--chat-template", default=None,
                        help="the chat template to use instead of the tokenizer's: a file, or the "
                        "Jinja template itself")
    server.add_argument("--response-role", default="assistant",
                        help="the role of chat replies after a generation prompt")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a chat_template in requests (refused by default: a template "
                        "is code the server runs)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    server.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="how the model writes tool calls into its text")
    server.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='do not give the chat template the tools of a request whose tool_choice is "none"')
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        server.add_argument(f"--allowed-{name}", type=_json_strings, default=["*"],
                            help=f"CORS: the {what} browsers may use, as a JSON list (default: [\"*\"], any)")
    server.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let browsers send credentials (cookies, authorization headers)")
    server.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="seconds in-flight requests get to finish after SIGINT/SIGTERM; "
                        "the rest are aborted")
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def engine_args_from(args: argparse.Namespace) -> AsyncEngineArgs:
    """The engine arguments of parsed `vllm serve` flags (the positional model wins)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return AsyncEngineArgs.from_cli_args(args)


def _json_strings(value: str) -> list[str]:
    """A flag's JSON list of strings, e.g. '["https://example.com"]'."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed
