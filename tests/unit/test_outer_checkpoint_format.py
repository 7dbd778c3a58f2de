"""The outer-loop checkpoint's pieces without Ray ([Note: the outer-loop checkpoint] in
geopipe.checkpoint.outer): which fragment is in flight when, which actor writes which shard,
cutting named tensors back into ZeRO-1 partitions (the inverse of the gather), and the
shard layout a loader reads, on real checkpoint files."""

from __future__ import annotations

import math

import pytest
import torch

from geopipe.checkpoint.outer import (
    INNER,
    MOMENTUM,
    group_shards,
    group_state,
    named,
    outer_entry,
    outer_layout,
    shard_index,
)
from geopipe.checkpoint.store import CheckpointError, load_checkpoint, load_state_for_layers
from geopipe.checkpoint.writer import CheckpointWriter
from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.actor.outer_ckpt import _cut, gather_outer
from geopipe.runtime.control.outerckpt import in_flight, shard_rows, shard_sites


@pytest.mark.parametrize("h,f,tau", [(4, 1, 0), (4, 2, 1), (8, 4, 1), (6, 2, 2), (12, 3, 3)])
def test_in_flight_is_exactly_between_a_send_and_its_apply(h, f, tau):
    s = StreamingSchedule(h, f, tau)
    flying = None
    for step in range(0, 4 * h + 1):
        if step >= 1 and s.sends_at(step) is not None and tau > 0:
            flying = s.sends_at(step)
        if step >= 1 and s.applies_at(step) == flying:
            flying = None
        assert in_flight(s, step) == (flying is not None), step
    # never at a round's end: a checkpoint every multiple of h holds nothing in flight
    assert not any(in_flight(s, k * h) for k in range(5))


