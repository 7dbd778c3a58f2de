"""Zero-bubble schedules: the backward split into ``I`` (input gradient) and ``W`` (weights).

[Note: split backward] ``I m`` computes only the gradient w.r.t. the stage's input, which
the upstream stage waits for; ``W m`` computes the weight gradients and may run any time
later (before the optimizer step), as long as the activations it needs stay in memory. So
``I`` sits on the critical path between stages and ``W`` is free to fill idle time.

ZB-H1 (Qi et al., "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024, §2.1): 1F1B's
order with the backward split, stage ``k``'s ``W`` trailing its ``I`` by ``k`` micro-batches
so every stage holds at most ``p`` micro-batches (1F1B's first-stage peak) and the trailing
``W``s fill the cool-down bubble: stage ``k`` runs ``p-k-1`` warm-up forwards, then ``F``,
``I`` and (once ``k`` backwards have run) ``W`` of the oldest micro-batch, then the remaining
``I``/``W`` and finally the ``W``s still owed.

[Note: look-ahead with split backward] Upstream of a WAN boundary a stage waits at each
``RECV_B`` for a gradient that crossed the WAN twice. Look-ahead (:mod:`.schedule`) covers
that round trip with ΔN extra warm-up forwards, i.e. ΔN more micro-batches of activations.
With the backward split every stage sends its gradient after ``I`` and computes ``W`` while
that gradient crosses the link, so the round trip the upstream stage must cover shrinks by
the ``W``s of every stage from it down to the last, and the same iteration time needs a
smaller ΔN. Stages with memory to spare defer ``W`` further, ZB-H1 style: a stage with
in-flight cap ``c`` (micro-batches whose forward ran and whose ``W`` did not — a deferred
``W`` still holds the activations it needs) and ``w`` warm-up forwards lets ``W`` trail its
``I`` by ``c - w - 1`` micro-batches, which fills the cool-down bubble. The default cap is
the first stage's own peak (ZB-H1's rule); the planner lowers it to what each device holds.

Placing a deferred ``W`` *before* the next ``RECV_B`` instead (into the WAN wait itself)
takes ``W`` off the loop ``F -> WAN -> I -> next F`` but holds one more micro-batch; in the
simulator that slot always bought more as one more ΔN, so the generator does not do it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from geopipe.pipeline.ir import (
    Kind,
    Program,
    Schedule,
    check_pm,
    warmup_counts,
    with_comm,
)

__all__ = ["default_caps", "lookahead_zb", "split_order", "zb_h1"]


def split_order(m: int, warmup: int, lag: int) -> list[tuple[Kind, int]]:
    """One stage's compute order with the backward split.

    ``warmup`` forwards, then per micro-batch ``j``: the forward ``j + warmup`` (while any
    remain), ``I j`` and — once ``lag`` backwards have run — ``W`` of micro-batch ``j - lag``;
    the ``W``s still owed close the list.
    """
    if lag < 0:
        raise ValueError(f"the W lag must be >= 0, got {lag}")
    order = [(Kind.F, i) for i in range(min(warmup, m))]
    for j in range(m):
        if j + warmup < m:
            order.append((Kind.F, j + warmup))
        order.append((Kind.I, j))
        if j - lag >= 0:
            order.append((Kind.W, j - lag))
    order += [(Kind.W, j) for j in range(max(0, m - lag), m)]
    return order


@lru_cache(maxsize=8192)
def _split_program(first: bool, last: bool, m: int, warmup: int, lag: int) -> Program:
    return with_comm(first, last, split_order(m, warmup, lag))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split and stage ``k``'s ``W`` ``k`` micro-batches late."""
    check_pm(p, m)
    warm = warmup_counts(p, m, [0] * (p - 1))
    progs = tuple(_split_program(k == 0, k == p - 1, m, warm[k], k) for k in range(p))
    sched = Schedule("zb-h1", p, m, progs, (0,) * p)
    return Schedule("zb-h1", p, m, progs, sched.max_in_flight)


def default_caps(p: int, m: int, delta_n: Sequence[int]) -> list[int]:
    """ZB-H1's rule carried over to look-ahead: every stage may hold as many micro-batches
    as the first stage holds anyway (its warm-up plus one)."""
    warm = warmup_counts(p, m, delta_n)
    return [min(m, warm[0] + 1)] * p


def lookahead_zb(
    p: int, m: int, delta_n: Sequence[int], caps: Sequence[int] | None = None
) -> Schedule:
    """Look-ahead's warm-up forwards with the backward split, each stage deferring ``W`` as
    far as ``caps[k]`` micro-batches in flight allow (see the note above).

    ``caps`` at or below a stage's warm-up plus one mean no deferral (``W`` right after its
    ``I``); caps above the default (:func:`default_caps`) are lowered to it.
    """
    check_pm(p, m)
    warm = warmup_counts(p, m, delta_n)
    top = default_caps(p, m, delta_n)
    if caps is None:
        caps = top
    if len(caps) != p:
        raise ValueError(f"caps needs one entry per stage ({p}), got {len(caps)}")
    progs = []
    for k in range(p):
        lag = max(0, min(top[k], caps[k]) - warm[k] - 1)
        progs.append(_split_program(k == 0, k == p - 1, m, warm[k], lag))
    sched = Schedule("lookahead-zb", p, m, tuple(progs), (0,) * p, tuple(delta_n))
    return Schedule("lookahead-zb", p, m, sched.programs, sched.max_in_flight, tuple(delta_n))
