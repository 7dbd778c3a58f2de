"""The lean-tie rule, its one home: among plans equally fast within the cost model's
accuracy, the one holding the least memory — chosen by :func:`lean_tie`, approached by
:func:`lean_descent` (pure: no geopipe types, so every search shares it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["TIE_TOLERANCE", "lean_descent", "lean_tie", "tie_limit"]

# [Note: lean ties] Plans within this fraction of the fastest one's time are equally fast: the
# cost model is not more accurate than that (nominal FLOP rates, link figures), while every
# extra micro-batch in flight costs its activations in device memory for certain. Among such
# plans the one holding the least activation memory in flight wins (choose()), everywhere a
# plan is chosen: the GA, exhaustive search, the templates' ΔN ladder and ΔN refinement.
TIE_TOLERANCE = 0.005
_T = TypeVar("_T")


def tie_limit(fastest: float) -> float:
    """The slowest time (or fitness) that still ties with ``fastest`` ([Note: lean ties])."""
    return fastest * (1 + TIE_TOLERANCE)


def lean_tie(
    items: Iterable[_T],
    time: Callable[[_T], float],
    memory: Callable[[_T], float],
    tiebreak: Callable[[_T], tuple] = lambda _: (),
) -> _T:
    """The rule of [Note: lean ties], the one home of it: among ``items`` within the tie
    tolerance of the fastest, the least memory, then the faster, then ``tiebreak``."""
    pool = list(items)
    limit = tie_limit(min(time(x) for x in pool))
    ties = [x for x in pool if time(x) <= limit]
    return min(ties, key=lambda x: (memory(x), time(x), *tiebreak(x)))


def lean_descent(
    genes: Sequence[int],
    slots: Iterable[int],
    lower: Callable[[int, int], Iterable[int]],
    accept: Callable[[list[int]], bool],
) -> list[int]:
    """The one ΔN descent of [Note: lean ties]: slot by slot, move a slot's value to the first
    of ``lower(slot, value)`` that ``accept`` takes, for as long as one is taken; sweep the
    slots again until a sweep changes nothing. ``accept`` says whether the plan with those
    genes stays feasible and within the tie tolerance (and, where asked, holds less)."""
    g = list(genes)
    order = list(slots)
    changed = True
    while changed:
        changed = False
        for i in order:
            moved = True
            while moved:
                moved = False
                for v in lower(i, g[i]):
                    trial = [*g[:i], v, *g[i + 1 :]]
                    if accept(trial):
                        g, changed, moved = trial, True, True
                        break
    return g
