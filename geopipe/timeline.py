"""Timelines as Chrome-trace / Perfetto JSON and as a side-by-side PNG.

The simulator and the runtime both produce ``(row, name, start_s, end_s)`` intervals, so a
simulated trace and a measured one open side by side in https://ui.perfetto.dev or
chrome://tracing and compare directly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

__all__ = ["chrome_trace", "plot_timelines", "write_chrome_trace"]


class Interval(Protocol):
    row: str
    name: str
    start: float
    end: float


def _row_key(row: str) -> tuple[int, int, str]:
    kind, _, rest = row.partition(" ")
    num = rest.split("->")[0].split()[0] if rest else "0"
    return (0 if kind == "stage" else 1, int(num) if num.isdigit() else 0, row)


def chrome_trace(events: Iterable[Interval], process: str = "geopipe") -> dict:
    """Trace Event Format: one thread (row) per stage and per link direction."""
    events = list(events)
    rows = sorted({e.row for e in events}, key=_row_key)
    tid = {r: i for i, r in enumerate(rows)}
    out: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process}}]
    for r, i in tid.items():
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": r}})
        out.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": i, "args": {"sort_index": i}}
        )
    for e in events:
        cat = e.name.rstrip("0123456789") or e.name
        out.append(
            {
                "name": e.name,
                "cat": cat,
                "ph": "X",
                "pid": 0,
                "tid": tid[e.row],
                "ts": e.start * 1e6,
                "dur": max(0.0, e.end - e.start) * 1e6,
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, events: Iterable[Interval], process: str = "geopipe"):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(chrome_trace(events, process)))


_COLORS = {
    "F": "#4C72B0",
    "B": "#55A868",
    "I": "#8DD3A0",
    "W": "#2E7D4F",
    "step": "#C44E52",
    "send": "#8172B2",
    "recv": "#CCB974",
}


def plot_timelines(
    path: str | Path, panels: Sequence[tuple[str, Sequence[Interval]]], title: str = ""
) -> None:
    """One panel per timeline (e.g. 1F1B and look-ahead), rows = stages and links."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    horizon = max((e.end for _, evs in panels for e in evs), default=1.0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 2.2 * len(panels)), squeeze=False)
    for ax, (label, evs) in zip(axes[:, 0], panels, strict=True):
        rows = sorted({e.row for e in evs}, key=_row_key)
        y = {r: i for i, r in enumerate(rows)}
        for e in evs:
            kind = e.name.rstrip("0123456789")
            color = _COLORS.get(kind, "#999999")
            height = 0.8 if e.row.startswith("stage") else 0.4
            ax.barh(y[e.row], e.end - e.start, left=e.start, height=height, color=color, lw=0)
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(label, loc="left", fontsize=10)
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, list(_COLORS), loc="upper right", ncol=len(_COLORS), fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
