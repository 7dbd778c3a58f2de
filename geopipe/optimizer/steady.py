"""Iteration time for any number of micro-batches ``m`` at a cost independent of ``m``.

The planner's fitness replays a schedule (:mod:`geopipe.optimizer.simulator`), which costs
``O(p·m)``. :func:`predict` returns the same numbers (to rounding: tested against the full
replay to 1e-9 relative) from a replay of a short run, because a pipeline's steady state is
periodic:

* GPipe has a closed form (:func:`gpipe_time`): its forward phase is a tandem of FIFO
  servers (stages and link directions) all fed at time 0, its backward phase the same
  tandem in reverse with each stage free from the end of its forward phase.
* Every other schedule is replayed for a short run and extrapolated along its periodic
  steady state — see [Note: periodic steady state]. Anything that does not fit the pattern
  (short runs, schedules without one) is simply replayed in full.

[Note: periodic steady state] A 1F1B-like schedule's fused program (:attr:`Schedule.fused`)
on stage ``k`` is warm-up ops, then a *body* of rounds in which round ``r+1`` repeats round
``r`` with every micro-batch one higher (``F w+r, B r`` for 1F1B), then cool-down ops; one
more micro-batch adds exactly one round and shifts the cool-down by one micro-batch
(checked on the generator's own output for ``m_s`` and ``m_s + 1``, :func:`_found_structure`;
for the 1F1B family the same structure is written in closed form and tested against it).
Event times are max-plus expressions (``start = max(ready, free) + cost``) of the events
before them, so: (1) a body event of a run of any length equals that of the infinite run
(checked: no body op waits for a cool-down op); (2) if, in some run, every body event of
the last ``W_j`` rounds of every stage ``j`` (and every message those rounds send) happens
exactly ``c·λ`` after the same event ``c`` rounds earlier, and each window ``W_j`` covers
how far before the end of ``j``'s body the inputs of any later event (of any stage, body or
cool-down) can lie — measured from the structure, ``2 + ΔN_{j-1}`` for look-ahead — then by
induction every later event does too, as max and + commute with a common shift; (3) the
cool-down of a run of ``m`` micro-batches then is that of a run of ``m - c·n`` shifted by
``c·n·λ``. Hence ``T(m) = T(m_a) + (m - m_a)·λ`` for a short ``m_a ≡ m (mod c)``. Steady
states of period ``c > 1`` happen (a round trip that spans several rounds); a transient
longer than the probe makes it grow, up to a full replay. The comparison allows float
rounding (:data:`_TOLERANCE`); max-plus maps do not amplify differences, so the error of
the extrapolation stays within the tolerance times the number of periods skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from geopipe.optimizer.onefoneb import fast_replay
from geopipe.optimizer.simulator import (
    PipelineCosts,
    Replay,
    SimResult,
    replay,
    result_for,
    simulate,
)
from geopipe.pipeline.schedule import (
    FUSED_B,
    FUSED_F,
    FUSED_I,
    FUSED_MASK,
    FUSED_SHIFT,
    Kind,
    Schedule,
    family,
    make_schedule,
    warmup_counts,
)

__all__ = [
    "gpipe_time",
    "peak_in_flight",
    "peak_in_flight_batch",
    "predict",
    "schedule_for",
]

# Families whose stages run forwards and backwards in micro-batch order (the simulator's
# in_flight_bound holds for them) and whose in-flight peak has the closed form below.

# A probe's periodicity test: every compared difference within this fraction of the largest
# event time. Rounding noise is ~1e-15 of it; a looser test could take a slow transient for
# the steady state.
_TOLERANCE = 4e-12
_RESIDUE = 12  # probes are as long as m modulo this (see predict)
_PROBE_ROUNDS = 10  # body rounds of the second probe (the first has the structure's two)

# Fused op codes (:attr:`Schedule.fused`): a forward (plain F or RECV/F/SEND), a backward
# that releases a micro-batch (B, fused or plain, and W), and a backward that only sends a
# gradient (I); one micro-batch more is one ``_NEXT_MB`` more on the op.
_F_KINDS = {int(Kind.F)} | set(range(FUSED_F, FUSED_F + 4))
_RELEASE = {int(Kind.B), int(Kind.W)} | set(range(FUSED_B, FUSED_B + 4))
_NEXT_MB = 1 << FUSED_SHIFT


@lru_cache(maxsize=8192)
def schedule_for(name: str, p: int, m: int, delta_n: tuple[int, ...]) -> Schedule:
    """The schedule family ``name`` at ``m`` micro-batches (cached: searches revisit)."""
    return make_schedule(name, p, m, delta_n)


# ---------------------------------------------------------------------------------------------
# Program structure


def _fb(code: int) -> int:
    """+1 for a forward, -1 for a backward that ends a micro-batch (B or W), else 0."""
    if code in _F_KINDS:
        return 1
    return -1 if code in _RELEASE else 0


def _fused_bits(code: int) -> tuple[str, int] | None:
    """A fused op's direction ('F' forward, 'B' backward: B or I) and its recv/send bits."""
    if FUSED_F <= code < FUSED_B:
        return "F", code - FUSED_F
    if FUSED_B <= code < FUSED_I:
        return "B", code - FUSED_B
    if FUSED_I <= code < FUSED_I + 4:
        return "B", code - FUSED_I
    return None


