"""Discrete-event replay of a schedule's action lists over the cluster's links.

The simulator executes exactly the lists :mod:`geopipe.pipeline.schedule` generates and
the stage actors run, with these semantics (the runtime's):

* a stage runs its actions in order on one compute resource;
* ``SEND`` hands the message to the link and returns at once. Each link direction is a
  FIFO server: a message starts serialising when the link is free, takes
  ``bytes / bandwidth`` (plus the codec's cost), then arrives ``latency`` later;
* ``RECV`` waits until its message has arrived;
* after its last action a stage reduces gradients inside its ZeRO-1 group and steps the
  optimizer (``step_s``).

All ``D`` pipelines run the same lists in lockstep, so one pipeline is simulated with
each WAN link's bandwidth divided by ``D`` (the caller folds that into ``ser_*``).

Bubble ratio: ``1 - sum(busy_k) / (p * iteration_time)``, busy = forward + backward +
step. For uniform stages, free links and no step cost, 1F1B gives ``(p-1)/(m+p-1)``.

The hot loop works on int lists and plain floats; a 2-stage, 32-micro-batch replay takes
~0.1 ms, which the genetic search needs (it evaluates thousands of candidates).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from geopipe.optimizer.costs import INPUT_GRAD_SHARE
from geopipe.pipeline.schedule import (
    FUSED_B,
    FUSED_F,
    FUSED_I,
    FUSED_MASK,
    FUSED_SHIFT,
    Kind,
    Schedule,
    ScheduleError,
)

__all__ = [
    "Event",
    "PipelineCosts",
    "Replay",
    "SimResult",
    "in_flight_bound",
    "lower_bound",
    "replay",
    "result_for",
    "simulate",
]

_F, _B, _SF, _RF, _SB, _RB, _I, _W = (int(k) for k in Kind)


@dataclass(frozen=True)
class PipelineCosts:
    """Per-stage compute and per-boundary link costs for one pipeline, in seconds.

    ``ser_f[j]``/``lat_f[j]``: serialisation and latency of one activation message over
    boundary ``j`` (stage j -> j+1); ``ser_b[j]``/``lat_b[j]``: the gradient going back.
    ``inp_s``/``wgt_s``: a split backward's ``I`` and ``W`` per stage (empty: ``bwd_s``
    split by :data:`~geopipe.optimizer.costs.INPUT_GRAD_SHARE`); only schedules with
    ``I``/``W`` read them.
    """

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    step_s: tuple[float, ...]
    ser_f: tuple[float, ...]
    lat_f: tuple[float, ...]
    ser_b: tuple[float, ...]
    lat_b: tuple[float, ...]
    inp_s: tuple[float, ...] = ()
    wgt_s: tuple[float, ...] = ()

    def split(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-stage ``I`` and ``W`` durations."""
        if self.inp_s and self.wgt_s:
            return self.inp_s, self.wgt_s
        inp = tuple(b * INPUT_GRAD_SHARE for b in self.bwd_s)
        return inp, tuple(b - i for b, i in zip(self.bwd_s, inp, strict=True))


@dataclass(frozen=True)
class Event:
    """One interval of the timeline (for traces and plots)."""

    row: str  # "stage 0" or "link 0->1"
    name: str  # "F3", "B3", "step", "F3" on a link row means activation 3 in transit
    start: float
    end: float


@dataclass
class SimResult:
    iteration_time_s: float
    pipeline_time_s: float
    busy_s: list[float]
    bubble_ratio: float
    link_busy_s: list[float]  # per boundary, both directions summed
    events: list[Event] = field(default_factory=list)


@dataclass
class Replay:
    """Everything one replay computed: the result, and the time of every event (for the
    steady-state extrapolation in :mod:`geopipe.optimizer.steady`).

    ``ends[k][i]``: stage ``k``'s clock after its ``i``-th fused op (:attr:`Schedule.fused`);
    ``arr_f[k][mb]`` / ``arr_b[k][mb]``: when activation / gradient ``mb`` reaches stage ``k``.
    """

    result: SimResult
    ends: list[list[float]]
    arr_f: list[list[float]]
    arr_b: list[list[float]]


