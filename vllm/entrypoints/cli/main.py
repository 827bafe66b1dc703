"""The `vllm` command: `vllm serve MODEL [flags]` starts the OpenAI-compatible server."""

import argparse
import asyncio
import logging
import sys

import vllm
from vllm.entrypoints.openai.api_server import run_server
from vllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM command-line interface")
    parser.add_argument("-v", "--version", action="version", version=vllm.__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                                usage="vllm serve [MODEL] [flags]")
    make_arg_parser(serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        asyncio.run(run_server(args, engine_args_from(args)))
    except ValueError as e:  # a bad flag value or combination, named in the message
        serve.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
