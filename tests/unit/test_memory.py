"""Per-stage memory model against hand-computed numbers, and the Evaluator's memory check.

The toy model: n_layer=2, n_embd=h=8, n_head=2, vocab V=16, max_seq_len=4. By hand:

* embed  = V·h + S·h                 = 128 + 32       = 160 parameters
* block  = 12·h² + 13·h              = 768 + 104      = 872 parameters
* head   = 2·h + V·h                 = 16 + 128       = 144 parameters
  (total 160 + 2·872 + 144 = 2048)

Activations for micro-batch b=2, seq s=4 (b·s·h = 64 elements):
embed keeps b·s·h, a block 16·b·s·h, the head b·s·h + 2·b·s·V = 64 + 256 elements; a stage that
does not start at layer 0 also keeps its received input (b·s·h).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geopipe.config import GiB, ModelSpec, load_cluster
from geopipe.model.sizes import layer_param_counts
from geopipe.optimizer.costs import activation_bytes
from geopipe.optimizer.evaluate import INFEASIBLE, Candidate, Evaluator, fits
from geopipe.optimizer.memory import MemoryBreakdown, snapshot_bytes, stage_memory

ROOT = Path(__file__).resolve().parents[2]
TOY = ModelSpec(n_layer=2, n_embd=8, n_head=2, vocab_size=16, max_seq_len=4)


def test_toy_param_counts() -> None:
    assert layer_param_counts(TOY) == [160, 872, 872, 144]
    assert sum(layer_param_counts(TOY)) == 2048


def test_toy_activation_bytes() -> None:
    assert activation_bytes(TOY, 0, 2, 4, "fp32") == 64 * 4
    assert activation_bytes(TOY, 1, 2, 4, "fp32") == 16 * 64 * 4
    assert activation_bytes(TOY, 3, 2, 4, "fp32") == (64 + 256) * 4
    assert activation_bytes(TOY, 3, 2, 4, "bf16") == (64 + 256) * 2


def test_first_stage_fp32() -> None:
    # layers [0, 2): embed + block 0 = 1032 params; 2 replicas; 3 micro-batches in flight.
    mem = stage_memory(TOY, "fp32", (0, 2), replicas=2, micro_batch=2, seq_len=4, in_flight=3)
    assert mem == MemoryBreakdown(
        weights=4 * 1032,  # 4128
        gradients=4 * 1032,  # 4128
        adam_state=8 * 1032 / 2,  # Adam m, v sharded over 2 replicas: 4128
        activations=3 * (64 * 4 + 16 * 64 * 4),  # 3 × (256 + 4096) = 13056
    )
    assert mem.total == 4128 * 3 + 13056


def test_last_stage_bf16() -> None:
    # layers [2, 4): block 1 + head = 1016 params; 4 replicas; 2 in flight.
    mem = stage_memory(TOY, "bf16", (2, 4), replicas=4, micro_batch=2, seq_len=4, in_flight=2)
    assert mem.weights == 2 * 1016  # 2032
    assert mem.gradients == 2 * 1016  # 2032
    assert mem.adam_state == 12 * 1016 / 4  # fp32 master + m + v over 4 replicas: 3048
    # block 16·64·2 = 2048, head (64 + 256)·2 = 640, received input 64·2 = 128
    assert mem.activations == 2 * (2048 + 640 + 128)  # 5632
    assert mem.total == 2032 + 2032 + 3048 + 5632


def test_fp16_is_priced_like_bf16() -> None:
    a = stage_memory(TOY, "fp16", (1, 3), 3, 1, 4, 5)
    b = stage_memory(TOY, "bf16", (1, 3), 3, 1, 4, 5)
    assert a == b
    # two blocks: 1744 params; b·s·h = 32 elements
    assert a.weights == 2 * 1744
    assert a.adam_state == pytest.approx(12 * 1744 / 3)
    assert a.activations == 5 * (2 * 16 * 32 * 2 + 32 * 2)


def test_whole_model_on_one_device() -> None:
    mem = stage_memory(TOY, "fp32", (0, 4), 1, 1, 4, 1)
    assert mem.weights == mem.gradients == 4 * 2048
    assert mem.adam_state == 8 * 2048
    # no received input: embed 32 + 2 blocks 2·16·32 + head 32 + 2·4·16, in fp32
    assert mem.activations == 4 * (32 + 2 * 512 + 32 + 128)
    # fp32 and mixed precision both spend 16 bytes per parameter on static state at d = 1
    bf = stage_memory(TOY, "bf16", (0, 4), 1, 1, 4, 1)
    assert bf.weights + bf.gradients + bf.adam_state == 16 * 2048


def test_memory_scales_as_documented() -> None:
    base = stage_memory(TOY, "fp32", (1, 3), 1, 2, 4, 1)
    more = stage_memory(TOY, "fp32", (1, 3), 1, 2, 4, 7)
    assert more.activations == 7 * base.activations
    assert more.weights == base.weights and more.adam_state == base.adam_state
    sharded = stage_memory(TOY, "fp32", (1, 3), 8, 2, 4, 1)
    assert sharded.adam_state == base.adam_state / 8  # ZeRO-1 shards optimizer state only
    assert sharded.weights == base.weights and sharded.gradients == base.gradients
    assert sharded.activations == base.activations
    double = stage_memory(TOY, "fp32", (1, 3), 1, 4, 4, 1)
    assert double.activations == 2 * base.activations


def test_param_counts_match_the_real_model() -> None:
    torch = pytest.importorskip("torch")
    from geopipe.model.gpt import GPTConfig, GPTStage, param_count

    for spec in (TOY, ModelSpec(n_layer=3, n_embd=32, n_head=4, vocab_size=50, max_seq_len=16)):
        cfg = GPTConfig(spec.n_layer, spec.n_embd, spec.n_head, spec.vocab_size, spec.max_seq_len)
        counts = layer_param_counts(spec)
        for i in range(len(counts)):
            assert param_count(cfg, i, i + 1) == counts[i]
            with torch.device("meta"):
                stage = GPTStage(cfg, i, i + 1)
            assert sum(p.numel() for p in stage.parameters()) == counts[i], i


# --------------------------------------------------------------------------------------------
# The Evaluator flags candidates whose memory exceeds the device


def _shrink_memory(spec, gib: float):
    sites = [s.model_copy(update={"device_memory_gb": gib}) for s in spec.sites]
    return spec.model_copy(update={"sites": sites})


def test_evaluator_memory_matches_stage_memory() -> None:
    spec = load_cluster(ROOT / "clusters" / "local-2dc.yaml")
    ev = Evaluator(spec)
    for b, dn, in_flight in [(1, 6, [8, 1]), (4, 6, [4, 1]), (2, 0, [2, 1])]:
        # m = 32 / (2 pipelines × b); stage 0 holds 1 + ΔN + 1 (at most m), the last stage 1
        e = ev.evaluate(Candidate(2, b, 128, (dn,), ("int8",)))
        plan = e.plan
        assert plan is not None
        assert plan.num_microbatches == 32 // (2 * b)
        for k in range(2):
            want = stage_memory(spec.model, "fp32", plan.partition[k], 2, b, 128, in_flight[k])
            assert e.memory[k] == want
        assert e.memory_limit_bytes == [2 * GiB, 2 * GiB]


def test_evaluator_flags_memory_over_device() -> None:
    spec = load_cluster(ROOT / "clusters" / "local-2dc.yaml")
    c = Candidate(2, 2, 128, (16,), ("none",))  # m = 8: stage 0 holds all 8 micro-batches
    ok = Evaluator(spec).evaluate(c)
    assert ok.feasible, ok.reason
    peak = max(ok.peak_memory_bytes)
    worst = ok.peak_memory_bytes.index(peak)

    just_above = _shrink_memory(spec, peak * 1.001 / GiB)
    e = Evaluator(just_above).evaluate(c)
    assert e.feasible and e.reason == "ok"

    just_below = _shrink_memory(spec, peak * 0.999 / GiB)
    e = Evaluator(just_below).evaluate(c)
    assert not e.feasible
    assert f"stage {worst} needs" in e.reason and "GiB" in e.reason
    assert e.fitness >= INFEASIBLE
    assert e.fitness > Evaluator(just_above).evaluate(c).fitness
    # same simulated time: only the verdict changes
    assert e.iteration_time_s == ok.iteration_time_s

    # a leaner candidate (fewer micro-batches in flight) still fits the smaller device
    lean = Evaluator(just_below).evaluate(Candidate(2, 2, 128, (0,), ("none",)))
    assert lean.feasible, lean.reason

    # fits(spec, plan) is the evaluator's device verdict, for any caller holding a plan
    assert ok.plan is not None and lean.plan is not None
    assert fits(just_above, ok.plan) and not fits(just_below, ok.plan)
    assert fits(just_below, lean.plan)
    for sched in ("1f1b", "lookahead", "lookahead-zb"):
        e = Evaluator(just_below, schedule=sched).evaluate(c)
        assert e.plan is not None and fits(just_below, e.plan) == e.feasible


def test_infeasible_penalty_grows_with_overshoot() -> None:
    spec = load_cluster(ROOT / "clusters" / "local-2dc.yaml")
    c = Candidate(2, 8, 128, (16,), ("none",))
    peak = max(Evaluator(spec).evaluate(c).peak_memory_bytes)
    a = Evaluator(_shrink_memory(spec, peak / 2 / GiB)).evaluate(c)
    b = Evaluator(_shrink_memory(spec, peak / 4 / GiB)).evaluate(c)
    assert not a.feasible and not b.feasible
    assert b.fitness > a.fitness >= INFEASIBLE


def test_snapshot_bytes_by_hand() -> None:
    # fp32 weights + both Adam moments (12 B/param) for each of the 2 kept boundaries.
    assert snapshot_bytes(TOY, (0, 2), kept=2) == (160 + 872) * 12 * 2
    assert snapshot_bytes(TOY, (2, 4), kept=1) == (872 + 144) * 12


def _with(spec, site_updates: dict | None = None, **training):
    sites = [s.model_copy(update=site_updates or {}) for s in spec.sites]
    return spec.model_copy(
        update={"sites": sites, "training": spec.training.model_copy(update=training)}
    )


def test_evaluator_checks_host_ram_for_recovery_snapshots() -> None:
    """Per node: devices_per_node replicas of the site's biggest stage (worst placement).
    Too little host RAM makes the plan infeasible with a reason that names the switch;
    turning snapshots off (recover from checkpoints) makes it feasible again."""
    spec = load_cluster(ROOT / "clusters" / "local-2dc.yaml")
    c = Candidate(2, 2, 128, (2,), ("int8",))
    e = Evaluator(spec).evaluate(c)
    assert e.feasible and e.host_memory_limit_bytes == {}  # no host_memory_gb: not checked
    assert spec.training.snapshots_kept == 2  # the newest step boundary and the one before
    plan = e.plan
    for site in spec.sites:
        want = max(
            snapshot_bytes(spec.model, plan.partition[k], spec.training.snapshots_kept)
            * site.devices_per_node
            for k in range(plan.num_stages)
            if plan.stage_sites[k] == site.name
        )
        assert e.host_memory_bytes[site.name] == want
    need = max(e.host_memory_bytes.values())

    roomy = Evaluator(_with(spec, {"host_memory_gb": need * 1.01 / GiB})).evaluate(c)
    assert roomy.feasible, roomy.reason
    tight = Evaluator(_with(spec, {"host_memory_gb": need * 0.99 / GiB})).evaluate(c)
    assert not tight.feasible and tight.fitness >= INFEASIBLE
    assert "recovery snapshots need" in tight.reason
    assert "training.recovery_snapshots: false" in tight.reason
    off = _with(spec, {"host_memory_gb": need * 0.99 / GiB}, recovery_snapshots=False)
    e_off = Evaluator(off).evaluate(c)
    assert e_off.feasible and e_off.host_memory_bytes == {}
    assert e_off.iteration_time_s == e.iteration_time_s
