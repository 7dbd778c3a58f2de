"""One pipeline-stage replica's DeepSpeed ZeRO-1 engine, with no Ray in it.

Inside a site the replicas of one pipeline stage form a ZeRO-1 data-parallel group: each keeps
the whole stage in memory, holds 1/R of the Adam state, and averages gradients with its peers
at the accumulation boundary. :class:`StageEngine` owns that engine for one replica; the
caller (the Ray actor, or a test) moves activations and gradients between stages and decides
the micro-batch order (1F1B or any other).

The numbers are checked against a single-process torch reference (``tests/test_engine.py``).
Each DeepSpeed trap avoided here is commented where it is avoided: silent config defaults
(clipping at 1.0, AdamW for "Adam"), the shared-memory op build, the surrogate backward,
the lazily created Adam state, stale gradients after an aborted step.

[Note: loss scaling]
    With ``M`` micro-batches per replica and ``R`` replicas in the stage's group, the
    gradient every stage applies must be that of the mean loss over the ``M * R`` micro-batches
    of the global batch (each micro-batch loss is itself a mean over its tokens).

    * The last stage calls ``engine.backward(loss)``, which divides by
      ``gradient_accumulation_steps == M``. The gradient it sends upstream therefore already
      carries the factor ``1/M``.
    * Non-last stages back-propagate the received gradient with
      ``engine.backward((out * grad_out).sum(), scale_wrt_gas=False)``: dividing again would
      give ``1/M**2``.
    * At the boundary DeepSpeed all-reduces gradients inside the stage's ZeRO-1 group and
      divides by ``R``: mean over micro-batches times mean over replicas = mean over the
      global batch (replicas run equal micro-batch counts of equal size).

    ``out.backward(grad_out)`` would scale correctly too, but it bypasses DeepSpeed's backward
    bookkeeping and fails at the boundary in 1F1B order (``KeyError`` in
    ``scaled_global_norm``), hence the scalar surrogate.


Split backwards (``I``/``W``): see :mod:`geopipe.runtime.actor.backward`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import deepspeed
import deepspeed.comm
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from geopipe.model.family import DTYPES, ModelDesc, build_stage
from geopipe.model.gpt import GPTConfig, lm_loss
from geopipe.runtime.actor import zero_state
from geopipe.runtime.actor.backward import (
    ActivationMeter,
    WeightGradStore,
    drop_output_hooks,
    weight_surrogate,
)
from geopipe.runtime.actor.distgroups import StageMPU, destroy_process_group, init_process_group
from geopipe.runtime.actor.engine_config import EngineConfig, deepspeed_config
from geopipe.runtime.actor.gradnorm import ModelError, NormExchange, install_global_norm
from geopipe.runtime.actor.lr import engine_lr_factor

__all__ = [
    "EngineConfig",
    "ModelError",
    "StageEngine",
    "add_received",
    "add_tied_gradient",
    "destroy_process_group",
    "init_process_group",
    "param_groups",
]


# [Note: the step after the sends]
# DeepSpeed steps (the ZeRO-1 reduction and Adam) inside the last backward, before that
# backward's input gradient can be sent: every stage but the first would hold its upstream
# neighbour's last gradient back by its own optimizer step (0.04 s, spikes to 0.13 s), in
# every schedule without a split backward and down the pipeline in series. With
# ``defer_step`` the boundary is DeepSpeed's unmanaged mode: backward only accumulates,
# ``end_iteration`` (after the step's sends) reduces and steps — where the simulator puts
# the step. Look-ahead then runs within 2-5 % of its calibrated prediction
# (benchmarks/wsplit.py; 5-14 % above it with the step inside the backward). It is also what
# a mixed plan needs: its ZeRO-1 group may span stages of one pipeline, and a downstream
# stage blocked in the all-reduce would never send the upstream one its last gradient.


# [Note: mixed precision]
# ``bf16``/``fp16`` are DeepSpeed's mixed precision: the stage's module, its activations and
# its gradients are in the 16-bit type, and the ZeRO-1 optimizer keeps fp32 master weights
# and Adam moments (12 B per parameter, sharded over the replicas, as the planner's memory
# model counts). Checkpoints and snapshots hold those fp32 masters, so a resume continues
# exactly in any precision. fp16 adds DeepSpeed's dynamic loss scaling; DeepSpeed refuses
# fp16 on a CPU (the launch checks it first and says so).
# [Note: no collections while the engine is built]
# The first engine of a process imports torch._dynamo (torch's Optimizer.add_param_group is
# wrapped in torch._disable_dynamo, whose first call imports it, and with it sympy, inductor
# and FSDP: ~0.9 s of CPU even with TORCHDYNAMO_DISABLE=1; Adam's step would import it
# anyway). Its allocations set off ~300 runs of Python's cyclic collector, the full ones
# rescanning the whole heap of torch and DeepSpeed. Nothing built here is garbage worth
# finding before the actor collects and freezes its heap after setup ([Note: garbage
# collection off the step] in .stage), so the collector is paused while DeepSpeed builds
# the engine: the same objects and numbers, ~0.3 s less CPU per actor start (medians of 6,
# getrusage around this constructor in a fresh process; a re-setup imports nothing, and
# gains little).
@contextmanager
def _collector_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def add_tied_gradient(grad: Tensor, exchange: Callable[[Tensor], Tensor]) -> None:
    """Swap gradients with the other copy of a tied embedding; add the other's to ``grad``.

    ``exchange`` is handed a host snapshot of ``grad`` taken before the add, not ``grad``
    itself: the direct channel may encode a queued message after ``exchange`` returned, by
    which time the add would have changed it (and the encoder reads a host copy anyway: the
    codecs work on CPU). The other copy's gradient comes back as the wire left it
    (:func:`add_received`)."""
    mine = grad.detach().to("cpu", copy=True)
    add_received(grad, exchange(mine))


def add_received(grad: Tensor, other: Tensor) -> None:
    """``grad += other`` for a tensor that came off the wire: a float32 CPU tensor (the codecs
    decode to CPU), while ``grad`` lives on the engine's device in the training dtype.
    ``other`` is moved to ``grad``'s device and dtype first: a CPU tensor added into a CUDA
    one is the "found at least two devices, cuda:0 and cpu" of the first GPU run. A tied
    copy's gradient travels in the training dtype (codec ``none`` widens it to fp32
    exactly), so the cast back is exact and both copies add bitwise the same two values."""
    grad.add_(other.to(device=grad.device, dtype=grad.dtype))


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Optimizer groups: decay >= 2-D weights (matrices, embeddings), never biases or norms.

    Empty groups are dropped (an embedding-only stage has no 1-D parameters); the reference
    in ``tests/test_engine.py`` builds the same two groups.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _process_groups(group_ranks: list[list[int]], my_group: int) -> tuple[StageMPU, Any]:
    """This rank's DeepSpeed MPU (its ZeRO-1 group, a model-parallel group of itself) and
    the group's second communicator for checkpoint threads.

    Collective over the whole world: same groups, same order on every rank. The checkpoint
    communicator carries the gathers that run while training continues, and must never
    interleave with the training's own collectives on the data-parallel group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_groups = [dist.new_group(ranks) for ranks in group_ranks]
    mp_groups = [dist.new_group([r]) for r in range(world)]
    ckpt_groups = [dist.new_group(ranks) for ranks in group_ranks]
    mpu = StageMPU(dp_groups[my_group], group_ranks[my_group], mp_groups[rank])
    return mpu, ckpt_groups[my_group]


