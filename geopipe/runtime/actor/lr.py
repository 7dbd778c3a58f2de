"""The learning-rate schedule of every stage: `transformers`' schedulers, held at their end.

[Note: the LR horizon]
    The schedule is a function of the optimizer step alone, with the YAML's horizon
    (``training.lr_decay_steps``, else ``training.steps``), never ``launch --steps``: that only
    says where a launch stops, so stopping at any N and resuming to any M gives the LRs of
    running M in one go. At and past the horizon the factor is the schedule's value at the
    horizon, i.e. the minimum LR (``training.min_lr``; 1 for ``constant``): a run taken past
    its YAML's steps continues at the final LR rather than stretching the schedule or letting
    a cosine climb back up (transformers' cosine would: its progress is not clamped).

The factors are those of ``transformers.get_scheduler`` (the schedulers the Hugging Face
Trainer uses, so a reference or a user compares against the same names), built once on a
throwaway optimizer and called with the clamped step; DeepSpeed has no warmup-stable-decay
schedule and warms up logarithmically by default, hence `transformers`' here.

[Note: the LR table]
    The driver tabulates the factors of steps 0..horizon (:func:`factor_table`, up to
    :data:`TABLE_MAX` steps) and the engine config carries them, so a stage actor never
    imports `transformers` for its schedule: that import is ~0.9 s of CPU in every actor of
    every launch (the built-in GPT needs nothing else of it), measured on 2 cores. Longer
    horizons build the library's function in the actor, on first use.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from geopipe.runtime.actor.engine_config import LR_SCHEDULES, EngineConfig

__all__ = [
    "LIBRARY_NAMES",
    "TABLE_MAX",
    "LRFactor",
    "engine_lr_factor",
    "factor_table",
    "library_kwargs",
    "lr_factor",
]

# The longest horizon the driver tabulates ([Note: the LR table]): 8 bytes a step, 1.6 MB.
TABLE_MAX = 200_000

# geopipe's schedule names -> transformers' SchedulerType of the same shape. "cosine" is
# transformers' cosine_with_min_lr, which with min_lr_rate 0 computes the very floats of
# transformers' "cosine".
LIBRARY_NAMES = {
    "cosine": "cosine_with_min_lr",
    "linear": "linear",
    "constant": "constant_with_warmup",
    "wsd": "warmup_stable_decay",
}
assert set(LIBRARY_NAMES) == set(LR_SCHEDULES)


def library_kwargs(
    schedule: str, warmup_steps: int, horizon: int, min_lr_ratio: float, wsd_decay_steps: int
) -> dict[str, Any]:
    """``transformers.get_scheduler``'s arguments (but the optimizer) for a schedule."""
    out: dict[str, Any] = {
        "name": LIBRARY_NAMES[schedule],
        "num_warmup_steps": warmup_steps,
        "num_training_steps": horizon,
    }
    if schedule == "cosine":
        out["scheduler_specific_kwargs"] = {"min_lr_rate": min_lr_ratio}
    elif schedule == "wsd":
        out["scheduler_specific_kwargs"] = {
            "num_decay_steps": wsd_decay_steps,
            "min_lr_ratio": min_lr_ratio,
        }
    return out


@lru_cache(maxsize=64)
def _library_lambda(
    schedule: str, warmup_steps: int, horizon: int, min_lr_ratio: float, wsd_decay_steps: int
) -> Any:
    import torch
    from transformers import get_scheduler

    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    kw = library_kwargs(schedule, warmup_steps, horizon, min_lr_ratio, wsd_decay_steps)
    return get_scheduler(optimizer=dummy, **kw).lr_lambdas[0]


@lru_cache(maxsize=8)
def factor_table(
    schedule: str, warmup_steps: int, horizon: int, min_lr_ratio: float, wsd_decay_steps: int
) -> tuple[float, ...]:
    """The factors of steps ``0..horizon`` ([Note: the LR table]); empty past :data:`TABLE_MAX`."""
    if horizon > TABLE_MAX:
        return ()
    f = _library_lambda(schedule, warmup_steps, horizon, min_lr_ratio, wsd_decay_steps)
    return tuple(float(f(step)) for step in range(horizon + 1))


class LRFactor:
    """The multiplier of the base LR at optimizer step ``step`` (0-based): transformers'
    schedule of that name at ``min(step, horizon)`` ([Note: the LR horizon]). Plain data
    (picklable); the library's function is built on first use."""

    def __init__(
        self,
        schedule: str = "cosine",
        warmup_steps: int = 0,
        horizon: int = 1,
        min_lr_ratio: float = 0.0,
        wsd_decay_steps: int = 0,
        table: tuple[float, ...] = (),
    ) -> None:
        if schedule not in LIBRARY_NAMES:
            raise ValueError(f"unknown LR schedule {schedule!r}: one of {sorted(LIBRARY_NAMES)}")
        self.args = (schedule, int(warmup_steps), int(horizon), float(min_lr_ratio))
        self.args += (int(wsd_decay_steps),)
        self.horizon = int(horizon)
        if table and len(table) != self.horizon + 1:
            raise ValueError(f"an LR table of {len(table)} factors for horizon {horizon}")
        self.table = table  # the driver's factor_table ([Note: the LR table]), or ()

    def __call__(self, step: int) -> float:
        step = min(int(step), self.horizon)
        if self.table:
            return self.table[step]
        return float(_library_lambda(*self.args)(step))


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str = "cosine") -> float:
    """Multiplier of the base LR for optimizer step ``step`` (0-based) with no minimum LR:
    transformers' schedule of that name with horizon ``total_steps``, held at its final value
    past it (:class:`LRFactor`; references in tests and benchmarks build their LambdaLR on
    it). As in transformers, warmup starts at 0: step 0 of a warmup moves nothing but Adam's
    moments."""
    return LRFactor(schedule, warmup_steps, total_steps)(step)


def engine_lr_factor(cfg: EngineConfig) -> LRFactor:
    """The engine's LR factor from its config ([Note: the LR horizon])."""
    return LRFactor(
        cfg.lr_schedule,
        cfg.warmup_steps,
        cfg.total_steps,
        cfg.min_lr_ratio,
        cfg.wsd_decay_steps,
        cfg.lr_table,
    )
