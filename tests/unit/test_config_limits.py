"""Every number finite and physical, cross-field limits, and hostile files: each is a
ConfigError naming the field (and the range), never a crash further down."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

import pytest
import yaml

from geopipe.config import ClusterSpec, ConfigError, load_cluster, parse_cluster
from geopipe.config.load import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "clusters" / "local-2dc.yaml"


def _doc() -> dict[str, Any]:
    return yaml.safe_load(LOCAL.read_text())


def _error(doc: Any, path: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_cluster(doc, "x.yaml")
    found = dict(info.value.problems)
    assert path in found, info.value.problems
    return found[path]


def _set(doc: dict, path: str, value: Any) -> dict:
    node: Any = doc
    *parents, last = path.replace("[", ".").replace("]", "").split(".")
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(last) if last.isdigit() else last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "span"),
    [
        ("sites[0].device_tflops", float("inf"), "(1e-06, 10000] TFLOP/s"),
        ("sites[0].device_tflops", float("nan"), "(1e-06, 10000] TFLOP/s"),
        ("sites[0].device_tflops", 1e300, "(1e-06, 10000] TFLOP/s"),
        ("sites[0].device_memory_gb", float("-inf"), "GiB"),
        ("sites[0].intra_latency_ms", float("inf"), "[0, 100000] ms"),
        ("sites[0].intra_bandwidth_gbps", 0.0, "[1e-06, 1e+06] Gbit/s"),
        ("sites[0].device_efficiency", 1.5, "(0, 1]"),
        ("links[0].latency_ms", float("nan"), "[0, 100000] ms"),
        ("links[0].loss", 0.9, "[0, 0.5]"),
        ("training.lr", float("inf"), "(0, 10]"),
        ("plan.topk_ratio", 0.0, "(0, 1]"),
        ("plan.ga.mutation_prob", float("nan"), "[0, 1]"),
    ],
)
def test_non_finite_and_unphysical_numbers_name_the_range(path: str, value: float, span: str):
    msg = _error(_set(_doc(), path, value), path)
    assert "finite number in" in msg and span in msg


@pytest.mark.parametrize(
    ("path", "value", "want"),
    [
        ("model.n_layer", 10**400, "must be an integer in [1, 10000] (got an integer of about"),
        ("model.n_embd", 10**30, "must be an integer in [8, 131072]"),
        ("sites[0].nodes", 10**30, "must be an integer in [1, 131072]"),
        ("training.seed", -1, "must be an integer in [0, 9223372036854775807]"),
        ("training.steps", 10**13, "must be an integer in [1, 1000000000000]"),
        ("plan.ga.generations", 10**9, "must be an integer in [1, 100000]"),
    ],
)
def test_huge_integers_are_refused_before_any_arithmetic(path: str, value: int, want: str):
    assert want in _error(_set(_doc(), path, value), path)


def test_huge_knob_values_name_the_item() -> None:
    doc = _set(_doc(), "plan.delta_n", [1, 10**40])
    with pytest.raises(ConfigError) as info:
        parse_cluster(doc, "x.yaml")
    paths = [p for p, _ in info.value.problems]
    assert any(p.startswith("plan.delta_n") for p in paths), info.value.problems
    assert "must be an integer in" in str(info.value)


def test_ga_probabilities_share_one_unit() -> None:
    # crossover 0.9 with the default mutation 0.3: valid alone, DEAP's varOr asserts.
    msg = _error(_set(_doc(), "plan.ga.crossover_prob", 0.9), "plan.ga")
    assert "crossover_prob (0.9) + mutation_prob (0.3) must be at most 1" in msg
    doc = _set(_doc(), "plan.ga", {"crossover_prob": 0.6, "mutation_prob": 0.4})
    assert isinstance(parse_cluster(doc), ClusterSpec)


@pytest.mark.parametrize("name", ["a b", "../up", "x/y", "-dash", "é", "a" * 200])
def test_names_must_work_as_actor_and_directory_names(name: str) -> None:
    assert "letters, digits" in _error(_set(_doc(), "name", name), "name")
    assert "letters, digits" in _error(_set(_doc(), "sites[0].name", name), "sites[0].name")


# --------------------------------------------------------------------------------------------
# Files


def _load_bytes(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "c.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value).startswith(f"{path}: ")
    return str(info.value)


def test_not_utf8_reports_the_byte_offset(tmp_path: Path) -> None:
    text = LOCAL.read_bytes()
    at = text.index(b"east")
    bad = text[:at] + b"\xe9" + text[at + 1 :]
    assert f"not UTF-8 text: byte 0xe9 at offset {at}" in _load_bytes(tmp_path, bad)


def test_utf8_with_bom_loads(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(codecs.BOM_UTF8 + LOCAL.read_bytes())
    assert load_cluster(path).name == "local-2dc"


def test_alias_bomb_is_refused(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    msg = _load_bytes(tmp_path, "\n".join(lines).encode())
    assert f"more than {MAX_NODES} values once aliases are expanded" in msg


def test_deep_nesting_is_refused(tmp_path: Path) -> None:
    assert f"nested more than {MAX_DEPTH} levels" in _load_bytes(tmp_path, b"[" * 20000)
    assert f"nested more than {MAX_DEPTH} levels" in _load_bytes(tmp_path, b"[" * 50 + b"]" * 50)


def test_oversized_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    assert "larger than" in _load_bytes(tmp_path, b"#" * (MAX_FILE_BYTES + 1))


def test_integer_literal_too_long_to_print(tmp_path: Path) -> None:
    msg = _load_bytes(tmp_path, b"name: x\nseed: " + b"9" * 5000 + b"\n")
    assert "not a usable YAML value" in msg


def test_control_characters_are_a_yaml_error(tmp_path: Path) -> None:
    assert "not valid YAML at character" in _load_bytes(tmp_path, b"name: a\x00b\n")


def test_aliases_within_the_caps_still_work(tmp_path: Path) -> None:
    # Anchors for repeated site settings are a legitimate use.
    doc = LOCAL.read_text().replace("  - name: east\n", "  - &east\n    name: east\n", 1)
    path = tmp_path / "anchors.yaml"
    path.write_text(doc)
    assert load_cluster(path).sites[0].name == "east"
