"""Socket helpers shared by the data plane's streams (:mod:`geopipe.transport.direct` for
activations and gradients, :mod:`geopipe.transport.bulk` for checkpoint copies): stream
options, the congestion control a socket asks for, the address a peer can dial, and a
shutdown that unblocks a thread stuck in a send or receive."""

from __future__ import annotations

import contextlib
import socket

__all__ = ["advertised_host", "set_congestion", "shutdown_socket", "tune_stream"]


def tune_stream(sock: socket.socket, user_timeout_s: float) -> None:
    """No Nagle (frames are written whole, so it would only delay a frame's tail by up to
    an RTT); keep-alive and a user timeout so a vanished peer fails the connection. Buffer
    sizes are left to the kernel: setting SO_SNDBUF/SO_RCVBUF disables autotuning."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(user_timeout_s * 1000))
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(user_timeout_s / 3)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(user_timeout_s / 9)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def set_congestion(sock: socket.socket, algorithm: str) -> bool:
    """Use ``algorithm`` on ``sock`` if the kernel lets us (an algorithm outside
    ``net.ipv4.tcp_allowed_congestion_control`` needs CAP_NET_ADMIN); False otherwise, and
    the host's default stays."""
    if not algorithm or not hasattr(socket, "TCP_CONGESTION"):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, algorithm.encode())
    except OSError:
        return False
    return True


def advertised_host(bound: str) -> str:
    """An address a peer can dial when bound to the wildcard (best effort; pass your own)."""
    if bound not in ("0.0.0.0", ""):
        return bound
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outbound address
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def shutdown_socket(sock: socket.socket | None) -> None:
    """Unblock any thread in send/recv on ``sock`` and release it."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
