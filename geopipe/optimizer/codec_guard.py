"""The codec error guard: a WAN hop whose sampled codec error exceeds ``plan.max_codec_error``
falls back, in that direction only, to the next finer codec.

The stage actors sample their senders' relative error ``||decode(encode(x)) - x|| / ||x||``
(every 32nd message, `geopipe.transport.direct.DirectSender`); this module turns a step's
samples into new settings for the plan. Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import pairwise

from geopipe.plan import Plan
from geopipe.transport.wire import codec_pair, finer_codec, pair_name

__all__ = ["Fallback", "apply_fallbacks", "codec_fallbacks"]


@dataclass(frozen=True)
class Fallback:
    """Hop ``src -> dst`` (the pipeline's direction) sends ``direction`` with ``new``."""

    src: str
    dst: str
    direction: str
    old: str
    new: str
    error: float


def codec_fallbacks(
    plan: Plan,
    samples: Iterable[tuple[int, int, str, float]],
    bound: float,
    allowed: Iterable[str],
) -> list[Fallback]:
    """The fallbacks a step's ``samples`` — ``(stage, pipeline, direction, error)`` — call for:
    one per hop and direction whose worst sample exceeds ``bound``, to the next finer codec
    among ``allowed`` (or exact)."""
    allowed = set(allowed)
    worst: dict[tuple[str, str, str], tuple[float, str]] = {}
    for k, r, direction, err in samples:
        sites = plan.pipeline(r).stage_sites
        j = k if direction == "forward" else k - 1  # the boundary the sender feeds
        if not 0 <= j < len(sites) - 1 or err <= bound:
            continue
        hop = (sites[j], sites[j + 1], direction)
        setting = plan.pipeline(r).codecs[j]
        if hop not in worst or err > worst[hop][0]:
            worst[hop] = (err, setting)
    out = []
    for (a, b, direction), (err, setting) in sorted(worst.items()):
        old = codec_pair(setting)[direction == "backward"]
        if old != "none":
            out.append(Fallback(a, b, direction, old, finer_codec(old, allowed), err))
    return out


def apply_fallbacks(plan: Plan, fallbacks: list[Fallback]) -> Plan:
    """``plan`` with the fallbacks' codecs on every pipeline's matching boundaries (the
    controller's plan, and each stage actor's own pipeline)."""

    def moved(sites: tuple[str, ...], codecs: tuple[str, ...]) -> tuple[str, ...]:
        out = list(codecs)
        for j, (a, b) in enumerate(pairwise(sites)):
            f, bw = codec_pair(out[j])
            for fb in fallbacks:
                if (fb.src, fb.dst) == (a, b):
                    if fb.direction == "forward":
                        f = fb.new
                    else:
                        bw = fb.new
            out[j] = pair_name(f, bw)
        return tuple(out)

    mix = tuple(replace(p, codecs=moved(p.stage_sites, p.codecs)) for p in plan.mix)
    return replace(plan, codecs=moved(plan.stage_sites, plan.codecs), mix=mix)