def _recv(code: int) -> str | None:
    """The message kind ('F' activation, 'B' gradient) an op waits for, if any."""
    if code == Kind.RECV_F:
        return "F"
    if code == Kind.RECV_B:
        return "B"
    bits = _fused_bits(code)
    return bits[0] if bits and bits[1] & 1 else None


def _send(code: int) -> str | None:
    if code == Kind.SEND_F:
        return "F"
    if code == Kind.SEND_B:
        return "B"
    bits = _fused_bits(code)
    return bits[0] if bits and bits[1] & 2 else None


@dataclass(frozen=True)
class _Body:
    start: int  # index of the body's first op in the fused program
    period: int  # ops per round
    rounds: int  # rounds at the structure's m_s

    @property
    def end(self) -> int:
        return self.start + self.rounds * self.period


def _body(ops: list[int]) -> _Body | None:
    """The longest run of rounds in which each op recurs ``period`` ops later with the next
    micro-batch, holding as many forwards as backwards (so the in-flight count is flat)."""
    best: _Body | None = None
    n = len(ops)
    for period in range(2, 9):
        i = 0
        while i + period < n:
            if ops[i + period] != ops[i] + _NEXT_MB:
                i += 1
                continue
            j = i
            while j + period < n and ops[j + period] == ops[j] + _NEXT_MB:
                j += 1
            rounds = (j + period - i) // period
            flat = sum(_fb(op & FUSED_MASK) for op in ops[i : i + period]) == 0
            if flat and (best is None or rounds > best.rounds):
                best = _Body(i, period, rounds)
            i = j + 1
    return best


@dataclass(frozen=True)
class _Structure:
    """A schedule family's shape for one (p, ΔN), valid for every ``m >= m_s``."""

    m_s: int
    bodies: tuple[_Body, ...]
    windows: tuple[int, ...]  # W_j of the module note, in rounds
    peak: tuple[int, ...]  # micro-batches in flight per stage, for every m >= m_s

    def rounds(self, k: int, m: int) -> int:
        return self.bodies[k].rounds + (m - self.m_s)


@lru_cache(maxsize=4096)
def _structure(name: str, p: int, delta_n: tuple[int, ...]) -> _Structure | None:
    """The body of every stage (module note); None if there is none."""
    fam = family(name)
    if fam.shape == "all-forward":
        return None
    if fam.shape == "one-f-one-b":
        return _one_f_one_b_structure(p, fam.delta_n(delta_n))
    return _found_structure(name, p, delta_n)


def _one_f_one_b_structure(p: int, delta_n: tuple[int, ...]) -> _Structure:
    """The 1F1B family's structure in closed form (what :func:`_found_structure` finds on its
    programs, tested): stage ``k`` warms up ``w_k = p-k-1 + Σ_{j≥k} ΔN_j`` forwards (one
    fused op each), then rounds ``F w_k+r, B r``; its in-flight peak is ``w_k + 1``. Round
    ``r`` of stage ``k`` takes stage ``k+1``'s gradient of round ``r``, which lies
    ``w_k - w_{k+1} = 1 + ΔN_k`` rounds before the end of ``k+1``'s body when ``k``'s ends,
    so ``W_{k+1} = 2 + ΔN_k`` (one more than the reach); ``W_0 = 2``."""
    warm = [p - k - 1 + sum(delta_n[k:]) for k in range(p)]
    m_s = warm[0] + 2
    bodies = tuple(_Body(w, 2, m_s - w) for w in warm)
    windows = (2, *(2 + d for d in delta_n))
    return _Structure(m_s, bodies, windows, tuple(w + 1 for w in warm))


