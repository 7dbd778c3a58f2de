"""The 1F1B family's replay in generation order: the simulator's numbers, 2-3× faster.

:func:`geopipe.optimizer.simulator.replay` runs any action lists: it sweeps the stages,
running each as far as it can, and revisits stages that wait on a message — a cost that
grows with how often stages block. The GA spends nearly all its time replaying 1F1B and
look-ahead schedules, whose shape is fixed (:func:`geopipe.pipeline.schedule.lookahead`):
stage ``k`` runs ``w_k`` warm-up forwards, then rounds ``F w_k+g, B g``, then backwards.
Processing *generation* ``g`` — stage ``k``'s forward ``w_k + g`` (if it has one) and its
backward ``g`` — for every stage from the last to the first, every input is ready when it
is read: the forward's activation was sent in an earlier generation (or the warm-up), the
backward's gradient by stage ``k+1`` a moment ago. So each action is touched once, with
the simulator's arithmetic in the simulator's order of operations (the results agree
exactly; tested on random costs and schedules), and nothing blocks.

[Note: 1F1B fast path] This mirrors the generator's shape. A change to the look-ahead or
1F1B generators (say, split backward actions) must change this too; until then the tests
comparing it with the generic replay fail, and :func:`fast_replay` is simply not used for a
family it does not know.
"""

from __future__ import annotations

from geopipe.optimizer.simulator import PipelineCosts, Replay, result_for
from geopipe.pipeline.schedule import family, warmup_counts

__all__ = ["fast_replay"]


def fast_replay(
    name: str, p: int, m: int, delta_n: tuple[int, ...], costs: PipelineCosts
) -> Replay:
    """What :func:`~geopipe.optimizer.simulator.replay` returns for schedule ``name`` (a
    ``one-f-one-b`` family of the registry) at ``m`` micro-batches, without the timeline."""
    if family(name).shape != "one-f-one-b":
        raise ValueError(f"no fast replay for schedule family {name!r}")
    w = warmup_counts(p, m, family(name).delta_n(delta_n))
    f, b = costs.fwd_s, costs.bwd_s
    ser_f, lat_f, ser_b, lat_b = costs.ser_f, costs.lat_f, costs.ser_b, costs.lat_b
    clock = [0.0] * p
    arr_f = [[-1.0] * m for _ in range(p)]
    arr_b = [[-1.0] * m for _ in range(p)]
    ends = [[0.0] * (2 * m) for _ in range(p)]  # fused ops: one F and one B per micro-batch
    free_f = [0.0] * max(p - 1, 0)
    free_b = [0.0] * max(p - 1, 0)
    for k in range(p):  # warm-ups: forwards only, fed by the stage before's warm-up
        t, fk, af, ek = 0.0, f[k], arr_f[k], ends[k]
        for x in range(w[k]):
            if k and af[x] > t:
                t = af[x]
            t += fk
            ek[x] = t
            if k < p - 1:
                start = t if t > free_f[k] else free_f[k]
                free_f[k] = start + ser_f[k]
                arr_f[k + 1][x] = free_f[k] + lat_f[k]
        clock[k] = t
    rounds = [m - x for x in w]
    for g in range(m):
        for k in range(p - 1, -1, -1):
            t, ek, wk = clock[k], ends[k], w[k]
            if g < rounds[k]:  # the round's forward
                x = wk + g
                if k:
                    a = arr_f[k][x]
                    if a > t:
                        t = a
                t += f[k]
                ek[wk + 2 * g] = t
                if k < p - 1:
                    start = t if t > free_f[k] else free_f[k]
                    free_f[k] = start + ser_f[k]
                    arr_f[k + 1][x] = free_f[k] + lat_f[k]
            if k < p - 1:  # the backward, in the round or the cool-down
                a = arr_b[k][g]
                if a > t:
                    t = a
            t += b[k]
            ek[wk + 2 * g + 1 if g < rounds[k] else wk + rounds[k] + g] = t
            if k:
                j = k - 1
                start = t if t > free_b[j] else free_b[j]
                free_b[j] = start + ser_b[j]
                arr_b[j][g] = free_b[j] + lat_b[j]
            clock[k] = t
    iteration = max(clock[k] + costs.step_s[k] for k in range(p))
    return Replay(result_for(costs, m, iteration, max(clock)), ends, arr_f, arr_b)
