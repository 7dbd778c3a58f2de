"""The driver's half of the outer loop: begin it on every actor, pair the peers, and after each
inner step send or apply the fragments the streaming schedule says.

The actors' half (:mod:`geopipe.runtime.actor.outer`) holds theta_global and the outer
momentum on each replica's fp32 master partition and moves the encoded pseudo-gradients over
the data plane itself; the driver only carries addresses and says when. Order of a round
(torchft's DiLoCo, :mod:`geopipe.outer.fragments`): after inner step ``s``, fragment
``sends_at(s)`` is encoded and its transfer starts (it runs on while training goes on), then
fragment ``applies_at(s)`` is averaged and applied, collectively in each ZeRO-1 group,
between iterations. With ``overlap`` 0 the two coincide: the round's transfer is exposed.

Peers: the replicas holding the same stage and ZeRO-1 partition in the other groups (every
group has one layout: :mod:`geopipe.optimizer.outerplan`); the exchange checks the layout's
digest and refuses a mismatch. On emulated sites each peer connection paces itself by the
YAML's link between the two sites (a real network paces itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from geopipe.config import ClusterSpec
from geopipe.optimizer.outerplan import OuterRun
from geopipe.outer.fragments import StreamingSchedule
from geopipe.runtime.actor.outer_wire import OuterPeer, OuterSettings
from geopipe.runtime.control.placement import emulated_link
from geopipe.runtime.control.workers import Workers, ask
from geopipe.transport.link import LinkParams

__all__ = ["OuterRounds", "peers_of"]


def peers_of(
    endpoints: list[dict], link: Callable[[str, str], LinkParams | None], sites: list[str]
) -> list[list[OuterPeer]]:
    """For each actor (``endpoints[i]``, in site ``sites[i]``), the actors of the other groups
    that hold its stage and partition."""
    out = []
    for i, me in enumerate(endpoints):
        out.append(
            [
                OuterPeer(ep["group"], tuple(ep["address"]), ep["layout"], link(sites[i], sites[j]))
                for j, ep in enumerate(endpoints)
                if ep["group"] != me["group"]
                and ep["stage"] == me["stage"]
                and ep["partition"] == me["partition"]
            ]
        )
    return out


class OuterRounds:
    """Sends and applies of one outer run; ``say``/``event`` report each applied fragment."""

    def __init__(
        self,
        spec: ClusterSpec,
        run: OuterRun,
        workers: Workers,
        say: Callable[[str], None],
        event: Callable[..., None],
    ) -> None:
        s = run.setting
        self.spec = spec
        self.workers = workers
        self.run = run
        self.schedule = StreamingSchedule(s.h, s.fragments, s.overlap)
        self.settings = OuterSettings(
            lr=run.lr,
            momentum=run.momentum,
            fragments=s.fragments,
            codec=s.codec,
            topk_ratio=spec.plan.topk_ratio,
            timeout_s=spec.health.wan_outage_s,
            seed=spec.training.seed,
        )
        self.say, self.event = say, event
        self.rounds: list[dict] = []  # what each applied fragment cost (the run's record)
        self._sent: dict[int, tuple[float, list[dict]]] = {}  # fragment -> (sent at, results)
        self._partitions: list[tuple[int, int]] = []  # each actor's (stage, partition)

    def begin(self, actors: list[Any], sites: list[str]) -> None:
        """theta_global from every replica's masters now (all groups hold the same weights:
        the start, or a loaded checkpoint), listeners up, peers connected."""
        endpoints = ask(self.workers, actors, "outer_begin", self.settings)
        self._partitions = [(ep["stage"], ep["partition"]) for ep in endpoints]
        peers = peers_of(endpoints, partial(emulated_link, self.spec), sites)
        w = self.workers
        w.get([w.call(a, "outer_connect", p) for a, p in zip(actors, peers, strict=True)])

    def after_step(self, done: int, actors: list[Any]) -> None:
        """``done`` inner steps have run: start the send and do the apply they call for."""
        f = self.schedule.sends_at(done)
        if f is not None:
            self._sent[f] = (time.perf_counter(), ask(self.workers, actors, "outer_send", f))
        f = self.schedule.applies_at(done)
        if f is None:
            return
        t0 = time.perf_counter()
        applied = ask(self.workers, actors, "outer_apply", f)
        sent_at, sent = self._sent.pop(f, (t0, []))
        self._record(done, f, time.perf_counter() - t0, t0 - sent_at, sent, applied)

    def _record(
        self,
        step: int,
        fragment: int,
        apply_s: float,
        overlapped_s: float,
        sent: list[dict],
        applied: list[dict],
    ) -> None:
        # theta_global must be bit-identical in every group: one digest per partition
        by_part: dict[tuple[int, int], set[str]] = {}
        for part, a in zip(self._partitions, applied, strict=True):
            by_part.setdefault(part, set()).add(a["digest"])
        wait_s = max((a.get("wait_s", 0.0) for a in applied), default=0.0)
        row = {
            "step": step,
            "round": applied[0]["round"],
            "fragment": fragment,
            "groups": self.run.plan.num_groups,
            "apply_s": apply_s,
            "overlapped_s": overlapped_s,  # inner steps ran while the transfer was in flight
            "exposed_s": wait_s,  # the transfer compute did not hide (the appliers' wait)
            "bytes": sum(s.get("payload_bytes", 0) for s in sent),
            "codec_error": max((s.get("codec_error") or 0.0 for s in sent), default=0.0),
            "digests_equal": all(len(d) == 1 for d in by_part.values()),
        }
        self.rounds.append(row)
        self.event("outer_round", **row)
        if fragment == self.settings.fragments - 1:
            self.say(
                f"step {step}: outer round {row['round']} over {row['groups']} groups, "
                f"{row['bytes'] / 1e6:.2f} MB, exposed {wait_s:.2f} s, apply {apply_s:.2f} s"
            )
