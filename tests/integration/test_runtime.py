"""Tier 2: real Ray, real DeepSpeed, real training on one machine with two emulated sites.

The suite's one embedded Ray (with both site resources and the dashboard, so the state API
works; tests/conftest.py) serves every test here; each test launches a Controller on it.

Parity reference: a single-process torch run of the same GPT, data, seed, Adam and LR
schedule, with the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import copy
import gc
import math
import os
from functools import partial
from pathlib import Path
from typing import NamedTuple

import pytest
import ray
import torch
import yaml

from geopipe.config import parse_cluster
from geopipe.model.data import Corpus, TokenStream, global_indices
from geopipe.model.family import build_stage
from geopipe.model.gpt import lm_loss
from geopipe.runtime.actor.executor import BREAKDOWN, FOREGROUND
from geopipe.runtime.actor.lr import lr_factor
from geopipe.runtime.control.cluster import LaunchError
from geopipe.runtime.control.controller import Controller, LaunchOptions
from geopipe.runtime.control.models import model_desc
from geopipe.runtime.control.placement import ACTOR_ENV

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):
    yield


def tiny_doc(devices: int, pipelines: int, codec: str = "none", steps: int = 3) -> dict:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["name"] = f"t{devices}{pipelines}{codec}"
    for s in doc["sites"]:
        s["devices_per_node"] = devices
    doc["links"][0].update(latency_ms=5.0, bandwidth_gbps=1.0, codec=codec)
    doc["model"] = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "max_seq_len": 32}
    doc["training"].update(
        global_batch_size=8, steps=steps, lr=0.01, warmup_steps=1, data_max_bytes=200_000
    )
    doc["plan"].update(
        pipelines=pipelines,
        micro_batch_size=2,
        seq_len=32,
        codecs=[codec],
        calibrate=False,
        delta_n={"min": 0, "max": 2},
    )
    return doc


class Run(NamedTuple):
    """One finished run: its controller, per-step losses and metrics, the final gathered
    state, its run directory and what :func:`run_pipeline` saw of its actors."""

    ctl: Controller
    losses: list[float]
    state: dict
    dir: Path
    steps: list
    seen: dict


def run_pipeline(doc: dict, tmp: Path) -> Run:
    """Launch, train and close ``doc`` in ``tmp``, its metrics written to ``metrics_out``
    (``tmp/out.jsonl``). Right after the launch it records what the state-API test checks
    of the actors (their names in Ray's state API, their environment, the objects frozen
    out of the collector's scans); after close, the names Ray still holds."""
    from _state import alive_actor_names, taken_names

    spec = parse_cluster(doc, "test")
    out = tmp / "out.jsonl"
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp), metrics_out=str(out), progress=False))
    seen: dict = {}
    try:
        ctl.launch()
        seen["alive"] = alive_actor_names()

        # Every stage actor runs with the environment geopipe sets for it (one malloc
        # arena: [Note: one malloc arena per actor] in geopipe.runtime.control.placement).
        def env(_actor) -> dict:
            return {k: os.environ.get(k) for k in ACTOR_ENV}

        actors = [a for row in ctl.actors for a in row]
        seen["envs"] = ray.get([a.__ray_call__.remote(env) for a in actors])
        frozen = [a.__ray_call__.remote(lambda _a: gc.get_freeze_count()) for a in actors]
        seen["frozen"] = ray.get(frozen)
        res = ctl.train()
        state = ctl.gather_state()
    finally:
        ctl.close()
    seen["taken_after"] = taken_names(set(ctl.names))
    seen["alive_after"] = alive_actor_names()
    return Run(ctl, [m.loss for m in res.steps], state, tmp, res.steps, seen)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """``runs(doc)``: the :class:`Run` of ``doc``, launched once for every test of the
    module that trains the same document (a launch costs seconds of actor start-up).
    Callers must not modify what they get."""
    import json

    done: dict[str, Run] = {}

    def get(doc: dict) -> Run:
        key = json.dumps(doc, sort_keys=True)
        if key not in done:
            done[key] = run_pipeline(doc, tmp_path_factory.mktemp(doc["name"]))
        return done[key]

    return get


