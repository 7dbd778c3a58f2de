"""The launch-time link probe, both ends in this process over loopback TCP, through the
transport's link emulator (no Ray): the round trip and rate it reports come from the link."""

from __future__ import annotations

import threading

import pytest

from geopipe.config import parse_cluster
from geopipe.optimizer.measurements import LinkRate, Measurements, costed
from geopipe.runtime.actor.probe import echo, probe
from geopipe.runtime.control.linkprobe import (
    LinkMeasurement,
    burst_rate,
    clock_offset,
)
from geopipe.transport.channel import Inbox
from geopipe.transport.direct import DirectReceiver
from geopipe.transport.link import LinkParams


def test_probe_measures_the_emulated_link():
    link = LinkParams(100e6, 0.020)
    up_inbox, down_inbox = Inbox(), Inbox()
    up_rx = DirectReceiver(up_inbox, host="127.0.0.1")
    down_rx = DirectReceiver(down_inbox, host="127.0.0.1")
    sizes = [1 << 20] * 8  # 8 × 1 MiB: 0.67 s of the link
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(a=echo(down_inbox, up_rx.address, link, sizes)))
    t.start()
    try:
        up = probe(up_inbox, down_rx.address, link, sizes)
        t.join(60)
    finally:
        up_rx.close()
        down_rx.close()
    rtt = up["rtt_s"]
    assert rtt >= 2 * link.latency_s * 0.99  # never faster than the link's round trip
    assert rtt < 2 * link.latency_s + 0.25
    rate = burst_rate(sizes, got["a"]["arrivals"])
    # Loose on purpose (a loaded host delays single arrivals): a probe that measured the
    # host instead of the link was off by 3× here before arrivals were stamped on receipt.
    assert 0.5 * link.bandwidth_bps <= rate <= 1.25 * link.bandwidth_bps
    # Both ends share this process's clock: the estimated offset is ~0 (at most half the
    # round trip's asymmetry, well under the emulated latency).
    assert abs(clock_offset(up, got["a"])) < link.latency_s / 2
    assert not down_inbox.arrived_at and not down_inbox.watched  # cleaned up


def test_burst_rate_is_the_median_of_per_message_rates():
    # Slow start: the first gaps are long; one stray late arrival; the steady rate is
    # 1000 B per 0.1 s = 80 kbit/s.
    arrivals = [0.0, 1.0, 1.5, 1.6, 1.7, 1.8, 2.5, 2.6, 2.7]
    assert burst_rate([1000] * 9, arrivals) == pytest.approx(1000 * 8 / 0.1)
    # A whole-burst figure would have been 8000 B / 2.7 s: 3.4x too low.
    assert burst_rate([100, 200], [1.0, 1.0]) is None


def test_clock_offset_from_the_shortest_round_trip():
    # Downstream's clock runs 5 s ahead; one-way 10 ms each way, except ping 0, whose
    # return was delayed (asymmetric): it must not be the one used.
    up = {"ping_sent": [0.0, 1.0], "pong_in": [0.050, 1.020]}
    down = {"ping_in": [5.010, 6.010], "pong_sent": [5.011, 6.010]}
    assert clock_offset(up, down) == pytest.approx(5.0)


def test_latency_warning_has_an_absolute_floor():
    """0.3 ms measured against a 0.1 ms YAML is not worth a warning; 5 vs 40 ms is."""
    assert LinkMeasurement("a", "b", 0.6e-3, 1e8, 0.1e-3, 1e8).off() == []
    assert len(LinkMeasurement("a", "b", 10e-3, 1e8, 40e-3, 1e8).off()) == 1


def test_measured_links_replace_the_yaml_and_say_what_is_off():
    from pathlib import Path

    import yaml

    doc = yaml.safe_load(Path("clusters/local-2dc.yaml").read_text())
    spec = parse_cluster(doc, "t")
    src, dst = spec.links[0].src, spec.links[0].dst
    yl = spec.link(src, dst)
    bw = yl.bandwidth_bps
    m = LinkMeasurement(src, dst, 4 * yl.latency_s, bw, yl.latency_s, bw)
    off = m.off()
    assert len(off) == 1 and off[0].startswith("one-way latency")
    new = costed(spec, Measurements(links=(LinkRate(src, dst, m.latency_s, m.bandwidth_bps),)))
    assert new.link(src, dst).latency_s == pytest.approx(2 * yl.latency_s)
    assert new.link(dst, src).latency_s == pytest.approx(2 * yl.latency_s)  # mirrored entry
    assert new.link(src, dst).bandwidth_bps == pytest.approx(yl.bandwidth_bps)
    assert m.to_dict()["rtt_ms"] == pytest.approx(4 * yl.latency_s * 1e3)
