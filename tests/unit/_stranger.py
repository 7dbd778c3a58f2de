"""A stranger that holds idle connections to a listener and reopens each one the listener
closes, for the data plane's starvation tests (127.0.0.1 only, stops by itself)."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time


class IdleStranger:
    """Holds ``n`` idle connections to ``address`` (never sends a byte) on a thread and
    reopens each one the server closes or resets, until `stop` or ``seconds``. With
    ``hello``: each connection sends it at once instead (a stranger that starts a handshake
    it cannot finish)."""

    def __init__(
        self, address: tuple[str, int], n: int = 48, seconds: float = 20.0, hello: bytes = b""
    ) -> None:
        assert address[0] == "127.0.0.1"  # test traffic stays on this machine
        self.address, self.n, self.seconds, self.hello = address, n, seconds, hello
        self.opened = 0
        self.reopened = 0
        self.held = 0  # connections open at the latest look
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stranger", daemon=True)

    def __enter__(self) -> IdleStranger:
        self._thread.start()
        deadline = time.monotonic() + 5
        while self.held < self.n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _open(self, sel: selectors.BaseSelector) -> None:
        try:
            s = socket.create_connection(self.address, timeout=2)
            if self.hello:
                s.sendall(self.hello)
        except OSError:
            return  # the backlog is full, or refused: try again on the next round
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        end = time.monotonic() + self.seconds
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                while len(sel.get_map()) < self.n and not self._stop.is_set():
                    before = self.opened
                    self._open(sel)
                    if self.opened == before:
                        break
                self.held = len(sel.get_map())
                for key, _ in sel.select(0.02):
                    s = key.fileobj
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:  # closed or reset by the server: open another at once
                        sel.unregister(s)
                        s.close()
                        self.reopened += 1
        finally:
            for key in list(sel.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()
            sel.close()
