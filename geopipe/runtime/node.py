"""Where this process runs, for the driver, the stage actors and the site stores alike."""

from __future__ import annotations

__all__ = ["node_ip"]


def node_ip() -> str:
    """This node's address for peers (Ray's view of it), or loopback outside Ray (tests)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return "127.0.0.1"
