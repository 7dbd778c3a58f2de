"""What a run reports beside its step lines (pure: no Ray): per-group losses, the outer
loop's rounds and the held-out evaluation as TensorBoard scalars, the same scalars to W&B,
the progress line's round, evaluation and ETA, the W&B mode, the held-out split, and the
``logging`` / ``training.eval`` keys."""

from __future__ import annotations

import math

import numpy as np
import pytest

from geopipe.config import parse_cluster
from geopipe.model.data import Corpus, TokenStream
from geopipe.runtime.actor.evaluate import (
    EVAL_SEED_SALT,
    EvalSetup,
    HeldOut,
    eval_samples,
    held_out_stream,
    split_corpus,
)
from geopipe.runtime.actor.executor import IterationResult
from geopipe.runtime.control.evaluation import Evaluator, summarize
from geopipe.runtime.control.metrics import MetricsSink, StepMetrics, aggregate
from geopipe.runtime.control.reporting import Eta, Progress, Reporter, clock
from geopipe.runtime.control.wandb_log import resolve_mode


def result(stage: int, replica: int, losses=()) -> IterationResult:
    return IterationResult(
        stage=stage,
        replica=replica,
        step=0,
        losses=list(losses),
        busy_s=0.5,
        wait_s=0.0,
        duration_s=1.0,
        start=0.0,
        wan_bytes=0,
        micro_batches=2,
        optimizer_steps=1,
    )


def metrics(step: int, loss: float, group_loss=()) -> StepMetrics:
    return StepMetrics(
        step=step,
        loss=loss,
        iteration_time_s=0.5,
        tokens=64,
        bubble_ratio=0.1,
        wan_bytes=0,
        tokens_per_s=128.0,
        group_loss=list(group_loss),
    )


def test_group_loss_is_each_replica_groups_mean() -> None:
    """Four pipelines in two groups (0, 0, 1, 1): each group's loss is the mean of its
    pipelines' last-stage micro-batch losses; the step's loss the mean of all."""
    results = [result(0, r) for r in range(4)] + [
        result(1, 0, (1.0, 3.0)),
        result(1, 1, (2.0, 2.0)),
        result(1, 2, (5.0, 7.0)),
        result(1, 3, (6.0, 6.0)),
    ]
    m = aggregate(results, num_stages=2, tokens=64, groups=(0, 0, 1, 1))
    assert m.group_loss == [2.0, 6.0] and m.loss == 4.0
    assert m.to_json()["group_loss"] == [2.0, 6.0]
    one = aggregate(results, num_stages=2, tokens=64)  # one group: no per-group figure
    assert one.group_loss == [] and "group_loss" not in one.to_json()


class FakeWandb:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.closed = False

    def log(self, scalars: dict, step: int) -> None:
        self.logged.append((step, dict(scalars)))

    def close(self) -> None:
        self.closed = True


