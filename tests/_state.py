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


def still_alive(names: set[str], timeout: float, poll: float = 0.2) -> set[str]:
    """Those of ``names`` still ALIVE after waiting up to ``timeout`` for them to leave the
    list (a killed actor leaves it a moment after ``ray.kill`` returns)."""
    import time

    deadline = time.time() + timeout
    alive = names & alive_actor_names()
    while alive and time.time() < deadline:
        time.sleep(poll)
        alive = names & alive_actor_names()
    return alive
