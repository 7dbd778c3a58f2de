"""Activation recompute (``training.recompute``): which decoder blocks run checkpointed.

``none`` keeps every block's activations for backward (the default); ``full`` checkpoints
every decoder block; ``every-N`` every N-th one (global blocks ``N, 2N, ...`` counting from
1, so the choice depends on the block, never on how the model is partitioned). A checkpointed
block keeps only its input per micro-batch and runs its forward again inside its backward
(:mod:`geopipe.model.gpt`, :mod:`geopipe.model.hf`); the planner prices both sides
(:mod:`geopipe.optimizer.memory`, :func:`geopipe.optimizer.costs.recompute_forward_share`).

Pure (no torch): the config layer validates with :func:`interval`, the planner counts with
:func:`checkpointed_blocks`, and the stages ask :func:`checkpointed` per block.
"""

from __future__ import annotations

import re

__all__ = ["MAX_INTERVAL", "checkpointed", "checkpointed_blocks", "interval", "setting"]

MAX_INTERVAL = 1 << 16  # every-N beyond any real model's depth is refused, not parsed freely


def interval(setting: str) -> int:
    """N for ``every-N`` (1 for ``full``, 0 for ``none``); ValueError naming what is allowed."""
    if setting == "none":
        return 0
    if setting == "full":
        return 1
    found = re.fullmatch(r"every-([0-9]{1,6})", setting)
    if found is None or not 1 <= int(found.group(1)) <= MAX_INTERVAL:
        raise ValueError(
            f"must be 'none', 'full' or 'every-N' with N in [1, {MAX_INTERVAL}], got {setting!r}"
        )
    return int(found.group(1))


def checkpointed(setting: str, layer: int, n_layer: int) -> bool:
    """Whether global layer ``layer`` is a decoder block run under recompute (the embedding,
    layer 0, and the head, layer ``n_layer + 1``, never are)."""
    n = interval(setting)
    return n > 0 and 1 <= layer <= n_layer and layer % n == 0


def checkpointed_blocks(setting: str, layers: tuple[int, int], n_layer: int) -> int:
    """How many of global layers ``[a, b)`` are checkpointed blocks."""
    return sum(checkpointed(setting, i, n_layer) for i in range(*layers))


def setting(value: str) -> str:
    """``value`` if it is a valid setting (the config's validator), else ValueError."""
    interval(value)
    return value
