"""A layer's fixed cost per micro-batch (``sites[].layer_overhead_ms``): fitted from two timed
micro-batch sizes, carried by the measurements, priced by the evaluator, and what turns the
planner from the smallest micro-batch to a larger one where nothing else is at stake."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from geopipe.config import parse_cluster
from geopipe.model.sizes import layer_forward_flops
from geopipe.optimizer.evaluate import Evaluator
from geopipe.optimizer.measurements import DeviceSpeed, Measurements, costed
from geopipe.optimizer.runplan import plan_run
from geopipe.optimizer.shapes import build_plan
from geopipe.runtime.control.calibration import fit_forward


def test_the_fit_recovers_a_line_and_refuses_a_bent_one() -> None:
    layers, per_sample, fixed = 6, 7.3e-3, 0.9e-3  # seconds
    at = {b: layers * fixed + b * per_sample for b in (1, 8)}
    slope, overhead = fit_forward((1, at[1]), (8, at[8]), layers)
    assert slope == pytest.approx(per_sample) and overhead == pytest.approx(fixed)
    # noise that makes the larger size cheaper per micro-batch, or the line cross below 0:
    # the small size's figure alone, no overhead
    assert fit_forward((1, 0.05), (8, 0.04), layers) == (0.05, 0.0)
    assert fit_forward((2, 0.01), (8, 0.08), layers) == (0.005, 0.0)


def _one_site_doc(mbs: dict | int) -> dict:
    doc = yaml.safe_load(Path("clusters/local-2dc.yaml").read_text())
    doc["sites"] = doc["sites"][:1]
    doc["sites"][0]["devices_per_node"] = 1
    doc["links"] = []
    doc["plan"].update(micro_batch_size=mbs, pipelines=1)
    doc["training"]["global_batch_size"] = 8
    return doc


def test_the_evaluator_prices_each_layers_fixed_cost_per_micro_batch() -> None:
    spec = parse_cluster(_one_site_doc(1), "t")
    site = spec.sites[0]
    plan = build_plan(
        spec,
        (site.name,),
        pipelines=1,
        micro_batch_size=2,
        seq_len=64,
        num_microbatches=4,
        schedule="1f1b",
        delta_n=(),
        codecs=(),
    )
    plain = Evaluator(spec).costs(plan).fwd_s[0]
    flops = sum(layer_forward_flops(spec.model, 64)) * 2 * 64 / site.flops_per_s
    assert plain == pytest.approx(flops)
    slow = spec.model_copy(update={"sites": [site.model_copy(update={"layer_overhead_ms": 0.5})]})
    layers = plan.partition[0][1] - plan.partition[0][0]
    assert Evaluator(slow).costs(plan).fwd_s[0] == pytest.approx(flops + layers * 0.5e-3)


def test_a_measured_overhead_reaches_the_cost_model_and_the_planner_batches_up() -> None:
    """One stage, one device, 8 sequences a step: with no fixed cost every micro-batch size
    computes the same, and the planner keeps the smallest; with the fixed cost a launch
    measured, it runs the 8 as one micro-batch."""
    spec = parse_cluster(_one_site_doc({"min": 1, "max": 8}), "t")
    name = spec.sites[0].name
    flat = Measurements(devices={name: DeviceSpeed(0.3, 2.0)})
    fixed = Measurements(devices={name: DeviceSpeed(0.3, 2.0, None, 0.7e-3)})
    assert costed(spec, fixed).sites[0].layer_overhead_ms == pytest.approx(0.7)
    assert spec.sites[0].layer_overhead_ms == 0.0  # the spec as loaded is never patched
    # a machine's figure: it changes no number a checkpoint holds, so not the config digest
    assert costed(spec, fixed).digest == costed(spec, flat).digest
    assert Measurements.from_dict(fixed.to_dict()) == fixed  # as the plan event carries it
    assert plan_run(spec, flat).plan.micro_batch_size == 1
    assert plan_run(spec, fixed).plan.micro_batch_size == 8


def test_the_fit_charges_a_hugging_face_models_own_layers(tmp_path, monkeypatch) -> None:
    """A Llama from a save_pretrained directory is timed as built (its embedding, blocks and
    head: what the evaluator charges a fixed cost per layer for): two forwards on a line
    ``layers x c + size x s`` give back ``c`` and ``s`` exactly."""
    from _hfdoc import LLAMA, two_site_hf_doc
    from transformers import AutoModelForCausalLM, LlamaConfig

    from geopipe.runtime.control import calibration
    from geopipe.runtime.control.models import model_desc

    AutoModelForCausalLM.from_config(
        LlamaConfig(**{**LLAMA, "num_hidden_layers": 3})
    ).save_pretrained(tmp_path / "llama")
    spec = parse_cluster(two_site_hf_doc("t", tmp_path / "llama"), "t")
    layers = model_desc(spec.model).num_layers
    assert layers == 3 + 2 and spec.model.family == "llama"  # embedding, 3 blocks, head
    c, per = 0.4e-3, 2e-3
    sizes: list[int] = []

    def timed(spec, micro_batch, seq_len, reps=5):
        sizes.append(micro_batch)
        return layers * c + micro_batch * per, 2 * (layers * c + micro_batch * per)

    monkeypatch.setattr(calibration, "_measure", timed)
    got = calibration.profile_machine(spec, 1, 32, largest=8)
    assert sizes == [1, 8]
    dev = got.devices["east"]
    assert dev.layer_overhead_s == pytest.approx(c)
    assert got.devices["west"].layer_overhead_s == pytest.approx(c)
