"""Runs the OpenAI-compatible server in a thread of the test process, on a free loopback port."""

import asyncio
import threading
import time

import uvicorn

from vllm.entrypoints.openai.api_server import bind_socket


class ServerThread:
    """`with ServerThread(app) as server:` serves `app` at `server.url` until the block ends."""

    def __init__(self, app) -> None:
        self.app = app
        self._sock = bind_socket("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve([self._sock])),
                                        daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the server did not stop"