def simulate(sched: Schedule, costs: PipelineCosts, record: bool = False) -> SimResult:
    """Replay ``sched`` with ``costs``; raise :class:`ScheduleError` on a deadlock."""
    return replay(sched, costs, record).result


def replay(sched: Schedule, costs: PipelineCosts, record: bool = False) -> Replay:
    """Replay ``sched`` with ``costs``, keeping every event time (see :class:`Replay`).

    Each stage runs as far as it can; a stage blocks on a receive whose message has not
    been sent yet, and the sweep moves on to the next stage. Runs of ``RECV x, x, SEND x``
    are pre-fused into one op (:attr:`Schedule.fused`) so the loop touches each micro-batch
    twice per stage instead of six times; the arithmetic is the same as unfused.
    """
    p, m = sched.num_stages, sched.num_microbatches
    progs = sched.fused
    fwd, bwd = costs.fwd_s, costs.bwd_s
    inp, wgt = costs.split()
    ser_f, lat_f, ser_b, lat_b = costs.ser_f, costs.lat_f, costs.ser_b, costs.lat_b
    clock = [0.0] * p
    ptr = [0] * p
    arr_f = [[-1.0] * m for _ in range(p)]  # arrival of activation mb at stage k
    arr_b = [[-1.0] * m for _ in range(p)]  # arrival of gradient mb at stage k
    free_f = [0.0] * max(p - 1, 0)
    free_b = [0.0] * max(p - 1, 0)
    link_busy = [0.0] * max(p - 1, 0)
    ev: list[Event] | None = [] if record else None
    lengths = [len(x) for x in progs]
    op_ends = [[0.0] * n for n in lengths]
    remaining = sum(lengths)
    while remaining:
        moved = False
        for k in range(p):
            ops, n, ends_k = progs[k], lengths[k], op_ends[k]
            i = ptr[k]
            if i == n:
                continue
            t = clock[k]
            while i < n:
                op = ops[i]
                c = op & FUSED_MASK
                mb = op >> FUSED_SHIFT
                if c >= FUSED_F:  # fused: [RECV] compute [SEND]
                    if c >= FUSED_B:  # backward: full (B) or input gradient only (I)
                        if c >= FUSED_I:
                            c, dur, name = c - FUSED_I, inp[k], "I"
                        else:
                            c, dur, name = c - FUSED_B, bwd[k], "B"
                        if c & 1:
                            a = arr_b[k][mb]
                            if a < 0:
                                break
                            if a > t:
                                t = a
                        if ev is not None:
                            ev.append(Event(f"stage {k}", f"{name}{mb}", t, t + dur))
                        t += dur
                        if c & 2:
                            j = k - 1
                            start = t if t > free_b[j] else free_b[j]
                            end = start + ser_b[j]
                            free_b[j] = end
                            link_busy[j] += ser_b[j]
                            arr_b[j][mb] = end + lat_b[j]
                            if ev is not None:
                                ev.append(Event(f"link {k}->{j}", f"B{mb}", start, end + lat_b[j]))
                    else:
                        c -= FUSED_F
                        if c & 1:
                            a = arr_f[k][mb]
                            if a < 0:
                                break
                            if a > t:
                                t = a
                        if ev is not None:
                            ev.append(Event(f"stage {k}", f"F{mb}", t, t + fwd[k]))
                        t += fwd[k]
                        if c & 2:
                            start = t if t > free_f[k] else free_f[k]
                            end = start + ser_f[k]
                            free_f[k] = end
                            link_busy[k] += ser_f[k]
                            arr_f[k + 1][mb] = end + lat_f[k]
                            if ev is not None:
                                ev.append(
                                    Event(f"link {k}->{k + 1}", f"F{mb}", start, end + lat_f[k])
                                )
                elif c == _F:
                    if ev is not None:
                        ev.append(Event(f"stage {k}", f"F{mb}", t, t + fwd[k]))
                    t += fwd[k]
                elif c == _B:
                    if ev is not None:
                        ev.append(Event(f"stage {k}", f"B{mb}", t, t + bwd[k]))
                    t += bwd[k]
                elif c == _SF:
                    start = t if t > free_f[k] else free_f[k]
                    end = start + ser_f[k]
                    free_f[k] = end
                    link_busy[k] += ser_f[k]
                    arr_f[k + 1][mb] = end + lat_f[k]
                    if ev is not None:
                        ev.append(Event(f"link {k}->{k + 1}", f"F{mb}", start, end + lat_f[k]))
                elif c == _SB:
                    j = k - 1
                    start = t if t > free_b[j] else free_b[j]
                    end = start + ser_b[j]
                    free_b[j] = end
                    link_busy[j] += ser_b[j]
                    arr_b[j][mb] = end + lat_b[j]
                    if ev is not None:
                        ev.append(Event(f"link {k}->{j}", f"B{mb}", start, end + lat_b[j]))
                elif c == _W:
                    if ev is not None:
                        ev.append(Event(f"stage {k}", f"W{mb}", t, t + wgt[k]))
                    t += wgt[k]
                elif c == _I:
                    if ev is not None:
                        ev.append(Event(f"stage {k}", f"I{mb}", t, t + inp[k]))
                    t += inp[k]
                elif c == _RF:
                    a = arr_f[k][mb]
                    if a < 0:
                        break
                    if a > t:
                        t = a
                else:  # _RB
                    a = arr_b[k][mb]
                    if a < 0:
                        break
                    if a > t:
                        t = a
                ends_k[i] = t
                i += 1
            if i != ptr[k]:
                remaining -= i - ptr[k]
                ptr[k] = i
                clock[k] = t
                moved = True
        if not moved:
            stuck = [f"stage {k} at op {ptr[k]}" for k in range(p) if ptr[k] < lengths[k]]
            raise ScheduleError(f"deadlock in {sched.name}: " + ", ".join(stuck))
    pipeline_time = max(clock)
    ends = [clock[k] + costs.step_s[k] for k in range(p)]
    if ev is not None:
        for k in range(p):
            if costs.step_s[k] > 0:
                ev.append(Event(f"stage {k}", "step", clock[k], ends[k]))
    iteration = max(ends)
    busy = [
        m * fwd[k] + n_b * bwd[k] + n_w * (inp[k] + wgt[k]) + costs.step_s[k]
        for k, (n_b, n_w) in enumerate(_backward_counts(sched))
    ]
    bubble = 1.0 - sum(busy) / (p * iteration) if iteration > 0 else 0.0
    result = SimResult(iteration, pipeline_time, busy, bubble, link_busy, ev or [])
    return Replay(result, op_ends, arr_f, arr_b)


