"""A step's transport timings: what the stage's inbox recorded of each frame of a step (how
long past its expected arrival it came, when it was sent and when it was usable), moved into
that step's :class:`~geopipe.runtime.actor.executor.IterationResult`.

Its own module because it is bookkeeping over the inbox's records, apart from running the
step (:mod:`.executor`) and from the actor's shell (:mod:`.stage`): the later steps' records
stay for their own step, a launch-time link probe's go.
"""

from __future__ import annotations

from typing import Any

from geopipe.runtime.actor.executor import IterationResult

__all__ = ["collect_transport"]


def collect_transport(inbox: Any, res: IterationResult, step: int) -> None:
    """Move this step's transport timings from the inbox into ``res`` (later steps'
    stay; a launch-time link probe's messages are no training traffic and go)."""
    res.transport_excess_s = {"F": [], "B": []}
    later = []
    for key, delay in inbox.transfers:
        if key[0] not in res.transport_excess_s:
            continue
        if key[1] == step:
            res.transport_excess_s[key[0]].append(delay)
        elif key[1] > step:
            later.append((key, delay))
    inbox.transfers = later
    res.transport_stamps = {"F": [], "B": []}
    stamped = []
    got = inbox.got_at
    for key, sent, usable in inbox.stamped:
        if key[0] not in res.transport_stamps:
            continue
        if key[1] == step:
            called, returned = got.get(key, (usable, usable))
            if called < usable:  # the computation waited: it had the data on waking
                usable = max(usable, returned)
            res.transport_stamps[key[0]].append((key[2], sent, usable))
        elif key[1] > step:
            stamped.append((key, sent, usable))
    inbox.stamped = stamped
    inbox.got_at = {k: v for k, v in got.items() if _step_of(k) > step}


def _step_of(key: Any) -> int:
    """The step of an inbox key ``(kind, step, mb)``; other keys count as past."""
    if isinstance(key, tuple) and len(key) > 1 and isinstance(key[1], int):
        return key[1]
    return -1
