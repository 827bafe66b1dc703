"""The `vllm` command: `vllm serve MODEL [flags]` starts the OpenAI-compatible server."""

import argparse
import sys

import vllm
from vllm.entrypoints.openai.api_server import serve_from_cli
from vllm.entrypoints.openai.cli_args import make_arg_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM command-line interface")
    parser.add_argument("-v", "--version", action="version", version=vllm.__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                                usage="vllm serve [MODEL] [flags]")
    make_arg_parser(serve)
    return serve_from_cli(serve, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
