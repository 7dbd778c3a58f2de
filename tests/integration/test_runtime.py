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

import pytest
import ray
import torch
import yaml

from geopipe.config import parse_cluster
from geopipe.model.data import Corpus, TokenStream, global_indices
from geopipe.model.family import build_stage
from geopipe.model.gpt import lm_loss
from geopipe.runtime.actor.engine import lr_factor
from geopipe.runtime.actor.executor import BREAKDOWN, FOREGROUND
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


def run_pipeline(doc: dict, tmp: Path) -> tuple[Controller, list[float], dict]:
    spec = parse_cluster(doc, "test")
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp), progress=False))
    try:
        ctl.launch()
        res = ctl.train()
        state = ctl.gather_state()
        return ctl, [m.loss for m in res.steps], state
    finally:
        ctl.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """``runs(doc)``: (controller, losses, final state, run directory) of one finished run
    of ``doc``, launched once for every test of the module that trains the same document
    (a launch costs seconds of actor start-up). Callers must not modify what they get."""
    import json

    done: dict[str, tuple[Controller, list[float], dict, Path]] = {}

    def get(doc: dict) -> tuple[Controller, list[float], dict, Path]:
        key = json.dumps(doc, sort_keys=True)
        if key not in done:
            run_dir = tmp_path_factory.mktemp(doc["name"])
            done[key] = (*run_pipeline(doc, run_dir), run_dir)
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
    ctl, losses, state, _ = runs(doc)
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
    _, ref_losses, _, none_dir = runs(tiny_doc(1, 1, "none"))
    none_bytes = _wan_bytes(none_dir)
    _, losses, _, int8_dir = runs(tiny_doc(1, 1, "int8"))
    int8_bytes = _wan_bytes(int8_dir)
    assert losses != ref_losses  # the codec really is in the path
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 2e-2
    assert none_bytes / int8_bytes == pytest.approx(4 / (1 + 4 / 32), rel=1e-6)
    # One codec per direction, as a YAML link says it: int8 activations, exact gradients.
    doc = tiny_doc(1, 1, "int8")
    doc["name"] = "t11mixed"
    doc["links"][0]["codec"] = {"forward": "int8", "backward": "none"}
    doc["plan"]["codecs"] = [{"forward": "int8", "backward": "none"}]
    ctl, mixed, _ = run_pipeline(doc, tmp_path / "mixed")
    assert ctl.plan.codecs == ("int8/none",)
    assert _wan_bytes(tmp_path / "mixed") == (none_bytes + int8_bytes) / 2
    assert mixed != losses and mixed != ref_losses
    assert max(abs(a - b) for a, b in zip(mixed, ref_losses, strict=True)) < 2e-2


def _wan_bytes(run_dir: Path) -> int:
    import json

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sum(x["wan_bytes"] for x in lines if "step" in x and "event" not in x)


def test_actors_named_in_state_api_and_metrics_written(tmp_path):
    import json

    from _state import alive_actor_names, taken_names

    from geopipe.optimizer.measurements import Measurements
    from geopipe.optimizer.runplan import plan_run

    doc = tiny_doc(2, 2, steps=2)
    spec = parse_cluster(doc, "test")
    out = tmp_path / "m.jsonl"
    ctl = Controller(
        spec, LaunchOptions(run_dir=str(tmp_path), metrics_out=str(out), progress=False)
    )
    try:
        ctl.launch()
        alive = alive_actor_names()
        expected = {
            f"geopipe/{spec.name}/{s}/stage{k}/r{r}"
            for k, s in enumerate(("east", "west"))
            for r in range(2)
        }
        assert expected <= alive

        # Every stage actor runs with the environment geopipe sets for it (one malloc
        # arena: [Note: one malloc arena per actor] in geopipe.runtime.control.placement).
        def env(_actor) -> dict:
            return {k: os.environ.get(k) for k in ACTOR_ENV}

        envs = ray.get([a.__ray_call__.remote(env) for row in ctl.actors for a in row])
        assert envs == [ACTOR_ENV] * 4
        # ... and with what exists once it is built frozen out of the collector's scans
        # ([Note: garbage collection off the step] in geopipe.runtime.actor.stage).
        frozen = ray.get(
            [
                a.__ray_call__.remote(lambda _a: gc.get_freeze_count())
                for row in ctl.actors
                for a in row
            ]
        )
        assert min(frozen) > 10_000, frozen
        ctl.train()
    finally:
        ctl.close()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    # The plan the launch ran is the one planning function's for what it measured first
    # (geopipe plan and --dry-run call the same function), under the YAML's config hash.
    (event,) = [x for x in lines if x.get("event") == "plan"]
    replayed = plan_run(spec, Measurements.from_dict(event["planned_with"]))
    assert event["plan"] == json.loads(json.dumps(replayed.plan.to_dict()))
    assert event["config_hash"] == spec.digest
    steps = [x for x in lines if "event" not in x]
    assert [x["step"] for x in steps] == [0, 1]
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
    assert status["step"] == 2 and len(status["stages"]) == 2
    # close() returns once the actors are gone and Ray has freed their names.
    assert not taken_names(expected) and not expected & alive_actor_names()


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


def demo_doc(schedule: str, delta_n: int = 0, steps: int = 3) -> dict:
    """The demo's GPT (clusters/local-2dc.yaml: 4 layers, n_embd 128) on one device per
    site, 8 micro-batches of 1 × 64 tokens per step, fp32, a fixed plan."""
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["name"] = f"split-{schedule}"
    for s in doc["sites"]:
        s["devices_per_node"] = 1
    doc["links"][0].update(latency_ms=5.0, bandwidth_gbps=1.0, codec="none")
    doc["training"].update(global_batch_size=8, steps=steps, warmup_steps=1, data_max_bytes=200_000)
    doc["training"]["checkpoint"] = {"every_steps": 1000, "keep": 1}
    doc["plan"].update(
        schedule=schedule,
        pipelines=1,
        micro_batch_size=1,
        seq_len=64,
        codecs=["none"],
        calibrate=False,
        delta_n=delta_n,
    )
    return doc


def test_split_backward_schedules_match_1f1b_losses(tmp_path):
    """zb-h1 and lookahead-zb (ΔN 2, W deferred on the last stage) run I and W as separate
    actions; DeepSpeed's ZeRO-1 step sees the same gradients, so the per-step losses equal
    1F1B's (fp32) within 1e-6."""
    runs = {}
    for name, dn in (("1f1b", 0), ("zb-h1", 0), ("lookahead-zb", 2)):
        ctl, losses, _ = run_pipeline(demo_doc(name, dn), tmp_path / name)
        assert ctl.plan.schedule == name and ctl.plan.num_microbatches == 8
        runs[name] = losses
    assert ctl.plan.delta_n == (2,) and ctl.plan.inflight_caps  # the last launch
    base = runs["1f1b"]
    assert len(base) == 3 and base[0] > base[-1]  # it trains
    for name in ("zb-h1", "lookahead-zb"):
        assert runs[name] == pytest.approx(base, abs=1e-6), name


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
    _, int8_losses, _, int8_dir = runs(tiny_doc(1, 1, "int8", steps=3))
    assert steps[0]["wan_bytes"] < steps[1]["wan_bytes"] == steps[2]["wan_bytes"]
    assert steps[2]["wan_bytes"] == _wan_bytes(int8_dir) / 3
    assert all(max(v for v in s["codec_error"].values()) < 0.05 for s in steps[1:])
    assert losses[0] != int8_losses[0]
