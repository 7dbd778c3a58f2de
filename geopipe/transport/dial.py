"""Reaching a data-plane listener: the TCP connect and the run's handshake, tried again with
backoff until a deadline.

A listener sheds connections it cannot serve yet by resetting them (:mod:`.gate`: idle too
long, over a bound while a stranger floods it) and refuses a wrong secret or certificate by
a normal close; a receiver may also not be listening yet while a run wires itself. So a
client tries again after a refused connect (``retry_refused``), a reset or a timeout in
the handshake (`HandshakeInterrupted`), sleeping 50 ms, 100 ms, ... up to 2 s between
tries (jittered, so clients shed together do not come back together), and gives up at
the deadline with `DialError`; a refusal ends it at once — a wrong secret stays wrong, and
each try would be one more line in the server's reject log.
"""

from __future__ import annotations

import errno
import random
import socket
import time

from geopipe.transport.security import (
    HANDSHAKE_TIMEOUT_S,
    ClockSkew,
    HandshakeError,
    HandshakeInterrupted,
    RunCredentials,
    SkewSink,
    TlsSealer,
    client_handshake,
    client_handshake_sealed,
    link_id,
)
from geopipe.transport.sockets import set_congestion

__all__ = ["BACKOFF_FIRST_S", "BACKOFF_MAX_S", "DialError", "clock_skew", "dial"]

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 2.0
_NOT_LISTENING = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)
_SHED = (errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE)


class DialError(ConnectionError):
    """The listener could not be reached or did not authenticate before the deadline (or
    refused this client outright)."""


def dial(
    address: tuple[str, int],
    creds: RunCredentials | None,
    timeout_s: float = 30.0,
    sealed: bool = False,
    congestion: str = "",
    retry_refused: bool = True,
    on_skew: SkewSink | None = None,
) -> tuple[socket.socket, TlsSealer | None]:
    """Connect to ``address`` and pass the run's handshake (``creds`` None: connect only),
    trying again as the module says until ``timeout_s`` has passed. Returns the socket in
    blocking mode and, with ``sealed`` and an encrypting run, the `TlsSealer` of a
    send-only connection (else the socket is TLS-wrapped itself). ``congestion``: the
    algorithm set before connecting; ``on_skew``: gets the server's clock skew."""
    address = (address[0], int(address[1]))
    deadline = time.monotonic() + timeout_s
    tries = 0
    while True:
        tries += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        set_congestion(sock, congestion)  # before connect: the handshake starts it
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            again = exc.errno in _SHED or (retry_refused and exc.errno in _NOT_LISTENING)
            if not again or not _pause(tries, deadline):
                raise DialError(f"cannot connect to {address}: {exc}") from exc
            continue
        if creds is None:
            sock.settimeout(None)
            return sock, None
        left = min(HANDSHAKE_TIMEOUT_S, max(deadline - time.monotonic(), 0.5))
        try:
            if sealed:
                return client_handshake_sealed(sock, creds, link_id(address), left, on_skew)
            return client_handshake(sock, creds, link_id(address), left, on_skew), None
        except HandshakeInterrupted as exc:
            sock.close()
            if not _pause(tries, deadline):
                raise DialError(
                    f"cannot authenticate to {address} after {tries} tries: {exc}"
                ) from exc
        except (HandshakeError, OSError) as exc:
            sock.close()
            raise DialError(f"cannot authenticate to {address}: {exc}") from exc


def clock_skew(
    address: tuple[str, int], creds: RunCredentials, timeout_s: float = 30.0
) -> ClockSkew | None:
    """The wall-clock skew of the node serving ``address`` (its clock minus ours, ± half a
    round trip), from one handshake with it; the connection is closed at once (a receiver
    takes that as a sender with nothing to send). For the runtime to measure and report
    at launch: a skew beyond the certificates' back-dating fails TLS before any handshake
    completes, and then this raises `DialError` naming the certificate's validity."""
    got: list[ClockSkew] = []
    sock, _ = dial(address, creds, timeout_s, sealed=True, on_skew=got.append)
    sock.close()
    return got[0] if got else None


def _pause(tries: int, deadline: float) -> bool:
    """Sleep before try ``tries + 1``; False (no sleep) if the deadline leaves no time."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(tries - 1, 16))
    time.sleep(min(left, backoff * random.uniform(0.5, 1.0)))
    return True
