"""Measure the WAN links at launch, over the data plane itself, instead of trusting the YAML.

For every WAN boundary of the plan, the stage upstream of it (replica 0) pings its
downstream neighbour a few times over a direct connection (round trip), then streams a
burst of bulk messages; the neighbour notes when each arrives, on its own clock, so the
rate comes from one clock and needs no clock sync. The probe connections are separate
from the training ones (codec ``none``; no codec state is touched) and go to the same
receivers, so they cross the same network path. Links emulated on one host
(``ray.emulate_links``) are not probed: the emulator enforces the YAML's figures by
construction (within 2 %), and on a loaded host a probe would measure the host's
scheduling rather than a link.

A few seconds at most: the burst is sized from the YAML's bandwidth (half a second's
worth, 1–32 MiB) and cut into :data:`BURST_MESSAGES` messages. The rate is the median of
the per-message rates (bytes over the gap between consecutive arrivals), not one figure
over the whole burst: a fresh connection over a long round trip spends its first few
hundred milliseconds in slow start (a whole-burst figure reads 58 Mbit/s on a
200 Mbit/s link); the median skips those first messages and a stray late arrival. The
actors' half (ping, echo, burst) is :mod:`geopipe.runtime.actor.probe`.

The pings also give the offset between the two actors' clocks (NTP's estimate, from the
ping with the shortest round trip): calibration uses it to turn the data plane's stamped
send and arrival times into one-way transfer times across hosts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.measurements import LinkRate, Measurements
from geopipe.runtime.actor.probe import burst_sizes
from geopipe.runtime.control.workers import Workers

__all__ = [
    "LinkMeasurement",
    "burst_rate",
    "clock_offset",
    "measure_clock_skew",
    "measure_codec_speeds",
    "measure_links",
    "probe_links",
    "skew_report",
]

WARN_OFF = 0.20  # warn when a measurement is this far from the YAML
# ... and the latency differs by more than this much in absolute terms: at L ≈ 0 a 0.3 ms
# measured against a 0.1 ms YAML is no 200 % error worth a warning.
WARN_FLOOR_S = 1e-3


@dataclass(frozen=True)
class LinkMeasurement:
    src: str
    dst: str
    rtt_s: float
    bandwidth_bps: float
    yaml_latency_s: float
    yaml_bandwidth_bps: float
    clock_offset_s: float = 0.0  # downstream actor's monotonic clock minus upstream's

    @property
    def latency_s(self) -> float:
        return self.rtt_s / 2

    def off(self) -> list[str]:
        """What differs from the YAML by more than :data:`WARN_OFF`."""
        out = []
        lat, yl = self.latency_s, self.yaml_latency_s
        if abs(lat - yl) > max(WARN_OFF * yl, WARN_FLOOR_S):
            out.append(f"one-way latency {lat * 1e3:.1f} ms (YAML {yl * 1e3:.1f} ms)")
        bw, yb = self.bandwidth_bps, self.yaml_bandwidth_bps
        if abs(bw - yb) > WARN_OFF * yb:
            out.append(f"bandwidth {bw / 1e6:.0f} Mbit/s (YAML {yb / 1e6:.0f} Mbit/s)")
        return out

    def to_dict(self) -> dict:
        return {
            "from": self.src,
            "to": self.dst,
            "rtt_ms": self.rtt_s * 1e3,
            "latency_ms": self.latency_s * 1e3,
            "bandwidth_mbps": self.bandwidth_bps / 1e6,
            "yaml_latency_ms": self.yaml_latency_s * 1e3,
            "yaml_bandwidth_mbps": self.yaml_bandwidth_bps / 1e6,
            "clock_offset_ms": self.clock_offset_s * 1e3,
        }


def burst_rate(sizes: list[int], arrivals: list[float]) -> float | None:
    """Bits per second from the burst's arrival times on the receiver's clock (no clock
    sync needed): the median over consecutive arrivals of a message's bytes over the gap
    before it, so slow start (the first few gaps) and a stray delay do not count. None when
    the arrivals carry no timing (all at once)."""
    rates = [
        n * 8 / (b - a) for n, a, b in zip(sizes[1:], arrivals, arrivals[1:], strict=False) if b > a
    ]
    return statistics.median(rates) if rates else None


def clock_offset(up: dict, down: dict) -> float:
    """Downstream clock minus upstream clock, from the ping with the shortest round trip
    (NTP's estimate: its error is at most half of that ping's round-trip asymmetry)."""
    best = min(
        range(len(up["ping_sent"])),
        key=lambda i: (
            (up["pong_in"][i] - up["ping_sent"][i]) - (down["pong_sent"][i] - down["ping_in"][i])
        ),
    )
    t0, t3 = up["ping_sent"][best], up["pong_in"][best]
    t1, t2 = down["ping_in"][best], down["pong_sent"][best]
    return ((t1 - t0) + (t2 - t3)) / 2


def measure_links(
    workers: Workers,
    spec: ClusterSpec,
    rows: list[list[Any]],
    sites: tuple[str, ...],
    addresses: dict,
) -> list[LinkMeasurement]:
    """Probe every WAN boundary of the layout (``rows[stage][replica]``, ``sites[stage]``;
    ``addresses[(stage, replica)]`` are the replicas' receivers)."""
    out = []
    for k in range(len(rows) - 1):
        a, b = sites[k], sites[k + 1]
        if a == b:
            continue
        yaml_link = spec.link(a, b)
        sizes = burst_sizes(yaml_link.bandwidth_bps)
        up, down = rows[k][0], rows[k + 1][0]
        echo_ref = workers.call(down, "probe_echo", addresses[(k, 0)], None, sizes)
        up_ref = workers.call(up, "probe_link", addresses[(k + 1, 0)], None, sizes)
        got_up = workers.get([up_ref])[0]
        got_down = workers.get([echo_ref])[0]
        bw = burst_rate(sizes, got_down["arrivals"]) or yaml_link.bandwidth_bps
        out.append(
            LinkMeasurement(
                a,
                b,
                got_up["rtt_s"],
                bw,
                yaml_link.latency_s,
                yaml_link.bandwidth_bps,
                clock_offset(got_up, got_down),
            )
        )
    return out


def measure_codec_speeds(
    workers: Workers, rows: list[list[Any]], sites: tuple[str, ...], codecs: list[str]
) -> dict[str, dict[str, float]]:
    """Each site at a WAN boundary times ``codecs`` on one of its devices (all at once)."""
    first: dict[str, Any] = {}
    for k in range(len(rows) - 1):
        if sites[k] != sites[k + 1]:
            first.setdefault(sites[k], rows[k][0])
            first.setdefault(sites[k + 1], rows[k + 1][0])
    refs = {site: workers.call(actor, "codec_speeds", codecs) for site, actor in first.items()}
    return {site: workers.get([ref])[0] for site, ref in refs.items()}


def probe_links(
    workers: Workers, spec: ClusterSpec, plan: Any, placement: Any, say: Callable[[str], None]
) -> tuple[Measurements, list[LinkMeasurement]]:
    """Measure the layout's WAN links and each boundary site's codec speeds, and warn where
    the YAML is off: the measurements (for the cost model) and the links' full readings
    (round trips, clock offsets: for calibration and the metrics)."""
    from geopipe.runtime.control.calibration import searched_codecs

    rows, sites = placement.rows, plan.stage_sites
    measured = measure_links(workers, spec, rows, sites, placement.wan_addresses)
    warn_if_off(measured, say)
    links = tuple(LinkRate(m.src, m.dst, m.latency_s, m.bandwidth_bps) for m in measured)
    codecs = searched_codecs(spec)
    speeds = measure_codec_speeds(workers, rows, sites, codecs) if codecs else {}
    return Measurements(links=links, codecs=speeds), measured


def warn_if_off(measured: list[LinkMeasurement], say: Callable[[str], None]) -> None:
    for m in measured:
        off = m.off()
        if off:
            say(
                f"link {m.src} -> {m.dst} measures {'; '.join(off)}: more than "
                f"{WARN_OFF:.0%} off; planning with the measurement"
            )


# Above this, a launch says so on the console (the event always carries the figures).
SKEW_WARN_S = 60.0


def skew_report(
    answers: dict[str, dict[str, tuple[float, float]]], tolerance_s: float
) -> tuple[dict[str, Any], str | None]:
    """The launch's ``clock_skew`` event and, past :data:`SKEW_WARN_S`, a console line, from
    what each actor's WAN handshakes measured (``{actor: {link: (offset_s, error_s)}}``, the
    peer's wall clock minus the actor's ± half the round trip).

    Why at launch: the run's certificates are valid from ``tolerance_s`` before the
    driver's clock, so a node that far behind fails every new connection; minutes of skew
    are harmless but worth knowing before a recovery's rewiring depends on them. The
    monotonic offsets :func:`clock_offset` takes are another matter (calibration's)."""
    pairs = [
        {"actor": actor, "link": link, "offset_s": off, "error_s": err}
        for actor, links in sorted(answers.items())
        for link, (off, err) in sorted(links.items())
    ]
    if not pairs:
        return {"measured": False, "tolerance_s": tolerance_s, "pairs": []}, None
    worst = max(pairs, key=lambda p: abs(p["offset_s"]))
    fields = {
        "measured": True,
        "max_abs_offset_s": abs(worst["offset_s"]),
        "error_s": worst["error_s"],
        "worst": f"{worst['actor']} {worst['link']}",
        "tolerance_s": tolerance_s,
        "pairs": pairs,
    }
    if abs(worst["offset_s"]) <= SKEW_WARN_S:
        return fields, None
    line = (
        f"clock skew: the {worst['link']} peer of {worst['actor']} is "
        f"{worst['offset_s']:+.1f} s (± {worst['error_s']:.2f} s) off its clock; certificates "
        f"tolerate {tolerance_s / 3600:g} h behind the driver: keep the nodes' clocks in sync"
    )
    return fields, line


def measure_clock_skew(
    workers: Workers, roles: dict[tuple[int, int], Any], tolerance_s: float
) -> tuple[dict[str, Any], str | None]:
    """:func:`skew_report` of every stage actor (``roles``: ``(stage, replica)`` -> actor),
    asked once the actors are wired (their WAN handshakes done)."""
    keys = list(roles)
    got = workers.get([workers.call(roles[k], "clock_skews") for k in keys])
    return skew_report(
        {f"stage{k}/r{r}": a for (k, r), a in zip(keys, got, strict=True)}, tolerance_s
    )
