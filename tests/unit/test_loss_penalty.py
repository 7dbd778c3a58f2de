"""The loss-penalty model (geopipe.optimizer.penalty): read from small tables written here,
never from the shipped table's numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from geopipe.optimizer.penalty import (
    ENV_VAR,
    PenaltyTableError,
    load_penalty,
    parse_table,
)


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
