"""The settings of one stage replica's engine, as plain data the driver builds and Ray ships,
and the DeepSpeed config they become (:func:`deepspeed_config`).

Apart from :mod:`geopipe.runtime.actor.engine` so the driver (placement) can build and check
them without importing DeepSpeed or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["LR_SCHEDULES", "PRECISIONS", "EngineConfig", "deepspeed_config"]

PRECISIONS = ("fp32", "bf16", "fp16")
# transformers' schedulers behind each name: geopipe.runtime.actor.lr
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")


@dataclass(frozen=True)
class EngineConfig:
    """Optimizer and accumulation settings of one stage replica.

    ``micro_batches`` is the number of micro-batches this replica runs per optimizer step
    (DeepSpeed's ``gradient_accumulation_steps``); ``micro_batch_size`` only feeds DeepSpeed's
    batch bookkeeping (``train_batch_size``), never the numbers. ``grad_clip`` 0 disables
    clipping; otherwise ``grad_clip_scope`` "global" clips by the norm over every stage of
    the pipeline (the engine's norm exchange, [Note: global gradient clipping] in
    :mod:`.gradnorm`), "stage" by this stage's own norm. ``weight_decay`` > 0 selects AdamW
    (decaying only >= 2-D weights). ``total_steps`` is the LR schedule's horizon ([Note: the
    LR horizon] in :mod:`.lr`); ``min_lr_ratio`` its floor as a fraction of ``lr``.
    """

    lr: float
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 1
    micro_batches: int = 1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    seed: int = 0
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.0
    wsd_decay_steps: int = 0  # the decay phase of "wsd" (its stable phase is the rest)
    grad_clip_scope: Literal["global", "stage"] = "global"
    micro_batch_size: int = 1
    # A mixed plan's factor on this replica's weight gradients (1 for identical pipelines;
    # [Note: gradient scale of a mixed plan] in geopipe.runtime.actor.sitegroups).
    grad_scale: float = 1.0
    # Reduce and step once after the iteration's sends instead of inside the last backward
    # (the runtime always does: [Note: the step after the sends] in :mod:`.engine`).
    defer_step: bool = False
    # The training precision ([Note: mixed precision] in :mod:`.engine`): weights,
    # activations and gradients in it, fp32 master weights and Adam state in ZeRO-1.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Which decoder blocks run under activation recompute (training.recompute,
    # geopipe.model.recompute; checked where the stage module is built).
    recompute: str = "none"
    # The LR schedule's factors at steps 0..total_steps, tabulated by the driver so the
    # actor never imports transformers ([Note: the LR table] in :mod:`.lr`); () : the actor's.
    lr_table: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"EngineConfig.lr must be > 0, got {self.lr}")
        for name in ("weight_decay", "grad_clip", "warmup_steps", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("total_steps", "micro_batches", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"EngineConfig.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"EngineConfig.eps must be > 0, got {self.eps}")
        if not (self.grad_scale > 0 and math.isfinite(self.grad_scale)):
            raise ValueError(f"EngineConfig.grad_scale must be > 0, got {self.grad_scale}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"EngineConfig.precision must be one of {sorted(PRECISIONS)}, "
                f"got {self.precision!r}"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"EngineConfig.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"EngineConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
            )
        if self.grad_clip_scope not in ("global", "stage"):
            raise ValueError(
                f"EngineConfig.grad_clip_scope must be 'global' or 'stage', "
                f"got {self.grad_clip_scope!r}"
            )


def deepspeed_config(cfg: EngineConfig, replicas: int) -> dict[str, Any]:
    """The ZeRO-1 engine's DeepSpeed config for a stage group of ``replicas``, every default
    that would change the numbers set explicitly, each commented where it is set."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.micro_batches,
        "train_batch_size": cfg.micro_batch_size * cfg.micro_batches * replicas,
        # DeepSpeed's default is 1.0, which clips silently.
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": cfg.lr,
                "betas": list(cfg.betas),
                "eps": cfg.eps,
                "weight_decay": cfg.weight_decay,
                # torch's Adam, not DeepSpeed's C++ one (a minute of compiling);
                # adam_w_mode defaults to True, i.e. AdamW, even for "type": "Adam".
                "torch_adam": True,
                "adam_w_mode": cfg.weight_decay > 0,
            },
        },
        "zero_optimization": {"stage": 1},
        "steps_per_print": 2**31 - 1,
        # False: backward never reduces; step() is the boundary (end_iteration).
        "managed_gradient_accumulation": not cfg.defer_step,
        **_precision_config(cfg.precision),
    }


def _precision_config(precision: str) -> dict[str, Any]:
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        return {"fp16": {"enabled": True, "initial_scale_power": 16}}
    return {}