def _found_structure(name: str, p: int, delta_n: tuple[int, ...]) -> _Structure | None:
    """Find and check the structure on the family's own programs (module note)."""
    m_s = p + sum(delta_n) + 2
    for _ in range(3):
        st = _check(schedule_for(name, p, m_s, delta_n), schedule_for(name, p, m_s + 1, delta_n))
        if st is not None:
            return st
        m_s *= 2
    return None


def _check(a: Schedule, b: Schedule) -> _Structure | None:
    """The structure if ``b`` (one more micro-batch) is ``a`` with one more body round and
    its cool-down shifted by one micro-batch, and no body op waits on a cool-down op."""
    bodies: list[_Body] = []
    for ops_a, ops_b in zip(a.fused, b.fused, strict=True):
        body = _body(ops_a)
        if body is None or body.rounds < 2:
            return None
        last = ops_a[body.end - body.period : body.end]
        grown = ops_a[: body.end] + [op + _NEXT_MB for op in last + ops_a[body.end :]]
        if grown != ops_b:
            return None
        bodies.append(body)
    if a.max_in_flight != b.max_in_flight:
        return None
    windows = _windows(a.fused, bodies)
    if windows is None:
        return None
    return _Structure(a.num_microbatches, tuple(bodies), windows, a.max_in_flight)


def _windows(progs: list[list[int]], bodies: list[_Body]) -> tuple[int, ...] | None:
    """Each stage's window ``W_j`` (module note): one more than how many rounds before the
    end of ``j``'s body an input of a later event can lie. None if a body op waits for
    another stage's cool-down."""
    p = len(progs)
    sent: list[dict[tuple[str, int], int]] = []
    for ops in progs:
        sent.append(
            {
                (kind, op >> FUSED_SHIFT): i
                for i, op in enumerate(ops)
                if (kind := _send(op & FUSED_MASK))
            }
        )
    reach = [1] * p  # an op's own stage: the previous op, one round back at most
    for k, ops in enumerate(progs):
        bk = bodies[k]
        for i, op in enumerate(ops):
            kind = _recv(op & FUSED_MASK)
            if kind is None or i < bk.start:
                continue
            j = k - 1 if kind == "F" else k + 1
            if not 0 <= j < p:
                return None
            idx = sent[j].get((kind, op >> FUSED_SHIFT))
            if idx is None:
                return None
            bj = bodies[j]
            if idx >= bj.end:
                if i < bk.end:
                    return None  # a body op waits for a cool-down op
                continue  # cool-down to cool-down: shifts along with the cool-down
            if idx < bj.start:
                continue  # a warm-up input: only the first rounds, far from the probe's end
            r_j = (idx - bj.start) // bj.period
            if i < bk.end:  # rounds past the end of k's body reach back this far into j's
                r_k = (i - bk.start) // bk.period
                reach[j] = max(reach[j], bj.rounds - bk.rounds + r_k - r_j)
            else:
                reach[j] = max(reach[j], bj.rounds - r_j)
    return tuple(r + 1 for r in reach)


def peak_in_flight(name: str, p: int, m: int, delta_n: tuple[int, ...]) -> tuple[int, ...]:
    """Micro-batches in flight at each stage's peak (the memory model's multiplier)."""
    fam = family(name)
    if fam.shape == "all-forward":
        return (m,) * p
    if fam.shape == "one-f-one-b":  # see peak_in_flight_batch
        return tuple(min(m, w + 1) for w in warmup_counts(p, m, fam.delta_n(delta_n)))
    st = _structure(name, p, delta_n)
    if st is not None and m >= st.m_s:
        return st.peak
    return schedule_for(name, p, m, delta_n).max_in_flight


