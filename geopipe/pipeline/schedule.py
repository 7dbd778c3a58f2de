"""Pipeline schedules as data.

A schedule is, per stage, an ordered list of :class:`Action` (stage, kind, micro-batch),
built by pure generators. The same lists are replayed by the simulator
(:mod:`geopipe.optimizer.simulator`) and executed by the stage actors
(:mod:`geopipe.runtime.actor.stage`), so prediction and execution cannot drift apart.

Semantics every executor follows:

* ``F m`` / ``B m`` are compute on micro-batch ``m`` (``B`` the full backward).
* ``I m`` / ``W m`` split the backward (zero-bubble pipelining, Qi et al., ICLR 2024): ``I``
  computes only the gradient w.r.t. the stage's input — the one the upstream stage waits
  for — and ``W`` later the weight gradients. A micro-batch takes either ``B`` or ``I`` then
  ``W`` on a stage. The letters are ``torch.distributed.pipelining``'s (``I`` is the
  paper's "B"): ``B`` already meant the full backward here and in torch's IR.
* ``SEND_F m`` / ``SEND_B m`` hand the activation (gradient) to the transport and return at
  once: transfer overlaps the compute that follows.
* ``RECV_F m`` / ``RECV_B m`` wait until that message has arrived. The transport delivers
  in the background, so the wait sits just before the compute that needs the data.

Text form: one action prints as ``<stage><KIND><mb>`` (``1F0``, ``0SEND_F3``), like
``torch.distributed.pipelining``; a schedule prints one line per stage and parses back.
The IR itself is in :mod:`geopipe.pipeline.ir`, the zero-bubble generators in
:mod:`geopipe.pipeline.zerobubble`, the validator in :mod:`geopipe.pipeline.validation`;
this module is the front door to all of them.

[Note: look-ahead] In 1F1B stage ``k`` of ``p`` runs ``p-k-1`` warm-up forwards and then
alternates one forward with one backward. Across a WAN link the backward for micro-batch
``m`` returns only after a round trip, so the upstream stage idles (GeoPipe's "cross-DC
bubble"). The look-ahead schedule gives stage ``k`` ``sum(ΔN_j for boundaries j >= k)``
extra warm-up forwards: the stage right before a WAN boundary keeps ΔN more micro-batches
in flight, and every stage before it must feed those, so it adds the same ΔN. With
asynchronous sends the extra forwards cover the round trip; the price is ΔN more
micro-batches of activations held in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from geopipe.pipeline.ir import (
    COMPUTE,
    FUSED_B,
    FUSED_F,
    FUSED_I,
    FUSED_MASK,
    FUSED_SHIFT,
    INPUT_BACKWARD,
    Action,
    Kind,
    Program,
    Schedule,
    ScheduleError,
    check_pm,
    parse_action,
    parse_schedule,
    warmup_counts,
    with_comm,
)
from geopipe.pipeline.validation import validate
from geopipe.pipeline.zerobubble import lookahead_zb, zb_h1

__all__ = [
    "AUTO",
    "AUTO_CHOICES",
    "COMPUTE",
    "FAMILIES",
    "FUSED_B",
    "FUSED_F",
    "FUSED_I",
    "FUSED_MASK",
    "FUSED_SHIFT",
    "INPUT_BACKWARD",
    "IN_ORDER_FAMILIES",
    "LOOKAHEAD_FAMILIES",
    "ONE_F_ONE_B_FAMILIES",
    "SCHEDULES",
    "SPLIT_FAMILIES",
    "Action",
    "Family",
    "Kind",
    "Program",
    "Schedule",
    "ScheduleError",
    "family",
    "gpipe",
    "lookahead",
    "lookahead_zb",
    "make_schedule",
    "one_f_one_b",
    "parse_action",
    "parse_schedule",
    "validate",
    "warmup_counts",
    "zb_h1",
]


# ----------------------------------------------------------------------------------------------
# Generators


@lru_cache(maxsize=8192)
def _program(family: str, first: bool, last: bool, m: int, warmup: int) -> Program:
    """One stage's program; shared by every schedule with the same (m, warm-up, position)."""
    if family == "gpipe":
        order = [(Kind.F, i) for i in range(m)] + [(Kind.B, i) for i in range(m)]
    else:
        order = _one_f_one_b_order(m, warmup)
    return with_comm(first, last, order)