def result_for(costs: PipelineCosts, m: int, iteration: float, pipeline: float) -> SimResult:
    """The :class:`SimResult` of a run of ``m`` micro-batches whose times are known: busy
    time and link use follow from ``m`` (every micro-batch runs once on every stage and
    crosses every boundary once each way)."""
    p = len(costs.fwd_s)
    busy = [m * (costs.fwd_s[k] + costs.bwd_s[k]) + costs.step_s[k] for k in range(p)]
    bubble = 1.0 - sum(busy) / (p * iteration) if iteration > 0 else 0.0
    link = [m * (costs.ser_f[j] + costs.ser_b[j]) for j in range(p - 1)]
    return SimResult(iteration, pipeline, busy, bubble, link)


def _backward_counts(sched: Schedule) -> list[tuple[int, int]]:
    """Per stage: micro-batches with a full backward, and with a split one."""
    return [(kinds.count(_B), kinds.count(_W)) for kinds, _ in sched.programs]


def lower_bound(costs: PipelineCosts, m: int, split: bool = False) -> float:
    """A cheap bound the simulated iteration time can never beat (any valid schedule).

    ``P`` is one micro-batch's round trip with no queueing: through every stage's forward
    and links to the last stage, then every backward and link back to stage 0. Stage k
    cannot start before the first activation reaches it (``fill_k``), computes
    ``m·(f_k + b_k)``, and its last gradient still travels back to stage 0 (``drain_k``).
    A link direction serialises ``m`` messages, so the last one leaves at least
    ``(m-1)·ser`` after the first and then still has a round trip's remainder to go:
    ``P + (m-1)·ser``. With ``split`` (schedules with ``I``/``W``) only ``I`` is on the
    way back, and a stage's ``W``s may come after its last ``I``. The search skips
    simulating candidates whose bound already loses.
    """
    fwd, bwd, step = costs.fwd_s, costs.bwd_s, costs.step_s
    if split:
        back, wgt = costs.split()
    else:
        back, wgt = bwd, (0.0,) * len(bwd)
    p = len(fwd)
    fill = [0.0] * p
    drain = [0.0] * p
    for k in range(1, p):
        fill[k] = fill[k - 1] + fwd[k - 1] + costs.ser_f[k - 1] + costs.lat_f[k - 1]
        drain[k] = drain[k - 1] + costs.ser_b[k - 1] + costs.lat_b[k - 1] + back[k - 1]
    round_trip = fill[p - 1] + fwd[p - 1] + back[p - 1] + drain[p - 1]
    best = 0.0
    for k in range(p):
        crit_k = fill[k] + m * (fwd[k] + back[k])
        end_k = crit_k + m * wgt[k]
        best = max(best, end_k + step[k], crit_k + drain[k] + step[0])
        best = max(best, round_trip + (m - 1) * fwd[k] + step[0])
    for j in range(p - 1):
        best = max(best, round_trip + (m - 1) * max(costs.ser_f[j], costs.ser_b[j]) + step[0])
    return best


