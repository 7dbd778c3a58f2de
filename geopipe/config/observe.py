"""``logging`` and ``training.eval``: what a run reports beside its training loss.

``logging.wandb`` mirrors the scalars TensorBoard gets into a Weights & Biases run (off by
default; ``mode: auto`` goes offline when the service cannot be reached, so a run on an
air-gapped cluster still keeps a run directory ``wandb sync`` uploads later).
``training.eval`` evaluates held-out data through the pipeline without gradients every
``every_steps`` steps and at the end: its own dataset (``data``), or the last ``holdout``
share of the training data, which training then never samples.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from geopipe.config.fields import Spec, bounded, name_of

__all__ = ["MAX_EVAL_BATCHES", "EvalSpec", "LoggingSpec", "WandbSpec"]

MAX_EVAL_BATCHES = 1 << 16  # held-out batches per evaluation (each a global batch)


class WandbSpec(Spec):
    """A Weights & Biases run beside TensorBoard (the ``wandb`` package: ``pip install
    'geopipe[wandb]'``)."""

    project: str = Field(min_length=1, max_length=128, description="the W&B project")
    entity: str | None = Field(None, max_length=128, description="team or user (W&B's default)")
    name: str | None = Field(None, max_length=128, description="run name (default: the run id)")
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto",
        description="auto: WANDB_MODE if set, else online when the W&B server answers and "
        "offline otherwise",
    )
    tags: list[name_of(64)] = Field(default_factory=list, max_length=64)  # type: ignore[valid-type]


class LoggingSpec(Spec):
    """Where a run's metrics go besides ``metrics.jsonl``, TensorBoard and Ray's metrics."""

    wandb: WandbSpec | None = None


class EvalSpec(Spec):
    """Held-out evaluation through the pipeline (see the module docstring)."""

    every_steps: int = Field(
        0, ge=0, le=10**12, description="evaluate after every this many steps (0: at the end only)"
    )
    batches: int = Field(
        1,
        ge=1,
        le=MAX_EVAL_BATCHES,
        description="held-out batches of training.global_batch_size sequences per evaluation",
    )
    data: str | None = Field(
        None,
        description="a dataset of its own (as training.data); default: the training data's "
        "held-out tail",
    )
    holdout: bounded(0.0, 0.5, lo_open=True) = Field(  # type: ignore[valid-type]
        0.05, description="share of the training data held out when data is unset"
    )
