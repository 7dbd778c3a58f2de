"""Stopping a run's actors, whatever ended it: the site stores and stage actors are killed,
and the embedded Ray this process started goes with them; on a cluster of one's own the
driver waits until Ray has freed the run's actor names, so a relaunch finds them free."""

from __future__ import annotations

import contextlib
from typing import Any

from geopipe.runtime.control.reporting import Reporter
from geopipe.runtime.control.workers import Workers

__all__ = ["stop_actors"]


def stop_actors(
    workers: Workers,
    checkpoints: Any,
    placement: Any,
    cluster: Any,
    namespace: str,
    reporter: Reporter,
) -> None:
    """Kill every actor the run made (``checkpoints``' stores, ``placement``'s stages)."""
    names = checkpoints.close()
    if placement is not None:
        names += placement.kill_all()
    if cluster is not None and cluster.started_here:
        with contextlib.suppress(Exception):
            workers.shutdown()  # the names go with the cluster
    elif names and (held := workers.wait_released(names, namespace)):
        reporter.say(
            f"Ray still holds {len(held)} actor name(s) of this run ({held[0]}, …): a "
            "relaunch on this cluster may find them taken until their processes exit",
            warning=True,
        )
