"""WAN emulator: timing accuracy with real bytes, FIFO queueing, loss model, timeout/close."""

from __future__ import annotations

import queue
import random
import statistics
import threading
import time

import pytest

from geopipe.transport import wire
from geopipe.transport.link import (
    DelayedMailbox,
    LinkEmulator,
    LinkParams,
    MailboxClosedError,
    _binomial,
)

MiB = 1 << 20


def _start_receiver(q: queue.Queue, mailbox: DelayedMailbox) -> threading.Thread:
    """Stand-in for the transport thread: drain the queue into the mailbox without waiting."""

    def run() -> None:
        while (item := q.get()) is not None:
            key, payload, deliver_at = item
            mailbox.put(key, payload, deliver_at)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _expected(nbytes: int, p: LinkParams) -> float:
    return wire.transfer_time(nbytes, p.bandwidth_bps, p.latency_s)


def assert_on_time(measured: float, expected: float) -> None:
    """Never early (the emulator's contract), and late only by scheduling noise. How close
    to the model deliveries land on a quiet machine (within 2 %) is measured by
    ``benchmarks/wan_overlap.py``, not asserted here: wall-clock bounds this tight fail
    on a loaded 2-core box."""
    assert measured >= expected * 0.995, (measured, expected)
    assert measured <= expected + 0.25, (measured, expected)


@pytest.mark.parametrize(
    ("nbytes", "bandwidth_bps", "latency_s"),
    [
        (4 * MiB, 100e6, 0.050),  # 0.385 s
        (8 * MiB, 500e6, 0.030),  # 0.164 s
        (16 * MiB, 1e9, 0.020),  # 0.154 s
        (16 * MiB, 250e6, 0.040),  # 0.577 s
    ],
)
def test_single_message_accuracy(nbytes: int, bandwidth_bps: float, latency_s: float) -> None:
    params = LinkParams(bandwidth_bps, latency_s)
    link, mailbox, q = LinkEmulator(params), DelayedMailbox(), queue.Queue()
    receiver = _start_receiver(q, mailbox)
    payload = bytes(nbytes)
    sent: dict[str, float] = {}

    def sender() -> None:
        sent["t"] = time.monotonic()
        q.put(("m", payload, link.stamp(len(payload), now=sent["t"])))

    threading.Thread(target=sender).start()
    got = mailbox.get("m", timeout=5.0)
    measured = time.monotonic() - sent["t"]
    q.put(None)
    receiver.join()
    assert got is payload
    expected = _expected(nbytes, params)
    assert_on_time(measured, expected)
    assert measured >= expected  # never early


def test_back_to_back_messages_queue_fifo() -> None:
    params = LinkParams(1e9, 0.020)
    link, mailbox, q = LinkEmulator(params), DelayedMailbox(), queue.Queue()
    receiver = _start_receiver(q, mailbox)
    payloads = [bytes(8 * MiB), bytes(8 * MiB)]
    t0 = time.monotonic()
    for i, p in enumerate(payloads):
        q.put((i, p, link.stamp(len(p))))
    # The transport keeps draining while both messages are held back.
    deadline = time.monotonic() + 0.05
    while len(mailbox) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)  # test-side polling, not the mailbox's drain loop
    assert len(mailbox) == 2
    assert mailbox.poll(0) is None and mailbox.poll(1) is None
    mailbox.get(0, timeout=5.0)
    t1 = time.monotonic()
    mailbox.get(1, timeout=5.0)
    t2 = time.monotonic()
    q.put(None)
    receiver.join()
    ser = 8 * MiB * 8 / params.bandwidth_bps
    assert_on_time(t1 - t0, params.latency_s + ser)
    assert_on_time(t2 - t0, params.latency_s + 2 * ser)  # queued behind the first


def test_stamp_queueing_math() -> None:
    p = LinkParams(1e8, 0.01)
    link = LinkEmulator(p)
    ser = MiB * 8 / p.bandwidth_bps
    a = link.stamp(MiB, now=100.0)
    b = link.stamp(MiB, now=100.0)
    assert a == pytest.approx(100.0 + ser + p.latency_s)
    assert b == pytest.approx(a + ser)
    assert link.busy_until == pytest.approx(100.0 + 2 * ser)
    # Once the link has drained, a new message starts at its own hand-over time.
    c = link.stamp(MiB, now=200.0)
    assert c == pytest.approx(200.0 + ser + p.latency_s)
    assert link.stamp(0, now=300.0) == pytest.approx(300.0 + p.latency_s)


