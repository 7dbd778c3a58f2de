"""Search over plans: a DEAP genetic algorithm, and exhaustive search to check it.

Genome: one index per gene into the :class:`~geopipe.optimizer.evaluate.SearchSpace`
lists — ``[pipelines, micro_batch, seq_len, ΔN per WAN boundary…, codec per WAN
boundary…]``. Fitness is lexicographic ``(seconds per token, activation bytes in flight)``.
Infeasible genomes (memory over the device, saturated link, batch that does not divide)
get a penalty fitness that ranks below every feasible one. The plan returned is not simply
the fittest genome: :func:`~geopipe.optimizer.evaluate.choose` picks, among every plan the
search scored within the tie tolerance of the fastest, the one holding the least
activation memory in flight (see [Note: lean ties]), after a last descent that lowers each
ΔN while the time stays within that tolerance.

The GA is (μ+λ) with tournament selection, uniform crossover and per-gene mutation
(random reset or a ±1 step), stopped after ``patience`` generations without a faster plan,
and finished with a hill-climb over ±1 steps of every gene (a hybrid GA as in DT-FM). Its
first generation is a structural sweep: every pipeline count, micro-batch and sequence
length (each codec on every WAN boundary) with the ΔN the steady state needs
(:func:`geopipe.optimizer.ladder.delta_n_cover`, which is the best ΔN or next to it and
does not depend on the number of micro-batches ``m``). The GA then starts at the right
structure with ΔN about right, so what is left to search — codec mixes, ΔN ±1, structures
the sweep ranks close — and the generations it takes are about the same whatever ``m``
(with ΔN drawn blindly the landscape grew with ``m``: more distinct ΔN values matter when
they are not clipped by ``m``). DEAP draws from Python's global
``random``; we seed it and restore its state after, so a search is reproducible and leaves
callers' randomness alone.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from deap import algorithms, base, creator, tools

from geopipe.optimizer.evaluate import (
    TIE_TOLERANCE,
    Candidate,
    Evaluation,
    Evaluator,
    choose,
)
from geopipe.optimizer.ladder import delta_n_cover
from geopipe.optimizer.lean import lean_descent, tie_limit

__all__ = ["SearchResult", "genetic_search"]

if not hasattr(creator, "GeoPipeFitness"):
    creator.create("GeoPipeFitness", base.Fitness, weights=(-1.0, -1.0))
    creator.create("GeoPipeGenome", list, fitness=creator.GeoPipeFitness)


@dataclass
class SearchResult:
    best: Evaluation
    evaluations: int
    seconds: float
    method: str
    space_size: int
    generations: int = 0
    simulated: int = 0  # candidates exhaustive search simulated (the rest: scored by bounds)


_BUCKET = math.log1p(TIE_TOLERANCE)


def _key(ev: Evaluation) -> tuple[float, float]:
    """Fitness tuple: the time in buckets of the tie tolerance (log scale), then activation
    bytes in flight — a total order that approximates [Note: lean ties], so selection keeps
    lean genomes among equally fast ones."""
    return (float(math.floor(math.log(ev.fitness) / _BUCKET)), ev.activation_bytes)


class _Genes:
    """Maps index genomes to candidates and back."""

    def __init__(self, ev: Evaluator):
        sp = ev.space
        self.ev = ev
        self.gbs = ev.spec.training.global_batch_size
        w = sp.wan_boundaries
        self.lists: list[tuple] = (
            [sp.pipelines, sp.micro_batch_sizes, sp.seq_lens] + [sp.delta_ns] * w + [sp.codecs] * w
        )
        self.w = w
        self.ups = [len(lst) - 1 for lst in self.lists]  # the largest index of every gene
        # The GA draws codecs from the settings as listed (each one for both directions);
        # the polish also tries every per-direction mix (SearchSpace.listed_codecs).
        listed = (sp.listed_codecs or len(sp.codecs)) - 1
        self.draw_ups = self.ups[: 3 + w] + [min(up, listed) for up in self.ups[3 + w :]]
        self.seen: dict[Candidate, Evaluation] = {}  # every candidate this search scored
        self._estimates: dict[tuple[int, ...], list[int]] = {}

    def candidate(self, g: list[int]) -> Candidate:
        v = [lst[i] for lst, i in zip(self.lists, g, strict=True)]
        w = self.w
        return Candidate(
            pipelines=v[0],
            micro_batch_size=v[1],
            seq_len=v[2],
            delta_n=tuple(v[3 : 3 + w]),
            codecs=tuple(v[3 + w :]),
            schedule=self.ev.space.schedule,
        )

    def repair(self, g: list[int]) -> None:
        """Move the micro-batch (then the pipeline count) to the nearest dividing value."""
        sp = self.ev.space
        for _ in range(len(sp.pipelines)):
            d = sp.pipelines[g[0]]
            ok = [i for i, b in enumerate(sp.micro_batch_sizes) if sp.valid(d, b, self.gbs)]
            if ok:
                g[1] = min(ok, key=lambda i: (abs(i - g[1]), i))
                return
            g[0] = (g[0] + 1) % len(sp.pipelines)

    def score(self, g: list[int]) -> Evaluation:
        """Repair ``g`` in place and score it (the searches' pruning evaluation)."""
        self.repair(g)
        c = self.candidate(g)
        e = self.seen[c] = self.ev.evaluate(c, prune=True)
        return e

    def fitness(self, g: list[int]) -> tuple[float, float]:
        """The GA's fitness of ``g`` (time in tie-tolerance buckets, then memory)."""
        return _key(self.score(g))

    def exact(self, g: list[int]) -> tuple[float, float]:
        """The hill-climb's fitness: the time itself (rounded to float noise), then memory.
        Bucketed times would make it walk ΔN down one step per full neighbourhood scan;
        :func:`_lean` does that walk directly."""
        e = self.score(g)
        return (float(f"{e.fitness:.7g}"), e.activation_bytes)

    def estimate(self, g: list[int]) -> list[int]:
        """Indices of the ΔN :func:`delta_n_cover` gives ``g``'s structure (cached: it
        depends on pipelines, micro-batch, sequence length and codecs only)."""
        key = (*g[:3], *g[3 + self.w :])
        if key not in self._estimates:
            plan = self.ev.make_plan(self.candidate(list(g)))
            est = delta_n_cover(self.ev.costs(plan), plan.wan_boundaries) if plan else ()
            dns = self.ev.space.delta_ns
            self._estimates[key] = [_nearest(dns, x) for x in est] or g[3 : 3 + self.w]
        return list(self._estimates[key])

    def retune(self, g: list[int]) -> list[list[int]]:
        """``g`` with every ΔN one step lower and one higher, and with ΔN at the estimate
        and one step either side of it: after a structural move the best ΔN is usually
        next to the old one, or next to the new structure's estimate."""
        g = list(g)
        self.repair(g)
        out: list[list[int]] = []
        w = range(3, 3 + self.w)
        est = self.estimate(g)
        for start in (g[3 : 3 + self.w], est):
            for step in (-1, 1, 0):
                t = list(g)
                for i, x in zip(w, start, strict=True):
                    t[i] = min(max(x + step, 0), self.ups[i])
                out.append(t)
        return [t for k, t in enumerate(out) if t != g and t not in out[:k]]


def _nearest(values: tuple, x: int) -> int:
    return min(range(len(values)), key=lambda i: (abs(values[i] - x), i))


def genetic_search(
    ev: Evaluator,
    population: int | None = None,
    generations: int | None = None,
    seed: int | None = None,
    patience: int = 8,
) -> SearchResult:
    """Run the GA over ``ev.space``; reproducible for a given seed."""
    ga = ev.spec.plan.ga
    population = population or ga.population
    generations = generations or ga.generations
    seed = ga.seed if seed is None else seed
    genes = _Genes(ev)
    start_evals, t0 = ev.evaluations, time.perf_counter()
    saved = random.getstate()
    random.seed(seed)
    try:
        pop = _initial_population(genes, population)
        pop, best, gen = _evolve(genes, pop, population, generations, patience)
        best = _polish(genes, pop, best)
        _lean(genes, best)
    finally:
        random.setstate(saved)
    chosen = choose(genes.seen.values())
    assert chosen is not None
    result = ev.evaluate(chosen.candidate)
    return SearchResult(
        best=result,
        evaluations=ev.evaluations - start_evals,
        seconds=time.perf_counter() - t0,
        method="genetic",
        space_size=ev.space.size(genes.gbs),
        generations=gen,
    )


def _draw(i: int, up: int, w: int) -> int:
    """A random value of gene ``i`` (its largest index ``up``): uniform, except ΔN, drawn
    log-uniformly — useful ΔN are small next to the range (a few micro-batches on the
    shipped clusters, see :func:`delta_n_cover`) and a plan costs more to score the larger
    its ΔN (its warm-up is longer), so search effort goes where the optimum lies."""
    if 3 <= i < 3 + w:
        return min(up, int((up + 1) ** random.random()) - 1)
    return random.randint(0, up)


def _toolbox(ups: list[int], w: int) -> base.Toolbox:
    """Uniform crossover, per-gene mutation (random reset or a ±1 step), tournaments."""
    tb = base.Toolbox()

    def mutate(ind: list[int], indpb: float = 0.25) -> tuple[list[int]]:
        for i, up in enumerate(ups):
            if up and random.random() < indpb:
                if random.random() < 0.5:
                    ind[i] = _draw(i, up, w)
                else:
                    ind[i] = min(up, max(0, ind[i] + random.choice((-1, 1))))
        return (ind,)

    tb.register("mate", tools.cxUniform, indpb=0.5)
    tb.register("mutate", mutate)
    tb.register("select", tools.selTournament, tournsize=3)
    return tb


def _sweep(genes: _Genes) -> list[list[int]]:
    """Every valid pipeline count × micro-batch × sequence length, each codec on every WAN
    boundary, ΔN at the structure's :func:`delta_n_cover`."""
    sp, w = genes.ev.space, genes.w
    out = []
    for di, d in enumerate(sp.pipelines):
        for bi, b in enumerate(sp.micro_batch_sizes):
            if not sp.valid(d, b, genes.gbs):
                continue
            for si in range(len(sp.seq_lens)):
                for ci in range(sp.listed_codecs or len(sp.codecs)):
                    g = [di, bi, si] + [0] * w + [ci] * w
                    g[3 : 3 + w] = genes.estimate(g)
                    out.append(g)
    return out


def _initial_population(genes: _Genes, population: int) -> list:
    """The structural sweep (:func:`_sweep`; up to twice the population of it, spread
    evenly over its order when larger), all scored; its best half population and random
    genomes for the rest (scored too)."""
    sweep = _sweep(genes)
    if len(sweep) > 2 * population:
        stride = len(sweep) / (2 * population)
        sweep = [sweep[int(i * stride)] for i in range(2 * population)]
    pop = [creator.GeoPipeGenome(g) for g in sweep]
    for ind in pop:
        ind.fitness.values = genes.fitness(ind)
    pop = tools.selBest(pop, min(len(pop), population // 2))
    while len(pop) < population:
        ind = creator.GeoPipeGenome([_draw(i, up, genes.w) for i, up in enumerate(genes.draw_ups)])
        ind.fitness.values = genes.fitness(ind)
        pop.append(ind)
    return pop


def _evolve(
    genes: _Genes,
    pop: list,
    population: int,
    generations: int,
    patience: int,
    trace: list | None = None,
) -> tuple[list, list[int], int]:
    """(μ+λ) generations with elitism until ``patience`` of them bring no faster plan (a
    leaner one at the same speed is kept but does not count: :func:`_lean` and the final
    choice take care of memory); returns the last population, the best genome seen and the
    generations run. ``trace`` (tests) gets the best fitness of every generation."""
    ga = genes.ev.spec.plan.ga
    tb = _toolbox(genes.draw_ups, genes.w)
    best = tools.selBest(pop, 1)[0]
    best_key, stale, gen = best.fitness.values, 0, 0
    for gen in range(1, generations + 1):  # noqa: B007 - gen is reported
        offspring = algorithms.varOr(pop, tb, population, ga.crossover_prob, ga.mutation_prob)
        for ind in offspring:
            if not ind.fitness.valid:
                ind.fitness.values = genes.fitness(ind)
        pool = pop + offspring
        elite = tools.selBest(pool, max(2, population // 8))
        pop = elite + tb.select(pool, population - len(elite))
        top = tools.selBest(pop, 1)[0]
        if trace is not None:
            trace.append(top.fitness.values)
        faster = top.fitness.values[0] < best_key[0]
        if top.fitness.values < best_key:
            best, best_key = top, top.fitness.values
        stale = 0 if faster else stale + 1
        if stale >= patience:
            break
    return pop, best, gen


# Polish also starts from other bases whose plan is within this of the best one's time.
_POLISH_SPREAD = 0.02


def _polish(genes: _Genes, pop: list, best: list[int]) -> list[int]:
    """Hill-climb from the best genome, and from the best of up to two other bases
    (pipelines, micro-batch, seq len, codecs) whose plans are nearly as fast — genomes
    differing only in ΔN climb to the same optimum, and far slower bases rarely overtake;
    the best result."""
    w = genes.w
    first = genes.score(list(best)).fitness
    starts: dict[tuple[int, ...], list[int]] = {}
    for ind in tools.selBest([*pop, best], len(pop) + 1):
        base = (*ind[:3], *ind[3 + w :])
        if base in starts or genes.score(list(ind)).fitness > first * (1 + _POLISH_SPREAD):
            continue
        starts[base] = list(ind)
        if len(starts) == 3:
            break
    climbed = [_hill_climb(g, genes.ups, genes.exact, genes.retune) for g in starts.values()]
    return min(climbed or [list(best)], key=genes.exact)


def _lean(genes: _Genes, g: list[int]) -> None:
    """Lower each ΔN gene of ``g`` one step at a time while the plan stays feasible and
    within the tie tolerance of the fastest plan seen ([Note: lean ties]); the plans it
    scores join ``genes.seen`` for the final choice."""
    ok = [e.fitness for e in genes.seen.values() if e.feasible and not e.skipped_simulation]
    if not ok:
        return
    limit = tie_limit(min(ok))

    def accept(trial: list[int]) -> bool:
        e = genes.score(trial)
        return e.feasible and not e.skipped_simulation and e.fitness <= limit

    lean_descent(g, range(3, 3 + genes.w), lambda _, v: [v - 1] if v > 0 else [], accept)


def _hill_climb(g: list[int], ups: list[int], fitness, retune) -> list[int]:
    """First-improvement local search.

    Moves: ±1 on each gene and halving or doubling its index (the best ΔN is often far
    below the GA's, and ±1 steps would need dozens of full neighbourhood scans to get
    there; likewise the pipeline count), every codec (they have no order); a move of a
    structural gene (pipelines, micro-batch, seq len) is also tried with ΔN re-tuned to the
    analytic estimate and its neighbours — the best ΔN shifts when the micro-batch changes,
    so single-gene moves alone stall in such valleys.
    """
    n_dn = (len(ups) - 3) // 2
    cur = fitness(g)
    improved = True
    while improved:
        improved = False
        for i, up in enumerate(ups):
            steps = [g[i] - 1, g[i] + 1]
            if i < 3 + n_dn:  # structural genes and ΔN: also jump
                steps += [g[i] // 2, 2 * g[i] + 1]
            elif i >= 3 + n_dn:  # a codec: no order among them, try each
                steps += list(range(up + 1))
            for j in dict.fromkeys(steps):
                if not 0 <= j <= up or j == g[i]:
                    continue
                trial = list(g)
                trial[i] = j
                trials = [trial] + (retune(trial) if i < 3 else [])
                for t in trials:
                    f = fitness(t)
                    if f < cur:
                        g, cur, improved = t, f, True
                        break
                if improved:
                    break
    return g
