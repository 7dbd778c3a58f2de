"""The loss-penalty model (geopipe.optimizer.penalty): read from small tables written here,
never from the shipped table's numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from geopipe.optimizer.penalty import (
    ENV_VAR,
    PenaltyTableError,
    load_penalty,
    parse_table,
)

LOCAL = Path(__file__).resolve().parents[2] / "clusters" / "local-2dc.yaml"


def _row(m: int, h: int, gap: float, codec: str = "none", f: int = 1, **extra) -> dict:
    return {"replicas": m, "h": h, "fragments": f, "codec": codec, "rel_gap": gap, **extra}


def _table(rows: list[dict]) -> dict:
    return {
        "source": "test",
        "model": "toy",
        "steps": 100,
        "tokens_per_step": 64,
        "sync_noise": 0.001,
        "rows": rows,
    }


TABLE = _table(
    [
        _row(2, 1, 0.001),
        _row(2, 10, 0.004),
        _row(2, 100, 0.010),
        _row(4, 10, 0.008),
        _row(4, 50, 0.020),
        _row(2, 10, 0.006, "int8"),
        _row(2, 20, 0.005, f=4, overlap=2),
    ]
)


def test_a_measured_point_costs_its_gap_h1_included() -> None:
    t = parse_table(TABLE)
    assert t.predict(2, 1, 1, "none").value == pytest.approx(0.001)
    assert t.predict(2, 10, 1, "none").value == pytest.approx(0.004)
    assert "measured at H=10" in t.predict(2, 10, 1, "none").basis


def test_between_points_the_gap_is_linear_in_log_h() -> None:
    t = parse_table(TABLE)
    # H = 30 is 48 % of the way from 10 to 100 in log H (22 % in H).
    p = t.predict(2, 30, 1, "none")
    w = (math.log(30) - math.log(10)) / (math.log(100) - math.log(10))
    assert p.value == pytest.approx(0.004 + w * 0.006)
    assert 0.004 + 0.5 * 0.006 > p.value > 0.004 + 0.4 * 0.006  # linear in H: 0.0053
    assert "interpolated in log H between H=10" in p.basis


def test_never_extrapolated_beyond_the_measured_h() -> None:
    t = parse_table(TABLE)
    above = t.predict(2, 101, 1, "none")
    assert above.value is None and not above.priced
    assert "beyond the largest H measured (H=100" in above.basis
    below = t.predict(4, 5, 1, "none")  # M = 4 measured from H = 10 only
    assert below.value is None and "below the smallest" in below.basis


@pytest.mark.parametrize(
    ("m", "f", "codec", "why"),
    [
        (8, 1, "none", "M=8 not measured for codec none (measured: M=2, M=4)"),
        (2, 1, "int4h", "codec int4h not measured"),
        (2, 2, "none", "F=2 not measured for M=2, none (measured: F=1, F=4)"),
    ],
)
def test_unmeasured_m_f_or_codec_is_unpriced(m: int, f: int, codec: str, why: str) -> None:
    p = parse_table(TABLE).predict(m, 20, f, codec)
    assert p.value is None and why in p.basis


def test_overlap_beyond_the_measured_is_unpriced() -> None:
    t = parse_table(TABLE)
    assert t.predict(2, 20, 4, "none", overlap=2).value == pytest.approx(0.005)
    assert t.predict(2, 20, 4, "none", overlap=1).priced
    p = t.predict(2, 20, 4, "none", overlap=3)
    assert p.value is None and "overlap 3 is beyond the largest measured (2" in p.basis
    assert not t.predict(2, 10, 1, "none", overlap=1).priced  # rows without overlap: 0


def test_repeated_rows_average_and_negative_gaps_count_zero() -> None:
    t = parse_table(_table([_row(2, 10, 0.002), _row(2, 10, 0.006), _row(2, 50, -0.01)]))
    assert t.predict(2, 10, 1, "none").value == pytest.approx(0.004)
    assert t.predict(2, 50, 1, "none").value == 0.0


def test_seeds_of_one_h_average_before_interpolation_and_the_basis_counts_them() -> None:
    # Three seeds at H = 10 and at H = 100, one at H = 50 (another key's seeds stay apart);
    # the per-seed gaps straddle zero as the runs did (-0.31 %, +1.69 %, ...).
    o = {"codec": "int8", "outer_lr": 1.0, "outer_momentum": 0.0}
    rows = [
        _row(2, 10, -0.0031, seed=0, **o),
        _row(2, 10, 0.0169, seed=1, **o),
        _row(2, 10, 0.0180, seed=2, **o),
        _row(2, 50, 0.0300, seed=0, **o),
        _row(2, 100, 0.0100, seed=0, **o),
        _row(2, 100, 0.0400, seed=1, **o),
        _row(2, 100, 0.0250, seed=2, **o),
        _row(2, 10, 0.5, seed=0, codec="none"),
    ]
    t = parse_table(_table(rows))
    p = t.predict(2, 10, 1, "int8", outer=(1.0, 0.0))
    assert p.value == pytest.approx(0.0106)  # (-0.0031 + 0.0169 + 0.0180) / 3, by hand
    assert "measured at H=10 (3 seeds)" in p.basis
    one = t.predict(2, 50, 1, "int8", outer=(1.0, 0.0))
    assert one.value == pytest.approx(0.03) and "seeds" not in one.basis
    # H = 25 between the 3-seed mean at H = 10 (1.06 %) and the 1-seed H = 50 (3 %):
    # log(25/10) / log(50/10) = 0.5693 of the way.
    mid = t.predict(2, 25, 1, "int8", outer=(1.0, 0.0))
    assert mid.value == pytest.approx(0.0106 + 0.569323 * (0.03 - 0.0106), rel=1e-5)
    assert "H=10 (1.06% (3 seeds))" in mid.basis
    assert t.predict(2, 100, 1, "int8", outer=(1.0, 0.0)).value == pytest.approx(0.025)
    # a mean below zero is 0, whatever one seed said
    neg = parse_table(_table([_row(2, 5, g, seed=i) for i, g in enumerate((-0.02, 0.01, 0.0))]))
    assert neg.predict(2, 5, 1, "none").value == 0.0


def test_a_key_whose_rows_differ_in_overlap_is_one_curve_up_to_its_largest() -> None:
    # The bounded grid's streaming rows: F = 5 with overlap 1 at H = 10 (H / F = 2 allows no
    # more) and overlap 4 at H = 25 and 50, two seeds each.
    gaps = {10: (0.004, 0.008), 25: (0.010, 0.014), 50: (0.020, 0.030)}
    rows = [
        _row(2, h, g, "int8", f=5, overlap=1 if h == 10 else 4, seed=i)
        for h, pair in gaps.items()
        for i, g in enumerate(pair)
    ]
    t = parse_table(_table(rows))
    assert t.predict(2, 10, 5, "int8", overlap=1).value == pytest.approx(0.006)
    assert t.predict(2, 25, 5, "int8", overlap=4).value == pytest.approx(0.012)
    assert t.predict(2, 50, 5, "int8", overlap=2).value == pytest.approx(0.025)
    w = math.log(20 / 10) / math.log(25 / 10)  # H = 20 overlap 3: within the key's largest
    assert t.predict(2, 20, 5, "int8", overlap=3).value == pytest.approx(0.006 + w * 0.006)
    p = t.predict(2, 50, 5, "int8", overlap=5)
    assert p.value is None and "overlap 5 is beyond the largest measured (4" in p.basis


def test_rows_of_one_replica_are_skipped() -> None:
    t = parse_table(_table([_row(1, 10, 0.5), _row(2, 10, 0.01)]))
    assert not t.predict(1, 10, 1, "none").priced
    assert t.predict(2, 10, 1, "none").value == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ([], "expected a JSON object"),
        ({"rows": []}, "rows: expected a non-empty list"),
        (_table([{"replicas": 2, "h": 10, "fragments": 1, "codec": "none"}]), "rows[0].rel_gap"),
        (_table([_row(2, 10, float("nan"))]), "rows[0].rel_gap"),
        (_table([_row(2, 10, 0.1, "int9")]), "rows[0].codec"),
        (_table([_row(2, 10, 0.1, f=3)]), "h a multiple of fragments"),
        (_table([_row(2, "10", 0.1)]), "rows[0].h"),
        (_table([_row(2, 10, 0.1, seed=-1)]), "rows[0].seed"),
        (_table([_row(2, 10, 0.1, seed="1")]), "rows[0].seed"),
    ],
)
def test_a_malformed_table_names_the_row(doc: object, where: str) -> None:
    with pytest.raises(PenaltyTableError, match=r"loss-penalty table t\.json") as info:
        parse_table(doc, "t.json")
    assert where in str(info.value)


def test_no_table_file_means_every_outer_candidate_is_unpriced(tmp_path: Path) -> None:
    model = load_penalty(tmp_path / "absent.json")
    assert model.table is None
    p = model.predict(2, 10, 1, "none")
    assert p.value is None and "no measured loss-penalty table" in p.basis


def test_the_environment_names_another_table(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE))
    model = load_penalty(environ={ENV_VAR: str(path)})
    assert model.path == str(path) and model.predict(4, 50, 1, "none").value == 0.020
    # An explicit path wins over the environment.
    assert load_penalty(tmp_path / "x.json", environ={ENV_VAR: str(path)}).table is None


def test_a_table_that_is_not_json_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(PenaltyTableError, match="not JSON"):
        load_penalty(path)


def test_rows_price_only_candidates_of_their_own_outer_optimizer() -> None:
    """The gap depends on the outer lr and momentum as much as on H: a row counts only for
    the outer optimizer it ran (rows that do not say ran DiLoCo's 0.7 / 0.9)."""
    from geopipe.optimizer.penalty import PenaltyModel, parse_table

    rows = [
        {"replicas": 2, "h": 10, "fragments": 1, "codec": "none", "rel_gap": 0.14},
        {
            "replicas": 2,
            "h": 10,
            "fragments": 1,
            "codec": "none",
            "rel_gap": 0.04,
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
        },
    ]
    doc = {"source": "t", "model": "t", "steps": 1, "tokens_per_step": 1, "sync_noise": 0.0}
    model = PenaltyModel(parse_table({**doc, "rows": rows}), "t.json")
    assert model.predict(2, 10, 1, "none").value == 0.14
    assert model.predict(2, 10, 1, "none", outer=(0.7, 0.9)).value == 0.14
    assert model.predict(2, 10, 1, "none", outer=(1.0, 0.0)).value == 0.04
    miss = model.predict(2, 10, 1, "none", outer=(0.5, 0.5))
    assert not miss.priced and "outer lr/momentum 0.5/0.5 not measured" in miss.basis
    assert "0.7/0.9" in miss.basis and "1/0" in miss.basis


def test_outer_lr_and_momentum_lists_are_planner_knobs() -> None:
    from geopipe.config import outer_settings, parse_cluster

    doc = yaml.safe_load(LOCAL.read_text())
    doc["plan"].update(strategy="outer", outer={"h": 10, "lr": [0.7, 1.0], "momentum": [0.9, 0]})
    doc["training"]["checkpoint"] = {"every_steps": 10}
    got = {(s.lr, s.momentum) for s in outer_settings(parse_cluster(doc, "t"))}
    assert got == {(0.7, 0.9), (0.7, 0.0), (1.0, 0.9), (1.0, 0.0)}


def test_a_price_carries_its_standard_error_from_the_pooled_seed_spread() -> None:
    """[Note: a bound on a noisy measure]: one run's deviation is pooled over every setting
    measured at several seeds (each about its own mean); a price's spread is it over the
    square root of its seeds, an interpolated price takes its less measured end's, and a
    table without repeated settings falls back to its sync noise."""
    rows = [
        _row(2, 10, 0.00, seed=0),
        _row(2, 10, 0.02, seed=1),
        _row(2, 10, 0.04, seed=2),  # mean 0.02, squared deviations 4e-4 + 0 + 4e-4
        _row(2, 50, 0.05, seed=0),
        _row(2, 50, 0.07, seed=1),  # mean 0.06, squared deviations 1e-4 + 1e-4
        _row(2, 100, 0.09),  # one seed: no deviation of its own
    ]
    t = parse_table(_table(rows))
    sd = math.sqrt((8e-4 + 2e-4) / (2 + 1))  # pooled over 3 degrees of freedom
    assert t.run_sd == pytest.approx(sd)
    at10 = t.predict(2, 10, 1, "none")
    assert at10.value == pytest.approx(0.02) and at10.spread == pytest.approx(sd / math.sqrt(3))
    assert at10.upper == pytest.approx(0.02 + sd / math.sqrt(3))
    assert t.predict(2, 50, 1, "none").spread == pytest.approx(sd / math.sqrt(2))
    between = t.predict(2, 70, 1, "none")  # between H=50 (2 seeds) and H=100 (1 seed)
    assert between.spread == pytest.approx(sd)
    single = parse_table(_table([_row(2, 10, 0.004), _row(2, 20, 0.006)]))
    assert single.run_sd == pytest.approx(0.001)  # _table's sync_noise
    assert single.predict(2, 10, 1, "none").spread == pytest.approx(0.001)