def reference(doc: dict, until: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process: same model, data order, Adam and LR schedule (``until``: stop after
    that many steps, the schedule unchanged)."""
    spec = parse_cluster(doc, "ref")
    m, t, pl = spec.model, spec.training, spec.plan
    desc = model_desc(m)
    model = build_stage(desc, 0, desc.num_layers, seed=t.seed)
    opt = torch.optim.Adam(model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, partial(lr_factor, warmup_steps=t.warmup_steps, total_steps=t.steps)
    )
    stream = TokenStream(Corpus(t.data, max_bytes=t.data_max_bytes), t.seed)
    d, b, s = pl.pipelines, pl.micro_batch_size, pl.seq_len
    micro = t.global_batch_size // (d * b)
    losses = []
    for step in range(t.steps if until is None else until):
        opt.zero_grad()
        step_losses = []
        for p in range(d):
            for mb in range(micro):
                x, y = stream.batch(global_indices(step, t.global_batch_size, p, d, mb, b), s)
                loss = lm_loss(model(x), y)
                (loss / (d * micro)).backward()
                step_losses.append(loss.item())
        opt.step()
        sched.step()
        losses.append(sum(step_losses) / len(step_losses))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("devices,pipelines", [(1, 1), (2, 2)], ids=["no-replicas", "zero1-x2"])
def test_pipelined_training_matches_single_process(runs, devices, pipelines):
    """2 stages (one per site), with and without a ZeRO-1 group of 2 per stage, codec none.

    Measured: losses equal to ~1e-7 and parameters to ~1e-6 (float32 reduction order);
    tolerances 1e-5 / 2e-5.
    """
    doc = tiny_doc(devices, pipelines)
    ctl, losses, state, *_ = runs(doc)
    assert ctl.plan.num_stages == 2 and ctl.plan.stage_sites == ("east", "west")
    ref_losses, ref_params = reference(doc)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert set(state["params"]) == set(ref_params)
    worst = max((state["params"][n] - p).abs().max().item() for n, p in ref_params.items())
    assert worst < 2e-5, worst
    assert state["step"] == doc["training"]["steps"]


def test_int8_codec_stays_close_and_sends_fewer_bytes(tmp_path, runs):
    """int8 on the WAN: bounded loss difference vs codec none (measured ≤ 3e-3 over 3 steps;
    bound 2e-2) and ~3.9x fewer WAN bytes (1 byte + one fp32 scale per 32-wide row)."""
    _, ref_losses, _, none_dir, *_ = runs(tiny_doc(1, 1, "none"))
    none_bytes = _wan_bytes(none_dir)
    _, losses, _, int8_dir, *_ = runs(tiny_doc(1, 1, "int8"))
    int8_bytes = _wan_bytes(int8_dir)
    assert losses != ref_losses  # the codec really is in the path
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 2e-2
    assert none_bytes / int8_bytes == pytest.approx(4 / (1 + 4 / 32), rel=1e-6)
    # One codec per direction, as a YAML link says it: int8 activations, exact gradients.
    doc = tiny_doc(1, 1, "int8")
    doc["name"] = "t11mixed"
    doc["links"][0]["codec"] = {"forward": "int8", "backward": "none"}
    doc["plan"]["codecs"] = [{"forward": "int8", "backward": "none"}]
    ctl, mixed, *_ = run_pipeline(doc, tmp_path / "mixed")
    assert ctl.plan.codecs == ("int8/none",)
    assert _wan_bytes(tmp_path / "mixed") == (none_bytes + int8_bytes) / 2
    assert mixed != losses and mixed != ref_losses
    assert max(abs(a - b) for a, b in zip(mixed, ref_losses, strict=True)) < 2e-2


def _wan_bytes(run_dir: Path) -> int:
    """The WAN bytes of every step of a :func:`run_pipeline` run in ``run_dir``."""
    import json

    lines = [json.loads(x) for x in (run_dir / "out.jsonl").read_text().splitlines()]
    return sum(x["wan_bytes"] for x in lines if "step" in x and "event" not in x)


def test_actors_named_in_state_api_and_metrics_written(runs):
    """The zero1-x2 parity run (2 stages x 2 replicas, 3 steps), as :func:`run_pipeline`
    saw it: its actors named in Ray's state API, their environment, the metrics file it
    wrote to ``metrics_out`` (not the run directory's default), the plan event, status.json,
    and its actor names freed once ``close()`` returned."""
    import json

    from geopipe.optimizer.measurements import Measurements
    from geopipe.optimizer.runplan import plan_run

    doc = tiny_doc(2, 2)
    spec = parse_cluster(doc, "test")
    run = runs(doc)
    tmp_path, out, seen = run.dir, run.dir / "out.jsonl", run.seen
    expected = {
        f"geopipe/{spec.name}/{s}/stage{k}/r{r}"
        for k, s in enumerate(("east", "west"))
        for r in range(2)
    }
    assert expected <= seen["alive"]
    # Every stage actor runs with the environment geopipe sets for it (one malloc arena:
    # [Note: one malloc arena per actor] in geopipe.runtime.control.placement) ...
    assert seen["envs"] == [ACTOR_ENV] * 4
    # ... and with what exists once it is built frozen out of the collector's scans
    # ([Note: garbage collection off the step] in geopipe.runtime.actor.stage).
    assert min(seen["frozen"]) > 10_000, seen["frozen"]
    assert not (tmp_path / "metrics.jsonl").exists()  # metrics_out replaces the default
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    # The plan the launch ran is the one planning function's for what it measured first
    # (geopipe plan and --dry-run call the same function), under the YAML's config hash.
    (event,) = [x for x in lines if x.get("event") == "plan"]
    replayed = plan_run(spec, Measurements.from_dict(event["planned_with"]))
    assert event["plan"] == json.loads(json.dumps(replayed.plan.to_dict()))
    assert event["config_hash"] == spec.digest
    steps = [x for x in lines if "event" not in x]
    assert [x["step"] for x in steps] == [0, 1, 2]
    for x in steps:
        assert {"loss", "iteration_time_s", "tokens", "bubble_ratio", "wan_bytes"} <= set(x)
        assert 0 <= x["bubble_ratio"] < 1 and x["wan_bytes"] > 0 and math.isfinite(x["loss"])
        # Where each stage's step went: the compute-thread parts add up to its duration
        # (at most the step's), the WAN stages encoded and decoded something.
        assert len(x["breakdown"]) == 2
        for part in x["breakdown"]:
            assert set(part) == set(BREAKDOWN) and min(part.values()) >= 0
            foreground = sum(part[k] for k in FOREGROUND)
            assert foreground <= x["iteration_time_s"] + 1e-3
            assert part["forward"] > 0 and part["backward"] > 0 and part["optimizer"] > 0
            assert part["encode"] > 0 and part["decode"] > 0
        # The bubble counts the optimizer step as busy, also now that it runs after the
        # sends ([Note: the step after the sends] in geopipe.runtime.actor.engine).
        busy = sum(p["forward"] + p["backward"] + p["optimizer"] for p in x["breakdown"])
        assert x["bubble_ratio"] == pytest.approx(1 - busy / (2 * x["iteration_time_s"]), abs=1e-3)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["step"] == 3 and len(status["stages"]) == 2
    # close() returns once the actors are gone and Ray has freed their names.
    assert expected <= set(run.ctl.names)
    assert not seen["taken_after"] and not expected & seen["alive_after"]


def test_a_run_name_taken_on_the_cluster_is_a_clear_error(tmp_path):
    """Another launch of the same run still holds an actor name on this Ray cluster: the
    launch says which name and what to do, and leaves no actor of its own behind."""
    from _state import taken_names

    doc = tiny_doc(1, 1)
    doc["name"] = "taken"
    spec = parse_cluster(doc, "test")

    @ray.remote(num_cpus=0)
    class Squatter:
        def ping(self) -> int:
            return 1

    squatter = Squatter.options(name="geopipe/taken/west/stage1/r0", namespace=spec.ray.namespace)
    squatter = squatter.remote()
    ray.get(squatter.ping.remote())
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp_path), progress=False))
    try:
        with pytest.raises(LaunchError, match=r"geopipe/taken/west/stage1/r0 is taken .* 'taken'"):
            ctl.launch()
    finally:
        ctl.close()
        ray.kill(squatter)
    assert not taken_names({"geopipe/taken/east/stage0/r0"})


def split_doc(schedule: str, delta_n: int = 0, recompute: str = "none") -> dict:
    """``tiny_doc(1, 1)`` (4 micro-batches of 2 x 32 tokens a step, fp32) under a fixed
    ``schedule`` and ΔN, with ``training.recompute``."""
    doc = tiny_doc(1, 1)
    doc["name"] = f"split-{schedule}-{recompute}"
    doc["training"]["recompute"] = recompute
    doc["plan"].update(schedule=schedule, delta_n=delta_n)
    return doc


def _held(run: Run) -> list[int]:
    """Per stage, the most bytes its activation meter saw held in any step."""
    return [max(col) for col in zip(*(m.peak_activation_bytes for m in run.steps), strict=True)]


def test_split_backward_schedules_match_the_full_backward_losses(runs):
    """zb-h1 and lookahead-zb (ΔN 2, W deferred on the last stage) run I and W as separate
    actions; DeepSpeed's ZeRO-1 step sees the gradients a full backward gives, so the
    per-step losses (fp32) equal within 1e-6 those of the same document under a full
    backward: the module's ``tiny_doc(1, 1)`` run (the parity test's, itself checked
    against the single-process reference), whose plan is 1F1B's family (lookahead, ΔN 2).
    Measured: a 1F1B run of that document, this run and both split runs give bitwise the
    same losses (so no 1F1B run of its own is launched)."""
    base = runs(tiny_doc(1, 1))
    assert base.ctl.plan.schedule in ("1f1b", "lookahead")  # no split backward
    assert len(base.losses) == 3 and base.losses[0] > base.losses[-1]  # it trains
    for name, dn in (("zb-h1", 0), ("lookahead-zb", 2)):
        ctl, losses, *_ = runs(split_doc(name, dn))
        assert ctl.plan.schedule == name and ctl.plan.num_microbatches == 4
        assert losses == pytest.approx(base.losses, abs=1e-6), name
    assert ctl.plan.delta_n == (2,) and ctl.plan.inflight_caps  # lookahead-zb's


def test_recompute_under_split_backward_gives_the_losses_of_no_recompute(runs):
    """``training.recompute: full`` under ZB-H1's split backward (I then W; the zb-h1 run of
    the test above): the losses equal the run without it bitwise (the same kernels on the
    same inputs). The first stage runs no I and its activation meter sees less held; the
    last stage's peak is what it keeps for W after I (each Linear's input and output
    gradient), the same with or without recompute ([Note: recompute in the memory model] in
    geopipe.optimizer.memory). 1F1B's case, over ZeRO-1 replicas in bf16, is
    tests/integration/test_recompute_runtime.py's."""
    base, again = runs(split_doc("zb-h1")), runs(split_doc("zb-h1", recompute="full"))
    assert again.ctl.plan.num_stages == 2 and again.ctl.plan.schedule == "zb-h1"
    assert len(base.losses) == 3 and base.losses[0] > base.losses[-1]  # it trains
    assert again.losses == pytest.approx(base.losses, abs=1e-6, rel=0)
    assert again.losses == base.losses
    base_held, again_held = _held(base), _held(again)
    assert again_held[0] < base_held[0], (again_held, base_held)
    assert again_held[1] == base_held[1], (again_held, base_held)


