"""Errors the engines raise to their callers."""


class EngineDeadError(RuntimeError):
    """The engine met an error it cannot recover from; it serves no more requests. The original
    error is the `__cause__`."""
