"""Refusals counted and logged at a rate: the data plane's listeners (the handshake gate,
the receiver's frame checks, the checkpoint chunk server) refuse strangers and bad frames,
and a peer retrying in a loop must not flood the logs.

Its own module because it is shared by those three and holds no security of its own (it
only counts what they refused), so it belongs to none of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

__all__ = ["RejectLog"]

# Still the logger security.py had, before RejectLog moved here: refusals are filtered by it.
log = logging.getLogger("geopipe.transport.security")


class RejectLog:
    """Counts connections refused by a server and logs them at most once per
    ``every_s`` seconds (a stranger retrying in a loop must not flood the logs)."""

    def __init__(self, what: str, every_s: float = 30.0) -> None:
        self.what = what
        self.every_s = every_s
        self.count = 0
        self._last = -float("inf")
        self._since = 0
        self._lock = threading.Lock()

    def reject(self, peer: object, why: BaseException | str) -> None:
        with self._lock:
            self.count += 1
            self._since += 1
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            n, self._since, self._last = self._since, 0, now
        with contextlib.suppress(Exception):
            log.warning("%s: refused %d connection(s), latest from %s: %s", self.what, n, peer, why)
