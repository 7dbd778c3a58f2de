"""Planning cost independent of m: the steady-state prediction, GPipe's closed form and the
1F1B family's generation-order replay, each against the simulator's full replay (1e-9)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from geopipe.optimizer import onefoneb, steady
from geopipe.optimizer.onefoneb import fast_replay
from geopipe.optimizer.simulator import (
    PipelineCosts,
    in_flight_bound,
    lower_bound,
    replay,
    simulate,
)
from geopipe.optimizer.steady import (
    gpipe_time,
    peak_in_flight,
    peak_in_flight_batch,
    predict,
    schedule_for,
)
from geopipe.pipeline import schedule
from geopipe.pipeline.schedule import make_schedule, parse_schedule, warmup_counts

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
REL = 1e-9


def _costs(rng: random.Random, p: int, zeros: bool = True) -> PipelineCosts:
    """Random costs; some entries zero (free links, no step) when ``zeros``."""

    def draw(lo: float, hi: float, n: int) -> tuple[float, ...]:
        return tuple(0.0 if zeros and rng.random() < 0.2 else rng.uniform(lo, hi) for _ in range(n))

    nb = p - 1
    return PipelineCosts(
        draw(0.01, 2, p),
        draw(0.01, 4, p),
        draw(0, 1, p),
        draw(0, 3, nb),
        draw(0, 10, nb),
        draw(0, 3, nb),
        draw(0, 10, nb),
    )


def _assert_same(got, want) -> None:
    assert got.iteration_time_s == pytest.approx(want.iteration_time_s, rel=REL, abs=1e-12)
    assert got.pipeline_time_s == pytest.approx(want.pipeline_time_s, rel=REL, abs=1e-12)
    assert got.bubble_ratio == pytest.approx(want.bubble_ratio, abs=1e-9)
    assert got.busy_s == pytest.approx(want.busy_s, rel=REL, abs=1e-12)
    assert got.link_busy_s == pytest.approx(want.link_busy_s, rel=REL, abs=1e-12)


@pytest.fixture
def extrapolations(monkeypatch) -> Counter:
    """Counts the periods (in rounds) of the steady states that predictions extrapolated."""
    seen: Counter = Counter()
    real = steady._extrapolate

    def spy(*args, **kwargs):
        seen[args[-2]] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(steady, "_extrapolate", spy)
    return seen


def test_matches_full_replay_on_random_cases(extrapolations: Counter) -> None:
    rng = random.Random(2024)
    for _ in range(250):
        p = rng.randint(1, 7)
        costs = _costs(rng, p)
        dn = tuple(rng.choice([0, 0, 1, 2, 3, 5, 8]) for _ in range(p - 1))
        for name in ("gpipe", "1f1b", "lookahead"):
            d = dn if name == "lookahead" else (0,) * (p - 1)
            for m in (rng.randint(1, 40), rng.randint(40, 300)):
                want = simulate(make_schedule(name, p, m, d), costs)
                _assert_same(predict(name, p, m, d, costs), want)
    # The shortcut was taken, including steady states that repeat every few rounds.
    assert sum(extrapolations.values()) > 300
    assert any(c > 1 for c in extrapolations), extrapolations


def _is_family_default(path: Path) -> bool:
    """Whether a golden schedule is what its shape (name, p, m, ΔN) alone generates. Not,
    e.g., lookahead-zb with memory caps: the planner replays such plans' own lists in full,
    not through predict()."""
    g = parse_schedule(path.read_text())
    dn = g.delta_n or (0,) * (g.num_stages - 1)
    return g.programs == make_schedule(g.name, g.num_stages, g.num_microbatches, dn).programs


DEFAULT_GOLDENS = [p for p in sorted(GOLDEN.glob("*.txt")) if _is_family_default(p)]


def test_only_capped_goldens_are_left_to_full_replay() -> None:
    others = {p.stem for p in GOLDEN.glob("*.txt")} - {p.stem for p in DEFAULT_GOLDENS}
    assert len(DEFAULT_GOLDENS) >= 5 and others and all("_caps" in n for n in others), others


@pytest.mark.parametrize("path", DEFAULT_GOLDENS, ids=lambda p: p.stem)
def test_matches_full_replay_on_golden_shapes(path: Path, extrapolations: Counter) -> None:
    golden = parse_schedule(path.read_text())
    p, name = golden.num_stages, golden.name
    dn = golden.delta_n or (0,) * (p - 1)
    rng = random.Random(path.stem)
    for _ in range(20):
        costs = _costs(rng, p, zeros=False)
        m0 = golden.num_microbatches
        assert predict(name, p, m0, dn, costs).iteration_time_s == pytest.approx(
            simulate(golden, costs).iteration_time_s, rel=REL
        )
        for m in (m0 + 1, 3 * m0, 64, 257, 1000):
            want = simulate(make_schedule(name, p, m, dn), costs)
            _assert_same(predict(name, p, m, dn, costs), want)
    if name != "gpipe":
        assert sum(extrapolations.values()) > 0


def test_long_runs_cost_a_short_replay(monkeypatch) -> None:
    # Planning cost independent of m: however many micro-batches, no replay is longer than
    # a few times the pipeline's warm-up (or the run itself when that is shorter).
    lengths: list[int] = []
    real = onefoneb.fast_replay

    def spy(name, p, m, dn, costs):
        lengths.append(m)
        return real(name, p, m, dn, costs)

    monkeypatch.setattr(steady, "fast_replay", spy)
    costs = PipelineCosts(
        (1.0, 1.2, 0.9), (2.0, 2.1, 1.9), (0.5,) * 3, (0.1, 0.3), (4.0, 0.1), (0.1, 0.3), (4.0, 0.1)
    )
    dn = (2, 0)
    for m in (10**3, 10**4, 10**5):
        t = predict("lookahead", 3, m, dn, costs).iteration_time_s
        assert max(lengths) <= 8 * (sum(warmup_counts(3, 10**3, dn)) + 12)
        lengths.clear()
        assert t > 0
    # and the prediction is the replay's where a full replay is still affordable
    want = simulate(make_schedule("lookahead", 3, 5000, dn), costs)
    _assert_same(predict("lookahead", 3, 5000, dn, costs), want)


def test_gpipe_closed_form_matches_replay() -> None:
    rng = random.Random(5)
    for _ in range(300):
        p, m = rng.randint(1, 8), rng.randint(1, 50)
        costs = _costs(rng, p)
        _assert_same(gpipe_time(costs, m), simulate(make_schedule("gpipe", p, m), costs))


def test_generation_order_replay_is_the_simulators() -> None:
    # Not approximately: the same arithmetic in the same order, every event time equal.
    rng = random.Random(7)
    for _ in range(300):
        p, m = rng.randint(1, 7), rng.randint(1, 30)
        costs = _costs(rng, p)
        dn = tuple(rng.choice([0, 1, 2, 5]) for _ in range(p - 1))
        for name in ("1f1b", "lookahead"):
            d = dn if name == "lookahead" else (0,) * (p - 1)
            a, b = replay(make_schedule(name, p, m, d), costs), fast_replay(name, p, m, d, costs)
            assert (a.ends, a.arr_f, a.arr_b) == (b.ends, b.arr_f, b.arr_b)
            assert a.result.iteration_time_s == b.result.iteration_time_s
    with pytest.raises(ValueError, match="no fast replay"):
        fast_replay("gpipe", 2, 4, (0,), _costs(rng, 2))


def test_generic_path_matches_for_an_unknown_family(monkeypatch) -> None:
    # Families without a closed form (e.g. future ones) go through the structure found on
    # their own programs: register look-ahead's generator as such a family (one registry
    # entry, as adding a schedule takes) and check the same numbers.
    rng = random.Random(11)
    cases = []
    for _ in range(40):
        p = rng.randint(2, 5)
        cases.append((p, _costs(rng, p), tuple(rng.choice([0, 1, 3]) for _ in range(p - 1))))
    new = schedule.Family(
        "lookahead-replayed",
        lambda p, m, dn, caps: schedule.lookahead(p, m, dn),
        "replayed",
        True,
        False,
        False,
    )
    monkeypatch.setitem(schedule.FAMILIES, new.name, new)
    steady._structure.cache_clear()
    steady._window.cache_clear()
    try:
        for p, costs, dn in cases:
            for m in (7, 90, 400):
                want = simulate(make_schedule("lookahead", p, m, dn), costs)
                _assert_same(predict(new.name, p, m, dn, costs), want)
                assert (
                    peak_in_flight(new.name, p, m, dn)
                    == make_schedule("lookahead", p, m, dn).max_in_flight
                )
    finally:
        steady._structure.cache_clear()
        steady._window.cache_clear()


def test_closed_form_structure_is_the_found_one() -> None:
    for p in range(1, 6):
        for dn in itertools.product(range(4), repeat=p - 1):
            closed = steady._one_f_one_b_structure(p, dn)
            found = steady._found_structure("lookahead", p, dn)
            assert found is not None
            assert closed.windows == found.windows and closed.peak == found.peak
            for k in range(p):
                a, b = closed.bodies[k], found.bodies[k]
                assert (a.start, a.period) == (b.start, b.period)
                assert closed.rounds(k, 60) == found.rounds(k, 60)
            for m in (1, 5, 13):
                w = warmup_counts(p, m, dn)
                progs = schedule_for("lookahead", p, m, dn).fused
                assert [steady._one_f_one_b_ops(k, p, m, w[k]) for k in range(p)] == progs


def test_in_flight_peaks_match_the_schedules() -> None:
    for name in ("gpipe", "1f1b", "lookahead"):
        for p, m in itertools.product(range(1, 5), range(1, 12)):
            rows = (
                list(itertools.product(range(4), repeat=p - 1))
                if name == "lookahead"
                else [(0,) * (p - 1)]
            )
            batch = peak_in_flight_batch(name, p, m, np.array(rows).reshape(len(rows), p - 1))
            for dn, got in zip(rows, batch, strict=True):
                want = make_schedule(name, p, m, dn).max_in_flight
                assert tuple(got) == want == peak_in_flight(name, p, m, dn)


def test_in_flight_bound_never_above_simulation() -> None:
    rng = random.Random(99)
    better = 0
    for _ in range(600):
        p, m = rng.randint(1, 6), rng.randint(1, 30)
        costs = _costs(rng, p)
        dn = [rng.choice([0, 1, 3, 8]) for _ in range(p - 1)]
        for sched in (make_schedule(n, p, m, dn) for n in ("gpipe", "1f1b", "lookahead")):
            t = simulate(sched, costs).iteration_time_s
            bound = in_flight_bound(costs, m, np.array([sched.max_in_flight]))[0]
            assert bound <= t * (1 + 1e-12), (sched.name, p, m, costs)
            better += bound > lower_bound(costs, m) * (1 + 1e-9)
    assert better > 100  # it sees what the ΔN-blind bound cannot
