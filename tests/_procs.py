"""Process checks shared by the test tiers (the reaper's unit test, the recovery tests)."""

from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A zombie (killed, not yet reaped by its parent) is gone
    for our purposes."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))
