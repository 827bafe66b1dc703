"""Logging of the `vllm` package, configured the way vLLM configures it.

On first import, unless VLLM_CONFIGURE_LOGGING=0, the `vllm` logger gets one handler on stderr
with vLLM's format and the level VLLM_LOGGING_LEVEL (default INFO):

    INFO 11-24 12:00:00 [cache_engine.py:51] KV cache: 512 blocks of 128 tokens (...)

It does not propagate to the root logger, so an application's own logging set-up neither
prints the engine's lines twice nor silences them. With VLLM_CONFIGURE_LOGGING=0 nothing is
touched and the application decides. Modules take their logger with `init_logger(__name__)`:
a child of `vllm`, so the one handler serves them all.
"""

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted, not when the handler was made:
    test harnesses and servers replace sys.stderr after the package is imported."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def _configure_logging() -> bool:
    value = os.environ.get("VLLM_CONFIGURE_LOGGING", "1")
    if value not in ("0", "1"):
        raise ValueError(f"VLLM_CONFIGURE_LOGGING={value!r} must be 0 or 1")
    return value == "1"


def _logging_level() -> int:
    value = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    if value.upper() not in _LEVELS:
        raise ValueError(f"VLLM_LOGGING_LEVEL={value!r} must be one of {', '.join(_LEVELS)}")
    return getattr(logging, value.upper())


def _configure_vllm_logger() -> None:
    if not _configure_logging():
        return
    logger = logging.getLogger("vllm")
    logger.setLevel(_logging_level())
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
    logger.addHandler(handler)
    logger.propagate = False


def init_logger(name: str) -> logging.Logger:
    """The logger of module `name` (pass `__name__`); under `vllm` it prints as configured above."""
    return logging.getLogger(name)


# Once per process: a module is executed only on its first import.
_configure_vllm_logger()
