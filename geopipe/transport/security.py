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
   The client proves itself first, so a stranger learns nothing but a random nonce. A
   replayed client answer fails (the server's nonce is fresh), a server answer cannot be
   replayed as a client's (the label differs), and a handshake relayed to another listener
   fails (the link identity differs).

The secret and the TLS key travel from the driver to the actors inside Ray actor-call
arguments (Ray's own control plane, token-authenticated); :class:`RunCredentials` never
prints them, and nothing writes them to logs, metrics or checkpoints.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "HandshakeError",
    "RejectLog",
    "RunCredentials",
    "TlsSealer",
    "client_handshake",
    "client_handshake_sealed",
    "make_credentials",
    "server_handshake",
]

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0  # the whole exchange, TLS included (a WAN round trip is < 1 s)
_HELLO = b"GPAU"
_VERSION = 1
_NONCE = 32
_MAC = 32


class HandshakeError(ConnectionError):
    """The peer did not prove it holds the run's secret (or spoke something else)."""


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

    def __reduce__(self) -> tuple:  # cached TLS contexts are per process, not pickled
        return (RunCredentials, (self.run_id, self.secret, self.ca_pem, self.cert_pem,
                                 self.key_pem))  # fmt: skip


def make_credentials(run_id: str, encrypt: bool, days: int = 30) -> RunCredentials:
    """A fresh secret and, with ``encrypt``, a CA (EC P-256, valid ``days``) and one
    certificate it signs, shared by the run's actors: they are one trust domain, and a
    certificate per actor would add issuance to every recovery for no isolation gained."""
    secret = secrets.token_bytes(32)
    if not encrypt:
        return RunCredentials(run_id, secret)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"geopipe run {run_id} CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"geopipe run {run_id}")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(ca_name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return RunCredentials(run_id, secret, ca.public_bytes(pem), cert.public_bytes(pem), key_pem)


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


# ------------------------------------------------------------------------------- handshake


def _mac(creds: RunCredentials, label: bytes, link: str, cn: bytes, sn: bytes) -> bytes:
    msg = b"\x00".join([label, creds.run_id.encode(), link.encode(), cn, sn])
    return hmac.new(creds.secret, msg, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError("handshake deadline passed")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise HandshakeError("handshake deadline passed") from None
        except ssl.SSLError as exc:
            raise HandshakeError(f"TLS: {exc.reason or exc}") from None
        except OSError as exc:
            raise HandshakeError(f"connection lost during the handshake: {exc}") from None
        if not chunk:
            raise HandshakeError("peer closed during the handshake")
        buf += chunk
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise HandshakeError("handshake deadline passed") from None
    except OSError as exc:
        raise HandshakeError(f"connection lost during the handshake: {exc}") from None


def _wrap(sock: socket.socket, creds: RunCredentials, server: bool, deadline: float,
          tls: bool = True) -> socket.socket:  # fmt: skip
    # The exchange is a few small writes each way: Nagle plus delayed ACKs would add ~40 ms
    # to it (measured on loopback). Both data paths run without Nagle anyway.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not (creds.encrypt and tls):
        return sock
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        return _context(creds, server).wrap_socket(sock, server_side=server)
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise HandshakeError(f"TLS handshake failed: {reason}") from None


def server_handshake(
    sock: socket.socket, creds: RunCredentials, link: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> socket.socket:  # fmt: skip
    """Authenticate an accepted connection (TLS first when the run encrypts); returns the
    socket to use (TLS-wrapped or ``sock``), in blocking mode. Raises HandshakeError."""
    deadline = time.monotonic() + timeout_s
    sock = _wrap(sock, creds, True, deadline)
    hello = _recv_exact(sock, len(_HELLO) + 1 + _NONCE, deadline)
    if hello[:4] != _HELLO:
        raise HandshakeError("not a geopipe handshake")
    if hello[4] != _VERSION:
        raise HandshakeError(f"handshake version {hello[4]}, this end speaks {_VERSION}")
    cn, sn = hello[5:], secrets.token_bytes(_NONCE)
    _send(sock, sn, deadline)
    answer = _recv_exact(sock, _MAC, deadline)
    if not hmac.compare_digest(answer, _mac(creds, b"client", link, cn, sn)):
        raise HandshakeError("the peer does not hold the run's secret")
    _send(sock, _mac(creds, b"server", link, cn, sn), deadline)
    sock.settimeout(None)
    return sock


def client_handshake(
    sock: socket.socket, creds: RunCredentials, link: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> socket.socket:  # fmt: skip
    """Authenticate a connected socket to a server of the run (``link``: the address
    dialled, ``host:port``); returns the socket to use, in blocking mode."""
    deadline = time.monotonic() + timeout_s
    sock = _wrap(sock, creds, False, deadline)
    _client_exchange(sock, creds, link, deadline)
    sock.settimeout(None)
    return sock


def client_handshake_sealed(
    sock: socket.socket, creds: RunCredentials, link: str,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> tuple[socket.socket, TlsSealer | None]:  # fmt: skip
    """`client_handshake` for a connection that only sends: returns the plain socket and,
    when the run encrypts, the `TlsSealer` that turns frames into TLS records for it."""
    deadline = time.monotonic() + timeout_s
    sock = _wrap(sock, creds, False, deadline, tls=False)
    sealer = None
    if creds.encrypt:
        sealer = TlsSealer(sock, _context(creds, False), deadline)
    _client_exchange(sealer or sock, creds, link, deadline)  # type: ignore[arg-type]
    sock.settimeout(None)
    return sock, sealer


def _client_exchange(sock: socket.socket, creds: RunCredentials, link: str, deadline: float
                     ) -> None:  # fmt: skip
    cn = secrets.token_bytes(_NONCE)
    _send(sock, _HELLO + bytes([_VERSION]) + cn, deadline)
    sn = _recv_exact(sock, _NONCE, deadline)
    _send(sock, _mac(creds, b"client", link, cn, sn), deadline)
    if not hmac.compare_digest(_recv_exact(sock, _MAC, deadline),
                               _mac(creds, b"server", link, cn, sn)):  # fmt: skip
        raise HandshakeError(f"the server at {link} does not hold the run's secret")


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
                raise HandshakeError(f"TLS handshake failed: {exc.reason or exc}") from None
        self._flush()

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
        self._flush()

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
        """Send what TLS wrote, read what the peer sent; False on the peer's EOF."""
        self._flush()
        self._sock.settimeout(max(self._deadline - time.monotonic(), 0.001))
        try:
            data = self._sock.recv(1 << 16)
        except TimeoutError:
            raise HandshakeError("handshake deadline passed") from None
        except OSError as exc:
            raise HandshakeError(f"connection lost during the handshake: {exc}") from None
        if not data:
            raise HandshakeError("peer closed during the TLS handshake")
        self._in.write(data)
        return True


def link_id(address: tuple[str, int]) -> str:
    """A listener's identity in the handshake: the address its clients dial."""
    return f"{address[0]}:{int(address[1])}"


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
            log.warning("%s: refused %d connection(s), latest from %s: %s", self.what, n,
                        peer, why)  # fmt: skip
