"""A 1F1B-shaped schedule written out by hand, independently of the generators: the tests
that need one (generator checks, validator and simulator failure cases) share this one."""

from __future__ import annotations

from geopipe.pipeline.schedule import Action, Kind, Schedule

__all__ = ["hand_1f1b"]


def hand_1f1b(p: int, m: int, warm: list[int], name: str = "hand") -> Schedule:
    """Stage ``k`` runs ``warm[k]`` forwards, then alternates one forward with one backward,
    then the remaining backwards; each forward receives (not on the first stage) and sends
    (not on the last), each backward the other way. Any warm-up counts are allowed (caps
    generous, so only the order matters): wrong ones make deadlocks on purpose."""
    stages = []
    for k in range(p):
        order = [(Kind.F, i) for i in range(warm[k])]
        for j in range(m - warm[k]):
            order += [(Kind.F, warm[k] + j), (Kind.B, j)]
        order += [(Kind.B, j) for j in range(m - warm[k], m)]
        acts = []
        for kind, mb in order:
            if kind == Kind.F:
                seq = ([] if k == 0 else [Kind.RECV_F]) + [Kind.F]
                seq += [] if k == p - 1 else [Kind.SEND_F]
            else:
                seq = ([] if k == p - 1 else [Kind.RECV_B]) + [Kind.B]
                seq += [] if k == 0 else [Kind.SEND_B]
            acts += [Action(k, c, mb) for c in seq]
        stages.append(acts)
    return Schedule.from_actions(name, p, m, stages, [m] * p)
