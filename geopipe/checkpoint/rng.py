"""The random number generators' state, saved in a checkpoint so a resumed run draws what
the uninterrupted one would have."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """Python, numpy (global) and torch CPU RNG states; all JSON-able except ``"torch"``."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": [version, list(internal), gauss],
        "numpy": [str(name), keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng`; accepts the lists JSON gives back for the tuples."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].detach().cpu().to(torch.uint8))