def peak_in_flight_batch(name: str, p: int, m: int, delta_n: np.ndarray) -> np.ndarray:
    """:func:`peak_in_flight` for many ΔN rows at once (``delta_n``: ``N × (p-1)``).

    For the 1F1B family stage ``k`` warms up ``w_k = p-k-1 + Σ_{j≥k} ΔN_j`` forwards
    (``warmup_counts``), so ``min(m, w_k + 1)`` are in flight at its peak; GPipe holds all
    ``m``. Other families are asked row by row.
    """
    rows = np.asarray(delta_n, dtype=np.int64)
    rows = rows.reshape(rows.shape[0] if rows.ndim > 1 else 1, max(p - 1, 0))
    if family(name).shape == "all-forward":
        return np.full((rows.shape[0], p), m, dtype=np.int64)
    if family(name).shape == "one-f-one-b":
        suffix = np.zeros((rows.shape[0], p), dtype=np.int64)
        if p > 1:
            suffix[:, :-1] = np.cumsum(rows[:, ::-1], axis=1)[:, ::-1]
        return np.minimum(m, np.arange(p, 0, -1) + suffix)
    return np.array([peak_in_flight(name, p, m, tuple(int(x) for x in r)) for r in rows])


# ---------------------------------------------------------------------------------------------
# Prediction


def predict(
    name: str, p: int, m: int, delta_n: tuple[int, ...], costs: PipelineCosts, record: bool = False
) -> SimResult:
    """The simulator's result for schedule ``name`` at ``m`` micro-batches (module note).

    With ``record`` (a timeline is wanted) the schedule is replayed in full.
    """
    if record:
        return simulate(schedule_for(name, p, m, delta_n), costs, record=True)
    if family(name).shape == "all-forward":
        return gpipe_time(costs, m)
    st = _structure(name, p, delta_n)
    if st is not None:
        # Probes, shortest first (module note): most steady states show two rounds after the
        # warm-up, so the first probe is that short and taken whenever it is shorter than
        # the run; later ones only while a miss leaves the full replay at most half more
        # work. Their length ≡ m (mod 12): a period dividing 12 needs no second replay.
        for m_p in _probe_lengths(st.m_s, m):
            probe = _run(name, p, m_p, delta_n, costs)
            found = _period(probe, *_window(name, p, delta_n, m_p))
            if found is not None:
                return _extrapolate(name, p, m, delta_n, costs, probe.result, m_p, *found)
    return _run(name, p, m, delta_n, costs).result


def _probe_lengths(m_s: int, m: int) -> list[int]:
    """The probes :func:`predict` tries for a run of ``m`` (see there)."""
    out = [m_s + 2] if m_s + 2 < m else []
    m_p = m_s + _PROBE_ROUNDS
    m_p += (m - m_p) % _RESIDUE
    while 2 * m_p <= m:
        out.append(m_p)
        m_p += m_p + (m - 2 * m_p) % _RESIDUE
    return out


def _run(name: str, p: int, m: int, delta_n: tuple[int, ...], costs: PipelineCosts) -> Replay:
    """A full replay: the 1F1B family's fast one (:mod:`.onefoneb`), else the simulator's."""
    if family(name).shape == "one-f-one-b":
        return fast_replay(name, p, m, delta_n, costs)
    return replay(schedule_for(name, p, m, delta_n), costs)


def _extrapolate(
    name: str,
    p: int,
    m: int,
    delta_n: tuple[int, ...],
    costs: PipelineCosts,
    probe: SimResult,
    m_p: int,
    period: int,
    lam: float,
) -> SimResult:
    """``T(m) = T(m_a) + (m - m_a)·λ`` with ``m_a ≡ m (mod period)`` (module note)."""
    m_a = m_p + (m - m_p) % period
    base = probe if m_a == m_p else _run(name, p, m_a, delta_n, costs).result
    shift = (m - m_a) * lam
    iteration = base.iteration_time_s + shift
    return result_for(costs, m, iteration, base.pipeline_time_s + shift)


