"""``geopipe`` command line: plan | simulate | launch | status | checkpoints.

Errors in user input (a bad YAML, an impossible setting) print one clear message and exit
with status 2; a traceback means a bug in geopipe.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from geopipe.cli.commands import (
    EXIT_USAGE,
    cmd_checkpoints,
    cmd_launch,
    cmd_plan,
    cmd_simulate,
    cmd_status,
)
from geopipe.config import ConfigError
from geopipe.pipeline.schedule import SCHEDULES

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="geopipe",
        description="Train GPT models pipelined across data centres joined by slow WAN links.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    pl = sub.add_parser("plan", help="choose micro-batch, seq len, ΔN and codec; predict speed")
    pl.add_argument("cluster", help="cluster YAML")
    pl.add_argument("--json", action="store_true", help="print one JSON document")
    pl.add_argument("--exhaustive", action="store_true", help="also run exhaustive search")
    pl.add_argument("--trace", metavar="FILE", help="write the simulated Chrome trace")
    pl.add_argument("--plot", metavar="FILE.png", help="plot 1F1B vs the plan's timeline")
    pl.add_argument(
        "--templates", action="store_true", help="also print the Oobleck-style pipeline templates"
    )
    pl.set_defaults(func=cmd_plan)

    sm = sub.add_parser("simulate", help="evaluate one fixed configuration")
    sm.add_argument("cluster")
    sm.add_argument("--schedule", choices=SCHEDULES, default="lookahead")
    sm.add_argument("--micro-batch-size", type=int, required=True)
    sm.add_argument("--seq-len", type=int, required=True)
    sm.add_argument("--delta-n", default="0", help="ΔN, or one per WAN boundary: 4,2")
    sm.add_argument("--pipelines", type=int, default=None, help="data-parallel degree D")
    sm.add_argument("--codec", default=None, help="WAN codec (default: the link's)")
    sm.add_argument("--json", action="store_true")
    sm.add_argument("--trace", metavar="FILE")
    sm.set_defaults(func=cmd_simulate)

    la = sub.add_parser("launch", help="train on the cluster the YAML describes")
    la.add_argument("cluster")
    la.add_argument("--steps", type=int, default=None, help="total optimizer steps of the run")
    la.add_argument("--schedule", choices=SCHEDULES, default=None)
    la.add_argument("--run-dir", default=None, help="where checkpoints, metrics, traces go")
    la.add_argument("--metrics-out", default=None, metavar="FILE.jsonl")
    la.add_argument("--trace", default=None, metavar="FILE", help="measured Chrome trace")
    la.add_argument("--no-progress", action="store_true", help="no progress bar")
    la.add_argument(
        "--resume", nargs="?", const=True, default=False, metavar="PATH",
        help="continue from the newest complete checkpoint of the run (or from PATH)",
    )  # fmt: skip
    la.add_argument(
        "--chaos-kill-every", type=int, default=None, metavar="N",
        help="kill a random stage actor in the middle of every N-th step (see recovery)",
    )  # fmt: skip
    la.set_defaults(func=cmd_launch)

    ck = sub.add_parser("checkpoints", help="list a run's checkpoints and whether they verify")
    ck.add_argument("run_dir", help="the run directory (or its checkpoints/ directory)")
    ck.add_argument("--fast", action="store_true", help="skip SHA-256 verification")
    ck.add_argument("--json", action="store_true")
    ck.set_defaults(func=cmd_checkpoints)

    st = sub.add_parser("status", help="the running (or last) job: stages, sites, step")
    st.add_argument("run_dir", nargs="?", default=None)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
