"""`vllm serve` as a user runs it, in a subprocess: engine flags from the command line, vLLM's
stats line in the log, and a graceful exit (status 0) on SIGTERM or SIGINT that lets an in-flight
stream finish, or aborts it once --shutdown-timeout has passed."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2
import pytest

from vllm.entrypoints.openai.api_server import serve_from_cli
from vllm.entrypoints.openai.cli_args import make_arg_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, port: int, *flags: str,
                 entry: tuple[str, ...] = ("vllm.entrypoints.cli.main", "serve")) -> subprocess.Popen:
    cmd = [sys.executable, "-m", *entry, model, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "tiny", "--dtype", "float32",
           "--max-model-len", "1024", "--block-size", "16", "--max-num-batched-tokens", "64",
           "--max-num-seqs", "4", "--enforce-eager", "--kv-cache-memory-bytes", str(32 * 2**20), *flags]
    env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_LOG_STATS_INTERVAL": "0.5"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx2.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not come up")


def stop_with_sigterm(proc: subprocess.Popen) -> str:
    """Its output, once SIGTERM has stopped it cleanly (status 0, no traceback)."""
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in output, output
    return output


def stream_events(url: str, max_tokens: int, events: list, first: threading.Event) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    try:
        with httpx2.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx2.TransportError:
        events.append("connection lost")
    first.set()


@pytest.mark.parametrize("sig, shutdown_timeout, finishes", [
    (signal.SIGTERM, "30", True),  # the in-flight stream finishes, then the server exits
    (signal.SIGINT, "0.3", False),  # the stream outlasts the timeout: it is aborted
])
def test_serve_shuts_down_gracefully(tiny_checkpoints, sig, shutdown_timeout, finishes):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tiny_checkpoints["llama"], port, "--shutdown-timeout", shutdown_timeout)
    try:
        wait_healthy(proc, url)
        assert httpx2.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 1024  # the flag
        events, first = [], threading.Event()
        client = threading.Thread(target=stream_events, args=(url, 900, events, first))
        client.start()
        assert first.wait(60)
        time.sleep(0.6)  # a stats line falls due while the stream runs
        proc.send_signal(sig)
        time.sleep(0.5)
        with pytest.raises(httpx2.TransportError):  # no longer accepting
            httpx2.get(f"{url}/health", timeout=2.0)
        client.join(60)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    chunks = [json.loads(e) for e in events if e.startswith("{")]
    if finishes:
        assert events[-1] == "[DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"] or c["choices"][0]["finish_reason"]) > 1
    else:
        assert events[-1] == "[DONE]" and "shut down" in chunks[-1]["error"]["message"]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert "Aborting 1 request(s) still running" in output
    assert "Avg prompt throughput:" in output and "Prefix cache hit rate:" in output
    assert "Traceback" not in output, output


def test_the_api_server_module_serves_with_the_same_flags(tiny_checkpoints):
    # `python -m vllm.entrypoints.openai.api_server --model MODEL`, the entry point older vLLM
    # guides start the server with.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    proc = start_server(f"--model={tiny_checkpoints['llama']}", port, "--chat-template", template,
                        "--response-role", "bot", entry=("vllm.entrypoints.openai.api_server",))
    try:
        wait_healthy(proc, url)
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
        resp = httpx2.post(f"{url}/v1/completions", json=body, timeout=60, headers={"Origin": "https://a.example"})
        assert resp.headers["access-control-allow-origin"] == "*"  # CORS: any origin by default, as vLLM
        completion = resp.json()
        assert completion["usage"]["completion_tokens"] == 5
        # The chat prompt is the template's: the message alone, as a completion's prompt (this
        # tokenizer adds no BOS; its own template would add role markers).
        chat = httpx2.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 1},
            timeout=60).json()
        assert chat["choices"][0]["message"]["role"] == "bot"
        assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"]
        stop_with_sigterm(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("entry", [("vllm.entrypoints.cli.main", "serve"), ("vllm.entrypoints.openai.api_server",)])
def test_serve_rejects_bad_flags(tiny_checkpoints, entry):
    result = subprocess.run(
        [sys.executable, "-m", *entry, tiny_checkpoints["llama"], "--max-num-seqs", "many"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--max-num-seqs" in result.stderr


@pytest.mark.parametrize("flags, words", [(["--chat-template", "nowhere.jinja"], ["nowhere.jinja", "neither"]),
                                          (["--allowed-origins", "*"], ["--allowed-origins", "JSON list"]),
                                          (["--enable-auto-tool-choice"], ["--tool-call-parser"]),
                                          (["--tool-call-parser", "nope"], ["--tool-call-parser", "hermes"]),
                                          (["--scheduling-policy", "sjf"], ["--scheduling-policy", "priority"])])
def test_bad_server_flags_exit_2_before_the_engine_loads(tiny_checkpoints, capsys, flags, words):
    parser = make_arg_parser(argparse.ArgumentParser(prog="vllm serve"))
    with pytest.raises(SystemExit) as exited:
        serve_from_cli(parser, parser.parse_args([tiny_checkpoints["llama"], "--port", "0", *flags]))
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert all(word in stderr for word in words), stderr


def test_serve_freezes_its_start_up_heap(tiny_checkpoints, monkeypatch):
    # What start-up left on the heap is frozen before the first request: the collections of the
    # oldest generation, which walk every tracked object, no longer stall the engine's steps.
    import argparse
    import asyncio
    import gc

    from vllm.entrypoints.openai import api_server
    from vllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser

    frozen = []

    async def serve_http(app, sock, **kwargs):
        frozen.append(gc.get_freeze_count())
        sock.close()

    monkeypatch.setattr(api_server, "serve_http", serve_http)
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        [tiny_checkpoints["llama"], "--host", "127.0.0.1", "--port", "0", "--dtype", "float32",
         "--max-model-len", "256", "--max-num-batched-tokens", "64", "--enforce-eager",
         "--kv-cache-memory-bytes", str(8 * 2**20)])
    gc.unfreeze()
    try:
        asyncio.run(api_server.run_server(args, engine_args_from(args)))
    finally:
        gc.unfreeze()  # the rest of the session collects as before
    assert frozen and frozen[0] > 10_000
