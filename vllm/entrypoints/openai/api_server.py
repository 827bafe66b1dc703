"""The OpenAI-compatible HTTP server: a FastAPI app on one AsyncLLMEngine (or, with
data_parallel_size > 1, a DataParallelEngine over replicas of it), served by uvicorn."""

import argparse
import asyncio
import contextlib
import gc
import hmac
import logging
import os
import signal
import socket
import sys
from argparse import Namespace
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

import vllm
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from vllm.engine.metrics import LoggingStatLogger, PrometheusStatLogger, log_interval_from_env
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser
from vllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              TokenizeRequest)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import SSE_DONE, OpenAIServingError, error_response, sse
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], api_key: str | None = None,
              log_stats: bool = True, chat_template: str | None = None, response_role: str = "assistant",
              trust_request_chat_template: bool = False, tool_parser: str | None = None,
              exclude_tools_when_tool_choice_none: bool = False) -> FastAPI:
    """The app for `engine`. While it serves, the engine reports to the periodic log line and to
    /metrics (unless not `log_stats`); when it stops, the engine is shut down. `chat_template`
    replaces the tokenizer's; with a `tool_parser` the model may call tools when it decides to
    (see OpenAIServing and OpenAIServingChat for the rest)."""
    registry = CollectorRegistry()
    config = engine.config
    loggers = {} if not log_stats else {
        "logging": LoggingStatLogger(log_interval_from_env()),
        "prometheus": PrometheusStatLogger(registry, served_model_names[0], config.model.max_model_len,
                                           config.scheduler.max_num_batched_tokens)}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for name, stat_logger in loggers.items():
            engine.add_logger(name, stat_logger)
        # The log line also comes while no step runs (an idle or stuck engine shows in the log).
        ticker = asyncio.create_task(_log_stats_periodically(engine)) if loggers else None
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
            await engine.shutdown()
            for name in loggers:
                engine.remove_logger(name)

    app = FastAPI(lifespan=lifespan)
    app.state.engine = engine
    templates = dict(chat_template=chat_template, trust_request_chat_template=trust_request_chat_template)
    completions = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names, response_role=response_role, tool_parser=tool_parser,
                             exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none, **templates)
    tokenization = OpenAIServingTokenization(engine, served_model_names, **templates)

    if api_key:
        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if request.url.path.startswith("/v1") and not _has_key(request, api_key):
                return _error(OpenAIServingError("Unauthorized: a valid API key is required",
                                                 HTTPStatus.UNAUTHORIZED))
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError):
        return _error(OpenAIServingError(_validation_message(exc), param=_validation_param(exc)))

    @app.exception_handler(OpenAIServingError)
    async def refused(_: Request, exc: OpenAIServingError):
        return _error(exc)

    @app.exception_handler(AsyncEngineDeadError)
    async def engine_dead(_: Request, exc: AsyncEngineDeadError):
        return _error(OpenAIServingError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE if engine.errored else HTTPStatus.OK)

    @app.get("/version")
    async def version() -> dict:
        return {"version": vllm.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        await engine.do_log_stats()  # gauges as of now, not as of the last step
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return completions.show_models()

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request):
        return await _respond(raw, completions.create_completion(request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request):
        return await _respond(raw, chat.create_chat_completion(request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return tokenization.create_tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return tokenization.create_detokenize(request)

    return app


def add_cors(app: FastAPI, origins: list[str], methods: list[str], headers: list[str],
             credentials: bool = False) -> None:
    """Lets browsers on `origins` call the API (vllm serve's --allowed-origins and the flags beside it)."""
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=methods, allow_headers=headers,
                       allow_credentials=credentials)


async def _log_stats_periodically(engine: AsyncLLMEngine) -> None:
    interval = log_interval_from_env()
    while True:
        await asyncio.sleep(interval)
        await engine.do_log_stats()


def _has_key(request: Request, api_key: str) -> bool:
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())


def _error(exc: OpenAIServingError) -> JSONResponse:
    return JSONResponse(exc.response().model_dump(), status_code=exc.status)


def _validation_param(exc: RequestValidationError) -> str | None:
    errors = exc.errors()
    if not errors or errors[0].get("type") == "json_invalid":
        return None
    loc = [str(part) for part in errors[0].get("loc", ()) if part != "body"]
    return ".".join(loc) or None


def _validation_message(exc: RequestValidationError) -> str:
    """One line per problem, naming the field (pydantic's `loc` without the leading "body")."""
    lines = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            lines.append(f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')})")
            continue
        loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        message = error.get("msg", "invalid value").removeprefix("Value error, ")
        lines.append(f"{loc}: {message}" if loc else message)
    return "; ".join(lines) or "invalid request"


async def _respond(raw: Request, handler: Awaitable) -> Response:
    """Runs the handler until it has a response; a client that disconnects first cancels it, which
    aborts its engine requests. A streamed response then stops on disconnect by itself (Starlette
    cancels the stream, and closing the stream aborts the request)."""
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # the client is gone: nobody reads this
    result = task.result()  # raises OpenAIServingError for a refused request
    if isinstance(result, AsyncIterator):
        return StreamingResponse(_events_or_error(result), media_type="text/event-stream")
    return JSONResponse(result.model_dump())


async def _events_or_error(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream's events; a failure once the stream has started (the engine died or was shut
    down) ends it with an error event, as vLLM's server does."""
    try:
        async for event in events:
            yield event
    except (AsyncEngineDeadError, OpenAIServingError) as e:
        status = getattr(e, "status", HTTPStatus.SERVICE_UNAVAILABLE)
        yield sse(error_response(str(e), status))
        yield SSE_DONE


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------- running it

async def serve_http(app: FastAPI, sock: socket.socket, log_level: str = "info",
                     shutdown_timeout: float | None = None) -> None:
    """Serves until SIGINT or SIGTERM, then stops accepting, lets in-flight requests finish for up
    to `shutdown_timeout` seconds (aborting the rest), shuts the engine down and returns."""
    # uvicorn would cancel the requests still running at its timeout (and log each as a failed
    # request); instead the engine ends them at ours, with an error the clients see.
    config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=5,
                            timeout_graceful_shutdown=None if shutdown_timeout is None else shutdown_timeout + 5)
    server = uvicorn.Server(config)
    deadline = None if shutdown_timeout is None else asyncio.create_task(
        _abort_after(server, app.state.engine, shutdown_timeout))
    # uvicorn handles the signals while it serves, then re-raises them to the handlers that were
    # in place before, so that those run after its graceful shutdown. These mark the shutdown as
    # asked for, so the process ends normally (exit status 0) instead of dying of the signal.
    previous = {sig: signal.signal(sig, _log_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        await server.serve(sockets=[sock])
    finally:
        if deadline is not None:
            deadline.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _abort_after(server: uvicorn.Server, engine: AsyncLLMEngine, timeout_s: float) -> None:
    """Once the server is asked to exit, gives in-flight requests `timeout_s` seconds, then shuts
    the engine down, which ends the streams still open with an error."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    await asyncio.sleep(timeout_s)
    if engine.num_unfinished_requests:
        logger.warning("Aborting %d request(s) still running %.1f s after the shutdown signal",
                       engine.num_unfinished_requests, timeout_s)
    await engine.shutdown()


def _log_signal(sig: int, _frame) -> None:
    logger.info("Shut down on %s", signal.Signals(sig).name)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine loads, so a taken port fails fast."""
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host or "0.0.0.0", port))
    sock.set_inheritable(True)
    return sock


async def run_server(args: Namespace, engine_args: AsyncEngineArgs) -> None:
    """`vllm serve`: binds the port, loads the engine, serves until a signal."""
    chat_template = load_chat_template(args.chat_template)  # a bad one fails before the engine loads
    sock = bind_socket(args.host, args.port)
    if engine_args.data_parallel_size > 1:
        from vllm.engine.data_parallel import DataParallelEngine  # imports ray

        engine = DataParallelEngine.from_engine_args(engine_args)
    else:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    # What start-up left on the heap (the model's modules, the tokenizer, the warm-up's objects)
    # lives as long as the server. Frozen, it is no longer walked by the collections of the
    # oldest generation, each of which would stall the engine's step and every stream in it.
    gc.collect()
    gc.freeze()
    config = engine.config
    names = args.served_model_name or [engine_args.model or config.model.model]
    api_key = args.api_key or os.environ.get("VLLM_API_KEY")
    app = build_app(engine, names, api_key=api_key, log_stats=not config.disable_log_stats,
                    chat_template=chat_template, response_role=args.response_role,
                    trust_request_chat_template=args.trust_request_chat_template,
                    tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                    exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none)
    add_cors(app, args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
    host, port = sock.getsockname()[:2]
    logger.info("Serving %s on http://%s:%d", ", ".join(names), host, port)
    await serve_http(app, sock, log_level=args.uvicorn_log_level, shutdown_timeout=args.shutdown_timeout)


def serve_from_cli(parser: argparse.ArgumentParser, args: Namespace) -> int:
    """Serves for parsed flags until a signal; a bad flag value or combination exits through
    `parser.error`, naming it."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        asyncio.run(run_server(args, engine_args_from(args)))
    except ValueError as e:
        parser.error(str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m vllm.entrypoints.openai.api_server --model MODEL [flags]`, the server's older
    entry point, with the flags of `vllm serve`."""
    parser = make_arg_parser(argparse.ArgumentParser(
        prog="python -m vllm.entrypoints.openai.api_server",
        description="vLLM's OpenAI-compatible HTTP server (the same as `vllm serve`)"))
    return serve_from_cli(parser, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
