"""The planner with ``training.recompute``: the memory model against the analytic formula
(a recomputed block keeps its input, ``b·s·h`` elements, per micro-batch in flight, plus one
block's activations while it recomputes), a cluster where no plan fits without recompute
and one is found with it, the backward priced one forward more (in I when split), and a bad
setting refused naming the field. Pure: no Ray."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from geopipe.cli import main
from geopipe.config import ClusterSpec, parse_cluster
from geopipe.model.sizes import layer_forward_flops
from geopipe.optimizer.evaluate import Candidate, Evaluator, plan_peak_memory
from geopipe.optimizer.planner import plan_cluster

ROOT = Path(__file__).resolve().parents[2]
DOC = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
# The demo GPT (4 blocks, h 128, V 256), 2 pipelines of 2 stages, micro-batches of 4 × 128.
B, S, H, V, E = 4, 128, 128, 256, 4  # E: bytes per fp32 element
BSH = B * S * H


def _spec(recompute: str, gb: float = 2.0, schedule: str = "1f1b") -> ClusterSpec:
    doc = copy.deepcopy(DOC)
    for site in doc["sites"]:
        site["device_memory_gb"] = gb
    doc["training"]["recompute"] = recompute
    doc["plan"].update(schedule=schedule, micro_batch_size=B, delta_n=0, codecs=["none"])
    return parse_cluster(doc, "test")


def _plan(spec: ClusterSpec):
    ev = Evaluator(spec, schedule=spec.plan.schedule)
    plan = ev.make_plan(Candidate(2, B, S, (0,), ("none",), spec.plan.schedule))
    assert plan is not None and plan.partition == ((0, 3), (3, 6))
    return ev, plan


def test_memory_matches_the_analytic_formula() -> None:
    # 1F1B: stage 0 (embedding, blocks 1-2) holds 2 micro-batches in flight, stage 1
    # (blocks 3-4, head) one. A GPT block keeps 16·b·s·h elements; the head b·s·h + 2·b·s·V;
    # the embedding b·s·h; stage 1 also the b·s·h it received.
    head = BSH + 2 * B * S * V
    want_none = [2 * (BSH + 2 * 16 * BSH) * E, 1 * (BSH + 2 * 16 * BSH + head) * E]
    want_full = [2 * (BSH + 2 * BSH) * E, 1 * (BSH + 2 * BSH + head) * E]
    want_every2 = [2 * (BSH + 16 * BSH + BSH) * E, 1 * (BSH + 16 * BSH + BSH + head) * E]
    for setting, want, peak in (
        ("none", want_none, [0, 0]),
        ("full", want_full, [16 * BSH * E] * 2),
        ("every-2", want_every2, [16 * BSH * E] * 2),  # blocks 2 and 4: one per stage
    ):
        spec = _spec(setting)
        mem = plan_peak_memory(spec, _plan(spec)[1])
        assert [m.activations for m in mem] == want, setting
        assert [m.recompute for m in mem] == peak, setting
        assert [m.total - m.activations - m.recompute for m in mem] == [
            m.total - m.activations for m in plan_peak_memory(_spec("none"), _plan(spec)[1])
        ]


def test_a_plan_that_fits_only_with_recompute_is_found() -> None:
    # 16 MiB-class devices: stage 0 needs 0.0211 GiB without recompute (its weights,
    # gradients and Adam shard are ~0.0083), 0.0104 with full recompute.
    for setting in ("none", "every-2"):  # every-2: half the blocks, not enough here
        best = plan_cluster(_spec(setting, gb=0.016)).best
        assert not best.feasible and "needs" in best.reason, setting
    found = plan_cluster(_spec("full", gb=0.016)).best
    assert found.feasible and found.plan is not None
    assert max(found.memory_limit_bytes) == 0.016 * (1 << 30)
    assert all(m.total <= 0.016 * (1 << 30) for m in found.memory)
    assert plan_cluster(_spec("every-2", gb=0.02)).best.feasible  # in proportion


def test_recompute_costs_one_more_forward_of_its_blocks() -> None:
    flops = layer_forward_flops(_spec("none").model, S)
    share = [sum(flops[1:3]) / sum(flops[0:3]), sum(flops[3:5]) / sum(flops[3:6])]
    for schedule in ("1f1b", "zb-h1"):
        base_ev, base_plan = _plan(_spec("none", schedule=schedule))
        ev, plan = _plan(_spec("full", schedule=schedule))
        base, again = base_ev.costs(base_plan), ev.costs(plan)
        assert again.fwd_s == base.fwd_s
        for k in range(2):
            extra = share[k] * base.fwd_s[k]
            assert again.bwd_s[k] == pytest.approx(base.bwd_s[k] + extra, rel=1e-12)
        # split: the recompute runs in I (autograd unpacks the saved tensors there); the
        # first stage's I does nothing and its W is the whole backward
        assert again.inp_s[1] == pytest.approx(base.inp_s[1] + share[1] * base.fwd_s[1])
        assert again.wgt_s[1] == pytest.approx(base.wgt_s[1])
        assert again.inp_s[0] == base.inp_s[0] == 0.0
        assert again.wgt_s[0] == pytest.approx(base.wgt_s[0] + share[0] * base.fwd_s[0])


def test_split_backward_counts_no_per_micro_batch_saving() -> None:
    # [Note: recompute in the memory model]: the weight-gradient store keeps each Linear's
    # input until W, so only the recompute's transient block is added.
    none, full = _spec("none", schedule="zb-h1"), _spec("full", schedule="zb-h1")
    base = plan_peak_memory(none, _plan(none)[1])
    again = plan_peak_memory(full, _plan(full)[1])
    assert [m.activations for m in again] == [m.activations for m in base]
    assert [m.total - b.total for m, b in zip(again, base, strict=True)] == [16 * BSH * E] * 2


@pytest.mark.parametrize("bad", ["every-0", "sometimes", "every-x", 3])
def test_a_bad_setting_exits_2_naming_the_field(tmp_path: Path, capsys, bad) -> None:
    doc = copy.deepcopy(DOC)
    doc["training"]["recompute"] = bad
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["plan", str(path)]) == 2
    out, err = capsys.readouterr()
    assert f"{path}: training.recompute:" in err and "Traceback" not in out + err
