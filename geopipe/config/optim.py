"""``training``'s optimizer keys: the LR schedule, Adam's betas and eps, the scope of gradient
clipping and the NaN policy; :class:`~geopipe.config.specs.TrainingSpec` inherits them (the
YAML keys stay ``training.*``). The schedules themselves are transformers'
(:mod:`geopipe.runtime.actor.lr`); these are the checks that need no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from geopipe.config.fields import Spec, bounded

__all__ = ["OptimizerFields"]

_STEPS = 10**12  # == geopipe.config.specs.MAX_STEPS
_BETA = bounded(0.0, 1.0)
_NONNEG = bounded(0.0, 10.0)


class OptimizerFields(Spec):
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr: _NONNEG = Field(0.0, description="the LR at the horizon and after (cosine, wsd)")
    wsd_decay_steps: int | None = Field(
        None, ge=1, le=_STEPS, description="wsd's decay phase (default: 10 % of the horizon)"
    )
    betas: tuple[_BETA, _BETA] = (0.9, 0.95)
    eps: bounded(1e-30, 1.0) = 1e-8
    grad_clip_scope: Literal["global", "stage"] = Field(
        "global", description="global: the norm over every stage; stage: each its own"
    )
    nan_policy: Literal["stop", "skip"] = "stop"
    max_skipped_steps: int = Field(10, ge=0, le=_STEPS)

    def wsd_decay(self, horizon: int) -> int:
        """The decay phase of the wsd schedule: ``wsd_decay_steps``, else 10 % of it."""
        return self.wsd_decay_steps or max(1, round(0.1 * horizon))

    @model_validator(mode="after")
    def _schedule(self) -> OptimizerFields:
        # lr, steps, lr_decay_steps, warmup_steps: TrainingSpec's own fields
        h = self.lr_decay_steps or self.steps  # type: ignore[attr-defined]
        if self.betas[0] >= 1 or self.betas[1] >= 1:
            raise ValueError(f"betas: each must be below 1, got {list(self.betas)}")
        if self.min_lr > 0 and self.lr_schedule not in ("cosine", "wsd"):
            why = "decays to 0" if self.lr_schedule == "linear" else "stays at lr"
            raise ValueError(
                f"min_lr: the {self.lr_schedule} schedule {why} (cosine and wsd have a minimum)"
            )
        if self.min_lr > self.lr:  # type: ignore[attr-defined]
            raise ValueError(f"min_lr: {self.min_lr:g} is above lr {self.lr:g}")  # type: ignore[attr-defined]
        if self.lr_schedule == "wsd" and self.warmup_steps + self.wsd_decay(h) > h:  # type: ignore[attr-defined]
            raise ValueError(
                f"wsd_decay_steps: warmup_steps + {self.wsd_decay(h)} decay steps exceed the "
                f"LR horizon {h}"
            )
        return self
