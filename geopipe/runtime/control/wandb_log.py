"""The optional Weights & Biases run (``logging.wandb``): the scalars TensorBoard gets, logged
through the ``wandb`` library beside it.

W&B is an extra (``pip install 'geopipe[wandb]'``), never needed to train: a missing package,
a server that refuses the run, a full disk: each is one warning and the run goes on with its
other sinks, as TensorBoard's failures do (:mod:`.metrics`). ``mode: auto`` takes
``WANDB_MODE`` when set, else asks whether the W&B server answers at all (one TCP connect,
two seconds at most) and goes offline when it does not: a cluster without internet access
keeps an offline run under ``RUN_DIR/wandb/`` that ``wandb sync`` uploads later, instead of
hanging on the network at launch. An online start that fails (no login, say) falls back to
offline the same way.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from geopipe.config.observe import WandbSpec

__all__ = ["WandbLog", "resolve_mode"]

DEFAULT_BASE_URL = "https://api.wandb.ai"
CONNECT_TIMEOUT_S = 2.0


def _reachable(url: str) -> bool:
    """Whether a TCP connection to ``url``'s host opens within :data:`CONNECT_TIMEOUT_S`."""
    u = urlparse(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def resolve_mode(
    mode: str,
    env: Mapping[str, str] | None = None,
    reachable: Callable[[str], bool] = _reachable,
) -> str:
    """The mode ``wandb.init`` gets: ``mode`` unless it is ``auto``; then ``WANDB_MODE`` if
    set, else ``online`` when the server (``WANDB_BASE_URL``, default W&B's) answers,
    ``offline`` when it does not."""
    if mode != "auto":
        return mode
    env = os.environ if env is None else env
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    return "online" if reachable(env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL) else "offline"


class WandbLog:
    """One W&B run of a geopipe launch; :meth:`start` returns None where it cannot be had."""

    def __init__(self, run: Any) -> None:
        self._run = run

    @classmethod
    def start(
        cls,
        spec: WandbSpec,
        run_dir: Path,
        run_id: str,
        config: dict,
        say: Callable[..., None],
    ) -> WandbLog | None:
        """Start the run in ``run_dir`` with ``config`` (the validated YAML) as its config."""
        try:
            import wandb
        except ImportError:
            say("logging.wandb is set but wandb is not installed (pip install wandb)", warning=True)
            return None
        mode = resolve_mode(spec.mode)
        if mode == "disabled":
            return None
        run_dir.mkdir(parents=True, exist_ok=True)
        # No console capture (rich's progress bar owns the terminal), no system-metrics
        # sampler (the actors need the CPUs; Ray's dashboard has those figures).
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        args = {
            "project": spec.project,
            "entity": spec.entity,
            "name": spec.name or run_id,
            "tags": list(spec.tags),
            "config": config,
            "dir": str(run_dir),
            "settings": settings,
        }
        try:
            return cls(wandb.init(mode=mode, **args))
        except Exception as exc:
            if mode != "online":
                say(f"no Weights & Biases run ({exc})", warning=True)
                return None
            say(f"Weights & Biases online failed ({exc}): logging offline", warning=True)
        try:
            return cls(wandb.init(mode="offline", **args))
        except Exception as exc:
            say(f"no Weights & Biases run ({exc})", warning=True)
            return None

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
