"""LR schedules against transformers' schedulers, the global norm's exchange and price, the
NaN guard's verdicts and the model-error path (issue 32: items 1, 2, 5, 6), without Ray."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import get_scheduler

from geopipe.config import ConfigError, parse_cluster
from geopipe.optimizer.costs import norm_exchange_s
from geopipe.runtime.actor.executor import IterationResult
from geopipe.runtime.actor.gradnorm import ModelError, NormExchange
from geopipe.runtime.actor.lr import LRFactor
from geopipe.runtime.control.guards import Diverged, NanGuard
from geopipe.runtime.control.health import (
    MODEL_ERROR_MARK,
    ModelFailed,
    raise_model_error,
)
from geopipe.runtime.control.workers import WorkerFailed, WorkerLost

LOCAL = Path(__file__).parents[2] / "clusters" / "local-2dc.yaml"
LR, HORIZON, WARMUP = 3e-3, 20, 4


def _library_lrs(name: str, steps: int, **kw: Any) -> list[float]:
    """The LR transformers' scheduler of that name gives each optimizer step."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = get_scheduler(name, opt, num_warmup_steps=WARMUP, num_training_steps=HORIZON, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


CASES = [
    ("cosine", 0.0, "cosine", {}),
    ("cosine", 0.1, "cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("linear", 0.0, "linear", {}),
    ("constant", 0.0, "constant_with_warmup", {}),
    ("wsd", 0.05, "warmup_stable_decay", {"num_decay_steps": 5, "min_lr_ratio": 0.05}),
]


@pytest.mark.parametrize(("ours", "floor", "name", "kw"), CASES)
def test_each_schedule_is_the_library_scheduler_of_that_name(
    ours: str, floor: float, name: str, kw: dict
) -> None:
    want = _library_lrs(name, HORIZON, scheduler_specific_kwargs=kw or None)
    f = LRFactor(ours, WARMUP, HORIZON, floor, kw.get("num_decay_steps", 0))
    got = [LR * f(k) for k in range(HORIZON)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-9
    assert got[WARMUP] == pytest.approx(LR)  # warmup ends at the peak, as there
    # At and past the horizon: the final value (the minimum LR; the peak for constant),
    # never the library's cosine climbing back up.
    final = LR if ours == "constant" else LR * floor
    for k in (HORIZON, HORIZON + 1, 2 * HORIZON, 10 * HORIZON):
        assert LR * f(k) == pytest.approx(final, abs=1e-12)
    assert LR * f(HORIZON - 1) >= final - 1e-12


def _doc(**training: Any) -> dict:
    doc = yaml.safe_load(LOCAL.read_text())
    doc["training"].update(training)
    return doc


@pytest.mark.parametrize(
    ("training", "field", "words"),
    [
        ({"lr_schedule": "linear", "min_lr": 1e-5}, "min_lr", "linear schedule decays to 0"),
        ({"lr_schedule": "constant", "min_lr": 1e-5}, "min_lr", "constant"),
        ({"min_lr": 10.0}, "min_lr", "above lr"),
        ({"lr_schedule": "wsd", "wsd_decay_steps": 10**6}, "wsd_decay_steps", "horizon"),
        ({"betas": [0.9, 1.0]}, "betas", "below 1"),
        ({"eps": 0}, "training.eps", ""),
        ({"lr_schedule": "exp"}, "training.lr_schedule", ""),
        ({"grad_clip_scope": "layer"}, "training.grad_clip_scope", ""),
        ({"nan_policy": "ignore"}, "training.nan_policy", ""),
    ],
)
def test_bad_optimizer_settings_name_the_field(training: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster(_doc(**training), "t.yaml")
    text = str(info.value)
    assert field in text and words in text


def test_defaults_and_settings_reach_the_spec() -> None:
    t = parse_cluster(_doc(lr_schedule="wsd", min_lr=1e-5, betas=[0.8, 0.99], eps=1e-6)).training
    assert (t.lr_schedule, t.min_lr, t.betas, t.eps) == ("wsd", 1e-5, (0.8, 0.99), 1e-6)
    assert t.wsd_decay(200) == 20 and t.grad_clip_scope == "global" and t.nan_policy == "stop"


def test_norm_exchange_is_priced_as_the_farthest_pair_latency() -> None:
    spec = parse_cluster(_doc(grad_clip=1.0))
    sites = [s.name for s in spec.sites]
    lk = spec.link(sites[0], sites[1])
    assert norm_exchange_s(spec, [sites[0], sites[1]]) == pytest.approx(lk.latency_s)
    one = spec.site(sites[0]).intra_latency_ms / 1e3
    assert norm_exchange_s(spec, [sites[0], sites[0]]) == pytest.approx(one)
    assert norm_exchange_s(spec, [sites[0]]) == 0.0  # one stage: nothing to exchange
    stage = parse_cluster(_doc(grad_clip=1.0, grad_clip_scope="stage"))
    assert norm_exchange_s(stage, sites[:2]) == 0.0
    assert norm_exchange_s(parse_cluster(_doc(grad_clip=0.0)), sites[:2]) == 0.0


class _Inbox:
    def __init__(self, frames: dict) -> None:
        self.frames = frames

    def get(self, key: tuple, timeout: float) -> torch.Tensor:
        return self.frames[key]


class _Sender:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, key: tuple, tensor: torch.Tensor, stream: str) -> int:
        self.sent.append((key, tensor.clone()))
        return 0


def test_global_norm_sums_each_group_once_in_one_order() -> None:
    """Stage 1 of three, stage 2 sharing stage 1's ZeRO-1 group (a mixed plan): the group
    counts once; the result is what every stage computes, and an invalid one poisons it."""
    s = _Sender()
    peer0 = torch.tensor([0.0, 2.0, 3.0])
    same = torch.tensor([2.0, 5.0, 4.0])  # stage 2: the same group as this one
    ex = NormExchange(1, (2, 5), [0, 2], [s], _Inbox({("N", 7, 0): peer0, ("N", 7, 2): same}), 1)
    got = ex.combine(torch.tensor(4.0), 7, 1.0)
    assert float(got) == pytest.approx(5.0)  # sqrt(3^2 + 4^2), the shared group once
    assert ex.stage_norm == 4.0 and s.sent[0][0] == ("N", 7, 1)
    assert s.sent[0][1].tolist() == [2.0, 5.0, 4.0]
    bad = NormExchange(1, (2, 5), [0], [s], _Inbox({("N", 8, 0): torch.tensor([0, 2, -1.0])}), 1)
    assert float(bad.combine(torch.tensor(4.0), 8, 1.0)) == -1.0  # DeepSpeed skips it
    scaled = NormExchange(1, (2, 5), [0], [s], _Inbox({("N", 9, 0): peer0}), 1)
    assert float(scaled.combine(torch.tensor(4.0 * 1024), 9, 1024.0)) == pytest.approx(5 * 1024)


def _result(stage: int, losses: list[float], norm: float | None) -> IterationResult:
    return IterationResult(stage, 0, 3, losses, 0.0, 0.0, 0.0, 0.0, 0, 1, 1, grad_norm=norm)


def test_nan_guard_stops_naming_step_stage_and_tensor() -> None:
    t = parse_cluster(_doc()).training
    guard = NanGuard(t)
    guard.check(3, [_result(0, [], 1.0), _result(1, [2.0, 2.1], 1.5)])  # finite: nothing
    with pytest.raises(Diverged) as info:
        guard.check(4, [_result(0, [], math.inf), _result(1, [2.0, math.nan], 1.0)])
    msg = str(info.value)
    assert "step 4" in msg and "micro-batch 1 (stage 1" in msg
    assert "gradient norm of stage 0" in msg and info.value.exit_code == 3


def test_nan_guard_skip_policy_counts_to_its_limit() -> None:
    t = parse_cluster(_doc(nan_policy="skip", max_skipped_steps=2)).training
    guard = NanGuard(t)
    for step in (5, 6):
        guard.check(step, [_result(1, [math.nan], math.inf)])
    assert guard.skipped == [5, 6]
    with pytest.raises(Diverged, match=r"step 9.*after 2 skipped steps"):
        guard.check(9, [_result(1, [math.nan], math.inf)])


def test_model_error_ends_the_run_with_its_message() -> None:
    assert MODEL_ERROR_MARK == ModelError.MARK
    with pytest.raises(ModelError) as info, ModelError.wrap("forward", 2, "stage 1, step 0: "):
        raise ValueError("sequence longer than the model allows")
    remote = (
        "ray::StageWorker.run_iteration() (pid=1)\n  File x, line 3\n"
        f"geopipe.runtime.actor.gradnorm.ModelError: {info.value}"
    )
    with pytest.raises(ModelFailed) as failed:
        raise_model_error(WorkerFailed(remote))
    text = str(failed.value)
    assert "stage 1, step 0: forward of micro-batch 2 raised ValueError: sequence longer" in text
    assert "no recovery" in text and failed.value.exit_code == 1
    raise_model_error(WorkerFailed("gloo: Connection reset by peer"))  # a peer: recovery
    raise_model_error(WorkerLost(remote))  # a lost process is never a model error


def test_planner_adds_the_exchange_to_every_stage_step_and_the_iteration() -> None:
    """The same candidate with and without global clipping: every stage's optimizer step
    longer by the link's one-way latency, and so the predicted iteration."""
    from geopipe.optimizer.evaluate import Candidate, Evaluator

    plain, clipped = parse_cluster(_doc()), parse_cluster(_doc(grad_clip=1.0))
    cand = Candidate(2, 1, 128, (0,), ("none",))
    a, b = Evaluator(plain), Evaluator(clipped)
    plan = a.make_plan(cand)
    lat = clipped.link(*plan.stage_sites[:2]).latency_s
    extra = [y - x for x, y in zip(a.costs(plan).step_s, b.costs(plan).step_s, strict=True)]
    assert extra == pytest.approx([lat] * plan.num_stages)
    ta, tb = a.evaluate(cand).iteration_time_s, b.evaluate(cand).iteration_time_s
    assert lat * 0.99 <= tb - ta <= lat * plan.num_stages + 1e-9
