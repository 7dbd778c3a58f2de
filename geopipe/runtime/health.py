"""Is the step making progress? Actor errors, heartbeats and the hang timeout.

Three ways a step can fail, each found as early as it can be:

* an actor error (process killed, node gone, an exception) surfaces as soon as that
  actor's result is known, not when the others finish;
* a frozen process or an unreachable node answers no ping: while a step runs, each
  unfinished actor is pinged every ``heartbeat_s`` and one that leaves a ping unanswered
  for ``unresponsive_s`` is lost — control-plane numbers, like Ray's own health checks;
* a hang (actors answer, the step never ends) after :func:`hang_timeout_s`, which follows
  the measured step time, so a slow WAN gets a long timeout and a fast one a short one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ActorsUnresponsive",
    "HealthConfig",
    "StepHung",
    "alive",
    "await_step",
    "hang_timeout_s",
    "quiet_get",
    "ref_failed",
]


@dataclass(frozen=True)
class HealthConfig:
    heartbeat_s: float = 1.0  # each unfinished actor is pinged this often during a step …
    unresponsive_s: float = 10.0  # … and one leaving a ping unanswered this long is lost
    hang_factor: float = 20.0  # a step may take this many predicted steps …
    hang_floor_s: float = 30.0  # … but at least this long once calibrated
    hang_floor_uncalibrated_s: float = 120.0  # … and this long before (warm-up steps)


class ActorsUnresponsive(RuntimeError):
    """Stage actors stopped answering heartbeats (frozen process, lost or partitioned node)."""

    def __init__(self, indices: list[int], seconds: float) -> None:
        super().__init__(f"{len(indices)} actor(s) unanswered heartbeat for {seconds:.0f} s")
        self.indices = indices


class StepHung(TimeoutError):
    """The step did not finish within the hang timeout although its actors answer."""


def hang_timeout_s(predicted_s: float, calibrated: bool, cfg: HealthConfig) -> float:
    """How long a step may run before it counts as hung: ``hang_factor`` × the predicted
    step — after calibration a prediction from the measured stage times and link delays —
    but at least the floor (a longer one before calibration, whose steps include warm-up)."""
    floor = cfg.hang_floor_s if calibrated else cfg.hang_floor_uncalibrated_s
    return max(floor, cfg.hang_factor * predicted_s)


def await_step(actors: list[Any], refs: list, hang_s: float, cfg: HealthConfig) -> list:
    """The step's results (``refs[i]`` is ``actors[i]``'s), failing fast: an actor error as
    soon as one is known, :class:`ActorsUnresponsive` after ``cfg.unresponsive_s`` of
    unanswered heartbeats, :class:`StepHung` after ``hang_s``."""
    import ray

    deadline = time.monotonic() + hang_s
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    pings: dict[int, tuple[Any, float]] = {}  # actor index -> (ping in flight, sent at)
    beat = time.monotonic() + cfg.heartbeat_s
    while pending:
        wait_s = max(0.0, beat - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        ray.get(ready)  # an actor error surfaces at once, not when the others finish
        now = time.monotonic()
        if now < beat or not pending:
            continue
        beat = now + cfg.heartbeat_s
        if now > deadline:
            raise StepHung(f"step unfinished after {hang_s:.0f} s: a hang")
        lost = []
        for i in (index[ref] for ref in pending):
            ping, sent = pings.get(i, (None, now))
            if ping is not None and not ray.wait([ping], timeout=0)[0]:
                if now - sent > cfg.unresponsive_s:
                    lost.append(i)
                continue
            pings[i] = (actors[i].ping.remote(), now)
        if lost:
            raise ActorsUnresponsive(lost, cfg.unresponsive_s)
    return ray.get(refs)


def alive(actors: list[Any], timeout: float) -> list[bool]:
    """Which actors answer a ping within ``timeout`` (all pinged at once)."""
    import ray

    refs = [a.ping.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    return [r in ready and quiet_get([r], 0)[0] is not None for r in refs]


def ref_failed(ref: Any) -> bool:
    """Whether a finished task's result is an error."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception:
        return True
    return False


def quiet_get(refs: list, timeout: float) -> list:
    """``ray.get`` that turns each failure into None (best-effort calls on survivors)."""
    import ray

    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=timeout))
        except Exception:
            out.append(None)
    return out
