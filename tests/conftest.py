"""Shared test setup.

RAY_AUTH_MODE must be set the same way for the cluster, the driver and the tests, and Ray
reads it when first imported: token authentication on, as in a user's run.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
