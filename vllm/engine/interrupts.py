"""Holds Ctrl-C back while the engine changes its state, so that a step happens or does not."""

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """A SIGINT that arrives inside the block is delivered when the block ends, to the handler
    that was in place (by default: KeyboardInterrupt). Python delivers signals to the main
    thread only, so in any other thread, or under a handler not set from Python, this is a plain
    block."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    received = False

    def hold(signum, frame) -> None:
        nonlocal received
        received = True

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)
