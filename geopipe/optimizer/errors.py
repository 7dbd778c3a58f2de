"""The planner's one error type for input it cannot plan."""

from __future__ import annotations

__all__ = ["PlanningError"]


class PlanningError(ValueError):
    """A valid cluster spec (or command-line setting) that cannot be planned.

    The message names the cause in the user's terms (the setting, the site, the limit); the
    command line prints it and exits with status 2. Any other exception out of the planner is
    a bug. A ``ValueError`` subclass, so callers that caught ``ValueError`` still do.
    """
