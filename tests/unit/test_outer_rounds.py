"""The driver's half of the outer loop against a recording fake of the worker seam: who is
paired with whom, and which fragment is sent and applied after which inner step."""

from __future__ import annotations

from pathlib import Path

import yaml

from geopipe.config import parse_cluster
from geopipe.optimizer.penalty import PenaltyModel, parse_table
from geopipe.optimizer.runplan import plan_run
from geopipe.runtime.control.outerloop import OuterRounds, peers_of

LOCAL = Path(__file__).resolve().parents[2] / "clusters" / "local-2dc.yaml"


class Recorder:
    """A worker seam whose actors answer the outer-loop calls from a script; it records
    every call in order. (The seam's full fake is tests/unit/fakes.py; these calls are all
    this component makes.)"""

    def __init__(self, endpoints: list[dict]) -> None:
        self.endpoints = endpoints
        self.calls: list[tuple[int, str, tuple]] = []
        self.round = 0

    def call(self, actor: int, method: str, *args):
        self.calls.append((actor, method, args))
        if method == "outer_begin":
            return self.endpoints[actor]
        if method == "outer_send":
            return {"payload_bytes": 100, "codec_error": 0.01}
        if method == "outer_gather":
            return {"have": sorted({ep["group"] for ep in self.endpoints}), "missing": {}}
        if method == "outer_apply":
            ep = self.endpoints[actor]
            return {
                "round": self.round,
                "wait_s": 0.0,
                "digest": f"{ep['stage']}/{ep['partition']}",
            }
        return None

    def get(self, pendings, timeout=None):
        return list(pendings)


def _endpoints() -> list[dict]:
    """Two groups, each a 2-stage pipeline whose stage 0 is a ZeRO-1 group of two."""
    out = []
    for g in (0, 1):
        for stage, part in ((0, 0), (0, 1), (1, 0)):
            out.append(
                {
                    "group": g,
                    "stage": stage,
                    "partition": part,
                    "address": ("h", 10 * g + stage * 2 + part),
                    "layout": f"{stage}/{part}",
                }
            )
    return out


def test_peers_are_the_same_stage_and_partition_in_the_other_groups() -> None:
    eps = _endpoints()
    sites = ["east"] * 3 + ["west"] * 3
    links = []
    peers = peers_of(eps, lambda a, b: links.append((a, b)) or None, sites)
    for i, me in enumerate(eps):
        (peer,) = peers[i]
        j = next(j for j, ep in enumerate(eps) if ep["address"] == peer.address)
        assert eps[j]["group"] != me["group"]
        assert (eps[j]["stage"], eps[j]["partition"]) == (me["stage"], me["partition"])
        assert peer.layout == me["layout"]
    assert sorted(set(links)) == [("east", "west"), ("west", "east")]


def _rounds(h: int, fragments: int, overlap: int) -> tuple[OuterRounds, Recorder, list]:
    doc = yaml.safe_load(LOCAL.read_text())
    doc["plan"].update(strategy="outer", outer={"h": h, "fragments": fragments, "overlap": overlap})
    doc["training"]["checkpoint"] = {"every_steps": h}
    spec = parse_cluster(doc, "t")
    rows = [
        {
            "replicas": 2,
            "h": h,
            "fragments": fragments,
            "overlap": overlap,
            "codec": "none",
            "rel_gap": 0.01,
        }
    ]
    table = {
        "source": "t",
        "model": "t",
        "steps": 1,
        "tokens_per_step": 1,
        "sync_noise": 0.0,
        "rows": rows,
    }
    run = plan_run(spec, penalty=PenaltyModel(parse_table(table), "t")).outer
    events: list = []
    rec = Recorder(_endpoints())
    rounds = OuterRounds(spec, run, rec, lambda s: None, lambda kind, **f: events.append((kind, f)))
    return rounds, rec, events


def test_streaming_sends_overlap_steps_before_each_apply_and_sends_come_first() -> None:
    rounds, rec, events = _rounds(h=8, fragments=2, overlap=1)
    actors = list(range(6))
    rounds.begin(actors, ["east"] * 3 + ["west"] * 3)
    assert [m for _, m, _ in rec.calls] == ["outer_begin"] * 6 + ["outer_connect"] * 6
    rec.calls.clear()
    timeline = []
    for done in range(1, 17):
        before = len(rec.calls)
        rounds.after_step(done, actors)
        kinds = [(m, a[0]) for _, m, a in rec.calls[before:]]
        timeline += [(done, m, f) for m, f in dict.fromkeys(kinds) if m != "outer_gather"]
    # F = 2 every H = 8: fragment 0 applied after 4 and 12, fragment 1 after 8 and 16; each
    # send starts one step (the overlap) before its apply
    assert timeline == [
        (3, "outer_send", 0),
        (4, "outer_apply", 0),
        (7, "outer_send", 1),
        (8, "outer_apply", 1),
        (11, "outer_send", 0),
        (12, "outer_apply", 0),
        (15, "outer_send", 1),
        (16, "outer_apply", 1),
    ]
    rows = [f for kind, f in events if kind == "outer_round"]
    assert [r["fragment"] for r in rows] == [0, 1, 0, 1] and all(r["digests_equal"] for r in rows)
    assert all(r["bytes"] == 600 and r["groups"] == 2 for r in rows)


def test_without_overlap_the_send_and_the_apply_fall_on_one_step() -> None:
    rounds, rec, events = _rounds(h=4, fragments=1, overlap=0)
    rounds.begin(list(range(6)), ["east"] * 3 + ["west"] * 3)
    rec.calls.clear()
    for done in range(1, 9):
        rounds.after_step(done, list(range(6)))
    steps = [m for _, m, _ in rec.calls]
    assert steps == (["outer_send"] * 6 + ["outer_gather"] * 6 + ["outer_apply"] * 6) * 2
    assert [f["step"] for kind, f in events] == [4, 8]


def test_a_group_whose_theta_differs_is_reported() -> None:
    rounds, rec, events = _rounds(h=4, fragments=1, overlap=0)
    rounds.begin(list(range(6)), ["east"] * 3 + ["west"] * 3)
    rec.endpoints[5] = {**rec.endpoints[5]}  # same partition as actor 2, another digest
    original = rec.call

    def drift(actor, method, *args):
        out = original(actor, method, *args)
        if method == "outer_apply" and actor == 5:
            out = {**out, "digest": "drifted"}
        return out

    rec.call = drift
    for done in range(1, 5):
        rounds.after_step(done, list(range(6)))
    assert events[-1][1]["digests_equal"] is False
