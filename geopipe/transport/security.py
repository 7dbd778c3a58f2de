"""Who may talk to a run's data plane: a run secret, a mutual handshake, and TLS.

The data plane (:mod:`.direct` for activations and gradients, :mod:`.bulk` for checkpoint
copies) listens on TCP ports that anyone on the network can reach. Every connection
therefore proves, before a single frame or request is read, that both ends hold the
run's secret:

1. (``encrypt``) TLS 1.3 with a certificate authority the driver makes for this run alone
   (`cryptography`); both ends present the run's certificate and accept only a peer whose
   certificate that CA signed — the certificate is pinned to the run, no public CA is
   trusted. Everything after this, frames included, is encrypted and integrity-protected.
2. A challenge–response over fresh nonces from both sides, HMAC-SHA256 keyed by the run
   secret and bound to the run id and the link's identity (the address the client
   dialled), with domain separation between the two directions::

       client -> server   "GPAU" | version u8 | client nonce (32 B)
       server -> client   server nonce (32 B)
       client -> server   HMAC(secret, "client" | run | link | cn | sn)
       server -> client   HMAC(secret, "server" | run | link | cn | sn)

   Fixed sizes, nothing to allocate from a length field; a deadline on the whole exchange.
   The client proves itself first, so a stranger learns nothing but a nonce. A replayed
   client answer fails (the server's nonce is fresh), a server answer cannot be replayed as
   a client's (the label differs), and a handshake relayed to another listener fails (the
   link identity differs). Each nonce is the sender's wall clock (f64) and 24 random bytes:
   192 random bits keep it fresh, and the clock lets a client measure the server's skew
   (`ClockSkew`) from an exchange both ends authenticate (the MACs cover the nonces).

The server's half is a state machine over whole messages (`ServerExchange`, no I/O), so
the listener (:mod:`.gate`) can run every pending handshake from one thread. A client tells
a refusal from a server shedding load by how the connection ended (`HandshakeInterrupted`).

The secret and the TLS key travel from the driver to the actors inside Ray actor-call
arguments (Ray's own control plane, token-authenticated); :class:`RunCredentials` never
prints them, and nothing writes them to logs, metrics or checkpoints.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import math
import os
import secrets
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from geopipe.transport.runca import CERT_BACKDATE, run_certificates

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "ClockSkew",
    "HandshakeError",
    "HandshakeInterrupted",
    "RunCredentials",
    "ServerExchange",
    "TlsSealer",
    "client_handshake",
    "client_handshake_sealed",
    "make_credentials",
    "server_context",
    "server_handshake",
    "tls_reason",
]

HANDSHAKE_TIMEOUT_S = 10.0  # the whole exchange, TLS included (a WAN round trip is < 1 s)
_HELLO = b"GPAU"
_VERSION = 1
_NONCE = 32
_MAC = 32
_CLOCK = struct.Struct("<d")  # the wall clock at the head of each nonce
_HELLO_BYTES = len(_HELLO) + 1 + _NONCE  # the client's first message


class HandshakeError(ConnectionError):
    """The peer did not prove it holds the run's secret (or spoke something else)."""


class HandshakeInterrupted(HandshakeError):
    """The connection was reset or timed out during the handshake: nothing says the peer
    refused. A listener shedding load resets the connections it drops (`gate`) and closes
    the ones it refuses normally, so a client tries again after this error, not after a
    plain `HandshakeError` (a wrong secret or certificate stays wrong)."""


@dataclass(frozen=True)
class ClockSkew:
    """The server's wall clock minus the client's, measured over one handshake round trip:
    the true offset lies within ``offset_s ± error_s`` (half the round trip)."""

    offset_s: float
    error_s: float


def _nonce() -> bytes:
    return _CLOCK.pack(time.time()) + secrets.token_bytes(_NONCE - _CLOCK.size)


def _skew(sent: float, received: float, peer_nonce: bytes) -> ClockSkew | None:
    """The skew a nonce read at ``received`` (answering a message sent at ``sent``, both on
    this wall clock) shows; None when its clock field is not a plausible time."""
    (peer,) = _CLOCK.unpack_from(peer_nonce)
    if not math.isfinite(peer) or abs(peer - received) > 10 * 365 * 86400:
        return None
    return ClockSkew(peer - (sent + received) / 2, max(received - sent, 0.0) / 2)


