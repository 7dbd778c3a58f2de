"""Cluster YAML validation: shipped configs load; every class of mistake names its field path.

Each error test asserts the three things a user needs: the file (``str(err)`` starts with it),
the field path (``problems[i][0]``) and what is wrong (``problems[i][1]``). A hypothesis test
mutates the shipped documents and checks that nothing but :class:`ConfigError` ever escapes.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geopipe.config import ClusterSpec, ConfigError, load_cluster, parse_cluster

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = sorted((ROOT / "clusters").glob("*.yaml"))
LOCAL = ROOT / "clusters" / "local-2dc.yaml"
THREE = ROOT / "clusters" / "three-dc-wan.yaml"
SOURCE = "my-cluster.yaml"


def _doc(path: Path = LOCAL) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _problems(doc: Any, source: str = SOURCE) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_cluster(doc, source)
    err = info.value
    assert str(err).startswith(source)
    assert err.source == source
    assert err.problems, "a ConfigError must list at least one problem"
    for path, msg in err.problems:
        assert isinstance(path, str)
        assert isinstance(msg, str) and msg
    return err


def _find(err: ConfigError, path: str) -> str:
    """The message reported for ``path`` (fails listing all problems if there is none)."""
    for p, msg in err.problems:
        if p == path:
            return msg
    raise AssertionError(f"no problem at {path!r}; got {err.problems}")


# --------------------------------------------------------------------------------------------
# Shipped configs


def test_clusters_dir_is_not_empty() -> None:
    assert len(CLUSTERS) >= 3


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_shipped_cluster_loads(path: Path) -> None:
    spec = load_cluster(path)
    assert isinstance(spec, ClusterSpec)
    assert spec.name == path.stem
    # loading from the parsed dict gives the same validated spec
    assert parse_cluster(_doc(path), str(path)) == spec
    assert len(spec.digest) == 16


def test_digest_changes_with_content() -> None:
    a = parse_cluster(_doc())
    doc = _doc()
    doc["training"]["lr"] = 0.001
    b = parse_cluster(doc)
    assert a.digest == parse_cluster(_doc()).digest
    assert a.digest != b.digest


# --------------------------------------------------------------------------------------------
# One test per class of mistake


def test_missing_field_names_path_and_required() -> None:
    doc = _doc()
    del doc["model"]["n_layer"]
    err = _problems(doc)
    assert "required" in _find(err, "model.n_layer")
    assert f"{SOURCE}: model.n_layer: " in str(err)


def test_missing_section_is_required() -> None:
    doc = _doc()
    del doc["training"]
    err = _problems(doc)
    assert "required" in _find(err, "training")


def test_wrong_type_names_path_and_value() -> None:
    doc = _doc()
    doc["sites"][0]["nodes"] = "two"
    err = _problems(doc)
    msg = _find(err, "sites[0].nodes")
    assert "integer" in msg
    assert "'two'" in msg


def test_negative_bandwidth() -> None:
    doc = _doc()
    doc["links"][0]["bandwidth_gbps"] = -1
    err = _problems(doc)
    msg = _find(err, "links[0].bandwidth_gbps")
    assert "finite number in [1e-06, 1e+06] Gbit/s" in msg
    assert "-1" in msg


def test_unknown_site_in_link_suggests_closest() -> None:
    doc = _doc()
    doc["links"][0]["to"] = "wset"
    err = _problems(doc)
    msg = _find(err, "links[0].to")
    assert "unknown site 'wset'" in msg
    assert "did you mean 'west'" in msg


def test_unknown_site_without_close_match_lists_sites() -> None:
    doc = _doc()
    doc["links"][0]["from"] = "zzzzzz"
    msg = _find(_problems(doc), "links[0].from")
    assert "east" in msg and "west" in msg


def test_unknown_key_suggests_closest() -> None:
    doc = _doc()
    doc["sites"][0]["devics_per_node"] = doc["sites"][0].pop("devices_per_node")
    err = _problems(doc)
    msg = _find(err, "sites[0].devics_per_node")
    assert "unknown key" in msg
    assert "did you mean 'devices_per_node'" in msg


def test_unknown_key_without_close_match_lists_allowed() -> None:
    doc = _doc()
    doc["model"]["qqqqqqq"] = 1
    msg = _find(_problems(doc), "model.qqqqqqq")
    assert "unknown key" in msg
    assert "n_layer" in msg and "n_embd" in msg


def test_unknown_top_level_key() -> None:
    doc = _doc()
    doc["trainig"] = doc["training"]
    msg = _find(_problems(doc), "trainig")
    assert "did you mean 'training'" in msg


def test_link_alias_keys_suggested() -> None:
    doc = _doc()
    doc["links"][0]["form"] = doc["links"][0].pop("from")
    err = _problems(doc)
    assert "did you mean 'from'" in _find(err, "links[0].form")


def test_model_that_cannot_fit() -> None:
    doc = _doc()
    doc["model"]["n_embd"] = 65536
    doc["model"]["n_head"] = 4
    msg = _find(_problems(doc), "model")
    assert "GiB" in msg
    assert "need" in msg


def test_one_layer_larger_than_any_device() -> None:
    # Enough devices in total, but one transformer block alone exceeds a device.
    doc = _doc()
    doc["sites"][0]["nodes"] = 1000
    doc["model"]["n_embd"] = 8192
    doc["model"]["n_head"] = 8
    msg = _find(_problems(doc), "model")
    assert "one layer" in msg


def test_global_batch_not_divisible() -> None:
    doc = _doc()
    doc["training"]["global_batch_size"] = 33
    msg = _find(_problems(doc), "training.global_batch_size")
    assert "33" in msg and "divisible" in msg


def test_global_batch_not_divisible_by_any_micro_batch() -> None:
    doc = _doc()
    del doc["plan"]["pipelines"]
    doc["plan"]["micro_batch_size"] = [2, 4]
    doc["training"]["global_batch_size"] = 7
    msg = _find(_problems(doc), "training.global_batch_size")
    assert "7" in msg and "[2, 4]" in msg


def test_duplicate_site() -> None:
    doc = _doc()
    doc["sites"].append(copy.deepcopy(doc["sites"][0]))
    msg = _find(_problems(doc), "sites[2].name")
    assert "duplicate" in msg and "'east'" in msg


def test_links_not_connecting_sites() -> None:
    doc = _doc(THREE)
    # keep only us-east <-> us-west: eu-west is unreachable
    doc["links"] = [doc["links"][0]]
    msg = _find(_problems(doc), "links")
    assert "connect" in msg


def test_no_links_between_two_sites() -> None:
    doc = _doc()
    doc["links"] = []
    assert "connect" in _find(_problems(doc), "links")


def test_link_to_itself() -> None:
    doc = _doc()
    doc["links"][0]["to"] = "east"
    assert "two different sites" in _find(_problems(doc), "links[0]")


def test_link_given_twice() -> None:
    doc = _doc()
    doc["links"].append(dict(doc["links"][0]))
    assert "twice" in _find(_problems(doc), "links[1]")


def test_unknown_codec() -> None:
    doc = _doc()
    doc["links"][0]["codec"] = "zstd"
    assert "unknown codec 'zstd'" in _find(_problems(doc), "links[0].codec")
    doc = _doc()
    doc["plan"]["codecs"] = ["none", "int3"]
    assert "unknown codec 'int3'" in _find(_problems(doc), "plan.codecs[1]")
    doc = _doc()
    doc["links"][0]["codec"] = {"forward": "int4h", "backward": "int3"}
    assert "unknown codec 'int4h/int3'" in _find(_problems(doc), "links[0].codec")
    doc = _doc()
    doc["links"][0]["codec"] = {"forward": "int4h"}
    assert "{forward: <codec>, backward: <codec>}" in _find(_problems(doc), "links[0].codec")
    doc = _doc()
    doc["sites"][1]["codec_gb_per_s"] = {"int8": 2.0, "zstd": 1.0}
    assert "unknown codec 'zstd'" in _find(_problems(doc), "sites[1].codec_gb_per_s.zstd")


def test_a_codec_per_direction() -> None:
    doc = _doc()
    doc["links"][0]["codec"] = {"forward": "int4h", "backward": "int8"}
    doc["plan"]["codecs"] = ["none", {"forward": "int8", "backward": "int8"}, "int4h/none"]
    spec = parse_cluster(doc, SOURCE)
    assert spec.links[0].codec == "int4h/int8"
    assert spec.plan.codecs == ["none", "int8", "int4h/none"]


def test_heads_must_divide_embedding() -> None:
    doc = _doc()
    doc["model"]["n_head"] = 3
    assert "divisible by n_head" in _find(_problems(doc), "model")


def test_range_min_above_max() -> None:
    doc = _doc()
    doc["plan"]["delta_n"] = {"min": 5, "max": 2}
    err = _problems(doc)
    assert any(p.startswith("plan.delta_n") and "larger than max" in m for p, m in err.problems)


def test_bad_choice_reports_one_line_per_field() -> None:
    doc = _doc()
    doc["plan"]["micro_batch_size"] = "lots"
    err = _problems(doc)
    paths = [p for p, _ in err.problems]
    assert paths.count("plan.micro_batch_size") == 1
    assert "an int, a list of ints or {min, max}" in _find(err, "plan.micro_batch_size")


def test_seq_len_above_model_max() -> None:
    doc = _doc()
    doc["plan"]["seq_len"] = 4096
    assert "max_seq_len" in _find(_problems(doc), "plan.seq_len")


def test_every_problem_reported_at_once() -> None:
    doc = _doc()
    doc["sites"][0]["nodes"] = "two"
    doc["links"][0]["bandwidth_gbps"] = -1
    del doc["model"]["n_layer"]
    err = _problems(doc)
    paths = {p for p, _ in err.problems}
    assert {"sites[0].nodes", "links[0].bandwidth_gbps", "model.n_layer"} <= paths
    assert len(str(err).splitlines()) == len(err.problems)
    assert all(line.startswith(f"{SOURCE}: ") for line in str(err).splitlines())


def test_empty_delta_n_list_is_rejected() -> None:
    # `delta_n: []` leaves the planner nothing to choose: the GA then fails with an IndexError
    # and exhaustive search with "the search space is empty". The loader should say so.
    doc = _doc()
    doc["plan"]["delta_n"] = []
    _problems(doc)


@pytest.mark.parametrize("field", ["micro_batch_size", "seq_len", "pipelines"])
def test_empty_candidate_lists_are_rejected(field: str) -> None:
    doc = _doc()
    doc["plan"][field] = []
    err = _problems(doc)
    assert any(p in (f"plan.{field}", "training.global_batch_size") for p, _ in err.problems)


_PARSE_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from geopipe.config import ConfigError, parse_cluster
try:
    parse_cluster(json.loads(sys.stdin.read()), "big.yaml")
    print("SPEC")
except ConfigError as err:
    print("CONFIGERROR", err.problems)
except BaseException as err:
    print("CRASH", type(err).__name__)
"""


