"""``geopipe`` command line: plan | simulate | launch | status | checkpoints | export |
prepare-data | testbed.

Errors in user input (a bad YAML, an impossible setting, a file that cannot be written)
print one clear message and exit with status 2. Anything else escaping a command is a bug
in geopipe: it prints ``internal error: …`` with where to report it and exits with status 1
(``GEOPIPE_DEBUG=1`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from geopipe.cli.commands import (
    EXIT_USAGE,
    cmd_checkpoints,
    cmd_export,
    cmd_launch,
    cmd_plan,
    cmd_prepare_data,
    cmd_simulate,
    cmd_status,
)
from geopipe.config import MAX_DELTA_N, MAX_STEPS, ConfigError
from geopipe.optimizer.errors import PlanningError
from geopipe.pipeline.schedule import AUTO, SCHEDULES
from geopipe.transport.wire import CODECS, check_codec

__all__ = ["EXIT_INTERNAL", "REPORT_TO", "build_parser", "main"]

EXIT_INTERNAL = 1
REPORT_TO = "the geopipe issue tracker (with the command, the cluster file and this message)"


def _int_in(lo: int, hi: int):
    """An argparse type: an integer in ``[lo, hi]`` (argparse turns the error into exit 2)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v

    return parse


def _delta_n(text: str) -> list[int]:
    """``4`` or ``4,2`` (one per WAN boundary)."""
    one = _int_in(0, MAX_DELTA_N)
    return [one(x.strip()) for x in text.split(",")]


_POSITIVE = _int_in(1, 1 << 31)


def _codec(text: str) -> str:
    try:
        check_codec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="geopipe",
        description="Train GPT models pipelined across data centres joined by slow WAN links.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    _planning_commands(sub)
    _run_commands(sub)
    _data_commands(sub)
    tb = sub.add_parser(
        "testbed",
        help="a real emulated WAN on this host (namespaces; needs root)",
        add_help=False,
    )
    tb.add_argument("testbed_args", nargs=argparse.REMAINDER)
    tb.set_defaults(func=_cmd_testbed)
    return p


def _set_option(parser: Any) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one YAML key (repeatable), validated as if written in the file: "
        "--set training.lr=1e-4 --set plan.pipelines=2",
    )


def _planning_commands(sub: Any) -> None:
    pl = sub.add_parser("plan", help="choose micro-batch, seq len, ΔN and codec; predict speed")
    pl.add_argument("cluster", help="cluster YAML")
    _set_option(pl)
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
    _set_option(sm)
    sm.add_argument("--schedule", choices=SCHEDULES, default="lookahead")
    sm.add_argument("--micro-batch-size", type=_POSITIVE, required=True)
    sm.add_argument("--seq-len", type=_POSITIVE, required=True)
    sm.add_argument(
        "--delta-n", type=_delta_n, default=[0], help="ΔN, or one per WAN boundary: 4,2"
    )
    sm.add_argument("--pipelines", type=_POSITIVE, default=None, help="data-parallel degree D")
    sm.add_argument(
        "--codec",
        type=_codec,
        default=None,
        metavar="CODEC",
        help=f"WAN codec, one of {', '.join(CODECS)}, or one per direction: int4h/int8 "
        "(default: the link's)",
    )
    sm.add_argument("--json", action="store_true")
    sm.add_argument("--trace", metavar="FILE")
    sm.set_defaults(func=cmd_simulate)


def _run_commands(sub: Any) -> None:
    la = sub.add_parser("launch", help="train on the cluster the YAML describes")
    la.add_argument("cluster")
    _set_option(la)
    la.add_argument(
        "--steps",
        type=_int_in(1, MAX_STEPS),
        default=None,
        help="total optimizer steps of the run",
    )
    la.add_argument("--schedule", choices=(*SCHEDULES, AUTO), default=None)
    la.add_argument("--run-dir", default=None, help="where checkpoints, metrics, traces go")
    la.add_argument("--metrics-out", default=None, metavar="FILE.jsonl")
    la.add_argument("--trace", default=None, metavar="FILE", help="measured Chrome trace")
    la.add_argument("--no-progress", action="store_true", help="no progress bar")
    la.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="PATH",
        help="continue from the newest complete checkpoint of the run (or from PATH)",
    )
    la.add_argument(
        "--chaos-kill-every",
        type=_POSITIVE,
        default=None,
        metavar="N",
        help="kill a random stage actor in the middle of every N-th step (see recovery)",
    )
    la.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the YAML and plan the run as launch would; start nothing",
    )
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


def _data_commands(sub: Any) -> None:
    pd = sub.add_parser("prepare-data", help="tokenize text, JSONL or Parquet into a dataset")
    pd.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories")
    pd.add_argument("--tokenizer", required=True, metavar="DIR", help="a tokenizer directory")
    pd.add_argument("--out", required=True, metavar="DIR", help="the dataset directory to write")
    pd.add_argument("--text-field", default="text", help="JSONL field / Parquet column (text)")
    pd.add_argument(
        "--processes",
        type=_POSITIVE,
        default=None,
        metavar="N",
        help="tokenizer processes (default: the CPUs available)",
    )
    pd.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    pd.add_argument("--no-progress", action="store_true", help="no progress bar")
    pd.set_defaults(func=cmd_prepare_data)

    ex = sub.add_parser("export", help="a run's checkpoint as a transformers model directory")
    ex.add_argument("run_dir", help="the run directory (or a checkpoints/ or step directory)")
    ex.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    ex.add_argument("--step", type=int, default=None, help="default: the newest complete one")
    ex.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="default: the checkpoint's own (fp32 master weights)",
    )
    ex.add_argument(
        "--max-shard-bytes",
        type=_POSITIVE,
        default=None,
        metavar="N",
        help="split the weights into files of at most N bytes (default 5 GB)",
    )
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ex.set_defaults(func=cmd_export)


def _cmd_testbed(args: argparse.Namespace) -> int:
    """Delegate to the test bed's own command line (also ``python -m geopipe.testbed``)."""
    from geopipe.testbed.cli import main as testbed_main

    return testbed_main(args.testbed_args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["testbed"]:  # its own options may come first (--state-dir X up …)
        return _cmd_testbed(argparse.Namespace(testbed_args=argv[1:]))
    args = build_parser().parse_args(argv)
    name = f"geopipe {args.command}"
    try:
        return args.func(args)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
    except PlanningError as exc:
        where = f" {args.cluster}" if getattr(args, "cluster", None) else ""
        print(f"{name}: cannot plan{where}: {exc}", file=sys.stderr)
    except OSError as exc:  # an output file that cannot be written, a full disk …
        what = f"{exc.filename}: " if exc.filename else ""
        print(f"{name}: {what}{exc.strerror or exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("GEOPIPE_DEBUG"):
            raise
        print(
            f"{name}: internal error: {type(exc).__name__}: {exc}\n"
            f"This is a bug in geopipe, not in your input. Please report it to {REPORT_TO}; "
            "GEOPIPE_DEBUG=1 shows the traceback.",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    return EXIT_USAGE
