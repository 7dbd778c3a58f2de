"""``--chaos-kill-every N``: kill a random stage actor in the middle of every N-th step, to
watch recovery on your own cluster."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.workers import Workers

__all__ = ["ChaosMonkey"]


class ChaosMonkey:
    def __init__(
        self, every: int | None, seed: int, first_step: int, reporter: Reporter, workers: Workers
    ) -> None:
        self.every = every
        self.workers = workers
        self.seed = seed
        self.first_step = first_step  # never the run's (or resume's) first step
        self.reporter = reporter
        self._done: set[int] = set()  # a redone step is not hit again

    def maybe_strike(self, step: int, rows: list[list[Any]], step_s: float) -> None:
        """Kill one actor of ``rows`` about 40 % into a step of ``step_s`` seconds."""
        n = self.every
        if not n or step == self.first_step or step % n or step in self._done:
            return
        self._done.add(step)
        rng = random.Random(self.seed * 7919 + step)
        k = rng.randrange(len(rows))
        r = rng.randrange(len(rows[k]))
        victim = rows[k][r]

        def kill() -> None:
            self.reporter.say(f"chaos: killing stage {k} replica {r} at step {step}")
            self.reporter.event("chaos_kill", step=step, stage=k, replica=r, time=time.time())
            self.workers.kill(victim)

        threading.Timer(0.4 * step_s, kill).start()
