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

from collections.abc import Sequence
from functools import lru_cache

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
    "FUSED_B",
    "FUSED_F",
    "FUSED_I",
    "FUSED_MASK",
    "FUSED_SHIFT",
    "INPUT_BACKWARD",
    "LOOKAHEAD_FAMILIES",
    "SCHEDULES",
    "SPLIT_FAMILIES",
    "Action",
    "Kind",
    "Program",
    "Schedule",
    "ScheduleError",
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


def make_schedule(
    name: str,
    p: int,
    m: int,
    delta_n: Sequence[int] | None = None,
    caps: Sequence[int] | None = None,
) -> Schedule:
    """Build a schedule by family name: ``gpipe``, ``1f1b``, ``lookahead``, ``zb-h1`` or
    ``lookahead-zb`` (``caps``: its per-stage in-flight caps, see :func:`lookahead_zb`)."""
    dn = list(delta_n) if delta_n is not None else [0] * (p - 1)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "lookahead":
        return lookahead(p, m, dn)
    if name == "zb-h1":
        return zb_h1(p, m)
    if name == "lookahead-zb":
        return lookahead_zb(p, m, dn, caps)
    raise ValueError(f"unknown schedule '{name}' ({', '.join(SCHEDULES)})")


SCHEDULES = ("gpipe", "1f1b", "lookahead", "zb-h1", "lookahead-zb")
# ``plan.schedule: auto``: the planner plans each of these and keeps the faster (see
# geopipe.optimizer.planner.plan_cluster); everything after planning sees the one it chose.
AUTO = "auto"
AUTO_CHOICES = ("lookahead", "lookahead-zb")
# Families with a ΔN per boundary (the planner searches it), and with split backwards.
LOOKAHEAD_FAMILIES = ("lookahead", "lookahead-zb")
SPLIT_FAMILIES = ("zb-h1", "lookahead-zb")
