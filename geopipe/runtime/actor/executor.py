"""Execute one stage's action list for one optimizer step: the runtime's interpreter of the IR.

The list is exactly what the planner simulated (:mod:`geopipe.pipeline.schedule`):

* ``F m``: forward micro-batch ``m`` (the first stage reads its tokens from the
  deterministic stream; the others take the activation that arrived);
* ``B m``: the last stage back-propagates its loss; the others the gradient received from
  downstream (surrogate backward, see :mod:`geopipe.runtime.actor.engine`);
* ``I m`` / ``W m``: the same backward split in two — the input gradient first (what
  ``SEND_B`` sends), the weight gradients later (:mod:`geopipe.runtime.actor.backward`);
* ``SEND_*``: hand the tensor to the link and go on (transfer overlaps compute);
* ``RECV_*``: wait for the message, which the transport has been receiving meanwhile.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from geopipe.pipeline.schedule import Kind
from geopipe.runtime.actor.links import StageLinks

__all__ = ["BREAKDOWN", "FOREGROUND", "Fault", "IterationResult", "execute"]

_F, _B, _SF, _RF, _SB, _RB, _I, _W = (int(k) for k in Kind)


@dataclass
class IterationResult:
    """What one stage replica reports for one step (shipped to the controller over Ray)."""

    stage: int
    replica: int
    step: int
    losses: list[float]  # per micro-batch, last stage only
    busy_s: float  # forward + backward + the optimizer step (wherever it ran)
    wait_s: float  # blocked in receives
    duration_s: float
    start: float  # time.monotonic() at the start, for aligning measured timelines
    wan_bytes: int
    micro_batches: int
    optimizer_steps: int
    # (kind, micro-batch, start, end) relative to ``start``; recorded on request only
    events: list[tuple[str, int, float, float]] = field(default_factory=list)
    # most bytes autograd held for backward at once (the activation meter's peak)
    peak_activation_bytes: int = 0
    # how much later than the (emulated) link each inbound WAN message became usable
    transport_excess_s: dict[str, list[float]] = field(default_factory=dict)
    # over a real link: (micro-batch, sent at on the sender's clock, usable at on this
    # replica's clock) of each inbound WAN message, per direction ("F", "B")
    transport_stamps: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    # where the step's time went on this replica (seconds; see :data:`BREAKDOWN`)
    breakdown: dict[str, float] = field(default_factory=dict)
    lr: float | None = None  # the learning rate of this step's optimizer step
    grad_norm: float | None = None  # this stage's gradient norm (over its ZeRO-1 group)
    # the latest sampled relative error of each lossy WAN codec it sends with, by direction
    codec_error: dict[str, float] = field(default_factory=dict)
    # an outer-loop run's send this replica made itself after the step (the answer of
    # ``OuterLoop.send``; :mod:`geopipe.runtime.actor.inner_run`), else None
    outer_sent: dict[str, Any] | None = None
    # the outer apply this replica made after the step, inside its span (the answer of
    # ``OuterLoop.apply``: [Note: applies decided inside a span] in .inner_run)
    outer_applied: dict[str, Any] | None = None


# The step-time breakdown. On the compute thread, adding up to ``duration_s``: forward,
# backward (without the optimizer step), optimizer (DeepSpeed's step: ZeRO-1 reduction and
# Adam), send (handing tensors to the links), recv_wait (blocked on arrivals), drain
# (waiting at the end for the last sends), tie_wait (swapping a tied embedding's gradient
# with the stage holding its other copy), snapshot (copying the boundary snapshot), other
# (the rest: the interpreter, bookkeeping). Encode (codec + checksum of sends) and decode
# (checksum + codec of arrivals) mostly run on the transport's threads, overlapping the
# above; a small send written inline (geopipe.transport.direct) encodes on the compute
# thread, so its encoding is inside "send" too. gc (Python's cyclic garbage collector,
# which pauses every thread) falls inside whichever of the above it interrupted.
FOREGROUND = (
    "forward",
    "backward",
    "optimizer",
    "send",
    "recv_wait",
    "drain",
    "tie_wait",
    "snapshot",
)
BREAKDOWN = (*FOREGROUND, "other", "encode", "decode", "gc")
_SLOT = {
    _F: "forward",
    _B: "backward",
    _I: "backward",
    _W: "backward",
    _SF: "send",
    _SB: "send",
    _RF: "recv_wait",
    _RB: "recv_wait",
}


class _GcClock:
    """Seconds this process spent in Python's cyclic garbage collector (any thread): a
    collection pauses every thread holding the GIL, inside whatever part it hit."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._t0


_GC = _GcClock()
gc.callbacks.append(_GC)


@dataclass(frozen=True)
class Fault:
    """Injected by tests: at ``step``, stall ``delay_s`` before the last send, then exit."""

    step: int
    delay_s: float