def _one_f_one_b_order(m: int, warmup: int) -> list[tuple[Kind, int]]:
    order = [(Kind.F, i) for i in range(warmup)]
    for j in range(m - warmup):
        order.append((Kind.F, warmup + j))
        order.append((Kind.B, j))
    order += [(Kind.B, j) for j in range(m - warmup, m)]
    return order


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards: simple, m activations in flight per stage."""
    check_pm(p, m)
    progs = tuple(_program("gpipe", k == 0, k == p - 1, m, m) for k in range(p))
    return Schedule("gpipe", p, m, progs, tuple([m] * p))


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush 1F1B: at most ``p-k`` micro-batches in flight on stage k."""
    check_pm(p, m)
    sched = lookahead(p, m, [0] * (p - 1))
    return Schedule("1f1b", p, m, sched.programs, sched.caps)


def lookahead(p: int, m: int, delta_n: Sequence[int]) -> Schedule:
    """1F1B with ΔN extra warm-up forwards upstream of each boundary (see the note above).

    ``delta_n[j]`` is the scheduling advance for the boundary between stage ``j`` and
    ``j+1``; boundaries inside a site normally get 0.
    """
    check_pm(p, m)
    warm = warmup_counts(p, m, delta_n)
    progs = tuple(_program("1f1b", k == 0, k == p - 1, m, warm[k]) for k in range(p))
    caps = tuple(min(m, w + 1) for w in warm)
    return Schedule("lookahead", p, m, progs, caps, tuple(delta_n))


@dataclass(frozen=True)
class Family:
    """A schedule family, as the planner, the simulator, the steady-state extrapolation and
    the runtime see it: adding a schedule is one entry here, its generator and golden files.

    ``shape`` says how its programs are built, which the fast paths rely on:
    ``"all-forward"`` (every forward, then every backward: ``m`` in flight, a closed-form
    time), ``"one-f-one-b"`` (warm-up forwards then one forward per backward: ``min(m, w+1)``
    in flight, a closed-form steady state and a fast replay), ``"replayed"`` (any other:
    its in-flight peak and steady state are found by replaying its programs)."""

    name: str
    build: Callable[[int, int, Sequence[int], Sequence[int] | None], Schedule]
    shape: Literal["all-forward", "one-f-one-b", "replayed"]
    has_delta_n: bool  # a ΔN per WAN boundary, searched by the planner
    split_backward: bool  # backward as I, then W
    memory_caps: bool  # its plans carry per-stage in-flight caps from device memory

    @property
    def in_order(self) -> bool:
        """Forwards and backwards each in micro-batch order, one backward per forward."""
        return self.shape != "replayed"

    def delta_n(self, delta_n: Sequence[int]) -> tuple[int, ...]:
        """The ΔN this family runs with: the given one, or none."""
        return tuple(delta_n) if self.has_delta_n else (0,) * len(delta_n)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("gpipe", lambda p, m, dn, caps: gpipe(p, m), "all-forward", False, False, False),
        Family(
            "1f1b", lambda p, m, dn, caps: one_f_one_b(p, m), "one-f-one-b", False, False, False
        ),
        Family(
            "lookahead",
            lambda p, m, dn, caps: lookahead(p, m, dn),
            "one-f-one-b",
            True,
            False,
            False,
        ),
        Family("zb-h1", lambda p, m, dn, caps: zb_h1(p, m), "replayed", False, True, False),
        Family(
            "lookahead-zb",
            lambda p, m, dn, caps: lookahead_zb(p, m, dn, caps),
            "replayed",
            True,
            True,
            True,
        ),
    )
}


def family(name: str) -> Family:
    """The family called ``name``; a clear error for an unknown one."""
    if name not in FAMILIES:
        raise ValueError(f"unknown schedule '{name}' ({', '.join(FAMILIES)})")
    return FAMILIES[name]


def make_schedule(
    name: str,
    p: int,
    m: int,
    delta_n: Sequence[int] | None = None,
    caps: Sequence[int] | None = None,
) -> Schedule:
    """Build a schedule by family name (:data:`FAMILIES`; ``caps``: a memory-capped family's
    per-stage in-flight caps, see :func:`lookahead_zb`)."""
    dn = list(delta_n) if delta_n is not None else [0] * (p - 1)
    return family(name).build(p, m, dn, caps)


SCHEDULES = tuple(FAMILIES)
# ``plan.schedule: auto``: the planner plans each of these and keeps the faster (see
# geopipe.optimizer.planner.plan_cluster); everything after planning sees the one it chose.
AUTO = "auto"
AUTO_CHOICES = ("lookahead", "lookahead-zb")
# Derived from the registry, for membership tests
LOOKAHEAD_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.has_delta_n)
SPLIT_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.split_backward)
IN_ORDER_FAMILIES = frozenset(n for n, f in FAMILIES.items() if f.in_order)
ONE_F_ONE_B_FAMILIES = frozenset(n for n, f in FAMILIES.items() if f.shape == "one-f-one-b")