def in_flight_bound(costs: PipelineCosts, m: int, in_flight: np.ndarray) -> np.ndarray:
    """A bound from each stage's in-flight cap, for many candidates at once.

    ``in_flight[i, k]``: the most micro-batches in flight on stage ``k`` under candidate
    ``i`` (its schedule's peak; ΔN raises it). Valid for schedules whose stages run forwards
    and backwards in micro-batch order (GPipe, 1F1B, look-ahead): stage ``k`` can then start
    ``F x`` only after ``B (x - cap)`` ended, and ``B x`` ends at least a round trip ``RT_k``
    (its compute and everything downstream, with every link's latency and serialisation)
    after ``F x`` starts. Chaining ``ceil(m / cap)`` round trips from the first activation's
    arrival (``fill_k``), then the last gradient's way back to stage 0 and its step, gives a
    bound that grows as ΔN shrinks — so the searches can prune over ΔN, which
    :func:`lower_bound` cannot see.
    """
    f, b, step = (np.asarray(x, dtype=float) for x in (costs.fwd_s, costs.bwd_s, costs.step_s))
    p = f.size
    hop_f = np.asarray(costs.ser_f, dtype=float) + np.asarray(costs.lat_f, dtype=float)
    hop_b = np.asarray(costs.ser_b, dtype=float) + np.asarray(costs.lat_b, dtype=float)
    fill = np.concatenate([[0.0], np.cumsum(f[:-1] + hop_f)])
    drain = np.concatenate([[0.0], np.cumsum(b[:-1] + hop_b)])
    rt = np.cumsum((f + b)[::-1])[::-1]
    rt[:-1] += np.cumsum((hop_f + hop_b)[::-1])[::-1] if p > 1 else 0.0
    cap = np.maximum(np.asarray(in_flight), 1)
    trips = np.ceil(m / cap)
    tail = np.maximum(drain + step[0], step)
    return np.max(fill + trips * rt + tail, axis=-1)