@dataclass
class _Run:
    """One iteration's moving parts: what has arrived, what waits to be sent."""

    step: int
    engine: Any
    links: StageLinks
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    first: bool
    last: bool
    recv_timeout_s: float
    res: IterationResult
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    outs: dict[int, torch.Tensor] = field(default_factory=dict)

    def act(self, c: int, mb: int) -> None:
        """Run one action ``c`` on micro-batch ``mb``."""
        step, engine, links, res = self.step, self.engine, self.links, self.res
        if c == _RF:
            self.inputs[mb] = links.inbox.get(("F", step, mb), timeout=self.recv_timeout_s)
        elif c == _RB:
            self.grads[mb] = links.inbox.get(("B", step, mb), timeout=self.recv_timeout_s)
        elif c == _F:
            x = self.batch(step, mb)[0] if self.first else self.inputs.pop(mb)
            self.outs[mb] = engine.forward(mb, x)
        elif c == _B:
            if self.last:
                res.losses.append(engine.backward_last(mb, self.batch(step, mb)[1]))
            else:
                engine.backward(mb, self.grads.pop(mb))
        elif c == _I:
            if self.last:
                res.losses.append(engine.backward_input(mb, targets=self.batch(step, mb)[1]))
            else:
                engine.backward_input(mb, self.grads.pop(mb))
        elif c == _W:
            engine.backward_weight(mb)
        elif c == _SF:
            res.wan_bytes += links.send_forward(("F", step, mb), self.outs.pop(mb))
        else:  # _SB
            res.wan_bytes += links.send_backward(("B", step, mb), engine.input_grad(mb))


def execute(
    program: list[tuple[int, int]],
    step: int,
    engine: Any,
    links: StageLinks,
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    *,
    stage: int,
    replica: int,
    first: bool,
    last: bool,
    record: bool,
    recv_timeout_s: float,
    shape: tuple[int, int, int],
    dtype: torch.dtype = torch.float32,
    fault: Fault | None = None,
) -> IterationResult:
    """Run ``program`` (``(kind, micro-batch)`` pairs) for optimizer step ``step``;
    ``shape`` and ``dtype`` are those of an activation (micro-batch, sequence, embedding)."""
    t_start = time.monotonic()
    links.expect(
        [("F", step, mb) for c, mb in program if c == _RF],
        [("B", step, mb) for c, mb in program if c == _RB],
        shape,
        dtype,
    )
    res = IterationResult(
        stage=stage,
        replica=replica,
        step=step,
        losses=[],
        busy_s=0.0,
        wait_s=0.0,
        duration_s=0.0,
        start=t_start,
        wan_bytes=0,
        micro_batches=sum(1 for c, _ in program if c == _F),
        optimizer_steps=0,
    )
    run = _Run(step, engine, links, batch, first, last, recv_timeout_s, res)
    sends = [i for i, (c, _) in enumerate(program) if c in (_SF, _SB)]
    spent = dict.fromkeys(BREAKDOWN, 0.0)
    start = (engine.optimizer_s, links.encode_s(), links.inbox.decode_s, _GC.total_s)
    engine.meter.reset_peak()
    for i, (c, mb) in enumerate(program):
        if fault is not None and fault.step == step and sends and i == sends[-1]:
            time.sleep(fault.delay_s)
            os._exit(1)  # the injected failure: a process dying mid-iteration
        t0 = time.monotonic()
        run.act(c, mb)
        t1 = time.monotonic()
        spent[_SLOT[c]] += t1 - t0
        if c in (_RF, _RB):
            res.wait_s += t1 - t0
        if record:
            res.events.append((Kind(c).name, mb, t0 - t_start, t1 - t_start))
        if first and c in (_B, _W):
            engine.input_grad(mb)  # frees the stored input of micro-batch mb
    run.outs.clear()
    return _finish(run, spent, start)


def _finish(run: _Run, spent: dict[str, float], start: tuple[float, ...]) -> IterationResult:
    """Drain the sends, take the optimizer step, and fill in the iteration's figures."""
    engine, links, res, step = run.engine, run.links, run.res, run.step
    opt0, enc0, dec0, gc0 = start
    t0 = time.monotonic()
    links.finish()
    spent["drain"] = time.monotonic() - t0
    # an engine without defer_step stepped inside its last backward: that is not backward
    spent["backward"] -= engine.optimizer_s - opt0
    t0 = time.monotonic()
    # the runtime's deferred step, after the sends (a tied embedding's copies first swap
    # their gradients: [Note: tied embeddings across stages] in geopipe.model.hf)
    engine.end_iteration(
        (lambda g: links.exchange_tied(step, g, run.recv_timeout_s)) if engine.has_tied else None
    )
    spent["tie_wait"] = max(0.0, time.monotonic() - t0 - (engine.optimizer_s - opt0))
    spent["optimizer"] = engine.optimizer_s - opt0
    res.lr, res.grad_norm = engine.step_stats()
    res.codec_error = links.codec_errors()
    spent["encode"] = links.encode_s() - enc0
    spent["decode"] = links.inbox.decode_s - dec0
    spent["gc"] = _GC.total_s - gc0
    # busy: the compute ops and the optimizer step, whether the last backward ran it or
    # end_iteration did after the sends ([Note: the step after the sends] in .engine)
    res.busy_s = spent["forward"] + spent["backward"] + spent["optimizer"]
    res.breakdown = spent
    res.peak_activation_bytes = engine.meter.peak
    res.optimizer_steps = engine.step_count
    return res
