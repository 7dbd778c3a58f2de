"""The reference the simulator is checked against: the schedule's action lists replayed one
action at a time, no fusion, no fast paths — the semantics the simulator's docstring states,
written as plainly as possible (F, B, I and W on the stage's clock; each send starts when
the stage reaches it and its link direction is free, and arrives serialisation + latency
later; a receive waits for its arrival)."""

from __future__ import annotations

from geopipe.optimizer.simulator import PipelineCosts
from geopipe.pipeline.schedule import Kind, Schedule, ScheduleError

__all__ = ["reference_time"]


def reference_time(sched: Schedule, c: PipelineCosts) -> float:
    """One action at a time, no fusion: the semantics the docstring states."""
    p = sched.num_stages
    inp, wgt = c.split()
    dur = {Kind.F: c.fwd_s, Kind.B: c.bwd_s, Kind.I: inp, Kind.W: wgt}
    clock = [0.0] * p
    ptr = [0] * p
    arrive: dict[tuple[int, Kind, int], float] = {}
    free: dict[tuple[int, str], float] = {}
    while any(ptr[k] < len(sched.stages[k]) for k in range(p)):
        moved = False
        for k in range(p):
            while ptr[k] < len(sched.stages[k]):
                a = sched.stages[k][ptr[k]]
                if a.kind in (Kind.RECV_F, Kind.RECV_B):
                    key = (k, a.kind, a.mb)
                    if key not in arrive:
                        break
                    clock[k] = max(clock[k], arrive[key])
                elif a.kind in dur:
                    clock[k] += dur[a.kind][k]
                elif a.kind == Kind.SEND_F:
                    start = max(clock[k], free.get((k, "f"), 0.0))
                    free[(k, "f")] = start + c.ser_f[k]
                    arrive[(k + 1, Kind.RECV_F, a.mb)] = start + c.ser_f[k] + c.lat_f[k]
                else:
                    j = k - 1
                    start = max(clock[k], free.get((j, "b"), 0.0))
                    free[(j, "b")] = start + c.ser_b[j]
                    arrive[(j, Kind.RECV_B, a.mb)] = start + c.ser_b[j] + c.lat_b[j]
                ptr[k] += 1
                moved = True
        if not moved:
            raise ScheduleError("deadlock (reference)")
    return max(clock[k] + c.step_s[k] for k in range(p))