def gpipe_time(costs: PipelineCosts, m: int) -> SimResult:
    """GPipe in closed form (module docstring): ``O(p²)``, independent of ``m``.

    Identical jobs through a tandem of FIFO servers of times ``t_i`` (plus pure delays)
    leave the last server at ``Σ t_i + Σ delays + (m-1)·max t_i``: the longest path through
    the job × server grid. Forwards start at 0, so stage ``k`` ends its forward phase at
    ``a_k`` by that formula over ``f_0, ser_f0, …, f_k``. Backwards run through
    ``b_{p-1}, ser_b, …, b_0`` with stage ``j`` free from ``a_j``, so stage ``k`` ends at
    ``max_{j≥k} a_j + Σ + (m-1)·max`` over the servers from ``j`` down to ``k``.
    """
    f, b, step = costs.fwd_s, costs.bwd_s, costs.step_s
    p = len(f)
    a = [0.0] * p
    total, delays, top = f[0], 0.0, f[0]
    a[0] = total + (m - 1) * top
    for k in range(1, p):
        total += costs.ser_f[k - 1] + f[k]
        delays += costs.lat_f[k - 1]
        top = max(top, costs.ser_f[k - 1], f[k])
        a[k] = total + delays + (m - 1) * top
    ends = []
    for k in range(p):
        total, top = b[k], b[k]
        best = a[k] + total + (m - 1) * top
        for j in range(k + 1, p):
            total += costs.ser_b[j - 1] + costs.lat_b[j - 1] + b[j]
            top = max(top, costs.ser_b[j - 1], b[j])
            best = max(best, a[j] + total + (m - 1) * top)
        ends.append(best)
    iteration = max(e + s for e, s in zip(ends, step, strict=True))
    return result_for(costs, m, iteration, max(ends))


@lru_cache(maxsize=4096)
def _window(
    name: str, p: int, delta_n: tuple[int, ...], m_p: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Indices (into the probe's flattened event times) of the last ``W_k`` body rounds of
    every stage ``k`` and of the messages they send, each index's distance to the same event
    one round earlier, and the largest period the probe can test."""
    st = _structure(name, p, delta_n)
    assert st is not None
    if family(name).shape == "one-f-one-b":  # the programs are known: no need to build them
        progs = [_one_f_one_b_ops(k, p, m_p, st.bodies[k].start) for k in range(p)]
    else:
        progs = schedule_for(name, p, m_p, delta_n).fused
    base: list[int] = []
    stride: list[int] = []
    offsets = np.cumsum([0] + [len(x) for x in progs]).tolist()
    arr_f0 = offsets[-1]
    arr_b0 = arr_f0 + p * m_p
    c_max = m_p
    for k, ops in enumerate(progs):
        b = st.bodies[k]
        rounds = st.rounds(k, m_p)
        c_max = min(c_max, rounds - st.windows[k])
        first = b.start + (rounds - st.windows[k]) * b.period
        for i in range(first, b.start + rounds * b.period):
            base.append(offsets[k] + i)
            stride.append(b.period)
            kind, mb = _send(ops[i] & FUSED_MASK), ops[i] >> FUSED_SHIFT
            if kind == "F":
                base.append(arr_f0 + (k + 1) * m_p + mb)
                stride.append(1)
            elif kind == "B":
                base.append(arr_b0 + (k - 1) * m_p + mb)
                stride.append(1)
    return np.array(base), np.array(stride), c_max


def _one_f_one_b_ops(k: int, p: int, m: int, w: int) -> list[int]:
    """Stage ``k``'s fused program in the 1F1B family with ``w`` warm-up forwards, as far as
    :func:`_window` reads it: each op's send kind and micro-batch (tested against the
    generator)."""
    f_op = FUSED_F + (2 if k < p - 1 else 0) + (1 if k else 0)
    b_op = FUSED_B + (2 if k else 0) + (1 if k < p - 1 else 0)
    s = FUSED_SHIFT
    ops = [f_op | (x << s) for x in range(w)]
    for r in range(m - w):
        ops += [f_op | ((w + r) << s), b_op | (r << s)]
    return ops + [b_op | (x << s) for x in range(m - w, m)]


def _period(
    probe: Replay, base: np.ndarray, stride: np.ndarray, c_max: int
) -> tuple[int, float] | None:
    """The steady state's period ``c`` (rounds) and time per round ``λ``, if the probe's last
    rounds show it (module note); None if they do not."""
    if c_max < 1:
        return None
    events = np.concatenate(
        [np.asarray(x, dtype=float) for x in (*probe.ends, *probe.arr_f, *probe.arr_b)]
    )
    tol = _TOLERANCE * float(np.max(np.abs(events)))
    periods = np.arange(1, c_max + 1)
    # Every period at once: row c-1 holds each windowed event minus the same event c rounds
    # earlier; the steady state's period is the first row whose differences all agree.
    diff = events[base][None, :] - events[base[None, :] - periods[:, None] * stride[None, :]]
    ok = np.flatnonzero(np.ptp(diff, axis=1) <= tol)
    if not ok.size:
        return None
    c = int(periods[ok[0]])
    return c, float(np.mean(diff[ok[0]])) / c
