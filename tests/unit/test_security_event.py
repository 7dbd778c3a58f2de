"""The metrics' ``security`` event says exactly what is protected (issue 33, item 4), and
what it says is checked against the transport on 127.0.0.1.

After the handshake, a frame's only checks are CRC32s anyone can recompute: in plaintext,
bytes written into an authenticated connection by someone who never held the run secret (an
on-path writer, here the raw socket itself) are filed as the peer's; under TLS the same
bytes break the record layer and nothing is filed. The event says "frames authenticated"
exactly when the second holds."""

from __future__ import annotations

import time

import pytest
import torch

from geopipe.transport.channel import Inbox
from geopipe.transport.codec import make_codec
from geopipe.transport.dial import dial
from geopipe.transport.direct import DirectReceiver
from geopipe.transport.frames import encode_frame
from geopipe.transport.seal import seal
from geopipe.transport.security import make_credentials

pytestmark = pytest.mark.timeout(60)


def forged_frame(key: tuple, x: torch.Tensor) -> bytes:
    """A well-formed frame made without the run secret (nothing in a frame needs it)."""
    enc = make_codec("none").encode(x, key="s", direction="forward")
    return b"".join(bytes(b) for b in encode_frame(key, seal(enc), 0, 0.0))


@pytest.mark.parametrize("encrypt", [False, True], ids=["plaintext", "tls"])
def test_the_event_says_what_the_transport_does(encrypt: bool) -> None:
    creds = make_credentials("run-e", encrypt=encrypt)
    said = creds.protection()
    assert said["encrypt"] is encrypt and said["handshake_authenticated"] is True
    assert said["frames_authenticated"] is encrypt and said["frames_encrypted"] is encrypt
    assert "run secret" in said["handshake"]
    assert ("TLS" in said["frames"]) is encrypt and "authenticated" in said["frames"]
    assert "authenticated" not in said  # the old, unqualified claim

    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=creds, max_payload=1 << 20)
    try:
        # the handshake passed (the peer proved the secret); the raw TCP socket then carries
        # bytes that no one proved anything for
        raw, _sealer = dial(rx.address, creds, timeout_s=10, sealed=True)
        x = torch.randn(2, 8)
        raw.sendall(forged_frame(("F", 0, 0), x))
        if said["frames_authenticated"]:
            with pytest.raises(TimeoutError):
                inbox.get(("F", 0, 0), timeout=2)  # never filed
            deadline = time.monotonic() + 10
            while not rx.errors and time.monotonic() < deadline:
                time.sleep(0.01)
            assert rx.errors and rx.messages == 0  # the TLS layer refused the record
        else:
            assert torch.equal(inbox.get(("F", 0, 0), timeout=10), x)  # taken as the peer's
        raw.close()
    finally:
        rx.close()
        inbox.close()


@pytest.mark.parametrize("groups", [1, 3])
def test_the_event_says_whether_outer_payloads_are_signed(groups: int) -> None:
    """An outer run's groups sign their payloads (per-group Ed25519): the event says so
    exactly when the driver's keyring makes keys, i.e. when there is more than one group."""
    from types import SimpleNamespace

    from geopipe.runtime.actor.outer_sign import GroupKeyring

    said = make_credentials("run-o", encrypt=False).protection(outer_groups=groups)
    plan = SimpleNamespace(num_groups=groups, group_of=lambda r: r)
    keyed = GroupKeyring().key_of(plan, 0) is not None
    assert said["outer_payloads_signed"] is keyed is (groups > 1)
    if keyed:
        assert "Ed25519" in said["outer_payloads"] and "3 groups" in said["outer_payloads"]
    else:
        assert "none exchanged" in said["outer_payloads"]
    assert make_credentials("run-p", encrypt=True).protection()["outer_payloads_signed"] is False
