"""The price of one outer round between ``M`` replica groups, from the groups' own plans and
the cluster's links.

Each group is a plan the search made (its inner step simulated by the pipeline simulator
with the YAML's, or the measured, links); this module adds what the outer loop costs on top.
One round of ``H`` inner steps, ``F`` fragments, each fragment's send overlapping ``tau``
(``overlap``) inner steps, codec ``c``::

    round = H · t_step + F · max(0, T_x − tau · t_step) + F · t_codec + t_outer + t_control

* ``t_step``: the slowest group's inner step (every group waits for it at each exchange);
* ``T_x``: one fragment's exchange, an all-gather of every group's *encoded* pseudo-gradient
  over a ring of the groups (each group encodes once and every group decodes the same bytes,
  so theta_global stays identical everywhere: ``geopipe.outer.exchange``). The ring visits
  the groups in the planner's site order; a hop is the fastest direct link between a site
  of one group and a site of the next, or, where none exists (the ring's closing hop may
  lack one), the path back along the site order (its latencies summed, its slowest link's
  bandwidth; it runs the reverse directions of the chain's links, which the ring's other
  hops leave free). In ring step ``s`` group ``g`` forwards the block of group ``g − s``;
  a step lasts as long as its slowest hop (latency + block bytes / bandwidth / (1 − loss)),
  and ``M − 1`` steps complete the all-gather. A block is the sum over the group's devices
  of their fragment slice's encoded size (:func:`geopipe.transport.wire.wire_bytes`, as
  rows of :data:`DELTA_ROW_LEN` like the runtime's encoder): every device of a group sends
  through the one hop, and that hop's bandwidth is all the group gets (conservative for a
  group spanning sites, whose own links could carry part of it; the hop to its sites'
  stages is not priced).
* ``t_codec``: the codec on the devices, not hidden (it runs on the compute stream): each
  group encodes its slice once and decodes ``M − 1`` blocks; a site's codec speed is quoted
  for encode + decode together (``codec_gb_per_s``, or the nominal speed), each taken as
  half of it.
* ``t_outer``: the outer step, elementwise over every device's fp32 partition, priced with
  the device memory bandwidth: the pseudo-gradient (read theta_global and the master, write
  Δ: 12 B), the average of the ``M`` decoded blocks (read 4 B each, write 4 B), Nesterov (read
  Δ, momentum, theta_global; write momentum, theta_global, the master: 24 B); then the
  ZeRO-1 group all-gathers the updated weights inside its site, as after an inner step.

* ``t_control``: the driver's control calls ([Note: the driver's control calls]).

Tokens per round: ``H`` × the groups' tokens per inner step. Device utilisation: the
devices' compute time (``1 - bubble`` of each group's step, for its devices, ``H`` times)
over their time in the round. What binds is the largest loss of device time: bubbles
inside the groups, waiting for the slowest group, the exposed exchange, the codec or the
outer step.

[Note: the driver's control calls]
The driver starts every inner step's work with a call to every actor and waits for the answers
(:mod:`geopipe.runtime.control.innerrun`): an outer run calls each actor once per *span* of
inner steps, up to the next point where the driver acts (a checkpoint, an evaluation), at
most :data:`SPAN_S` seconds of steps, ending at an apply point where only that length
cuts it (:func:`span_end`; [Note: spans end at applies] in
:mod:`geopipe.runtime.control.innerrun`). The outer loop's own work rides inside the spans
(:data:`OUTER_CALLS_PER_FRAGMENT` is 0): the actors make the sends and the applies
themselves, and the driver names each apply's groups while the span runs ([Note: applies
decided inside a span] in :mod:`geopipe.runtime.actor.inner_run`). Every call waits for the
farthest group's answer, so each costs the round trip from the driver to it plus a per-call
overhead (Ray's call and the driver's own work on the answers, which the actors wait
through)::

    t_control = (H / steps_per_call) · overhead + (H / steps_per_wait) · RTT

A span that ends only because it is long (at :data:`SPAN_S` seconds of steps, not at a point
where the driver acts) has the next one queued behind it as soon as it is called, so the
actors go on without waiting for the driver: of the calls, only the first after each
boundary (a checkpoint, an evaluation) costs its round trip (``steps_per_wait`` steps per such
call), every call its overhead. :func:`steps_per_call` counts the spans exactly over one
period of the boundaries (with ``cap`` = :data:`_HORIZON`, the boundaries alone).

An apply waits inside its span for nothing but the payloads: the driver names its groups
as the apply point comes up, long before the payloads arrive, and takes that back only when a
group is lost ([Note: taking back a decision] in :mod:`geopipe.runtime.control.outerdecide`).
So each fragment exposes ``max(0, T_x − tau · t)``, no control round trip.

The driver is taken to sit in the first site listed (where the test bed, and usually a
cluster, starts Ray's head): the RTT is the shortest-latency path there and back to the
farthest site of any group. On emulated links the control plane is not emulated (every actor
answers on this machine), so the RTT is 0 there; the overhead is the nominal
:data:`CALL_OVERHEAD_S` until a run measures it (:mod:`geopipe.runtime.control.outercal`
feeds this same function with the measured figures).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Any

from geopipe.config import ClusterSpec, OuterSetting
from geopipe.model.sizes import elem_bytes, stage_param_count
from geopipe.optimizer.evaluate import Evaluation
from geopipe.optimizer.pipecosts import codec_speed
from geopipe.plan import Plan
from geopipe.transport.wire import transfer_time, wire_bytes

__all__ = [
    "CALL_OVERHEAD_S",
    "DELTA_ROW_LEN",
    "MAX_SPAN",
    "OUTER_CALLS_PER_FRAGMENT",
    "SPAN_S",
    "Control",
    "Hop",
    "RoundCost",
    "block_bytes",
    "driver_rtt_s",
    "planned_control",
    "price_round",
    "queues_spans",
    "ring_hops",
    "span_cap",
    "span_end",
    "steps_per_call",
]

# Elements per int8 scale of an encoded pseudo-gradient: geopipe.outer.exchange.ROW_LEN (that
# module imports torch, so the planner keeps its own copy; a unit test holds them equal).
DELTA_ROW_LEN = 256
OUTER_STEP_BYTES = 40.0  # per parameter, besides 4 B per group averaged (module docstring)
# A loss of device time below this share of the round is not named as what binds.
_BINDS_FROM = 0.05
# [Note: the driver's control calls]. The runtime's spans (geopipe.runtime.control.innerrun)
# take these and span_cap / span_end from here: the planner counts the calls it makes.
SPAN_S = 5.0  # predicted seconds of inner steps per driver call at most (the progress lag)
MAX_SPAN = 1000  # inner steps per driver call at most (a prediction of ~0 s: tiny steps)
OUTER_CALLS_PER_FRAGMENT = 0  # the send and the apply ride inside the span calls
# Nominal seconds of one driver call beyond the round trip (Ray's call, the driver's work on
# the answers) until a run measures it: the order of what a call to a local actor takes.
CALL_OVERHEAD_S = 0.005
_HORIZON = 100_000  # steps_per_call counts spans over at most this many steps


@dataclass(frozen=True)
class Hop:
    """One hop of the ring of groups: ``src -> dst`` over a link (or a routed path)."""

    src: str
    dst: str
    latency_s: float
    bandwidth_bps: float
    loss: float = 0.0
    routed: bool = False  # no direct link: back along the site order

    def seconds(self, nbytes: float) -> float:
        return transfer_time(math.ceil(nbytes), self.bandwidth_bps, self.latency_s, self.loss)

    @property
    def name(self) -> str:
        return f"{self.src}→{self.dst}" + (" (routed)" if self.routed else "")


def _direct_hop(spec: ClusterSpec, a: Sequence[str], b: Sequence[str]) -> Hop | None:
    """The fastest direct link from a site of ``a`` to a site of ``b`` (for 64 MiB)."""
    best = None
    for x in a:
        for y in b:
            lk = spec.link(x, y)
            if lk is None:
                continue
            hop = Hop(x, y, lk.latency_s, lk.bandwidth_bps, lk.loss)
            if best is None or hop.seconds(1 << 26) < best.seconds(1 << 26):
                best = hop
    return best


def ring_hops(spec: ClusterSpec, groups: Sequence[Sequence[str]]) -> list[Hop]:
    """Hop ``g`` carries group ``g``'s forwarding to group ``g + 1`` (mod ``M``); ``groups``
    are contiguous runs of the site order (module docstring)."""
    order = [s for g in groups for s in g]
    hops = []
    for g, a in enumerate(groups):
        b = groups[(g + 1) % len(groups)]
        hop = _direct_hop(spec, a, b)
        if hop is None:  # back along the chain, from a's first site to b's last
            path = order[order.index(b[-1]) : order.index(a[0]) + 1][::-1]
            links = [spec.link(x, y) for x, y in pairwise(path)]
            hop = Hop(
                a[0],
                b[-1],
                sum(lk.latency_s for lk in links),
                min(lk.bandwidth_bps for lk in links),
                1 - math.prod(1 - lk.loss for lk in links),
                routed=True,
            )
        hops.append(hop)
    return hops


def _stage_slices(spec: ClusterSpec, plan: Plan, fragments: int) -> list[tuple[str, int]]:
    """``(site, elements)`` of one device's slice of one fragment, per stage."""
    return [
        (site, -(-stage_param_count(spec.model, layers) // (plan.pipelines * fragments)))
        for site, layers in zip(plan.stage_sites, plan.partition, strict=True)
    ]


def block_bytes(spec: ClusterSpec, plan: Plan, setting: OuterSetting) -> float:
    """One group's encoded pseudo-gradient of one fragment: every device's slice."""
    total = 0.0
    for _, n in _stage_slices(spec, plan, setting.fragments):
        rows = -(-n // DELTA_ROW_LEN)
        total += plan.pipelines * wire_bytes(
            setting.codec, rows * DELTA_ROW_LEN, DELTA_ROW_LEN, 4, "backward", spec.plan.topk_ratio
        )
    return total


def _codec_s(spec: ClusterSpec, plan: Plan, setting: OuterSetting, m: int) -> float:
    """Seconds the slowest device of the group spends on the codec per fragment."""
    return max(
        4.0 * n * (m / 2) / codec_speed(spec.site(site), setting.codec)
        for site, n in _stage_slices(spec, plan, setting.fragments)
    )


def _outer_step_s(spec: ClusterSpec, plan: Plan, m: int, fragments: int) -> float:
    """Seconds of the outer step per round on the group's slowest device (module docstring)."""
    d, e = plan.pipelines, elem_bytes(spec.training.precision)
    worst = 0.0
    for site_name, layers in zip(plan.stage_sites, plan.partition, strict=True):
        site, params = spec.site(site_name), stage_param_count(spec.model, layers)
        t = params / d * (OUTER_STEP_BYTES + 4.0 * m) / (site.device_mem_bw_gb_per_s * 1e9)
        if d > 1:  # the ZeRO-1 group all-gathers the new weights, once per fragment
            t += (d - 1) / d * params * e * 8 / (site.intra_bandwidth_gbps * 1e9)
            t += fragments * (d - 1) * site.intra_latency_ms / 1e3
        worst = max(worst, t)
    return worst


def span_end(start: int, limit: int, cap: int, period: int = 1) -> int:
    """The step after which a span of inner steps from ``start`` ends when only its length
    cuts it: at most ``cap`` steps, never past ``limit``, and at an apply point (a multiple
    of ``period``, the steps between two applies) -- the last within the cap, or, when the
    next lies beyond it, one of equal spans that reach it ([Note: spans end at applies])."""
    end = min(limit, start + cap)
    if end == limit or period <= 1:
        return end
    last = end - end % period
    if last > start:
        return last
    left = last + period - start  # to the next apply point
    return start + -(-left // -(-left // cap))


def _calls_between(a: int, b: int, cap: int, period: int) -> int:
    """Spans from step ``a`` to the boundary ``b`` (:func:`span_end`), whole periods counted
    at once (from an apply point each takes the same spans)."""
    if period <= 1:
        return -(-(b - a) // cap)
    calls = 0
    while a < b and a % period:  # up to the first apply point
        a, calls = span_end(a, b, cap, period), calls + 1
    stride, per = ((cap // period) * period, 1) if cap >= period else (period, -(-period // cap))
    whole = max(0, (b - a) // stride - 1)  # leave the last ones to the walk below
    calls, a = calls + whole * per, a + whole * stride
    while a < b:
        a, calls = span_end(a, b, cap, period), calls + 1
    return calls


@lru_cache(maxsize=4096)
def steps_per_call(*intervals: int, cap: int = MAX_SPAN, period: int = 1) -> float:
    """Inner steps per driver call on average when each call runs up to the next multiple of
    any of ``intervals`` (checkpoints, evaluations; 0 = none), at most ``cap`` steps and
    ending at an apply point every ``period`` steps where the cap cuts it
    (:func:`span_end`): the spans counted exactly over one period of all the boundaries
    (their least common multiple, at most :data:`_HORIZON` steps; none: spans of ``cap``)."""
    every = sorted({int(i) for i in intervals if i and i > 0}) or [_HORIZON]
    if cap < 1:
        raise ValueError(f"steps_per_call needs cap >= 1, got {cap}")
    span = min(math.lcm(*every), _HORIZON)
    ends = sorted({k for i in every for k in range(i, span + 1, i)} | {span})
    calls = sum(_calls_between(a, b, cap, max(1, period)) for a, b in pairwise([0, *ends]))
    return span / calls


def span_cap(step_s: float) -> int:
    """Inner steps per call at most for steps of ``step_s`` seconds (the runtime's spans use it)."""
    return max(1, min(MAX_SPAN, int(SPAN_S / step_s) if step_s > 0 else 1))


@lru_cache(maxsize=64)
def _latencies(
    sites: tuple[str, ...], links: tuple[tuple[str, str, float], ...]
) -> dict[tuple[str, str], float]:
    """One-way seconds between every two sites over the fastest path of ``links``
    (``(src, dst, latency_s)``; one without an entry for its reverse serves both ways, as
    :meth:`ClusterSpec.link` reads it): Floyd–Warshall over a handful of sites, memoised
    (the strategy table prices thousands of rounds on one cluster)."""
    best = {(a, b): 0.0 if a == b else math.inf for a in sites for b in sites}
    listed = {(a, b) for a, b, _ in links}
    for a, b, t in links:
        best[a, b] = min(best[a, b], t)
        if (b, a) not in listed:
            best[b, a] = min(best[b, a], t)
    for k in sites:
        for a in sites:
            for b in sites:
                best[a, b] = min(best[a, b], best[a, k] + best[k, b])
    return best


def driver_rtt_s(spec: ClusterSpec, sites: Sequence[str], driver: str | None = None) -> float:
    """The round trip from the driver's site (default: the first listed) to the farthest of
    ``sites`` and back over the links; 0 on emulated links ([Note: the driver's control
    calls])."""
    if spec.ray.links_emulated or not sites:
        return 0.0
    driver = driver or spec.sites[0].name
    names = tuple(s.name for s in spec.sites)
    one_way = _latencies(names, tuple((lk.src, lk.dst, lk.latency_s) for lk in spec.links))
    return max(one_way[driver, s] + one_way[s, driver] for s in sites)


@dataclass(frozen=True)
class Control:
    """The driver's control calls of an outer run ([Note: the driver's control calls])."""

    rtt_s: float  # the driver to the farthest group and back
    overhead_s: float = CALL_OVERHEAD_S  # per call, beyond the round trip
    steps_per_call: float = 1.0  # inner steps each call to the actors runs, on average
    calls_per_fragment: int = OUTER_CALLS_PER_FRAGMENT  # at each apply
    # inner steps per call whose round trip the actors wait through (a span queued behind
    # the one running hides its round trip: [Note: the driver's control calls]); None: every
    # call's (one step per call)
    steps_per_wait: float | None = None

    def __post_init__(self) -> None:
        if not self.steps_per_call >= 1:
            raise ValueError(f"steps_per_call must be >= 1, got {self.steps_per_call}")
        if self.rtt_s < 0 or self.overhead_s < 0 or self.calls_per_fragment < 0:
            raise ValueError(f"control figures must be >= 0: {self}")

    @property
    def call_s(self) -> float:
        return self.rtt_s + self.overhead_s

    def calls(self, setting: OuterSetting) -> float:
        """Driver calls per round."""
        return setting.h / self.steps_per_call + setting.fragments * self.calls_per_fragment

    def waits(self, setting: OuterSetting) -> float:
        """Of :meth:`calls`, those whose round trip the actors wait through."""
        per_wait = self.steps_per_wait or self.steps_per_call
        return setting.h / per_wait + setting.fragments * self.calls_per_fragment

    def round_s(self, setting: OuterSetting) -> float:
        return self.calls(setting) * self.overhead_s + self.waits(setting) * self.rtt_s


def queues_spans(plans: Sequence[Any]) -> bool:
    """Whether the runtime queues a span behind one that ends for its length: not when a
    group sends over a lossy codec (its guard may order a finer one, which must land between
    spans) -- the planner's rule and the runtime's (:mod:`geopipe.runtime.control.innerrun`)."""
    return all(c == "none" for p in plans for c in p.codecs)


def planned_control(
    spec: ClusterSpec,
    groups: Sequence[Sequence[str]],
    setting: OuterSetting,
    step_s: float,
    overhead_s: float = CALL_OVERHEAD_S,
    cap: int | None = None,
    queued: bool = True,
) -> Control:
    """The control calls of ``setting`` between ``groups`` with inner steps of ``step_s``:
    the runtime's spans (checkpoint and evaluation boundaries, at most ``cap`` steps:
    default :data:`SPAN_S` seconds of steps; ``queued``: see :func:`queues_spans`), the
    links' round trip, ``overhead_s``."""
    t = spec.training
    ev = t.eval.every_steps if t.eval is not None else 0
    period = setting.h // setting.fragments
    per_call = steps_per_call(
        t.checkpoint.every_steps, ev, cap=cap if cap else span_cap(step_s), period=period
    )
    per_wait = steps_per_call(t.checkpoint.every_steps, ev, cap=_HORIZON)
    rtt = driver_rtt_s(spec, [s for g in groups for s in g])
    queued = queued and (cap or span_cap(step_s)) > 1  # one a call: the per-step driver
    return Control(rtt, overhead_s, per_call, steps_per_wait=per_wait if queued else None)


@dataclass(frozen=True)
class RoundCost:
    """One outer round's time and where it goes (module docstring)."""

    setting: OuterSetting
    step_s: float  # the slowest group's inner step
    exchange_s: float  # one fragment's all-gather over the ring (transfer only)
    exposed_s: float  # per round: the exchange compute did not hide
    codec_s: float  # per round
    outer_step_s: float  # per round
    control: Control  # the driver's calls
    tokens: int  # per round, all groups
    wan_bytes: float  # per round, every ring hop
    device_utilization: float
    bound: str

    @property
    def round_s(self) -> float:
        h = self.setting.h
        return h * self.step_s + self.exposed_s + self.codec_s + self.outer_step_s + self.control_s

    @property
    def control_s(self) -> float:
        """Per round: the driver's calls ([Note: the driver's control calls])."""
        return self.control.round_s(self.setting)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.round_s

    def to_json(self) -> dict:
        return {
            "round_s": self.round_s,
            "inner_step_s": self.step_s,
            "inner_s": self.setting.h * self.step_s,
            "exchange_s": self.exchange_s,
            "exposed_s": self.exposed_s,
            "codec_s": self.codec_s,
            "outer_step_s": self.outer_step_s,
            "control_s": self.control_s,
            "control_rtt_s": self.control.rtt_s,
            "control_overhead_s": self.control.overhead_s,
            "steps_per_call": self.control.steps_per_call,
            "steps_per_wait": self.control.steps_per_wait or self.control.steps_per_call,
            "wan_bytes": self.wan_bytes,
        }


def _all_gather_s(hops: Sequence[Hop], blocks: Sequence[float]) -> tuple[float, str]:
    """Seconds of a ring all-gather of ``blocks`` (one per group), and its slowest hop."""
    m, total, worst = len(blocks), 0.0, (0.0, "")
    for s in range(1, m):
        times = [(hop.seconds(blocks[(g - s) % m]), hop.name) for g, hop in enumerate(hops)]
        step = max(times)
        total += step[0]
        worst = max(worst, step)
    return total, worst[1]


def price_round(
    spec: ClusterSpec,
    groups: Sequence[Sequence[str]],
    evaluations: Sequence[Evaluation],
    setting: OuterSetting,
    control: Control | None = None,
) -> RoundCost:
    """The round of ``setting`` between ``groups`` (site names, contiguous runs of the site
    order), each running the plan of its feasible evaluation (same order; its
    ``iteration_time_s`` is the group's inner step), the driver's calls priced by
    ``control`` (default: :func:`planned_control`)."""
    m, f = len(groups), setting.fragments
    plans = [e.plan for e in evaluations]
    step = max(e.iteration_time_s for e in evaluations)
    control = control or planned_control(spec, groups, setting, step, queued=queues_spans(plans))
    blocks = [block_bytes(spec, p, setting) for p in plans]
    # One group left (the others lost): nothing to exchange.
    exchange, slowest_hop = _all_gather_s(ring_hops(spec, groups), blocks) if m > 1 else (0, "")
    exposed = f * max(0.0, exchange - setting.overlap * step)
    codec = f * max(_codec_s(spec, p, setting, m) for p in plans)
    outer = max(_outer_step_s(spec, p, m, f) for p in plans)
    devices = [p.pipelines * p.num_stages for p in plans]
    round_s = setting.h * step + exposed + codec + outer + control.round_s(setting)
    busy = sum(
        n * setting.h * e.device_utilization * e.iteration_time_s
        for n, e in zip(devices, evaluations, strict=True)
    )
    losses = {
        "bubbles inside the groups": sum(
            n * setting.h * (1 - e.device_utilization) * e.iteration_time_s
            for n, e in zip(devices, evaluations, strict=True)
        ),
        "waiting for the slowest group": sum(
            n * setting.h * (step - e.iteration_time_s)
            for n, e in zip(devices, evaluations, strict=True)
        ),
        f"exchange over {slowest_hop}": sum(devices) * exposed,
        "pseudo-gradient codec": sum(devices) * codec,
        "outer step": sum(devices) * outer,
        "the driver's control calls": sum(devices) * control.round_s(setting),
    }
    what, lost = max(losses.items(), key=lambda kv: kv[1])
    return RoundCost(
        setting=setting,
        step_s=step,
        exchange_s=exchange,
        exposed_s=exposed,
        codec_s=codec,
        outer_step_s=outer,
        control=control,
        tokens=setting.h * sum(e.tokens_per_iteration for e in evaluations),
        wan_bytes=f * (m - 1) * sum(blocks),
        device_utilization=busy / (sum(devices) * round_s),
        bound=what if lost > _BINDS_FROM * sum(devices) * round_s else "compute",
    )