def test_outer_rounds_eval_and_group_loss_reach_tensorboard_and_wandb(tmp_path) -> None:
    """TensorBoard's own reader finds the per-group losses, each outer round's figures and
    each evaluation; the W&B logger is handed exactly the same scalars at the same steps;
    metrics.jsonl keeps the rows."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    wb = FakeWandb()
    sink = MetricsSink(
        tmp_path / "m.jsonl", "r", use_ray=False, tensorboard=tmp_path / "tb", wandb=wb
    )
    sink.write(metrics(0, 4.0, (3.5, 4.5)))
    row = {"step": 1, "round": 0, "fragment": 0, "groups": 2, "apply_s": 0.25}
    row |= {"overlapped_s": 0.5, "exposed_s": 0.125, "bytes": 4096, "codec_error": 0.01}
    sink.event("outer_round", **row, digests_equal=True)
    sink.event("eval", step=1, eval_loss=3.0, perplexity=math.exp(3.0), micro_batches=4)
    sink.event("checkpoint", step=1)  # no scalars
    sink.close()
    assert wb.closed
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tb = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert tb[0, "group/0/loss"] == 3.5 and tb[0, "group/1/loss"] == 4.5
    assert tb[1, "outer/exposed_s"] == 0.125 and tb[1, "outer/bytes"] == 4096
    assert tb[1, "outer/codec_error"] == pytest.approx(0.01)
    assert tb[1, "eval/loss"] == 3.0
    assert tb[1, "eval/perplexity"] == pytest.approx(math.exp(3.0))
    logged = {(s, tag): v for s, scalars in wb.logged for tag, v in scalars.items()}
    assert logged.keys() == tb.keys()  # TensorBoard's float32 values, W&B's float64
    assert all(tb[k] == pytest.approx(v, rel=1e-6) for k, v in logged.items())
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x.get("event") for x in lines] == [None, "outer_round", "eval", "checkpoint"]
    assert lines[0]["group_loss"] == [3.5, 4.5]


def test_eta_takes_the_median_of_recent_steps_not_the_first() -> None:
    eta = Eta()
    assert eta.seconds(10) is None
    eta.tick(0.0)
    assert eta.seconds(10) is None  # one tick: no interval yet
    for t in (30.0, 31.0, 32.0, 33.0, 40.0, 41.0):  # a 30 s first step, one 7 s straggler
        eta.tick(t)
    assert eta.seconds(10) == pytest.approx(10 * 1.0)
    assert eta.seconds(-3) == 0
    assert clock(75) == "1:15" and clock(3725) == "1:02:05"


def test_progress_line_shows_round_eval_and_eta(tmp_path) -> None:
    """The reporter learns H from the plan event, shows "round r/R" once a round's last
    fragment is applied, the latest evaluation, and the time left."""
    rep = Reporter("r", tmp_path, 20)
    rep.start_progress(False, 0)
    rep.event("plan", outer={"h": 4, "fragments": 2})
    rep.event("outer_round", step=4, round=0, fragment=0)
    assert rep.progress.round is None  # the round is not over before its last fragment
    rep.event("outer_round", step=4, round=0, fragment=1)
    rep.event("eval", step=4, eval_loss=2.5, perplexity=math.exp(2.5))
    p: Progress = rep.progress
    p.eta.tick(0.0)
    p.eta.tick(2.0)
    p.done = 10
    info = p.info(metrics(9, 3.0))
    assert "round 1/5" in info and "eval 2.5000 (ppl 12.18)" in info
    assert info.endswith("ETA 0:20")


def test_wandb_mode_auto_goes_offline_without_a_server() -> None:
    assert resolve_mode("offline") == "offline"
    assert resolve_mode("auto", env={"WANDB_MODE": "disabled"}) == "disabled"
    asked: list[str] = []

    def down(url: str) -> bool:
        asked.append(url)
        return False

    assert resolve_mode("auto", env={}, reachable=down) == "offline"
    assert asked == ["https://api.wandb.ai"]
    env = {"WANDB_BASE_URL": "http://wandb.internal:8080"}
    assert resolve_mode("auto", env=env, reachable=lambda u: u == env["WANDB_BASE_URL"]) == (
        "online"
    )


def test_held_out_split_is_disjoint_and_training_never_reaches_it() -> None:
    corpus = Corpus.from_bytes(bytes(range(256)) * 8)  # 2048 tokens
    train, held = split_corpus(corpus, 0.25, seq_len=16)
    assert (len(train), len(held)) == (1536, 512)
    assert held.window(0, 4).tolist() == corpus.window(1536, 4).tolist()
    stream = TokenStream(train, seed=3)
    for i in range(300):  # every training window ends inside the training part
        s = stream.sample(i, 16)
        offsets = [o for o in range(1536 - 16) if np.array_equal(corpus.window(o, 17), s)]
        assert offsets and max(offsets) + 17 <= 1536
    with pytest.raises(IndexError):
        train.window(1530, 17)
    assert train.digest != held.digest != corpus.digest
    with pytest.raises(ValueError, match=r"training\.eval\.holdout"):
        split_corpus(corpus, 0.005, seq_len=16)  # 10 tokens held out: not one sample


def test_held_out_stream_splits_the_whole_corpus_again() -> None:
    """A new layout calls set_eval on a stage whose stream is already split: the split is
    taken of the whole corpus again, not of the training part."""
    corpus = Corpus.from_bytes(bytes(range(256)) * 4)
    setup = EvalSetup(data=None, holdout=0.5, sequences=8, seed=1, data_max_bytes=1 << 20)
    train, stream = held_out_stream(setup, corpus, 8)
    again, _ = held_out_stream(setup, train, 8)
    assert isinstance(again, HeldOut) and (again.start, again.end) == (0, 512)
    assert stream.seed == 1 + EVAL_SEED_SALT


def test_eval_micro_batches_cover_the_held_out_set_once() -> None:
    parts = [eval_samples(16, 2, 3, p) for p in range(3)]
    flat = sorted(i for part in parts for mb in part for i in mb)
    assert flat == list(range(16))
    assert parts[1][0] == [2, 3] and len(parts[0]) == 3 and len(parts[2]) == 2


def test_eval_summary_and_when_it_runs(tmp_path) -> None:
    answers = [
        {"stage": 0, "pipeline": 0, "group": 0, "losses": []},
        {"stage": 1, "pipeline": 0, "group": 0, "losses": [2.0, 4.0]},
        {"stage": 1, "pipeline": 1, "group": 1, "losses": [6.0]},
    ]
    f = summarize(answers, 7)
    assert f["eval_loss"] == 4.0 and f["perplexity"] == pytest.approx(math.exp(4.0))
    assert f["group_eval_loss"] == [3.0, 6.0] and f["micro_batches"] == 3
    spec = parse_cluster(doc(eval={"every_steps": 3, "batches": 2}), "t")
    ev = Evaluator(spec, workers=None, reporter=None)  # type: ignore[arg-type]
    assert [d for d in range(1, 11) if ev.due(d, 10)] == [3, 6, 9, 10]
    assert ev.setup.sequences == 2 * 8 and ev.setup.holdout == 0.05
    off = Evaluator(parse_cluster(doc(), "t"), workers=None, reporter=None)  # type: ignore[arg-type]
    assert not any(off.due(d, 10) for d in range(1, 11))
    off.prepare([object()])  # no eval: no actor is asked anything


def doc(**training) -> dict:
    site = {"nodes": 1, "devices_per_node": 1, "device_memory_gb": 2, "device_tflops": 1.0}
    return {
        "name": "obs",
        "sites": [{"name": "east", **site}],
        "model": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "max_seq_len": 32},
        "training": {"global_batch_size": 8, "steps": 10, "lr": 0.01, **training},
    }


def test_logging_and_eval_keys_validate_and_leave_the_config_hash_alone() -> None:
    plain = parse_cluster(doc(), "t")
    spec = parse_cluster(
        {
            **doc(eval={"every_steps": 5, "data": "stdlib"}),
            "logging": {"wandb": {"project": "geo", "mode": "offline", "tags": ["a", "b"]}},
        },
        "t",
    )
    assert spec.logging.wandb.project == "geo" and spec.logging.wandb.tags == ["a", "b"]
    assert spec.training.eval.every_steps == 5 and spec.training.eval.batches == 1
    assert plain.logging.wandb is None and plain.training.eval is None
    assert spec.digest == plain.digest  # what a run reports is no part of what it trains
    from geopipe.config import ConfigError

    with pytest.raises(ConfigError, match=r"logging\.wandb\.mode"):
        parse_cluster({**doc(), "logging": {"wandb": {"project": "p", "mode": "sometimes"}}}, "t")
    with pytest.raises(ConfigError, match=r"training\.eval\.holdout"):
        parse_cluster(doc(eval={"holdout": 0.9}), "t")
    with pytest.raises(ConfigError, match=r"training\.eval\.batches"):
        parse_cluster(doc(eval={"batches": 0}), "t")


def test_the_controller_evaluates_on_schedule_and_on_every_new_layout(
    tmp_path, monkeypatch, corpus
) -> None:
    """On the fake worker group: evaluations after steps 2, 4 and the last (5), each the
    last stages' answers averaged; a replica lost in step 2 gives a new layout, whose
    actors all get the held-out setup again before training goes on."""
    from tests.unit._controller_runs import Run, make_doc
    from tests.unit.fakes import FakeStage, FakeWorkers

    prepared: list[str] = []  # every actor given the setup, in order
    original = FakeStage.set_eval

    def set_eval(self, setup) -> None:
        prepared.append(self.handle.name)
        original(self, setup)

    monkeypatch.setattr(FakeStage, "set_eval", set_eval)
    fake = FakeWorkers()
    fake.inject("west/stage1/r1", die_at_step=2)
    doc = make_doc(corpus, steps=5, every=0)
    doc["training"]["eval"] = {"every_steps": 2, "batches": 2}
    run = Run(doc, tmp_path / "run", fake).go()
    assert "recovering 2" in run.path()
    evals = run.events("eval")
    assert [(e["step"], e["eval_loss"]) for e in evals] == [(2, 2.0), (4, 4.0), (5, 5.0)]
    assert [e["step"] for e in run.ctl.evals.results] == [2, 4, 5]
    # 2 pipelines x 2 stages at launch; the 3 survivors of the new layout again
    assert len(prepared) == 4 + 3 and len(set(prepared[:4])) == 4
    assert set(prepared[4:]) < set(prepared[:4]) and "geopipe/fk2/west/stage1/r1" in prepared[:4]
    assert "geopipe/fk2/west/stage1/r1" not in prepared[4:]
