"""The outer loop's numerics (geopipe.outer): the outer step is torch's Nesterov SGD on the
pseudo-gradient; lr 1, momentum 0, codec none is plain replica averaging; theta_global stays
bit-identical across groups under every codec; the Streaming DiLoCo schedule is torchft's;
the outer state resumes bit-exactly mid-round."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from geopipe.model.gpt import lm_loss
from geopipe.outer import (
    ROW_LEN,
    OuterOptimizer,
    StreamingSchedule,
    average_encoded,
    check_outer_settings,
    decode_delta,
    encode_delta,
    fragment_bounds,
    pseudo_gradient,
)
from geopipe.transport.codec import CODECS, make_codec


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


SHAPES = [(7, 5), (13,), (3, 4, 2)]


def _theta(seed: int = 0) -> list[torch.Tensor]:
    return [_randn(*s, seed=seed + i) for i, s in enumerate(SHAPES)]


# --------------------------------------------------------------------------- the outer step


def test_pseudo_gradient_is_global_minus_local() -> None:
    g, loc = _randn(5, seed=1), _randn(5, seed=2)
    assert torch.equal(pseudo_gradient(g, loc), g - loc)


@pytest.mark.parametrize("fragments", [1, 3])
def test_outer_step_equals_torch_sgd_nesterov(fragments: int) -> None:
    """Several rounds, each fragment stepped in turn: the same bits as torch.optim.SGD
    (nesterov) stepping the whole model with the pseudo-gradient as its gradient."""
    outer = OuterOptimizer(_theta(), lr=0.7, momentum=0.9, fragments=fragments)
    ref = [torch.nn.Parameter(t.clone()) for t in _theta()]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for r in range(5):
        local = [
            t + _randn(*t.shape, seed=100 * r + i, scale=0.1) for i, t in enumerate(outer.theta)
        ]
        for p, loc in zip(ref, local, strict=True):
            p.grad = pseudo_gradient(p.detach(), loc)
        sgd.step()
        for f in range(fragments):
            outer.step(outer.pseudo_gradient(local, f), f)
        for p, t in zip(ref, outer.theta, strict=True):
            assert float((p.detach() - t).abs().max()) <= 1e-7
        # The step moved theta toward the local weights (the sign torchft once had wrong).
        assert r > 0 or all(
            float((t - loc).norm()) < float((t0 - loc).norm())
            for t, t0, loc in zip(outer.theta, _theta(), local, strict=True)
        )
    assert [outer.steps(f) for f in range(fragments)] == [5] * fragments


def test_outer_rejects_bad_settings_and_shapes() -> None:
    with pytest.raises(ValueError, match=r"plan\.outer\.lr"):
        OuterOptimizer(_theta(), lr=0.0)
    with pytest.raises(ValueError, match=r"plan\.outer\.momentum"):
        OuterOptimizer(_theta(), momentum=1.0)
    outer = OuterOptimizer(_theta(), fragments=2)
    with pytest.raises(ValueError, match="elements"):
        outer.step(torch.zeros(3), 0)
    with pytest.raises(ValueError, match="not finite"):
        outer.step(torch.full((outer.fragment_numel(1),), float("nan")), 1)
    with pytest.raises(ValueError, match="out of range"):
        outer.pseudo_gradient(_theta(), 2)


# --------------------------------------------------------------------------- replica averaging

VOCAB, M, H, STEPS, BATCH = 32, 3, 4, 16, 6


def _model() -> torch.nn.Module:
    """A bigram language model with a hidden layer. Not the GPT: its attention's key bias
    has a gradient of exactly zero in exact arithmetic, so Adam turns that bias's rounding
    noise into full-size steps, and two equal computations rounded differently part by
    ~1e-5 within a few steps whatever the outer loop does."""
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 16),
        torch.nn.Linear(16, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, VOCAB),
    )


def _replicas() -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    out = []
    for _ in range(M):
        model = _model()
        out.append((model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))))
    return out


def _inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, group: int) -> None:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, VOCAB, (BATCH, 9), generator=g)
    per = BATCH // M
    x = data[group * per : (group + 1) * per]
    opt.zero_grad()
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()


def test_lr1_momentum0_codec_none_equals_averaging_replicas() -> None:
    """M replicas averaged every H steps (the reference) against the outer loop with lr 1,
    momentum 0, codec none, F = 1: equal within 1e-6 after every inner step."""
    ref, run = _replicas(), _replicas()
    outer = OuterOptimizer([p.detach() for p in run[0][0].parameters()], lr=1.0, momentum=0.0)
    codecs = [make_codec("none") for _ in range(M)]
    drift = 0.0
    for step in range(1, STEPS + 1):
        for group in range(M):
            _inner_step(*ref[group], step, group)
            _inner_step(*run[group], step, group)
        if step % H == 0:
            a, b = (next(m.parameters()).detach() for m, _ in run[:2])
            drift = max(drift, float((a - b).abs().max()))
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m, _ in ref), strict=True):
                    mean = torch.stack([p.detach() for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
            locals_ = [list(m.parameters()) for m, _ in run]
            payloads = [
                encode_delta(outer.pseudo_gradient(loc), c)
                for loc, c in zip(locals_, codecs, strict=True)
            ]
            outer.step(average_encoded(payloads, outer.fragment_numel(0)))
            for loc in locals_:
                outer.copy_to(loc)
        for group in range(M):
            for a, b in zip(ref[group][0].parameters(), run[group][0].parameters(), strict=True):
                assert float((a - b).detach().abs().max()) <= 1e-6, (step, group)
    # The replicas drifted apart between rounds (so averaging was exercised) and are equal
    # right after the last one.
    a, b = (next(m.parameters()).detach() for m, _ in run[:2])
    assert drift > 1e-3 and torch.equal(a, b)
    assert outer.steps() == STEPS // H


def test_a_fragment_digest_hashes_that_fragment_alone() -> None:
    """A round's digest is its fragment's (the apply hashes what it changed): it moves when
    that fragment's slices move and not when another fragment's do."""
    import hashlib

    outer = OuterOptimizer(_theta(), fragments=3)
    before = [outer.digest(f) for f in range(3)]
    whole = outer.digest()
    with torch.no_grad():
        for part in outer._parts(outer.theta, 1):
            part.add_(1.0)
    assert [outer.digest(f) for f in range(3)] == [before[0], outer.digest(1), before[2]]
    assert outer.digest(1) != before[1] and outer.digest() != whole
    h = hashlib.sha256()  # the same bytes as the slices, shape by shape
    for part in outer._parts(outer.theta, 2):
        h.update(repr(tuple(part.shape)).encode())
        h.update(part.contiguous().numpy().tobytes())
    assert outer.digest(2) == h.hexdigest()


# --------------------------------------------------------------------------- across groups


@pytest.mark.parametrize("codec_name", CODECS)
def test_theta_global_digest_equal_across_groups(codec_name: str) -> None:
    """Each group encodes once, decodes everyone's payloads in group order and steps its
    own OuterOptimizer: the digests agree after every round, two fragments, every codec."""
    groups = 3
    outers = [OuterOptimizer(_theta(), fragments=2) for _ in range(groups)]
    codecs = [make_codec(codec_name, topk_ratio=0.1, seed=7 + g) for g in range(groups)]
    digests = {outers[0].digest()}
    sched = StreamingSchedule(h=4, fragments=2, overlap=1)
    for step in range(1, 17):
        f = sched.sends_at(step)
        if f is None:
            continue
        payloads = []
        for g, (outer, codec) in enumerate(zip(outers, codecs, strict=True)):
            local = [
                t + _randn(*t.shape, seed=1000 * step + 10 * g + i, scale=0.05)
                for i, t in enumerate(outer.theta)
            ]
            payloads.append(encode_delta(outer.pseudo_gradient(local, f), codec, key=f"outer/{f}"))
        for outer in outers:
            outer.step(average_encoded(payloads, outer.fragment_numel(f)), f)
        round_digests = {o.digest() for o in outers}
        assert len(round_digests) == 1, (codec_name, step)
        assert not round_digests & digests  # theta_global moved
        digests |= round_digests
    if codec_name == "topk":  # error feedback is per group: each keeps its own residual
        residuals = [c.state_dict()["outer/0"] for c in codecs]
        assert not torch.equal(residuals[0], residuals[1])


@pytest.mark.parametrize("codec_name", ["none", "bf16", "int8", "int4h"])
def test_average_encoded_is_close_to_the_mean(codec_name: str) -> None:
    numel = 3 * ROW_LEN + 17  # a padded last row
    deltas = [_randn(numel, seed=s, scale=1e-3) for s in range(4)]
    codec = make_codec(codec_name, seed=1)
    avg = average_encoded([encode_delta(d, codec) for d in deltas], numel)
    mean = torch.stack(deltas).mean(0)
    err = float((avg - mean).norm() / mean.norm())
    assert err <= {"none": 1e-7, "bf16": 1e-2, "int8": 2e-2, "int4h": 0.2}[codec_name]
    with pytest.raises(ValueError, match="rows"):
        decode_delta(encode_delta(deltas[0], codec), numel + ROW_LEN)


# --------------------------------------------------------------------------- the schedule


def _torchft_events(h: int, fragments: int, tau: int, steps: int) -> list[tuple[int, str, int]]:
    """torchft's DiLoCo._step_post_hook, transcribed: a counter of inner steps since the
    last sync; prepare (send) at period - tau, perform (apply) at period; the fragment is
    the number of syncs so far modulo F (the manager's step counts committed syncs)."""
    period, local, syncs, out = h // fragments, 0, 0, []
    for step in range(1, steps + 1):
        local += 1
        if local == period - tau:
            out.append((step, "send", syncs % fragments))
        if local == period:
            out.append((step, "apply", syncs % fragments))
            syncs, local = syncs + 1, 0
    return out


@pytest.mark.parametrize(
    "h,fragments,tau", [(1, 1, 0), (10, 1, 0), (10, 1, 4), (8, 4, 1), (12, 3, 3), (6, 2, 0)]
)
def test_schedule_matches_torchft(h: int, fragments: int, tau: int) -> None:
    sched = StreamingSchedule(h, fragments, tau)
    assert sched.events(5 * h) == _torchft_events(h, fragments, tau, 5 * h)
    for f in range(fragments):
        applies = [s for s in range(1, 5 * h + 1) if sched.applies_at(s) == f]
        assert applies == [sched.apply_step(f, r) for r in range(len(applies))]
        assert all(b - a == h for a, b in itertools.pairwise(applies))
        assert sched.sends_at(sched.send_step(f, 1)) == f
        assert sched.round_of(sched.apply_step(f, 2)) == 2


def test_schedule_example() -> None:
    sched = StreamingSchedule(h=8, fragments=4, overlap=1)
    assert sched.events(10) == [
        (1, "send", 0),
        (2, "apply", 0),
        (3, "send", 1),
        (4, "apply", 1),
        (5, "send", 2),
        (6, "apply", 2),
        (7, "send", 3),
        (8, "apply", 3),
        (9, "send", 0),
        (10, "apply", 0),
    ]


@pytest.mark.parametrize(
    "h,fragments,overlap,field",
    [
        (0, 1, 0, "plan.outer.h"),
        (10, 4, 0, "plan.outer.h"),
        (10, 4, 0, "plan.outer.fragments"),
        (8, 0, 0, "plan.outer.fragments"),
        (8, 4, 2, "plan.outer.overlap"),
        (8, 1, 8, "plan.outer.overlap"),
        (8, 1, -1, "plan.outer.overlap"),
        (8, 1, True, "plan.outer.overlap"),
        (8.0, 1, 0, "plan.outer.h"),
    ],
)
def test_schedule_validation_names_the_field(h, fragments, overlap, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_outer_settings(h, fragments, overlap)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        StreamingSchedule(h, fragments, overlap)


@pytest.mark.parametrize("numel,fragments", [(10, 4), (12, 4), (3, 5), (0, 2), (1, 1)])
def test_fragment_bounds_are_equal_contiguous_slices(numel: int, fragments: int) -> None:
    bounds = fragment_bounds(numel, fragments)
    sizes = [e - s for s, e in bounds]
    assert sizes == [len(t) for t in torch.tensor_split(torch.arange(numel), fragments)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


# --------------------------------------------------------------------------- resume


def _round(outer: OuterOptimizer, codec, f: int, seed: int) -> None:
    local = [t + _randn(*t.shape, seed=seed + i, scale=0.05) for i, t in enumerate(outer.theta)]
    enc = encode_delta(outer.pseudo_gradient(local, f), codec, key=f"outer/{f}")
    outer.step(average_encoded([enc], outer.fragment_numel(f)), f)


def test_state_dict_resumes_bit_exactly_mid_round() -> None:
    """Three fragments, stopped after fragment 0's fourth step (fragments 1 and 2 one step
    behind), saved through torch.save with the top-k residuals; resumed from another start,
    the next rounds give the same bits as the run that never stopped."""
    sched = StreamingSchedule(h=6, fragments=3)
    a, codec_a = OuterOptimizer(_theta(), fragments=3), make_codec("topk", topk_ratio=0.2)
    applies = [s for s in range(1, 40) if sched.applies_at(s) is not None]
    for s in applies[:10]:
        _round(a, codec_a, sched.applies_at(s), seed=s)
    assert [a.steps(f) for f in range(3)] == [4, 3, 3]
    buf = io.BytesIO()
    torch.save({"outer": a.state_dict(), "codec": codec_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    b, codec_b = OuterOptimizer(_theta(seed=50), fragments=3), make_codec("topk", topk_ratio=0.2)
    b.load_state_dict(saved["outer"])
    codec_b.load_state_dict(saved["codec"])
    assert b.digest() == a.digest()
    for s in applies[10:]:
        _round(a, codec_a, sched.applies_at(s), seed=s)
        _round(b, codec_b, sched.applies_at(s), seed=s)
        assert b.digest() == a.digest()
    sa, sb = a.state_dict(), b.state_dict()
    for x, y in zip(sa["momentum_buffer"], sb["momentum_buffer"], strict=True):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="fragments"):
        OuterOptimizer(_theta(), fragments=2).load_state_dict(sa)