def _parse_bounded(doc: dict[str, Any]) -> str:
    """parse_cluster in a child process with 2 GiB of address space and a 30 s limit."""
    out = subprocess.run(
        [sys.executable, "-c", _PARSE_CHILD],
        input=json.dumps(doc),
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    return out.stdout.strip() or out.stderr.strip()


def test_absurd_layer_count_is_a_config_error() -> None:
    # A typo like `n_layer: 10000000000` must be reported with the supported range, not
    # allocate a Python list with one entry per layer and die with MemoryError.
    doc = _doc()
    doc["model"]["n_layer"] = 10**10
    out = _parse_bounded(doc)
    assert out.startswith("CONFIGERROR"), out
    assert "('model.n_layer', 'must be an integer in [1, 10000]" in out


def test_huge_pipelines_range_does_not_exhaust_memory() -> None:
    # The divisibility check should not materialise a billion candidate pipeline counts.
    doc = _doc()
    doc["plan"]["pipelines"] = {"min": 1, "max": 10**9}
    out = _parse_bounded(doc)
    assert out.startswith(("SPEC", "CONFIGERROR")), out


@pytest.mark.parametrize("doc", [None, [], "name: x", 3])
def test_document_must_be_a_mapping(doc: Any) -> None:
    err = _problems(doc)
    assert err.problems[0][0] == ""
    assert "mapping" in err.problems[0][1]
    assert "mapping" in str(err)


def test_bad_yaml_syntax_reports_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: broken\nsites:\n  - {name: a, nodes: 1\nlinks: []\n")
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    err = info.value
    assert str(err).startswith(str(path))
    assert len(err.problems) == 1
    msg = err.problems[0][1]
    assert "not valid YAML" in msg
    assert "line 4" in msg


def test_bad_indentation_reports_line(tmp_path: Path) -> None:
    path = tmp_path / "indent.yaml"
    text = LOCAL.read_text().replace("  n_embd: 128", "    n_embd: 128")
    assert text != LOCAL.read_text()
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    line = 1 + text.splitlines().index("    n_embd: 128")
    assert f"line {line}" in info.value.problems[0][1]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value).startswith(str(path))
    assert info.value.problems == [("", "file not found")]


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_cluster(tmp_path)
    assert str(info.value).startswith(str(tmp_path))
    assert "cannot read" in info.value.problems[0][1]


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    doc = _doc()
    doc["links"][0]["bandwidth_gbps"] = -1
    path = tmp_path / "neg.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value).startswith(f"{path}: links[0].bandwidth_gbps: ")


# --------------------------------------------------------------------------------------------
# Property: mutated documents give a spec or a ConfigError, never anything else

BASES = {"local-2dc": _doc(LOCAL), "three-dc-wan": _doc(THREE)}

Path_ = tuple[Any, ...]


def _paths(node: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every path to a value inside ``node`` (dict keys and list indices), root excluded."""
    out: list[Path_] = []
    if isinstance(node, dict):
        items: list[tuple[Any, Any]] = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return out
    for key, child in items:
        out.append((*prefix, key))
        out += _paths(child, (*prefix, key))
    return out


def _containers(node: Any, prefix: Path_ = ()) -> list[Path_]:
    """Paths to every dict (where a key can be inserted or renamed), root included."""
    if isinstance(node, dict):
        out, children = [prefix], list(node.items())
    elif isinstance(node, list):
        out, children = [], list(enumerate(node))
    else:
        return []
    for key, child in children:
        out += _containers(child, (*prefix, key))
    return out


def _at(doc: Any, path: Path_) -> Any:
    for key in path:
        doc = doc[key]
    return doc


KEYS = st.one_of(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=16),
    st.sampled_from(
        ["name", "nodes", "devics_per_node", "from", "to", "min", "max", "n_layer", "codec"]
    ),
    st.integers(-3, 3),
)
VALUES = st.one_of(
    st.text(max_size=12),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.booleans(),
    st.integers(-1000, -1),
    st.floats(max_value=-1e-9, allow_nan=False),
    st.lists(st.one_of(st.integers(-5, 300), st.text(max_size=4)), max_size=4),
    st.dictionaries(st.text(max_size=6), st.integers(-5, 300), max_size=3),
    st.fixed_dictionaries({"min": st.integers(-5, 100), "max": st.integers(-5, 100)}),
)


def _delete(doc: Any, data: st.DataObject) -> None:
    paths = _paths(doc)
    path = data.draw(st.sampled_from(paths), label="delete")
    parent = _at(doc, path[:-1])
    del parent[path[-1]]


def _set(doc: Any, data: st.DataObject) -> None:
    paths = _paths(doc)
    path = data.draw(st.sampled_from(paths), label="set")
    _at(doc, path[:-1])[path[-1]] = data.draw(VALUES, label="value")


def _insert(doc: Any, data: st.DataObject) -> None:
    where = data.draw(st.sampled_from(_containers(doc)), label="insert into")
    _at(doc, where)[data.draw(KEYS, label="key")] = data.draw(VALUES, label="value")


def _rename(doc: Any, data: st.DataObject) -> None:
    where = [c for c in _containers(doc) if _at(doc, c)]
    parent = _at(doc, data.draw(st.sampled_from(where), label="rename in"))
    old = data.draw(st.sampled_from(sorted(parent, key=repr)), label="old key")
    new = data.draw(KEYS, label="new key")
    parent[new] = parent.pop(old)


MUTATIONS: list[Callable[[Any, st.DataObject], None]] = [_delete, _set, _insert, _rename]


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(base=st.sampled_from(sorted(BASES)), data=st.data())
def test_mutated_documents_never_crash(base: str, data: st.DataObject) -> None:
    doc = copy.deepcopy(BASES[base])
    steps = data.draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3), label="ops")
    for op in steps:
        if not isinstance(doc, dict) or not doc:
            break
        op(doc, data)
    try:
        spec = parse_cluster(doc, "fuzz.yaml")
    except ConfigError as err:
        assert err.problems
        for path, msg in err.problems:
            assert isinstance(path, str)
            assert isinstance(msg, str) and msg.strip()
        assert str(err).startswith("fuzz.yaml: ")
    else:
        assert isinstance(spec, ClusterSpec)
