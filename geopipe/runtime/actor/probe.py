"""The stage actors' half of the launch-time link probe: the upstream stage pings its
downstream neighbour and streams a burst (:func:`probe`), the neighbour answers and times
the arrivals (:func:`echo`). The controller's half, which turns the timings into link
figures, is :mod:`geopipe.runtime.control.linkprobe`."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from geopipe.transport.direct import DirectSender
from geopipe.transport.link import LinkParams

__all__ = ["BURST_MAX_BYTES", "BURST_MESSAGES", "burst_sizes", "echo", "probe"]

PINGS = 5
PING_BYTES = 1024
# How long one side of the probe waits for a ping or its answer, and for the burst to be
# sent or to arrive (a link's first bytes can take a slow start; a burst, a slow link).
PING_WAIT_S = 60.0
BURST_WAIT_S = 120.0
BURST_MESSAGES = 9  # 8 inter-arrival rates; the median ignores slow start's few
BURST_MAX_BYTES = 32 << 20  # the whole burst at most (each message a fraction of it)


def burst_sizes(bandwidth_bps: float) -> list[int]:
    """Message sizes of the bulk burst: about half a second of the link, 1–32 MiB."""
    total = int(min(BURST_MAX_BYTES, max(1 << 20, bandwidth_bps / 8 * 0.5)))
    return [total // BURST_MESSAGES] * BURST_MESSAGES


def probe(
    inbox: Any,
    address: tuple[str, int],
    link: LinkParams | None,
    sizes: list[int],
    creds: Any = None,
) -> dict:
    """Upstream side: ping the neighbour at ``address`` and stream the burst. Returns
    ``rtt_s`` (median round trip), and per ping when it was sent and its answer in (this
    clock). The neighbour runs :func:`echo` at the same time."""
    tx = DirectSender(address, "none", "forward", link, creds=creds)
    inbox.watched, inbox.arrived_at = {"probe-pong"}, {}
    try:
        sent, rtts = [], []
        small = torch.zeros(PING_BYTES // 4)
        for i in range(PINGS):
            t0 = time.monotonic()
            tx.send(("probe-ping", i), small, stream="probe")
            inbox.get(("probe-pong", i), timeout=PING_WAIT_S)
            sent.append(t0)
            rtts.append(time.monotonic() - t0)
        for j, n in enumerate(sizes):
            tx.send(("probe-bulk", j), torch.zeros(n // 4), stream="probe")
        tx.flush(timeout=BURST_WAIT_S)
        back = [inbox.arrived_at[("probe-pong", i)] for i in range(PINGS)]
        return {"rtt_s": statistics.median(rtts), "ping_sent": sent, "pong_in": back}
    finally:
        inbox.watched, inbox.arrived_at = set(), {}
        tx.close()


def echo(
    inbox: Any,
    address: tuple[str, int],
    link: LinkParams | None,
    sizes: list[int],
    creds: Any = None,
) -> dict:
    """Downstream side: answer the pings, then time the burst's arrivals on this clock
    (stamped by the transport as each message is in, see ``Inbox.watched``). Returns the
    burst's ``arrivals`` and per ping when it was in and its answer sent (this clock)."""
    tx = DirectSender(address, "none", "backward", link, creds=creds)
    inbox.watched, inbox.arrived_at = {"probe-bulk", "probe-ping"}, {}
    try:
        small = torch.zeros(PING_BYTES // 4)
        ping_in, answered = [], []
        for i in range(PINGS):
            inbox.get(("probe-ping", i), timeout=PING_WAIT_S)
            answered.append(time.monotonic())
            # The first ping may be in before this call started watching: then it waited,
            # its round trip looks long, and clock_offset does not pick it.
            ping_in.append(inbox.arrived_at.get(("probe-ping", i), answered[-1]))
            tx.send(("probe-pong", i), small, stream="probe")
        tx.flush(timeout=PING_WAIT_S)
        for j in range(len(sizes)):
            inbox.get(("probe-bulk", j), timeout=BURST_WAIT_S)
        return {
            "arrivals": [inbox.arrived_at[("probe-bulk", j)] for j in range(len(sizes))],
            "ping_in": ping_in,
            "pong_sent": answered,
        }
    finally:
        inbox.watched, inbox.arrived_at = set(), {}
        tx.close()
