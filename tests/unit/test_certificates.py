"""The run's certificates outlast the run and tolerate clock skew; the handshake measures
the skew (issue 33, item 5), on 127.0.0.1 without Ray."""

from __future__ import annotations

import datetime
import struct

import pytest
from cryptography import x509

from geopipe.transport import security
from geopipe.transport.channel import Inbox
from geopipe.transport.dial import clock_skew
from geopipe.transport.direct import DirectReceiver, DirectSender, PeerLostError
from geopipe.transport.security import ClockSkew, make_credentials

pytestmark = pytest.mark.timeout(60)

UTC = datetime.timezone.utc


def validity(pem: bytes) -> tuple[datetime.datetime, datetime.datetime]:
    cert = x509.load_pem_x509_certificate(pem)
    return cert.not_valid_before_utc, cert.not_valid_after_utc


def test_certificates_last_the_planned_run_and_start_a_day_early() -> None:
    now = datetime.datetime.now(UTC)
    creds = make_credentials("run-c", encrypt=True)
    for pem in (creds.ca_pem, creds.cert_pem):
        start, end = validity(pem)
        assert start <= now - datetime.timedelta(hours=23)
        assert end >= now + datetime.timedelta(days=399)
    long = make_credentials("run-c", encrypt=True, days=1000)
    assert validity(long.cert_pem)[1] >= now + datetime.timedelta(days=999)


def connects(creds) -> DirectSender:
    rx = DirectReceiver(Inbox(), creds=creds)
    try:
        tx = DirectSender(rx.address, "none", "forward", creds=creds, connect_timeout_s=5)
        tx.close()
        return tx
    finally:
        rx.close()


def test_a_driver_clock_hours_ahead_still_connects() -> None:
    """Made by a driver whose clock is 6 hours ahead of this node's: this node sees
    certificates that start 18 hours ago by its own clock, and accepts them."""
    ahead = datetime.datetime.now(UTC) + datetime.timedelta(hours=6)
    tx = connects(make_credentials("run-c", encrypt=True, now=ahead))
    assert tx.clock_skew is not None


def test_a_driver_clock_days_ahead_fails_with_a_clear_reason() -> None:
    ahead = datetime.datetime.now(UTC) + datetime.timedelta(days=2)
    with pytest.raises(PeerLostError, match="not yet valid"):
        connects(make_credentials("run-c", encrypt=True, now=ahead))


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "tls"])
def test_the_handshake_measures_the_servers_clock_skew(encrypt) -> None:
    tx = connects(make_credentials("run-c", encrypt=encrypt))
    skew = tx.clock_skew
    assert skew is not None and skew.error_s >= 0
    assert abs(skew.offset_s) <= skew.error_s + 0.5  # one machine: no real skew


def test_the_skew_arithmetic() -> None:
    # sent at 100.0, answered at 100.2 by a server whose clock read 3700.1 meanwhile
    nonce = struct.pack("<d", 3700.1) + bytes(24)
    skew = security._skew(100.0, 100.2, nonce)
    assert isinstance(skew, ClockSkew)
    assert skew.offset_s == pytest.approx(3600.0) and skew.error_s == pytest.approx(0.1)
    assert security._skew(100.0, 100.2, struct.pack("<d", float("nan")) + bytes(24)) is None


def test_a_peers_skew_can_be_measured_on_its_own() -> None:
    creds = make_credentials("run-c", encrypt=True)
    inbox = Inbox()
    rx = DirectReceiver(inbox, creds=creds)
    try:
        skew = clock_skew(rx.address, creds, timeout_s=10)
        assert skew is not None and abs(skew.offset_s) <= skew.error_s + 0.5
        assert rx.errors == [] and rx.rejected.count == 0  # a clean, empty connection
    finally:
        rx.close()
        inbox.close()
