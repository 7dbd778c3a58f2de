"""Unequal batch shares between replica groups ([Note: batch shares] in
geopipe.optimizer.strategy), the pure parts: each group's slice of a global batch, the
weighted outer average, the weights the driver hands out, and what launch can run."""

from __future__ import annotations

import pytest
import torch

from geopipe.model.data import group_sample_indices, sample_indices
from geopipe.optimizer.outerplan import unlaunchable
from geopipe.outer import ROW_LEN, average_encoded, encode_delta
from geopipe.plan import PipelineLayout, Plan
from geopipe.runtime.control.outerloop import shares
from geopipe.transport.codec import make_codec


def test_a_slice_from_its_start_covers_the_batch_once_and_matches_equal_shares() -> None:
    gb, mbs = 16, 2
    micro, starts = (6, 2), (0, 6)
    got = [
        i
        for g in range(2)
        for mb in range(micro[g])
        for i in group_sample_indices(3, gb, g, 2, mb, mbs, starts[g])
    ]
    assert sorted(got) == sorted(i for mb in range(8) for i in sample_indices(3, gb, mb, mbs))
    # equal shares: the start an equal split gives is the old rule, sample for sample
    for g in range(2):
        for mb in range(4):
            assert group_sample_indices(5, gb, g, 2, mb, mbs, 4 * g) == group_sample_indices(
                5, gb, g, 2, mb, mbs
            )
    with pytest.raises(ValueError, match="outside the global batch"):
        group_sample_indices(0, gb, 1, 2, 2, mbs, 6)


def test_the_weighted_average_is_the_shares_mean_and_equal_weights_the_plain_one() -> None:
    torch.manual_seed(0)
    n = 3 * ROW_LEN
    deltas = [torch.randn(n) for _ in range(3)]
    enc = [encode_delta(d, make_codec("none")) for d in deltas]
    w = (12.0, 4.0, 8.0)
    want = (12 * deltas[0] + 4 * deltas[1] + 8 * deltas[2]) / 24
    assert torch.allclose(average_encoded(enc, n, w), want, atol=1e-6)
    assert torch.equal(average_encoded(enc, n, (2.0, 2.0, 2.0)), average_encoded(enc, n))
    with pytest.raises(ValueError):
        average_encoded(enc, n, (1.0, 2.0))
    with pytest.raises(ValueError):
        average_encoded(enc, n, (1.0, 0.0, 2.0))


def _plan(micro: tuple[int, ...], stages: tuple[int, ...] = (1, 1)) -> Plan:
    sites = ("east", "west")
    mix = tuple(
        PipelineLayout(
            (sites[g],) * k,
            ((0, 2),) if k == 1 else ((0, 1), (1, 2)),
            m,
            (0,) * (k - 1),
            ("none",) * (k - 1),
            (),
        )
        for g, (m, k) in enumerate(zip(micro, stages, strict=True))
    )
    return Plan(
        pipelines=2,
        stage_sites=mix[0].stage_sites,
        partition=mix[0].partition,
        micro_batch_size=2,
        seq_len=16,
        num_microbatches=micro[0],
        schedule="1f1b",
        delta_n=mix[0].delta_n,
        codecs=mix[0].codecs,
        mix=mix,
        groups=(0, 1),
    )


def test_the_driver_weights_each_group_by_its_sequences_per_step() -> None:
    assert shares(_plan((6, 2))) == (12.0, 4.0)
    assert shares(_plan((4, 4))) == ()  # alike: the plain mean


def test_launch_runs_groups_of_one_layout_whatever_their_shares() -> None:
    one = Plan(
        pipelines=1,
        stage_sites=("east",),
        partition=((0, 2),),
        micro_batch_size=2,
        seq_len=16,
        num_microbatches=6,
        schedule="1f1b",
        delta_n=(),
        codecs=(),
    )
    fewer = Plan(**{**one.__dict__, "num_microbatches": 2})
    assert unlaunchable([one, fewer]) == ""
    two_stages = Plan(
        **{
            **one.__dict__,
            "stage_sites": ("east", "east"),
            "partition": ((0, 1), (1, 2)),
            "delta_n": (0,),
            "codecs": ("none",),
        }
    )
    assert "one layout only" in unlaunchable([one, two_stages])


def test_a_tied_embedding_split_over_two_stages_is_no_launchable_outer_loop() -> None:
    """The strategy table marks it so (``split_tie`` beside ``unlaunchable``), and
    ``auto`` never picks what launch would refuse."""
    from types import SimpleNamespace

    from geopipe.optimizer.outerplan import split_tie

    one_stage = _plan((4, 4))
    two = Plan(
        **{
            **one_stage.__dict__,
            "mix": (),
            "groups": (),
            "pipelines": 1,
            "stage_sites": ("east", "east"),
            "partition": ((0, 1), (1, 2)),
            "delta_n": (0,),
            "codecs": ("none",),
        }
    )
    tied = SimpleNamespace(model=SimpleNamespace(tie_embeddings=True))
    untied = SimpleNamespace(model=SimpleNamespace(tie_embeddings=False))
    assert "tie_embeddings" in split_tie(tied, [two])
    assert split_tie(untied, [two]) == "" and split_tie(tied, [one_stage]) == ""
