"""Ctrl-C while training: the first one finishes the step in flight and saves, the second
abandons it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["StopRequest", "graceful_sigint"]


class StopRequest:
    """The run's stop flag: the first Ctrl-C sets it and says what happens (the step in
    flight finishes, a checkpoint is saved, the run stops) and returns True; the second
    returns False (abandon the step)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.requested = False
        self._say = say

    def __call__(self) -> bool:
        if self.requested:
            return False
        self.requested = True
        self._say(
            "\nfinishing the step in flight, then saving a checkpoint (Ctrl-C again to abandon it)"
        )
        return True


@contextlib.contextmanager
def graceful_sigint(request_stop: Callable[[], bool]) -> Iterator[None]:
    """While inside, SIGINT calls ``request_stop()``; when it returns False (a stop was
    already requested) the interrupt raises KeyboardInterrupt.

    A handler that only sets a flag, rather than Python's default KeyboardInterrupt, so the
    interrupt can never land between writing a step's metrics and its status, or in the
    middle of a checkpoint's bookkeeping. Off the main thread (signals go to the main
    thread only) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if not request_stop():
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