def test_shard_rows_put_each_live_groups_first_pipeline_first():
    # [stage][pipeline]: three groups of two pipelines, two stages; "kKrR" is actor (K, R)
    rows = [[f"k{k}r{r}" for r in range(6)] for k in range(2)]
    group_of = {f"k{k}r{r}": r // 2 for k in range(2) for r in range(6)}.__getitem__
    got = shard_rows(rows, group_of)
    assert len(got) == 6  # i * S + k
    assert got[shard_index(1, 0, 2)] == ["k0r2", "k0r3"]
    assert got[shard_index(2, 1, 2)] == ["k1r4", "k1r5"]
    sites = [(a, f"site{group_of(a)}") for row in rows for a in row]
    assert shard_sites(got, sites) == ["site0", "site0", "site1", "site1", "site2", "site2"]
    # group 0 lost: the others' shards are numbered by their place among the live ones
    alive = [[a for a in row if group_of(a) != 0] for row in rows]
    got = shard_rows(alive, group_of)
    assert got[shard_index(0, 1, 2)] == ["k1r2", "k1r3"] and len(got) == 4
    assert shard_rows(rows, None) is rows  # a pipeline run: one shard per stage, as ever


def _layouts(shapes: dict[str, tuple[int, ...]], pad: int) -> tuple[list, int]:
    lay, off = [], 0
    for name, shape in shapes.items():
        lay.append((name, off, shape))
        off += math.prod(shape)
    return [lay], off + pad


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_cutting_named_tensors_inverts_the_gather(ranks):
    shapes = {"a.weight": (3, 5), "a.bias": (5,), "b.weight": (7,)}
    layouts, total = _layouts(shapes, pad=(-27) % ranks)
    flat = torch.randn(total)
    size = total // ranks
    parts = [flat[r * size : (r + 1) * size].clone() for r in range(ranks)]
    by_name = {n: flat[o : o + math.prod(s)].view(s).clone() for n, o, s in layouts[0]}
    for r in range(ranks):
        base = [torch.full((size,), 9.0)]
        (got,) = _cut(by_name, layouts, base, r)
        covered = torch.zeros(total, dtype=torch.bool)
        covered[:27] = True
        mine = covered[r * size : (r + 1) * size]
        assert torch.equal(got[mine], parts[r][mine])
        assert bool((got[~mine] == 9.0).all())  # padding keeps the base's values
    if ranks == 1:  # one replica: the gather is a copy, cut by the same layout
        taken = {"parts": {"params/": parts}, "codec": {}, "meta": {"x": 1}}
        out = gather_outer(taken, layouts, None, 1)
        assert out["meta"] == {"x": 1}
        assert all(torch.equal(out["tensors"]["params/" + n], t) for n, t in by_name.items())


def _write(root, groups: int, stages: int):
    """A checkpoint laid out as an outer-loop run writes it: theta as params/ in group 0."""
    w = CheckpointWriter(root, 8)
    for g in range(groups):
        for k in range(stages):
            name = f"layer{k}.w"
            t = {
                f"{INNER}{x}/{name}": torch.full((2,), 10.0 * g + k)
                for x in ("params", "exp_avg", "exp_avg_sq")
            }
            if g == 0:
                t[f"params/{name}"] = torch.full((2,), -1.0 - k)
                t[f"{MOMENTUM}{name}"] = torch.full((2,), 0.5)
            meta = {"adam_step": 8, "lr_step": 8, "layers": [k, k + 1], "group": g}
            w.write_shard(shard_index(g, k, stages), t, meta)
    manifest = {
        "config_hash": "x",
        "plan": {},
        "data": {},
        "model": {"n_layer": 2, "n_embd": 4, "n_head": 1, "vocab_size": 8, "max_seq_len": 4},
        **{"outer": outer_entry(groups, stages, {"h": 4})},
    }
    return w.commit(manifest, num_stages=groups * stages)


def test_a_loader_reads_each_groups_state_and_theta_as_the_params(tmp_path):
    ckpt = load_checkpoint(_write(tmp_path, groups=2, stages=2))
    assert outer_layout(ckpt.manifest) == (2, 2)
    assert [s.stage for s in group_shards(ckpt, 1)] == [2, 3]
    st = group_state(ckpt, 1, ["layer0.w", "layer1.w"])
    assert st["step"] == 8 and torch.equal(st["params"]["layer1.w"], torch.full((2,), 11.0))
    # what every by-name reader sees (export, a pipeline run's resume): theta_global
    plain = load_state_for_layers(ckpt, ["layer0.w", "layer1.w"])["params"]
    assert torch.equal(plain["layer1.w"], torch.full((2,), -2.0))
    assert torch.equal(
        named(group_shards(ckpt, 0), MOMENTUM, ["layer0.w"])["layer0.w"], torch.full((2,), 0.5)
    )
    with pytest.raises(CheckpointError, match=r"groups 0\.\.1, not group 2"):
        group_shards(ckpt, 2)
    assert outer_layout({"num_stages": 3}) is None
    with pytest.raises(CheckpointError, match="2 groups x 2 stages"):
        outer_layout({"outer": {"groups": 2, "stages": 2}, "num_stages": 3})


def test_a_launch_refuses_an_end_in_flight_and_another_group_count(tmp_path):
    from types import SimpleNamespace

    from geopipe.runtime.control.cluster import LaunchError
    from geopipe.runtime.control.outerckpt import check_outer_launch

    def spec(steps):
        return SimpleNamespace(training=SimpleNamespace(steps=steps))

    def outer(groups):
        setting = SimpleNamespace(h=4, fragments=2, overlap=1)
        return SimpleNamespace(setting=setting, plan=SimpleNamespace(num_groups=groups))

    check_outer_launch(spec(5), None, None)  # a pipeline run: nothing to check
    check_outer_launch(spec(6), outer(2), None)  # fragment 0 applied, 1 not yet sent
    with pytest.raises(LaunchError, match=r"training\.steps"):
        check_outer_launch(spec(5), outer(2), None)  # fragment 0 sent after 5, applied at 6
    path = _write(tmp_path, groups=2, stages=1)
    resume = SimpleNamespace(path=str(path))
    check_outer_launch(spec(8), outer(2), resume)
    with pytest.raises(LaunchError, match="2 replica groups, this outer-loop run has 3"):
        check_outer_launch(spec(8), outer(3), resume)


def test_a_checkpoint_after_a_lost_group_is_read_by_stable_group_ids():
    from geopipe.checkpoint.outer import group_position

    manifest = {"outer": {"groups": 2, "stages": 1, "group_ids": [1, 2]}, "num_stages": 2}
    assert [group_position(manifest, g) for g in (1, 2)] == [0, 1]
    with pytest.raises(CheckpointError, match=r"groups \[1, 2\], not group 0"):
        group_position(manifest, 0)
    assert group_position({"outer": {"groups": 2, "stages": 1}}, 1) == 1  # no ids: all there
