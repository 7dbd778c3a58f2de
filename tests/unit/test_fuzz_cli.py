"""Fuzzing every command that reads a cluster file: no input ever ends in a traceback.

Three generators, over 500 configs per run: clusters built from the whole schema (every
section, each field sometimes replaced by a hostile value: huge or non-finite numbers, wrong
types, cross-field clashes), mutations of the shipped clusters, and byte-level damage to a
cluster file (invalid UTF-8, broken YAML). Each runs one command in-process — ``plan``
(text, ``--json``, ``--exhaustive``, ``--templates``), ``simulate`` with drawn arguments,
``launch --dry-run`` — and must exit 0, or 2 with a message; stdout of ``--json`` must be
strict JSON (no NaN/Infinity). Planning settings stay tiny so each example is fast;
``derandomize`` keeps runs reproducible.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geopipe.cli import main
from geopipe.transport.wire import CODECS

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    n: yaml.safe_load((ROOT / "clusters" / f"{n}.yaml").read_text())
    for n in ("local-2dc", "three-dc-wan")
}
TINY_GA = {"population": 4, "generations": 1}


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# Values that must never get past validation silently: non-finite and absurd numbers, integers
# too large for any arithmetic (and too long to print), wrong types.
HOSTILE = st.sampled_from(
    [
        math.inf,
        -math.inf,
        math.nan,
        1e300,
        -1e300,
        1e-300,
        0,
        -1,
        0.5,
        2**63,
        10**30,
        10**400,
        -(10**400),
        True,
        "x",
        "",
        None,
        [],
        {},
        [1, "a"],
        {"min": 5, "max": 2},
    ]
)


def strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def check(argv: list[str]) -> None:
    code, out, err = run_cli(argv)
    assert "Traceback" not in out + err, (argv, err)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        assert err.strip(), argv
    elif "--json" in argv:
        strict_json(out)


def _file(data: bytes | Any) -> str:
    path = Path(tempfile.mkdtemp(prefix="geopipe-fuzz-")) / "cluster.yaml"
    path.write_bytes(data if isinstance(data, bytes) else yaml.safe_dump(data).encode())
    return str(path)


# --------------------------------------------------------------------------------------------
# Clusters from the schema


@st.composite
def clusters(draw: st.DrawFn) -> dict:
    """A small cluster touching every section; a few fields then get hostile values."""
    n_sites = draw(st.integers(1, 3))
    names = [f"s{i}" for i in range(n_sites)]
    sites = []
    for name in names:
        site = {
            "name": name,
            "nodes": draw(st.integers(1, 2)),
            "devices_per_node": draw(st.integers(1, 2)),
            "device_memory_gb": draw(st.sampled_from([0.001, 0.02, 2, 80, 1e5])),
            "device_tflops": draw(st.sampled_from([1e-3, 0.05, 312, 1e4])),
            "device_efficiency": draw(st.sampled_from([0.01, 0.4, 1.0])),
            "backward_forward_ratio": draw(st.sampled_from([0.5, 2.0, 3.0])),
            "device_mem_bw_gb_per_s": draw(st.sampled_from([1.0, 1000.0])),
            "intra_bandwidth_gbps": draw(st.sampled_from([1e-6, 0.1, 400])),
            "intra_latency_ms": draw(st.sampled_from([0.0, 0.05, 1e5])),
        }
        if draw(st.booleans()):
            site["host_memory_gb"] = draw(st.sampled_from([1e-6, 16, 1e4]))
        sites.append(site)
    links = []
    for a, b in itertools.pairwise(names):
        links.append(
            {
                "from": a,
                "to": b,
                "bandwidth_gbps": draw(st.sampled_from([1e-6, 0.2, 10, 1e6])),
                "latency_ms": draw(st.sampled_from([0.0, 25.0, 1e5])),
                "loss": draw(st.sampled_from([0.0, 0.01, 0.5])),
                "codec": draw(st.sampled_from(CODECS)),
            }
        )
    heads = draw(st.sampled_from([1, 2, 4]))
    doc = {
        "name": draw(st.sampled_from(["fuzz", "f-1.x"])),
        "ray": {"address": draw(st.sampled_from(["local", "auto"]))},
        "sites": sites,
        "links": links,
        "model": {
            "n_layer": draw(st.integers(1, 6)),
            "n_embd": heads * draw(st.sampled_from([8, 16, 32])),
            "n_head": heads,
            "vocab_size": draw(st.sampled_from([2, 256])),
            "max_seq_len": draw(st.sampled_from([16, 16, 128, 2])),
        },
        "training": {
            "global_batch_size": draw(st.sampled_from([8, 8, 32, 1, 6])),
            "steps": draw(st.integers(1, 10)),
            "lr": draw(st.sampled_from([1e-4, 0.003])),
            "precision": draw(st.sampled_from(["fp32", "bf16", "fp16"])),
            "seed": draw(st.integers(0, 5)),
        },
        "plan": {
            "schedule": draw(st.sampled_from(["lookahead", "1f1b", "gpipe"])),
            "micro_batch_size": draw(st.sampled_from([1, 2, [1, 2, 3], {"min": 1, "max": 8}])),
            "delta_n": draw(st.sampled_from([0, 3, [0, 2], {"min": 0, "max": 6}])),
            "codecs": draw(st.sampled_from([["none"], ["int8", "bf16"], ["topk"]])),
            "topk_ratio": draw(st.sampled_from([0.01, 1.0])),
            "ga": {
                **TINY_GA,
                "crossover_prob": draw(st.sampled_from([0.5, 0.7])),
                "mutation_prob": draw(st.sampled_from([0.1, 0.3])),
            },
        },
    }
    if draw(st.booleans()):
        doc["plan"]["seq_len"] = draw(st.sampled_from([8, [4, 16], {"min": 2, "max": 16}]))
    if draw(st.booleans()):
        doc["plan"]["pipelines"] = draw(st.sampled_from([1, 2, [1, 2], {"min": 1, "max": 4}]))
    if not draw(st.integers(0, 2)):  # two in three stay valid (may still be unplannable)
        for _ in range(draw(st.sampled_from([1, 1, 2, 4]))):
            draw(st.sampled_from([_poison, _poison, _clash]))(doc, draw)
    return doc


def _clash(doc: dict, draw: st.DrawFn) -> None:
    """A cross-field problem: each value is fine alone, not together."""
    kind = draw(st.sampled_from(["ga", "link", "twin", "codec", "name", "seq", "batch"]))
    if kind == "ga":  # DEAP's varOr asserts on this
        doc["plan"]["ga"].update(crossover_prob=0.9, mutation_prob=0.3)
    elif kind == "link" and doc["links"]:
        doc["links"].pop(draw(st.integers(0, len(doc["links"]) - 1)))  # the chain breaks
    elif kind == "twin":
        doc["sites"][-1]["name"] = doc["sites"][0]["name"]
    elif kind == "codec":
        doc["plan"]["codecs"] = ["zip"]
    elif kind == "name":
        doc["name"] = draw(st.sampled_from(["a b", "../up", "x" * 300]))
    elif kind == "seq":
        doc["plan"]["seq_len"] = doc["model"]["max_seq_len"] * 4
    else:
        doc["training"]["global_batch_size"] = 7
        doc["plan"]["micro_batch_size"] = 2


def _leaves(node: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return [prefix]
    out: list[tuple] = []
    for key, child in items:
        out += _leaves(child, (*prefix, key))
    return out


def _poison(doc: dict, draw: st.DrawFn) -> None:
    """Replace one value anywhere in ``doc`` by a hostile one."""
    path = draw(st.sampled_from(_leaves(doc)))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = draw(HOSTILE)


def _command(draw: st.DrawFn, path: str, small: bool) -> list[str]:
    kind = draw(st.sampled_from(["plan", "json", "exhaustive", "templates", "simulate", "dry"]))
    if not small and kind in ("exhaustive", "templates"):
        kind = "json"
    if kind == "simulate":
        argv = ["simulate", path, "--json"] if draw(st.booleans()) else ["simulate", path]
        argv += ["--schedule", draw(st.sampled_from(["gpipe", "1f1b", "lookahead"]))]
        if draw(st.integers(0, 3)):  # mostly settings a small cluster can run
            argv += ["--micro-batch-size", "1", "--seq-len", draw(st.sampled_from(["2", "8"]))]
            argv += ["--delta-n", draw(st.sampled_from(["0", "2"]))]
            return argv
        argv += ["--micro-batch-size", draw(st.sampled_from(["1", "2", "3", "0", "x"]))]
        argv += ["--seq-len", draw(st.sampled_from(["1", "16", "99999"]))]
        argv += ["--delta-n", draw(st.sampled_from(["0", "1,1", "-1", "1e9"]))]
        if draw(st.booleans()):
            argv += ["--pipelines", draw(st.sampled_from(["1", "2", "64"]))]
        if draw(st.booleans()):
            argv += ["--codec", draw(st.sampled_from([*CODECS, "zip"]))]
        return argv
    return {
        "plan": ["plan", path],
        "json": ["plan", path, "--json"],
        "exhaustive": ["plan", path, "--json", "--exhaustive"],
        "templates": ["plan", path, "--templates"],
        "dry": ["launch", path, "--dry-run"],
    }[kind]


@fuzz(300)
@given(doc=clusters(), data=st.data())
def test_fuzz_generated_clusters(doc: dict, data: st.DataObject) -> None:
    check(_command(data.draw, _file(doc), small=True))


# --------------------------------------------------------------------------------------------
# Mutations of the shipped clusters


def _mutate(doc: Any, data: st.DataObject) -> None:
    paths = _leaves(doc)
    op = data.draw(st.sampled_from(["delete", "set", "insert"]))
    path = data.draw(st.sampled_from(paths))
    node = doc
    for key in path[:-1]:
        node = node[key]
    if op == "delete" and isinstance(node, dict):
        node.pop(path[-1], None)
    elif op == "insert" and isinstance(node, dict):
        node[data.draw(st.sampled_from(["extra", "devics_per_node", "min", "codec"]))] = 1
    else:
        node[path[-1]] = data.draw(st.one_of(HOSTILE, st.floats(), st.integers(-5, 10**6)))


@fuzz(150)
@given(base=st.sampled_from(sorted(SHIPPED)), data=st.data())
def test_fuzz_mutated_shipped_clusters(base: str, data: st.DataObject) -> None:
    doc = copy.deepcopy(SHIPPED[base])
    doc["plan"]["ga"] = dict(TINY_GA)
    for _ in range(data.draw(st.integers(1, 3))):
        _mutate(doc, data)
    check(_command(data.draw, _file(doc), small=False))


# --------------------------------------------------------------------------------------------
# Damaged bytes


@fuzz(100)
@given(
    base=st.sampled_from(sorted(SHIPPED)),
    edits=st.lists(st.tuples(st.floats(0, 1), st.binary(min_size=0, max_size=4)), max_size=4),
    cut=st.floats(0.2, 1.0),
)
def test_fuzz_damaged_bytes(base: str, edits: list, cut: float) -> None:
    doc = copy.deepcopy(SHIPPED[base])
    doc["plan"]["ga"] = dict(TINY_GA)
    raw = bytearray(yaml.safe_dump(doc).encode())
    for where, blob in edits:
        at = int(where * len(raw))
        raw[at : at + len(blob)] = blob
    check(["plan", _file(bytes(raw[: max(1, int(cut * len(raw)))])), "--json"])
