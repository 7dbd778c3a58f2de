"""The test bed's pure parts and its forwarder, without root: the forwarder's devices are
stood in for by datagram socket pairs (they keep packet boundaries, as a TUN device does)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from geopipe.cli.main import main as geopipe_main
from geopipe.testbed.cli import main as bed_cli
from geopipe.testbed.forwarder import VNET_HDR, Direction, Forwarder
from geopipe.testbed.netns import unavailable
from geopipe.testbed.plan import HEADER_BYTES, MSS_BYTES, BedError, BedPlan, wire_bytes_of_gso


def test_plan_names_addresses_and_link_arithmetic():
    p = BedPlan(("east", "west", "asia"), latency_ms=40, rate_mbit=200)
    assert p.namespaces == ["gptb-east", "gptb-west", "gptb-asia"]
    assert [p.address(s) for s in p.sites] == ["10.231.0.1", "10.231.0.2", "10.231.0.3"]
    assert p.site_of_address("10.231.0.2") == "west" and p.site_of_address("1.2.3.4") is None
    assert p.head_address == "10.231.0.1:6379"
    # 128 KiB: 91 segments, each with its own header, at 25 MB/s, plus 40 ms.
    n = 128 << 10
    segs = -(-n // MSS_BYTES)
    assert p.one_way_s(n) == pytest.approx(0.040 + (n + segs * HEADER_BYTES) * 8 / 200e6)
    assert p.goodput_ceiling == pytest.approx(1448 / 1500)
    assert BedPlan.from_json(p.to_json()) == p
    with pytest.raises(BedError, match="unknown site 'mars'"):
        p.address("mars")


@pytest.mark.parametrize(
    ("kw", "option"),
    [
        ({"sites": ("east",)}, "--sites"),
        ({"sites": ("east", "east")}, "--sites"),
        ({"sites": ("East", "west")}, "--sites"),
        ({"sites": ("east", "west"), "latency_ms": -1}, "--latency-ms"),
        ({"sites": ("east", "west"), "rate_mbit": 0}, "--rate-mbit"),
        ({"sites": ("east", "west"), "subnet": "10.0.0.0/31"}, "--subnet"),
    ],
)
def test_bad_settings_name_the_option(kw, option):
    with pytest.raises(BedError, match=option):
        BedPlan(**kw)


def test_gso_wire_bytes_count_one_header_per_segment():
    # A 64 KiB super-packet with 52 B of headers, cut into 1448 B segments.
    data, hdr = 52 + 45 * 1448, 52
    assert wire_bytes_of_gso(data, 1448, hdr) == data + 44 * hdr
    assert wire_bytes_of_gso(100, 0, 0) == 100  # a plain packet


def test_direction_serialises_in_order_and_drops_beyond_the_buffer():
    d = Direction()
    rate, lat, queue = 8e6, 0.010, 0.003  # 1 MB/s: 1000 B take 1 ms
    assert d.admit(0.0, 1000, rate, lat, queue) == pytest.approx(0.011)
    assert d.admit(0.0, 1000, rate, lat, queue) == pytest.approx(0.012)  # queued behind
    assert d.admit(0.0005, 1000, rate, lat, queue) == pytest.approx(0.013)
    d.admit(0.0, 1000, rate, lat, queue)
    assert d.admit(0.0, 1000, rate, lat, queue) is None  # 4 ms of backlog > 3 ms buffer
    assert (d.packets, d.dropped) == (4, 1)
    # The latency drops from 10 to 0 ms: later packets still never overtake earlier ones.
    assert d.admit(1.0, 1000, rate, 0.0, queue) == pytest.approx(1.001)
    d2 = Direction()
    first = d2.admit(0.0, 1000, rate, 0.050, queue)
    assert d2.admit(0.0011, 10, rate, 0.0, queue) == pytest.approx(first)


def _packet(dst: str, payload: bytes) -> bytes:
    """A vnet header (no GSO) and a minimal IPv4 header addressed to ``dst``."""
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(payload),
        0,
        0,
        64,
        17,
        0,
        socket.inet_aton("10.231.0.1"),
        socket.inet_aton(dst),
    )
    return VNET_HDR.pack(0, 0, 0, 0, 0, 0) + ip + payload


def test_forwarder_delivers_to_the_addressed_site_after_the_latency():
    plan = BedPlan(("east", "west"), latency_ms=30, rate_mbit=100)
    pairs = {s: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for s in plan.sites}
    for a, _ in pairs.values():
        a.setblocking(False)
    fwd = Forwarder(plan, {s: a.fileno() for s, (a, _) in pairs.items()})
    t = threading.Thread(target=fwd.run, daemon=True)
    t.start()
    try:
        east, west = pairs["east"][1], pairs["west"][1]
        west.settimeout(5)
        pkt = _packet("10.231.0.2", b"x" * 1000)
        t0 = time.monotonic()
        east.send(_packet("10.9.9.9", b"lost"))  # nobody has that address: dropped
        east.send(pkt)
        got = west.recv(4096)
        took = time.monotonic() - t0
        assert got == pkt  # the same bytes, to the right site, and only the routable one
        assert took >= plan.latency_s + len(pkt) * 8 / plan.rate_bps * 0.999
        fwd.reload(plan.with_link(0.0, None))  # SIGHUP's effect: a new latency in place
        west.send(_packet("10.231.0.1", b"back"))
        pairs["east"][1].settimeout(5)
        assert pairs["east"][1].recv(4096).endswith(b"back")
    finally:
        fwd.stopped = True
        t.join(5)
        for a, b in pairs.values():
            a.close()
            b.close()
    st = fwd.stats()
    assert st["unroutable"] == 1 and st["latency_ms"] == 0.0
    assert st["directions"]["east->west"]["packets"] == 1
    assert st["directions"]["west->east"]["packets"] == 1


def test_command_line_errors_name_the_option(tmp_path, capsys):
    assert bed_cli(["up", "--sites", "east"]) == 2
    assert "--sites" in capsys.readouterr().err
    why = unavailable()
    code = geopipe_main(["testbed", "--state-dir", str(tmp_path), "status"])
    if why is None:
        assert code == 2 and "no test bed is up" in capsys.readouterr().err
    else:  # no root or no TUN: every command says so
        assert code == 3 and why in capsys.readouterr().err
