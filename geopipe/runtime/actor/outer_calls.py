"""The outer loop's calls on a stage actor: theta_global taken, peers connected, the
pseudo-gradient's sends, gathers and the outer step, the outer state in and out of
checkpoints (the loop itself: :mod:`geopipe.runtime.actor.outer`).

Its own module because these calls are the one part of the actor's surface that only an
outer-loop run uses, and all of them drive the replica's ``OuterLoop``;
:class:`~geopipe.runtime.actor.stage.StageWorker` inherits them, so Ray serves them on the
same actor as its other methods.
"""

from __future__ import annotations

from typing import Any

from geopipe.runtime.actor.outer_wire import OuterPeer, OuterSettings
from geopipe.runtime.node import node_ip

__all__ = ["OuterCalls"]


class OuterCalls:
    """The outer-loop methods of :class:`~geopipe.runtime.actor.stage.StageWorker`, over
    the state it holds (its engine, stage, spec, links, layers, boundary snapshots)."""

    engine: Any
    k: int
    spec: Any  # the StageSpec
    links: Any
    layers: tuple[int, ...]
    boundaries: Any
    _outer: Any  # the outer loop's state and exchange (outer_begin)

    def outer_begin(self, settings: OuterSettings) -> dict[str, Any]:
        """Take theta_global from this replica's fp32 masters now and open its outer
        listener; returns its endpoint (group, stage, partition, address, layout)."""
        from geopipe.runtime.actor.outer import OuterLoop

        self._end_outer()
        self._outer = OuterLoop(
            self.engine,
            self.k,
            self.spec.group,
            settings,
            host=node_ip(),
            listen_all=self.spec.listen_all,
            creds=self.spec.creds,
            user_timeout_s=self.links.user_timeout_s,
            tag=f"{self.layers}/{self.spec.hold}",
        )
        self._outer.net.identify(self.spec.outer_key)  # signs its payloads: .outer_sign
        return self._outer.endpoint()

    def outer_connect(self, peers: list[OuterPeer]) -> None:
        """Connect to this replica's peers: same (stage, partition) in the other groups."""
        self._outer.connect(peers)

    def outer_send(self, fragment: int, done: int | None = None) -> dict[str, Any]:
        """Encode this replica's pseudo-gradient of ``fragment``; its sends run on."""
        return self._outer.send(fragment, done)

    def outer_gather(
        self,
        fragment: int,
        timeout_s: float | None = None,
        sent_done: int | None = None,
        send_wait_s: float = 0.0,
    ) -> dict[str, Any]:
        """Wait for the peers' payloads of ``fragment``: the groups held, the ones missing
        (``sent_done``: of the round a span sends after that many steps, once sent)."""
        return self._outer.gather(fragment, timeout_s, sent_done, send_wait_s)

    def outer_decide(self, done: int, groups: list[int] | None, seq: int = 0) -> dict[str, Any]:
        """The driver's groups for the apply after ``done`` inner steps, which the span
        running on this replica makes when it holds their payloads (None: hold it); answered
        beside the span, with the groups an apply already made there used (``made``)."""
        return self._outer.decide(done, groups, seq)

    def outer_decision(self, done: int, fragment: int, wait_s: float) -> list[int]:
        """The groups :meth:`outer_decide` named for the apply after ``done`` inner steps,
        once their payloads of ``fragment`` are held (the span's own thread, at that apply:
        :mod:`.inner_run`)."""
        return self._outer.decision(done, fragment, wait_s)

    def outer_drop(self, groups: list[int]) -> None:
        """Write ``groups`` off (a gather waiting on them stops); answered beside a gather."""
        self._outer.drop(groups)

    def outer_apply(self, fragment: int, groups: list[int] | None = None) -> dict[str, Any]:
        """The outer step of ``fragment`` over ``groups`` (None: all; COLLECTIVE on the ZeRO-1
        group, between iterations). The boundary snapshot of this step is re-taken: recovery
        must roll back to the weights after the outer step, not before it."""
        out = self._outer.apply(fragment, groups)
        step = self.engine.step_count
        self.boundaries.retake_weights(step, self.engine)  # [Note: an apply's re-take]
        return out

    def outer_state(self) -> dict[str, Any]:
        """theta_global and the outer momentum of this replica's partition (checkpoints)."""
        return self._outer.state.state_dict()

    def load_outer_state(self, state: dict[str, Any]) -> None:
        self._outer.state.load_state_dict(state)

    def load_outer_checkpoint(self, path: str) -> str:
        """The outer state of the checkpoint at ``path`` (:mod:`.outer_ckpt`)."""
        from geopipe.runtime.actor.outer_ckpt import restore_outer

        return restore_outer(self._outer, path, self.spec.group, self.k)

    def _end_outer(self) -> None:
        if self._outer is not None:
            self._outer.close()
            self._outer = None