def test_a_codec_erring_beyond_the_bound_falls_back_to_the_next_finer(tmp_path, runs):
    """plan.max_codec_error: int2h's sampled error (~0.4) exceeds 0.05 on the first step, so
    both directions switch to int8 (the next finer codec searched) from the second step:
    the event names the link, the plan and the actors' senders change, and the WAN bytes
    per step become exactly int8's."""
    import json

    from geopipe.optimizer.measurements import Measurements, costed
    from geopipe.runtime.control.linkprobe import measure_codec_speeds

    doc = tiny_doc(1, 1, "int2h", steps=3)
    doc["links"][0]["bandwidth_gbps"] = 0.001  # thin: the planner picks the smallest codec
    doc["plan"].update(codecs=["int2h", "int8"], max_codec_error=0.05)
    ctl = Controller(
        parse_cluster(doc, "t"), LaunchOptions(run_dir=str(tmp_path / "guard"), progress=False)
    )
    try:
        ctl.launch()
        # what a launch over a real network asks each boundary site's devices (next to the
        # link probe): their own encode + decode speed of the searched codecs
        rows, sites = ctl.placement.rows, ctl.plan.stage_sites
        speeds = measure_codec_speeds(ctl.workers, rows, sites, ["int2h", "int8"])
        losses = [m.loss for m in ctl.train().steps]
    finally:
        ctl.close()
    assert set(speeds) == {"east", "west"}
    assert all(set(v) == {"int2h", "int8"} and min(v.values()) > 0 for v in speeds.values())
    yaml_spec = ctl.spec.model_copy(
        update={
            "sites": [
                ctl.spec.sites[0],
                ctl.spec.sites[1].model_copy(update={"codec_gb_per_s": {"int8": 99.0}}),
            ]
        }
    )
    spec = costed(yaml_spec, Measurements(codecs=speeds))
    assert spec.sites[0].codec_gb_per_s == speeds["east"]
    assert spec.sites[1].codec_gb_per_s == {**speeds["west"], "int8": 99.0}  # the YAML's stands
    lines = [json.loads(x) for x in (tmp_path / "guard" / "metrics.jsonl").read_text().splitlines()]
    events = [x for x in lines if x.get("event") == "codec_fallback"]
    assert sorted((e["direction"], e["codec"], e["to"]) for e in events) == [
        ("backward", "int2h", "int8"),
        ("forward", "int2h", "int8"),
    ]
    assert all(e["step"] == 0 and e["error"] > 0.05 and e["link"] == "east→west" for e in events)
    assert ctl.plan.codecs == ("int8",)
    steps = [x for x in lines if "step" in x and "event" not in x]
    _, int8_losses, _, int8_dir, *_ = runs(tiny_doc(1, 1, "int8", steps=3))
    assert steps[0]["wan_bytes"] < steps[1]["wan_bytes"] == steps[2]["wan_bytes"]
    assert steps[2]["wan_bytes"] == _wan_bytes(int8_dir) / 3
    assert all(max(v for v in s["codec_error"].values()) < 0.05 for s in steps[1:])
    assert losses[0] != int8_losses[0]
