"""A stage replica's part of the outer loop (DiLoCo between replica groups).

The numerics are :mod:`geopipe.outer`'s (theta_global, the Nesterov step, the encoded
all-gather); this module binds them to a stage replica's DeepSpeed ZeRO-1 engine and to its
peers over the data plane (:mod:`.outer_wire`).

[Note: the outer loop partition by partition]
Under ZeRO-1 each replica of a stage owns one flat fp32 master partition per parameter
group (:func:`~geopipe.runtime.actor.zero_state.master_partitions`). The outer step is
elementwise, so each replica keeps theta_global and the outer momentum for its own
partition only and exchanges it only with its *peers*: the replicas that own the same
(stage, partition) in the other groups. That needs the same partition layout in every
group (same stage split, same ZeRO-1 size): checked by a digest before the first round.
A fragment is slice ``f`` of each of the replica's partitions (equal slices, so the
fragments' transfers are equal). After the step theta_global is written into the masters
and the working weights are all-gathered inside the ZeRO-1 group, as DeepSpeed does after
its own step, so the next inner step starts from theta_global. Adam's state is not touched.
theta_global, the momentum, the pseudo-gradient and the average live on the host while the
masters may be on a GPU ([Note: the outer state lives on the host] in
:mod:`geopipe.outer.optimizer`): the masters are copied out to take the pseudo-gradient and
written back in place, on their own device, after the step.

[Note: chunks, seeds and identical averages]
A fragment's pseudo-gradient is cut into chunks of ``chunk_elems`` (a multiple of the
codec's row, :data:`~geopipe.outer.ROW_LEN`), each encoded once and sent as one frame, so
no frame exceeds the receiver's payload bound whatever the model's size. Every group
averages the same bytes in group order, chunk by chunk, so theta_global stays bitwise equal
in every group under every codec. A seeded codec (the rotated int4h/int2h) takes its seed
from (run seed, stage, partition, fragment, round, chunk): the same in every group.

[Note: a round over the survivors]
An apply is two calls. :meth:`OuterLoop.gather` waits (up to ``health.wan_outage_s``) for
the peers' payloads and says which groups' it holds; the driver then names one list of
groups, the live ones every replica holds, and :meth:`OuterLoop.apply` averages over exactly
those. Every replica of every surviving group averages the same payloads in the same order,
so theta_global stays bit-identical among the survivors even when a group died after its
payload reached some of them and not others: a lost group's payload is never used, so the
round in flight averages over the survivors alone, whenever in the round the loss came.
:meth:`OuterLoop.drop` (called beside a waiting gather, on another of the actor's threads)
ends the wait for a group the driver wrote off; sends and gathers asked again after a
failure repeat nothing already done. A group whose frames this replica's listener refused
(a header off the plan, a payload holding NaN, inf or an overflowing value: :mod:`.outer_frames`)
is not waited for: the gather names it missing, and refused, at once, for the driver to
write it off like a silent one. Its payload is never filed, so no apply can average it.

[Note: tied embeddings and the outer loop]
With ZeRO-1 a partition never holds two copies of one tensor, but a pipeline whose first and
last stages hold the two copies of a tied embedding has them in two *different* stages'
partitions, at different offsets. Exact averaging (codec ``none``) would keep them equal,
since both copies start equal and get equal inputs; a lossy codec quantises each copy with
different neighbours in its rows and the copies drift apart. Rather than promise what is
not tested, an outer loop over a stage holding a tied copy is refused
(:class:`OuterState`); exchanging the tied tensor as a stream of its own, encoded with the
same rows on both stages, is the way to lift that.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from geopipe.outer import OuterOptimizer, average_encoded, decode_delta, encode_delta
from geopipe.runtime.actor import zero_state
from geopipe.runtime.actor.gradnorm import ModelError
from geopipe.runtime.actor.outer_wire import (
    CHUNK_ELEMS,
    OuterExchange,
    OuterFrames,
    OuterPeer,
    OuterSettings,
    bad_values,
)
from geopipe.transport import wire
from geopipe.transport.codec import Codec, Encoded, make_codec
from geopipe.transport.security import RunCredentials

__all__ = ["CHUNK_ELEMS", "OuterLoop", "OuterPeer", "OuterSettings", "OuterState"]


class OuterState:
    """theta_global and the outer momentum of one replica's ZeRO-1 partitions, bound to its
    engine ([Note: the outer loop partition by partition]).

    ``engine`` is the replica's :class:`~geopipe.runtime.actor.engine.StageEngine`. The
    initial theta_global is a copy of the fp32 masters now: build it when every group holds
    the same weights (at the start, after a checkpoint load, or after a round)."""

    def __init__(self, engine: Any, stage: int, settings: OuterSettings, tag: str = "") -> None:
        if engine.has_tied:
            raise ValueError(
                "the outer loop does not yet run on a stage holding one copy of a tied "
                "embedding split over two stages ([Note: tied embeddings and the outer loop] "
                "in geopipe.runtime.actor.outer): untie the model, or keep it in one stage"
            )
        self.engine, self.stage, self.settings = engine, stage, settings
        layout = zero_state.partition_layout(engine.engine)
        self.partition, self.partitions = layout["rank"], layout["size"]
        self.layout = _digest({**layout, "stage": stage, "tag": tag})
        masters = zero_state.master_partitions(engine.engine)
        self.opt = OuterOptimizer(  # copies the masters to the host
            masters,
            settings.lr,
            settings.momentum,
            settings.fragments,
        )
        self._codec = make_codec(settings.codec, topk_ratio=settings.topk_ratio)

    def chunks(self, fragment: int) -> list[tuple[int, int]]:
        """``[start, end)`` of each chunk of ``fragment``'s flat vector."""
        n = self.opt.fragment_numel(fragment)
        size = self.settings.chunk_elems
        return [(s, min(s + size, n)) for s in range(0, n, size)] or [(0, 0)]

    def seed(self, fragment: int, round_: int, chunk: int) -> int:
        """The codec seed of one chunk: equal in every group ([Note: chunks, seeds and
        identical averages])."""
        key = f"{self.settings.seed}/{self.stage}/{self.partition}/{fragment}/{round_}/{chunk}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")

    def _codec_for(self, fragment: int, round_: int, chunk: int) -> Codec:
        if self.settings.codec in wire.GROUPED:  # stateless apart from the seed
            seed = self.seed(fragment, round_, chunk)
            return make_codec(self.settings.codec, self.settings.topk_ratio, seed=seed)
        return self._codec  # top-k keeps its error feedback, per fragment and chunk

    def delta(self, fragment: int, round_: int | None = None) -> tuple[list[Encoded], float]:
        """This replica's encoded pseudo-gradient (theta_global - masters) of ``fragment``,
        one payload per chunk, and the codec's relative error on it (0 for ``none``). The
        pseudo-gradient is taken on the host (the masters copied out of the device).

        Raises :class:`~geopipe.runtime.actor.gradnorm.ModelError` when the pseudo-gradient,
        or what a peer would decode from its encoding, holds values no average may take
        (NaN, inf, beyond ``MAX_ABS``: [Note: what an outer payload may hold]), or the codec
        cannot carry it: this group's model diverged, and sending would poison every other
        group's theta_global (each would refuse it and write this group off); as a model
        error, the driver ends the run naming the fragment instead."""
        round_ = self.opt.steps(fragment) if round_ is None else round_
        masters = zero_state.master_partitions(self.engine.engine)
        delta = self.opt.pseudo_gradient(masters, fragment)
        if (why := bad_values(delta)) is not None:
            raise self._diverged(fragment, round_, why)
        out, err2 = [], 0.0
        for c, (s, e) in enumerate(self.chunks(fragment)):
            codec = self._codec_for(fragment, round_, c)
            try:
                enc = encode_delta(delta[s:e], codec, key=f"outer/{fragment}/{c}")
            except ValueError as exc:  # a grouped codec's scale beyond fp16's range
                if self.settings.codec not in wire.GROUPED:
                    raise
                raise self._diverged(fragment, round_, f"cannot be encoded ({exc})") from exc
            if self.settings.codec != "none":  # what the peers decode (fp16 may overflow)
                sent = decode_delta(enc, e - s)
                if (why := bad_values(sent)) is not None:
                    raise self._diverged(fragment, round_, f"decodes to a chunk that {why}")
                err2 += float((sent - delta[s:e]).pow(2).sum())
            out.append(enc)
        norm = float(delta.norm())
        return out, (err2**0.5 / norm if norm > 0 else err2**0.5)

    def _diverged(self, fragment: int, round_: int, why: str) -> ModelError:
        """The :class:`ModelError` :meth:`delta` raises: its message names the fragment and
        leads with the mark the driver reads as a model error."""
        return ModelError(
            f"{ModelError.MARK} outer fragment {fragment} (round {round_}) of stage "
            f"{self.stage}, ZeRO-1 partition {self.partition}: its pseudo-gradient {why}; "
            "this group's model diverged, so it is not sent to the other groups"
        )

    @torch.no_grad()
    def apply(
        self,
        fragment: int,
        payloads: Sequence[Sequence[Encoded]],
        weights: Sequence[float] | None = None,
    ) -> None:
        """The outer step of ``fragment`` from every group's chunks (``payloads[g][c]``, in
        the same group order in every group, this replica's own among them); then the
        masters of ``fragment`` are set to theta_global and the working weights re-synced.
        The average and the step are on the host; the write-back copies into each master
        on its own device.

        COLLECTIVE on the ZeRO-1 group (the all-gather): every replica of the group applies
        the same fragment, between iterations."""
        avg = torch.empty(self.opt.fragment_numel(fragment), dtype=torch.float32, device="cpu")
        for c, (s, e) in enumerate(self.chunks(fragment)):
            avg[s:e] = average_encoded([p[c] for p in payloads], e - s, weights)
        self.opt.step(avg, fragment)
        masters = zero_state.master_partitions(self.engine.engine)
        self.opt.copy_to(masters, fragment)
        zero_state.sync_working_params(self.engine.engine)

    def digest(self, fragment: int | None = None) -> str:
        return self.opt.digest(fragment)

    def state_dict(self) -> dict[str, Any]:
        """theta_global, momentum and step counts (:meth:`OuterOptimizer.state_dict`), the
        partition they belong to, and the top-k residuals (error feedback)."""
        codec_state = self._codec.state_dict() if hasattr(self._codec, "state_dict") else {}
        return {
            **self.opt.state_dict(),
            "stage": self.stage,
            "partition": self.partition,
            "partitions": self.partitions,
            "layout": self.layout,
            "codec": self.settings.codec,
            "codec_state": codec_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same (stage, partition) layout bit-exactly."""
        if state["layout"] != self.layout:
            raise ValueError(
                f"outer state of stage {state['stage']} partition {state['partition']}/"
                f"{state['partitions']} does not fit stage {self.stage} partition "
                f"{self.partition}/{self.partitions} (layouts differ)"
            )
        self.opt.load_state_dict(state)
        if state.get("codec_state") and hasattr(self._codec, "load_state_dict"):
            self._codec.load_state_dict(state["codec_state"])


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class OuterLoop:
    """One replica's outer state and its exchange with its peers: what the
    :class:`~geopipe.runtime.actor.stage.StageWorker` methods ``outer_*`` call.

    A round of fragment ``f``: :meth:`send` (take and encode the pseudo-gradient, send it to
    every peer in the background), any number of inner steps (the overlap tau), then
    :meth:`apply` (wait for the peers' payloads, average, step, write, all-gather)."""

    def __init__(
        self,
        engine: Any,
        stage: int,
        group: int,
        settings: OuterSettings,
        *,
        host: str,
        listen_all: bool = False,
        creds: RunCredentials | None = None,
        user_timeout_s: float = 30.0,
        tag: str = "",
    ) -> None:
        self.state = OuterState(engine, stage, settings, tag)
        self.group, self.settings = group, settings
        self.net = OuterExchange(
            "0.0.0.0" if listen_all else host, host, creds, settings.max_payload, user_timeout_s
        )
        opt = self.state.opt  # every group's layout is this one's: its frames are known
        numels = [opt.fragment_numel(f) for f in range(settings.fragments)]
        self.net.expect(OuterFrames(settings, self._tag(0, 0)[:3], numels, opt.steps))
        # fragment -> (round, own chunks, what the send answered); the peers' chunks by group
        self._pending: dict[int, tuple[int, list[Encoded], dict[str, Any]]] = {}
        self._got: dict[int, dict[int, list[Encoded]]] = {}
        self._told: dict[int, set[int]] = {}  # fragment -> refused groups a gather reported
        self._sent_bytes: dict[int, int] = {}
        # [Note: applies decided inside a span]: the span's thread makes the sends and the
        # applies; the driver's gathers and decisions come on other threads of the actor
        self._sync = threading.Condition()
        self._sent_done: dict[int, int | None] = {}  # fragment -> inner steps done at its send
        self._decided: dict[int, list[int]] = {}  # apply point (steps done) -> the groups
        self._made: dict[int, list[int]] = {}  # apply point -> the groups its apply used
        self._seq: dict[int, int] = {}  # apply point -> the latest word of the driver's on it
        # fragment -> (inner steps done at its send, the groups) of its latest applied round
        self._applied: dict[int, tuple[int | None, list[int]]] = {}
        self._sent_clock: dict[int, float] = {}  # fragment -> when its pending round was sent

    def endpoint(self) -> dict[str, Any]:
        """What the driver needs to pair peers: (stage, partition) and the listener."""
        s = self.state
        return {
            "group": self.group,
            "stage": s.stage,
            "partition": s.partition,
            "partitions": s.partitions,
            "address": self.net.address,
            "layout": s.layout,
        }

    def connect(self, peers: Sequence[OuterPeer]) -> None:
        for p in peers:
            if p.layout != self.state.layout:
                raise ValueError(
                    f"outer peer in group {p.group} at {p.address} has another "
                    "partition layout: every group must split its stages and "
                    "ZeRO-1 partitions alike"
                )
            if p.group == self.group:
                raise ValueError(f"outer peer at {p.address} is in this replica's group {p.group}")
        self.net.connect(peers)

    def _tag(self, fragment: int, round_: int) -> tuple:
        return ("O", self.state.stage, self.state.partition, fragment, round_)

    def send(self, fragment: int, done: int | None = None) -> dict[str, Any]:
        """Encode this replica's pseudo-gradient of ``fragment`` and start sending it
        (``done``: the inner steps done, which a gather may name). Asked again before the
        apply (the driver retrying a round a failure interrupted), it answers what the first
        send did and sends nothing twice."""
        if fragment in self._pending:
            return self._pending[fragment][2]
        t0 = time.perf_counter()
        round_ = self.state.opt.steps(fragment)
        chunks, err = self.state.delta(fragment, round_)
        encode_s = time.perf_counter() - t0
        self.net.post(self._tag(fragment, round_), self.group, chunks)
        out = {
            "fragment": fragment,
            "round": round_,
            "chunks": len(chunks),
            "payload_bytes": sum(c.payload_nbytes for c in chunks),
            "encode_s": encode_s,
            "codec_error": err,
        }
        with self._sync:
            self._pending[fragment] = (round_, chunks, out)
            self._sent_done[fragment] = done
            self._sent_clock[fragment] = time.monotonic()
            self._sync.notify_all()
        return out

    def sent(self, fragment: int, done: int, wait_s: float) -> bool:
        """Whether the round of ``fragment`` sent after ``done`` inner steps is pending (its
        apply not made yet), waiting up to ``wait_s`` for the span to send it."""
        with self._sync:
            return self._sync.wait_for(
                lambda: (
                    self._sent_done.get(fragment) == done
                    or self._applied.get(fragment, (None, []))[0] == done
                ),
                timeout=wait_s,
            )

    def decide(self, done: int, groups: Sequence[int] | None, seq: int = 0) -> dict[str, Any]:
        """The driver's groups for the apply after ``done`` inner steps, which the span
        makes once this replica holds every one's payload (None: hold it, the driver
        decides again; ``seq``: its order among the driver's word on this apply, an older
        one arriving late changes nothing); answered on another thread than the span's.
        Returns the groups an
        apply already made there averaged over (``made``; None: not made, and now it will
        follow this decision): atomic with the apply's own start, so the driver learns
        either that the apply is made or that it will follow what it says ([Note: applies
        decided inside a span] in :mod:`.inner_run`)."""
        with self._sync:
            made = self._made.get(done)
            if made is None and seq >= self._seq.get(done, 0):
                self._seq[done] = seq
                if groups is None:
                    self._decided.pop(done, None)
                else:
                    self._decided[done] = sorted(groups)
                self._sync.notify_all()
            return {"made": made}

    def decision(self, done: int, fragment: int, wait_s: float) -> list[int]:
        """The groups of the apply after ``done`` inner steps, once the driver has named
        them and this replica holds every one's payload of ``fragment`` (the span's
        thread, at the apply point; the driver's gathers file the payloads), waiting up to
        ``wait_s``. From here the decision is made: :meth:`decide` no longer changes it."""
        with self._sync:
            if not self._sync.wait_for(lambda: self._ready(done, fragment), timeout=wait_s):
                raise TimeoutError(
                    f"no decision from the driver for the outer apply after {done} inner steps "
                    f"in {wait_s:.0f} s"
                )
            groups = self._made[done] = self._decided.pop(done)
            for old in [d for d in self._made if d < done - 1000]:
                del self._made[old]  # the driver asks about the apply in flight only
                self._seq.pop(old, None)
            return groups

    def _ready(self, done: int, fragment: int) -> bool:
        """Whether the apply after ``done`` steps is decided and every named group's payload
        of ``fragment`` is held (this replica's own: sent). Under ``_sync``."""
        groups = self._decided.get(done)
        if groups is None or fragment not in self._pending:
            return False
        got = self._got.get(fragment, {})
        return all(g == self.group or g in got for g in groups)

    def gather(
        self,
        fragment: int,
        timeout_s: float | None = None,
        sent_done: int | None = None,
        send_wait_s: float = 0.0,
    ) -> dict[str, Any]:
        """Wait (up to ``timeout_s``, by default ``settings.timeout_s``) for the peers'
        payloads of the sent ``fragment``; returns the groups whose payloads this replica
        holds (its own among them), why each other one is missing and, among those, the
        groups whose frames were refused (``refused``: group -> why; the listener dropped
        their streams, so they will not come: see :class:`OuterExchange`). Asked again, it
        waits only for the peers still missing and not dropped ([Note: a round over the
        survivors]).

        A refused peer is not waited for, so a gather missing only refused peers answers at
        once; asked again with nothing new to say, it answers after ``timeout_s`` like a
        gather that waited: the driver asks in slices of that length until
        ``health.wan_outage_s``, and an answer it already had must not come back at once
        each time, or its loop would spin for that long.

        ``sent_done``: the gather of the round sent after that many inner steps, asked while
        a span runs ([Note: applies decided inside a span]): it first waits up to
        ``send_wait_s`` for the span to make that send, and answers ``sent: False`` if it
        has not."""
        if sent_done is not None and not self.sent(fragment, sent_done, send_wait_s):
            return {"fragment": fragment, "group": self.group, "sent": False, "have": []}
        with self._sync:
            done, groups = self._applied.get(fragment, (None, []))
        if sent_done is not None and done == sent_done:  # applied already: it held them all
            have = sorted({self.group, *groups})
            return {
                "fragment": fragment,
                "group": self.group,
                "applied": groups,
                "have": have,
                "missing": {},
                "refused": {},
                "wait_s": 0.0,
            }
        with self._sync:
            if fragment not in self._pending:
                raise RuntimeError(f"fragment {fragment} has not been sent")
            round_, own, _ = self._pending[fragment]
        have = self._got.setdefault(fragment, {})
        t0 = time.perf_counter()
        wait = self.settings.timeout_s if timeout_s is None else timeout_s
        got, missing, sent = self.net.gather(self._tag(fragment, round_), len(own), wait)
        with self._sync:  # a span waiting at the apply for these payloads goes on
            have.update(got)
            self._sync.notify_all()
        self._sent_bytes[fragment] = self._sent_bytes.get(fragment, 0) + sent
        missing = {g: why for g, why in missing.items() if g not in have}
        refused = {g: self.net.refused[g] for g in missing if g in self.net.refused}
        told = self._told.setdefault(fragment, set())
        if refused and set(refused) <= told:  # said already: answer at the slice's pace
            time.sleep(max(0.0, wait - (time.perf_counter() - t0)))
        told.update(refused)
        return {
            "fragment": fragment,
            "round": round_,
            "group": self.group,
            "have": sorted({self.group, *have}),
            "missing": missing,
            "refused": refused,
            "wait_s": time.perf_counter() - t0,
        }

    def drop(self, groups: Sequence[int]) -> None:
        """Write ``groups`` off: no round waits for them again (safe beside a gather)."""
        self.net.drop(groups)

    def apply(self, fragment: int, groups: Sequence[int] | None = None) -> dict[str, Any]:
        """The outer step of the sent ``fragment`` averaged over ``groups`` (their payloads
        as :meth:`gather` holds them, in group order); None: gather, and every peer must
        have answered. COLLECTIVE on the ZeRO-1 group (see :meth:`OuterState.apply`)."""
        if fragment not in self._pending:
            raise RuntimeError(f"fragment {fragment} has not been sent")
        wait_s = 0.0
        if groups is None:
            g = self.gather(fragment)
            wait_s = g["wait_s"]
            if g["missing"]:
                peer, why = sorted(g["missing"].items())[0]
                raise TimeoutError(f"outer exchange: group {peer}: {why}")
            groups = g["have"]
        round_, own, _ = self._pending[fragment]
        have = {**self._got.get(fragment, {}), self.group: own}
        absent = [g for g in groups if g not in have]
        if absent or self.group not in groups:
            raise RuntimeError(
                f"outer apply of fragment {fragment} over groups {sorted(groups)}: this "
                f"replica (group {self.group}) holds no payload of group(s) {absent}"
                if absent
                else f"outer apply over groups {sorted(groups)} leaves out this group"
            )
        payloads = [have[g] for g in sorted(groups)]
        w = self.settings.weights
        weights = [w[g] for g in sorted(groups)] if w else None
        with self._sync:
            del self._pending[fragment]  # only now: a failed apply can be asked again
            self._got.pop(fragment, None)
            self._told.pop(fragment, None)
            self._applied[fragment] = (self._sent_done.pop(fragment, None), sorted(groups))
            since_send_s = time.monotonic() - self._sent_clock.pop(fragment, time.monotonic())
        t0 = time.perf_counter()
        self.state.apply(fragment, payloads, weights)
        # after the step: the plan's window has moved on, so nothing of the round comes after
        self.net.forget(self._tag(fragment, round_), len(own))
        return {
            "fragment": fragment,
            "round": round_,
            "groups": len(payloads),
            "bytes_sent": self._sent_bytes.pop(fragment, 0),
            "wait_s": wait_s,
            "apply_s": time.perf_counter() - t0,
            "since_send_s": since_send_s,
            "digest": self.state.digest(fragment),  # the fragment this round changed
        }

    def close(self) -> None:
        self.net.close()