def test_loss_mean_matches_transfer_time() -> None:
    p = LinkParams(1e9, 0.02, loss=0.01, seed=123)
    link = LinkEmulator(p)
    nbytes = 4 * MiB
    times = [link.stamp(nbytes, now=i * 10.0) - i * 10.0 for i in range(5000)]
    mean = statistics.fmean(times)
    assert mean == pytest.approx(wire.transfer_time(nbytes, 1e9, 0.02, 0.01), rel=0.01)
    # The serialisation part alone is stretched by 1/(1-loss), i.e. ~1.0101x.
    ser = nbytes * 8 / 1e9
    stretch = (mean - p.latency_s) / ser
    assert stretch == pytest.approx(1 / 0.99, abs=0.002)
    assert min(times) == pytest.approx(p.latency_s + ser)  # no loss, no penalty
    # Same seed, same draws; the emulator is reproducible.
    again = LinkEmulator(p)
    assert [again.stamp(nbytes, now=i * 10.0) - i * 10.0 for i in range(200)] == times[:200]


def test_binomial_sampler_moments() -> None:
    rng = random.Random(7)
    n, prob = 256, 0.05
    draws = [_binomial(rng, n, prob) for _ in range(20000)]
    assert statistics.fmean(draws) == pytest.approx(n * prob, rel=0.02)
    assert statistics.pvariance(draws) == pytest.approx(n * prob * (1 - prob), rel=0.05)
    assert max(draws) <= n
    assert _binomial(rng, n, 0.0) == 0 and _binomial(rng, 0, 0.5) == 0


def test_link_params_validation() -> None:
    for bad in (dict(bandwidth_bps=0, latency_s=0.0), dict(bandwidth_bps=1e9, latency_s=-1)):
        with pytest.raises(ValueError):
            LinkParams(**bad)
    with pytest.raises(ValueError):
        LinkParams(1e9, 0.01, loss=1.0)
    with pytest.raises(ValueError):
        wire.transfer_time(10, 1e9, 0.01, loss=-0.1)


def test_get_waits_until_due_not_just_present() -> None:
    mb = DelayedMailbox()
    due = time.monotonic() + 0.03
    mb.put("x", b"data", due)
    assert mb.poll("x") is None
    assert mb.get("x", timeout=1.0) == b"data"
    late = time.monotonic() - due
    # Never early; how late depends on the machine's load (a busy 2-core box can preempt
    # the waiter for a while), so the upper bound only catches a wait that ignores `due`.
    assert 0.0 <= late < 0.25
    assert mb.poll("x") is None  # taken


def test_poll_returns_due_message() -> None:
    mb = DelayedMailbox()
    mb.put("k", 42, time.monotonic() - 1.0)
    assert mb.poll("k") == 42
    assert mb.poll("k") is None
    with pytest.raises(ValueError):
        mb.put("n", None, 0.0)


def test_duplicate_key_rejected() -> None:
    mb = DelayedMailbox()
    mb.put("k", 1, 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        mb.put("k", 2, 0.0)


def test_timeout_missing_message() -> None:
    mb = DelayedMailbox()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="never arrived"):
        mb.get("missing", timeout=0.05)
    assert 0.05 <= time.monotonic() - t0 < 0.2


def test_timeout_message_not_yet_due() -> None:
    mb = DelayedMailbox()
    mb.put("slow", b"x", time.monotonic() + 10.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="due"):
        mb.get("slow", timeout=0.05)
    assert time.monotonic() - t0 < 0.2
    assert len(mb) == 1  # still there for a later get


@pytest.mark.parametrize("present", [False, True])
def test_close_wakes_blocked_getter(present: bool) -> None:
    mb = DelayedMailbox()
    if present:
        mb.put("k", b"x", time.monotonic() + 10.0)
    errors: list[BaseException] = []

    def getter() -> None:
        try:
            mb.get("k")
        except BaseException as e:  # recorded for the assertion below
            errors.append(e)

    t = threading.Thread(target=getter)
    t.start()
    time.sleep(0.02)
    t0 = time.monotonic()
    mb.close()
    t.join(timeout=1.0)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 0.1
    assert len(errors) == 1 and isinstance(errors[0], MailboxClosedError)
    assert mb.closed
    mb.put("late", b"y", 0.0)  # dropped silently at shutdown
    with pytest.raises(MailboxClosedError):
        mb.get("late", timeout=0.01)
    with pytest.raises(MailboxClosedError):
        mb.poll("late")


def test_put_wakes_getter_waiting_for_other_key() -> None:
    """A getter blocked on one key is not confused by messages for another key."""
    mb = DelayedMailbox()
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.setdefault("b", mb.get("b", timeout=2.0)))
    t.start()
    mb.put("a", 1, time.monotonic())
    time.sleep(0.01)
    assert t.is_alive()
    mb.put("b", 2, time.monotonic() + 0.01)
    t.join(timeout=1.0)
    assert out == {"b": 2}
    assert mb.get("a", timeout=0.1) == 1
