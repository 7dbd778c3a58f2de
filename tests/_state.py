"""Ray's state API pointed at this test session's own cluster.

Without an address the state API discovers clusters by scanning the host's processes and
refuses when it finds more than one (say, a test bed's Ray in a network namespace), so the
tests name theirs: the dashboard of the embedded cluster the ``ray_cluster`` fixture made.
"""

from __future__ import annotations

DASHBOARD: dict[str, str] = {}


def alive_actor_names() -> set[str]:
    from ray.util.state import list_actors

    actors = list_actors(address=DASHBOARD.get("url"), filters=[("state", "=", "ALIVE")])
    return {a.name for a in actors}


def taken_names(names: set[str], namespace: str = "geopipe") -> set[str]:
    """Those of ``names`` Ray still holds: a relaunch of their run would find them taken."""
    import ray

    held = set()
    for name in names:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        held.add(name)
    return held