class StageEngine:
    """Global layers ``layers = (start, end)`` of a GPT, trained by a DeepSpeed ZeRO-1 engine.

    ``group_ranks`` lists the replica groups of *all* stages in the world; every rank must
    build the same list because ``new_group`` is collective over the whole world, and it
    creates them in that order followed by one single-rank group per rank. ``my_group`` indexes
    this rank's group. DeepSpeed keeps its groups module-global: one engine per process.

    Micro-batches are keyed by the caller's index ``mb``: ``forward`` stores the stage's input
    and output; ``backward_last`` / ``backward`` consume the output; ``input_grad`` returns
    the gradient to send upstream and frees the input. DeepSpeed steps the optimizer only at
    the accumulation boundary (every ``micro_batches``-th backward). Clipping by the norm of
    the whole pipeline needs its other stages' norms: :meth:`connect_norm_peers` (without
    it, or with ``grad_clip_scope: stage``, the norm is this stage's own).
    """

    def __init__(
        self,
        model: ModelDesc | GPTConfig,
        layers: tuple[int, int],
        group_ranks: list[list[int]],
        my_group: int,
        cfg: EngineConfig,
        hold: tuple[int, int] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("call init_process_group() before building a StageEngine")
        if isinstance(model, GPTConfig):  # the built-in GPT given by its shape (tests)
            model = ModelDesc.from_gpt(model)
        rank, world = dist.get_rank(), dist.get_world_size()
        flat = sorted(r for ranks in group_ranks for r in ranks)
        if flat != list(range(world)):
            raise ValueError(
                f"group_ranks {group_ranks} must partition the world's ranks 0..{world - 1}"
            )
        if not 0 <= my_group < len(group_ranks) or rank not in group_ranks[my_group]:
            raise ValueError(f"rank {rank} is not in group_ranks[{my_group}] of {group_ranks}")
        self.cfg = cfg
        # ``hold``: the layers of this replica's ZeRO-1 group when it runs only some of them
        # (a mixed plan: [Note: ZeRO-1 groups of a mixed plan] in geopipe.runtime.actor.sitegroups).
        hold = tuple(layers) if hold is None else tuple(hold)
        self.module = build_stage(
            model, hold[0], hold[1], seed=cfg.seed, active=tuple(layers), recompute=cfg.recompute
        )
        self.dtype = DTYPES[cfg.precision]
        self._tied = self.module.tied_parameter()
        if self._tied is not None and not cfg.defer_step:
            raise ValueError(
                "a tied embedding split over two stages needs defer_step (its "
                "gradients are summed after the step's sends)"
            )
        active = {
            id(p)
            for n, p in self.module.named_parameters()
            if layers[0] <= self.module.layer_of(n) < layers[1]
        }
        self._idle = [p for p in self.module.parameters() if id(p) not in active]
        self._scale = cfg.grad_scale

        mpu, self.ckpt_group = _process_groups(group_ranks, my_group)
        self.replicas = len(group_ranks[my_group])
        ds_config = deepspeed_config(cfg, self.replicas)
        # The LR schedule is a torch LambdaLR over transformers' schedule (.lr), built by
        # DeepSpeed on its torch optimizer (so it scales the groups ZeRO steps with) and
        # stepped once per optimizer step: step k uses lr * factor(k).
        self._lr_lambda = engine_lr_factor(cfg)
        with _collector_paused():  # [Note: no collections while the engine is built]
            self.engine, _, _, _ = deepspeed.initialize(
                model=self.module,
                model_parameters=param_groups(self.module, cfg.weight_decay),
                config=ds_config,
                mpu=mpu,
                lr_scheduler=lambda opt: LambdaLR(opt, self._lr_lambda),
            )
        self.device = self.engine.device
        self.optimizer_s = 0.0  # seconds in DeepSpeed's step (reduction + Adam), cumulative
        self.reducing = False  # inside the deferred step's ZeRO-1 collectives (read by recovery)
        self._step_base = 0
        self._inputs: dict[int, Tensor] = {}
        self._outputs: dict[int, Tensor] = {}
        self.store = WeightGradStore(self.module)
        self.meter = ActivationMeter(self.store.params)
        self._weight_pending: dict[int, tuple[Any, ...]] = {}  # I done, W owed
        self._step_lr: float | None = None  # the LR the last optimizer step applied
        self.label = f"layers {layers[0]}-{layers[1] - 1}, "  # the stage names itself
        self.norms = NormExchange.local(hold)  # [Note: global gradient clipping] in .gradnorm
        if cfg.grad_clip > 0 and cfg.grad_clip_scope == "global":
            install_global_norm(self.engine.optimizer, self)

    def connect_norm_peers(self, exchange: NormExchange) -> None:
        """The other stages of this pipeline, for the global gradient norm (only with
        ``grad_clip_scope: global``). A tied head's copy of the embedding is then left out
        of the norm (DeepSpeed's ``ds_pipe_replicated``): the embedding counts once, as in
        one process, not once per copy."""
        self.norms = exchange
        if self._tied is not None and self.module.has_head:
            self._tied.ds_pipe_replicated = True

    def _model(self, what: str, mb: int) -> Any:
        """Where the model's own exceptions become :class:`ModelError` (see there)."""
        return ModelError.wrap(what, mb, f"{self.label}step {self.step_count}: ")

    @property
    def step_count(self) -> int:
        """Optimizer steps taken, counting those restored by :meth:`load_full_state`."""
        return self._step_base + self.engine.global_steps

    def forward(self, mb: int, x: Tensor) -> Tensor:
        """Run micro-batch ``mb`` forward and keep its graph; returns the output, detached.

        The first stage takes token ids (B, T); later stages a hidden state (B, T, C), made a
        leaf that requires grad so :meth:`input_grad` can hand its gradient upstream.
        """
        if mb in self._inputs:
            raise ValueError(f"micro-batch {mb} is already in flight on this stage")
        x = x.to(self.device)
        if not self.module.has_embed:
            x = x.to(self.dtype).detach().requires_grad_(True)
        with self.meter.forward(mb), self.store.forward(mb), self._model("forward", mb):
            out = self.engine(x)
        self._inputs[mb], self._outputs[mb] = x, out
        return out.detach()

    def _pop_output(self, mb: int) -> Tensor:
        if mb not in self._outputs:
            raise KeyError(f"micro-batch {mb} has no pending forward on this stage")
        return self._outputs.pop(mb)

    def backward_last(self, mb: int, targets: Tensor) -> float:
        """Last stage: back-propagate ``lm_loss`` of micro-batch ``mb``; returns the loss.

        ``engine.backward`` divides by ``micro_batches`` (see [Note: loss scaling]); the
        returned value is the unscaled micro-batch loss.
        """
        if not self.module.has_head:
            raise RuntimeError("backward_last() is only for the stage holding the head")
        out = self._pop_output(mb)
        self._idle_grads()
        with self._model("backward", mb):
            loss = lm_loss(out, targets.to(self.device))
            self.engine.backward(loss if self._scale == 1.0 else loss * self._scale)
        self._unscale_input(mb)
        self._step()
        self._done(mb)
        return loss.item()

    def backward(self, mb: int, grad_out: Tensor) -> None:
        """Non-last stage: back-propagate the gradient received for micro-batch ``mb``.

        ``scale_wrt_gas=False``: ``grad_out`` already carries 1/micro_batches ([Note: loss
        scaling]).
        """
        if self.module.has_head:
            raise RuntimeError("the last stage computes its own loss: use backward_last()")
        out = self._pop_output(mb)
        surrogate = (out * grad_out.to(device=out.device, dtype=out.dtype)).sum()
        self._idle_grads()
        with self._model("backward", mb):
            self.engine.backward(surrogate * self._scale, scale_wrt_gas=False)
        self._unscale_input(mb)
        self._step()
        self._done(mb)

    def _idle_grads(self) -> None:
        """Zero gradients on held layers this replica does not run: every replica of the
        group must reduce the same parameters (DeepSpeed skips those without a gradient)."""
        for p in self._idle:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _unscale_input(self, mb: int) -> None:
        """The input gradient goes upstream without this replica's weight-gradient factor."""
        x = self._inputs.get(mb)
        if self._scale != 1.0 and x is not None and x.grad is not None:
            x.grad.div_(self._scale)

    def _done(self, mb: int) -> None:
        self.meter.release(mb)
        self.store.drop(mb)

    def backward_input(
        self, mb: int, grad_out: Tensor | None = None, targets: Tensor | None = None
    ) -> float | None:
        """``I`` of micro-batch ``mb`` ([Note: I and W in autograd] in :mod:`.backward`): from the
        gradient received from downstream, or on the last stage from ``targets`` (returns
        the micro-batch loss). :meth:`input_grad` then has the gradient to send."""
        out = self._pop_output(mb)
        if targets is not None:
            if not self.module.has_head:
                raise RuntimeError("targets are only for the stage holding the head")
            with self._model("backward", mb):
                loss = lm_loss(out, targets.to(self.device))
            # scaled as engine.backward(loss) scales it ([Note: loss scaling])
            root, grad, full = loss / self.engine.gradient_accumulation_steps(), None, (loss, True)
        else:
            g = grad_out.to(device=out.device, dtype=out.dtype)
            root, grad, full = out, g, ((out * g).sum(), False)
        if self.module.has_embed:  # nothing to send upstream: W runs the full backward
            self._weight_pending[mb] = ("full", *full)
        else:
            drop_output_hooks(out)
            x = self._inputs[mb]
            with self._model("backward", mb):
                x.grad = self.store.input_backward(mb, root, grad, x)
            self.meter.release(mb)  # the graph is gone; what W needs stays in the store
            self.meter.keep(mb, self.store.kept(mb))
            self._weight_pending[mb] = ("split",)
        return None if targets is None else loss.item()

    def backward_weight(self, mb: int) -> None:
        """``W`` of micro-batch ``mb``: its weight gradients into DeepSpeed's accumulation (and,
        without ``defer_step``, at the accumulation boundary the ZeRO-1 reduction and
        optimizer step)."""
        if mb not in self._weight_pending:
            raise KeyError(f"micro-batch {mb} has no input-gradient pass awaiting W")
        kind, *state = self._weight_pending.pop(mb)
        self._idle_grads()
        if kind == "full":  # the first stage: nothing goes upstream
            root, scale = state
            with self._model("backward", mb):
                self.engine.backward(root * self._scale, scale_wrt_gas=scale)
        else:
            # [Note: W accumulates in place]: the sums are handed over, not added again
            grads = self.store.weight_gradients(mb, self._scale)
            surrogate = weight_surrogate(self.store.params, grads)
            del grads  # autograd adopts only an otherwise unreferenced tensor
            self.engine.backward(surrogate, scale_wrt_gas=False)
        self._step()
        self._done(mb)

    def _step(self) -> None:
        # DeepSpeed's step: a no-op but for the micro-batch that ends gradient accumulation,
        # where it reduces the gradients in the ZeRO-1 group and runs Adam.
        if self.cfg.defer_step:
            return
        t0 = time.perf_counter()
        self._step_lr = self._lr_now()
        self.engine.step()
        self.optimizer_s += time.perf_counter() - t0

    def end_iteration(self, exchange: Callable[[Tensor], Tensor] | None = None) -> None:
        """After the iteration's sends: the deferred reduction and optimizer step (only
        with ``defer_step``; otherwise the last backward has already stepped).

        A stage holding one copy of a tied embedding first adds the other copy's gradient:
        ``exchange`` sends this copy's and returns the other's ([Note: tied embeddings across
        stages] in :mod:`geopipe.model.hf`). Both sides add the same two tensors, so the
        copies receive bitwise-equal gradients (:func:`add_tied_gradient`)."""
        if self._tied is not None:
            if exchange is None:
                raise RuntimeError(
                    "this stage holds a tied embedding: end_iteration needs the "
                    "exchange with the other copy"
                )
            if self._tied.grad is None:
                self._tied.grad = torch.zeros_like(self._tied)
            add_tied_gradient(self._tied.grad, exchange)
        if self.cfg.defer_step:
            t0 = time.perf_counter()
            self.reducing = True
            self._step_lr = self._lr_now()
            try:
                self.engine.step()
            finally:
                self.reducing = False
            self.optimizer_s += time.perf_counter() - t0

    def _lr_now(self) -> float:
        """The LR the next optimizer step applies (the scheduler steps after each step)."""
        return float(self.engine.optimizer.param_groups[0]["lr"])

    @property
    def has_tied(self) -> bool:
        """Whether this stage holds one copy of an embedding tied to another stage's head."""
        return self._tied is not None

    def step_stats(self) -> tuple[float, float | None]:
        """The learning rate the last optimizer step applied (read before the scheduler
        moved on to the next step's) and this stage's gradient norm
        (over its ZeRO-1 group, the tied head's copy left out under a global norm: the
        stages' norms then add up to the pipeline's; None before the first step)."""
        lr = self._step_lr if self._step_lr is not None else self._lr_now()
        if self.norms.stage_norm is not None:
            return lr, self.norms.stage_norm
        norm = self.engine.get_global_grad_norm()
        return lr, None if norm is None else float(norm)

    def input_grad(self, mb: int) -> Tensor | None:
        """Gradient w.r.t. micro-batch ``mb``'s input (None on the first stage); frees ``mb``."""
        if mb in self._outputs:
            raise RuntimeError(f"micro-batch {mb} has not been back-propagated yet")
        x = self._inputs.pop(mb)
        return None if self.module.has_embed else x.grad

    def full_state(self) -> dict[str, Any]:
        """Unsharded fp32 parameters and Adam state, keyed by partition-independent names.

        COLLECTIVE inside the stage's ZeRO-1 group: every replica must call it (each gets the
        whole state). On an engine that has not stepped yet the moments are zeros, step 0.
        """
        return zero_state.full_state(self.engine, self.module)

    def local_snapshot(self, weights_only: bool = False) -> dict[str, Any]:
        """This replica's ZeRO-1 partitions (fp32 weights, Adam moments unless
        ``weights_only``) copied to memory, no communication
        (:func:`~geopipe.runtime.actor.zero_state.local_snapshot`)."""
        return zero_state.local_snapshot(self.engine, self.module, weights_only)

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Load a :meth:`full_state` (taken with any replica count) into this engine.

        Every replica of the group loads the same full state and keeps its own shard. Names
        in ``state`` that this stage does not hold are ignored, so a whole-model state can be
        handed to every stage. A tied head's copy missing from ``state`` (saved by a layout
        where one stage held both ends) is taken from the embedding it equals.
        """
        zero_state.load_full_state(self.engine, self.module, state, self.device)
        zero_state.set_lr_step(self.engine, self._lr_lambda, int(state["lr_step"]))
        self._step_base = int(state["step"]) - self.engine.global_steps

    def destroy(self) -> None:
        """Release the engine (hooks, hp links) and drop gradients and in-flight micro-batches.

        The process group stays; call :func:`destroy_process_group` to re-form it. Stale
        ``.grad`` of an aborted step would otherwise leak into the next engine on this module.
        """
        self.norms.close()
        self.engine.destroy()
        for p in self.module.parameters():
            p.grad = None
        for mb in {*self._weight_pending, *self._outputs}:
            self._done(mb)
        self._inputs.clear()
        self._outputs.clear()
        self._weight_pending.clear()
