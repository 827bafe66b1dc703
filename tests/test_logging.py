"""vLLM-style logging (vllm/logger.py): on by default, VLLM_LOGGING_LEVEL, VLLM_CONFIGURE_LOGGING.

The `vllm` logger is configured once, when the package is imported, so each case runs in a
fresh interpreter."""

import logging
import os
import re
import subprocess
import sys

import pytest

import vllm.logger
from vllm.logger import init_logger

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _vllm_line(level: str, message: str, file: str = r"<string>") -> str:
    """vLLM's format: `LEVEL MM-DD HH:MM:SS [file:line] message`."""
    return rf"{level} \d\d-\d\d \d\d:\d\d:\d\d \[{re.escape(file)}:\d+\] {message}"


# One line at each level through a vllm module's logger, in an application that configured
# the root logger for itself (everything, from DEBUG up, prefixed with APP).
_LOG_EACH_LEVEL = """
import logging
from vllm.logger import init_logger
logging.basicConfig(format="APP %(levelname)s %(message)s", level=logging.DEBUG)
logger = init_logger("vllm.test_logging")
logger.debug("a debug line")
logger.info("an info line")
logger.warning("a warning line")
"""


def _run(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING")}
    environ.update(env, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=environ)


@pytest.mark.parametrize("env, expected", [
    ({}, [_vllm_line("INFO", "an info line"), _vllm_line("WARNING", "a warning line")]),
    ({"VLLM_LOGGING_LEVEL": "debug"}, [_vllm_line("DEBUG", "a debug line"), _vllm_line("INFO", "an info line"),
                                       _vllm_line("WARNING", "a warning line")]),
    ({"VLLM_LOGGING_LEVEL": "WARNING"}, [_vllm_line("WARNING", "a warning line")]),
    # Left alone: the application's root configuration prints every line, once, its way.
    ({"VLLM_CONFIGURE_LOGGING": "0"}, ["APP DEBUG a debug line", "APP INFO an info line",
                                       "APP WARNING a warning line"]),
], ids=["default", "debug", "warning", "not-configured"])
def test_environment_sets_level_and_who_configures(env, expected):
    proc = _run(_LOG_EACH_LEVEL, **env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == len(expected), proc.stderr  # configured: no second copy through the root
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), line


@pytest.mark.parametrize("variable, value, read", [("VLLM_LOGGING_LEVEL", "LOUD", vllm.logger._logging_level),
                                                   ("VLLM_CONFIGURE_LOGGING", "yes", vllm.logger._configure_logging)])
def test_bad_values_are_refused_by_name(monkeypatch, variable, value, read):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}='{value}'"):
        read()


def test_engine_info_lines_are_visible_by_default(tiny_checkpoints):
    code = (f"from vllm import LLM\n"
            f"LLM({tiny_checkpoints['llama']!r}, dtype='float32', max_model_len=256, block_size=16, "
            f"max_num_batched_tokens=32, max_num_seqs=8, enforce_eager=True)\n")
    proc = _run(code, timeout=300)
    assert proc.returncode == 0, proc.stderr
    kv_cache = re.compile(_vllm_line("INFO", "KV cache: .*", file="cache_engine.py"))
    assert any(kv_cache.fullmatch(line) for line in proc.stderr.splitlines()), proc.stderr


def test_lines_go_to_the_stderr_of_the_moment(capsys):
    """Test harnesses and servers replace sys.stderr after vllm is imported."""
    handlers = logging.getLogger("vllm").handlers
    if os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        pytest.skip("logging left unconfigured")
    init_logger("vllm.test_logging").error("to the stderr of %s", "the moment")
    assert handlers and re.fullmatch(_vllm_line("ERROR", "to the stderr of the moment", "test_logging.py") + "\n",
                                     capsys.readouterr().err)