@dataclass(frozen=True)
class RunCredentials:
    """A run's shared secret (and, with encryption, its CA and certificate), as every actor
    of the run holds it. ``repr`` shows neither."""

    run_id: str
    secret: bytes = field(repr=False)
    ca_pem: bytes | None = field(default=None, repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the run secret must be at least 16 bytes")

    @property
    def encrypt(self) -> bool:
        return self.cert_pem is not None

    def __repr__(self) -> str:
        return f"RunCredentials(run_id={self.run_id!r}, encrypt={self.encrypt})"

    __str__ = __repr__

    def protection(self, outer_groups: int = 1) -> dict[str, object]:
        """What these credentials protect, exactly (the metrics' ``security`` event): the
        handshake is always authenticated by the run secret; what follows it on the same
        connection is authenticated and encrypted only under TLS — in plaintext a frame
        carries CRC32s against corruption, which anyone on the path can recompute. With
        ``outer_groups`` > 1 (an outer-loop run's replica groups) every group signs its
        outer payloads with its own Ed25519 key (geopipe.runtime.actor.outer_sign, the
        driver's ``GroupKeyring``: keys exactly when there is more than one group), so the
        run secret, which every actor holds, is not what says which group sent one."""
        tls = self.encrypt
        signed = outer_groups > 1
        return {
            "encrypt": tls,
            "handshake": "authenticated: mutual HMAC-SHA256 challenge-response, run secret",
            "handshake_authenticated": True,
            "frames_authenticated": tls,
            "frames_encrypted": tls,
            "frames": (
                "authenticated and encrypted: TLS 1.3, both ends certified by the run's CA"
                if tls
                else "neither authenticated nor encrypted after the handshake (plaintext; "
                "CRC32 against corruption only)"
            ),
            "covers": "data plane: activations, gradients, tied-embedding gradients, link "
            "probe, outer-loop payloads, checkpoint copies between sites",
            "outer_payloads_signed": signed,
            "outer_payloads": (
                f"signed per replica group ({outer_groups} groups): Ed25519, one key pair per "
                "group made by the driver for this run; a listener takes a payload as group "
                "g's only if g's key verifies it, and blames a group only for bytes its key "
                "signed"
                if signed
                else "none exchanged (one replica group: no outer-loop exchange to sign)"
            ),
            "not_covered": "Ray's control plane and object store (Ray's own protection; the "
            "site rendezvous goes through it); torch.distributed inside a site (gloo/NCCL: "
            "the site's network is trusted)",
        }

    def __reduce__(self) -> tuple:  # cached TLS contexts are per process, not pickled
        return (
            RunCredentials,
            (self.run_id, self.secret, self.ca_pem, self.cert_pem, self.key_pem),
        )


def make_credentials(
    run_id: str,
    encrypt: bool,
    days: float = 400.0,
    backdate: datetime.timedelta = CERT_BACKDATE,
    now: datetime.datetime | None = None,
) -> RunCredentials:
    """A fresh secret and, with ``encrypt``, a CA (EC P-256) and one certificate it signs,
    shared by the run's actors: they are one trust domain, and a certificate per actor would
    add issuance to every recovery for no isolation gained.

    Both are valid from ``backdate`` before ``now`` (the driver's clock) to ``days`` after
    it: a certificate that expires mid-run fails every later connection (a recovery's
    rewiring included), so ``days`` is the run's planned length plus a margin (the default
    covers a year's run); the back-dating lets a node whose clock is hours behind the
    driver's accept them. ``now`` exists for tests (a driver whose clock is off)."""
    secret = secrets.token_bytes(32)
    if not encrypt:
        return RunCredentials(run_id, secret)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    start, end = now - backdate, now + datetime.timedelta(days=days)
    return RunCredentials(run_id, secret, *run_certificates(run_id, start, end))


# ------------------------------------------------------------------------------- TLS


_contexts: dict[tuple[bytes, bool], ssl.SSLContext] = {}
_contexts_lock = threading.Lock()


def _context(creds: RunCredentials, server: bool) -> ssl.SSLContext:
    """The run's TLS 1.3 context for one side (made once per process and side)."""
    cache_key = (hashlib.sha256(creds.cert_pem or b"").digest(), server)
    with _contexts_lock:
        ctx = _contexts.get(cache_key)
        if ctx is not None:
            return ctx
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        if server:
            ctx.num_tickets = 0  # nobody resumes: a client never reads what it does not need
        ctx.check_hostname = False  # the run's CA is the identity: addresses change on recovery
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=(creds.ca_pem or b"").decode())
        # load_cert_chain reads files only: a private directory, removed at once.
        with tempfile.TemporaryDirectory(prefix="geopipe-tls-") as d:
            cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
            for path, data in ((cert, creds.cert_pem), (key, creds.key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data or b"")
            ctx.load_cert_chain(cert, key)
        _contexts[cache_key] = ctx
        return ctx


def server_context(creds: RunCredentials) -> ssl.SSLContext:
    """The run's TLS server context (for a listener that drives its own TLS handshakes)."""
    return _context(creds, True)


# ------------------------------------------------------------------------------- handshake


def _mac(creds: RunCredentials, label: bytes, link: str, cn: bytes, sn: bytes) -> bytes:
    msg = b"\x00".join([label, creds.run_id.encode(), link.encode(), cn, sn])
    return hmac.new(creds.secret, msg, hashlib.sha256).digest()


def tls_reason(exc: ssl.SSLError) -> str:
    """Why TLS failed, in words: a certificate's own reason when verifying it failed, with
    the likely cause when it is its validity period (the certificates are the driver's)."""
    why = getattr(exc, "verify_message", None) or exc.reason or str(exc)
    if "not yet valid" in why or "expired" in why:
        why += (
            " (this node's clock and the driver's differ by more than the run's"
            " certificates allow, or the run outlived them: see make_credentials)"
        )
    return why


def _lost(exc: BaseException) -> HandshakeError:
    """The error a failed handshake read or write becomes: a TLS failure or alert is a
    refusal; a reset, a timeout or any other socket error is an interruption."""
    if isinstance(exc, HandshakeError):  # from a TlsSealer's own reads: already classified
        return exc
    if isinstance(exc, ssl.SSLError):
        return HandshakeError(f"TLS: {tls_reason(exc)}")
    if isinstance(exc, TimeoutError):
        return HandshakeInterrupted("handshake deadline passed")
    return HandshakeInterrupted(f"connection lost during the handshake: {exc}")


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeInterrupted("handshake deadline passed")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except OSError as exc:
            raise _lost(exc) from None
        if not chunk:  # a clean close: how a listener refuses (it resets what it sheds)
            raise HandshakeError("peer closed during the handshake")
        buf += chunk
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        sock.sendall(data)
    except OSError as exc:
        raise _lost(exc) from None


def _wrap(
    sock: socket.socket, creds: RunCredentials, server: bool, deadline: float, tls: bool = True
) -> socket.socket:
    # The exchange is a few small writes each way: Nagle plus delayed ACKs would add ~40 ms
    # to it (measured on loopback). Both data paths run without Nagle anyway.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not (creds.encrypt and tls):
        return sock
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        return _context(creds, server).wrap_socket(sock, server_side=server)
    except ssl.SSLError as exc:
        raise HandshakeError(f"TLS handshake failed: {tls_reason(exc)}") from None
    except OSError as exc:  # a reset or the deadline: the peer may have shed the connection
        raise _lost(exc) from None


class ServerExchange:
    """The server's half of the run handshake over whole messages, without I/O: the
    listener (:mod:`.gate`) drives every pending connection's from one thread, so a stranger
    that connects and sends nothing holds no thread. ``wanted`` is the size of the client's
    next message; ``take`` checks it and returns the reply; ``done`` once the client proved
    the secret and the reply that proves ours is out."""

    def __init__(self, creds: RunCredentials, link: str) -> None:
        self._creds, self._link = creds, link
        self._cn = self._sn = b""
        self.done = False

    @property
    def wanted(self) -> int:
        return 0 if self.done else _MAC if self._sn else _HELLO_BYTES

    def take(self, msg: bytes) -> bytes:
        """Check the client's next message (``wanted`` bytes); the reply. Raises
        `HandshakeError`."""
        if not self._sn:
            if msg[:4] != _HELLO:
                raise HandshakeError("not a geopipe handshake")
            if msg[4] != _VERSION:
                raise HandshakeError(f"handshake version {msg[4]}, this end speaks {_VERSION}")
            self._cn, self._sn = msg[5:], _nonce()
            return self._sn
        if self.done or not hmac.compare_digest(
            msg, _mac(self._creds, b"client", self._link, self._cn, self._sn)
        ):
            raise HandshakeError("the peer does not hold the run's secret")
        self.done = True
        return _mac(self._creds, b"server", self._link, self._cn, self._sn)


def server_handshake(
    sock: socket.socket,
    creds: RunCredentials,
    link: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> socket.socket:
    """Authenticate an accepted connection on the calling thread (TLS first when the run
    encrypts); returns the socket to use (TLS-wrapped or ``sock``), in blocking mode.
    Raises HandshakeError. The data plane's listeners use `gate` instead."""
    deadline = time.monotonic() + timeout_s
    sock = _wrap(sock, creds, True, deadline)
    exchange = ServerExchange(creds, link)
    while not exchange.done:
        _send(sock, exchange.take(_recv_exact(sock, exchange.wanted, deadline)), deadline)
    sock.settimeout(None)
    return sock


SkewSink = Callable[[ClockSkew], None]


def client_handshake(
    sock: socket.socket,
    creds: RunCredentials,
    link: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
    on_skew: SkewSink | None = None,
) -> socket.socket:
    """Authenticate a connected socket to a server of the run (``link``: the address
    dialled, ``host:port``); returns the socket to use, in blocking mode. ``on_skew`` gets
    the server's clock skew, measured over the exchange."""
    deadline = time.monotonic() + timeout_s
    sock = _wrap(sock, creds, False, deadline)
    try:
        _client_exchange(sock, creds, link, deadline, on_skew)
    except BaseException:
        sock.close()  # the TLS socket owns the descriptor now
        raise
    sock.settimeout(None)
    return sock


def client_handshake_sealed(
    sock: socket.socket,
    creds: RunCredentials,
    link: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
    on_skew: SkewSink | None = None,
) -> tuple[socket.socket, TlsSealer | None]:
    """`client_handshake` for a connection that only sends: returns the plain socket and,
    when the run encrypts, the `TlsSealer` that turns frames into TLS records for it."""
    deadline = time.monotonic() + timeout_s
    sock = _wrap(sock, creds, False, deadline, tls=False)
    sealer = None
    if creds.encrypt:
        sealer = TlsSealer(sock, _context(creds, False), deadline)
    _client_exchange(sealer or sock, creds, link, deadline, on_skew)  # type: ignore[arg-type]
    sock.settimeout(None)
    return sock, sealer


def _client_exchange(
    sock: socket.socket,
    creds: RunCredentials,
    link: str,
    deadline: float,
    on_skew: SkewSink | None = None,
) -> None:
    cn = _nonce()
    sent = time.time()
    _send(sock, _HELLO + bytes([_VERSION]) + cn, deadline)
    sn = _recv_exact(sock, _NONCE, deadline)
    received = time.time()
    _send(sock, _mac(creds, b"client", link, cn, sn), deadline)
    if not hmac.compare_digest(
        _recv_exact(sock, _MAC, deadline), _mac(creds, b"server", link, cn, sn)
    ):
        raise HandshakeError(f"the server at {link} does not hold the run's secret")
    skew = _skew(sent, received, sn)  # only now: the server's answer covered its nonce
    if on_skew is not None and skew is not None:
        on_skew(skew)


class TlsSealer:
    """The sending side of a TLS 1.3 connection whose records are made in memory
    (`ssl.MemoryBIO`) and written by the caller to the plain socket.

    [Note: TLS records are sealed apart from the socket]
    An `ssl.SSLSocket` cannot take part of a non-blocking write and the rest later from
    another thread, so the data plane's inline send (the compute thread hands the kernel
    what fits, the writer thread the rest) would block compute on a full send buffer: step
    time ×1.07 of plain at 200 Mbit/s, 40 ms, against ×1.02 sealed apart
    (`benchmarks/security.py`). Sealed into bytes first, a frame's records go through
    the same non-blocking path as plain frames. Records come out in the order ``seal`` is
    called: the sender seals in frame order and writes in that order.
    """

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, deadline: float) -> None:
        self._sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=False)
        self._deadline = deadline
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._pump()
            except ssl.SSLError as exc:
                raise HandshakeError(f"TLS handshake failed: {tls_reason(exc)}") from None
        try:
            self._flush()
        except OSError as exc:
            raise _lost(exc) from None

    def seal(self, bufs: list[memoryview]) -> list[memoryview]:
        """The TLS records carrying ``bufs``, in order (the GIL is released while sealing)."""
        for b in bufs:
            if b.nbytes:
                self._tls.write(b.cast("B"))
        return [memoryview(self._out.read())]

    # socket-like surface for the handshake's own messages (blocking, with its deadline)

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def sendall(self, data: bytes) -> None:
        self._tls.write(data)
        self._flush()  # OSError: _send makes it a handshake error

    def recv(self, n: int) -> bytes:
        while True:
            try:
                return self._tls.read(n)
            except ssl.SSLWantReadError:
                if not self._pump():
                    return b""

    def _flush(self) -> None:
        if self._out.pending:
            self._sock.sendall(self._out.read())

    def _pump(self) -> bool:
        """Send what TLS wrote, read what the peer sent; raises on the peer's EOF."""
        self._sock.settimeout(max(self._deadline - time.monotonic(), 0.001))
        try:
            self._flush()
            data = self._sock.recv(1 << 16)
        except OSError as exc:
            raise _lost(exc) from None
        if not data:
            raise HandshakeError("peer closed during the TLS handshake")
        self._in.write(data)
        return True


def link_id(address: tuple[str, int]) -> str:
    """A listener's identity in the handshake: the address its clients dial."""
    return f"{address[0]}:{int(address[1])}"
