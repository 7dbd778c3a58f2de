"""``geopipe`` command line: plan | simulate | launch | status | checkpoints.

Errors in user input (a bad YAML, an impossible setting) print one clear message and exit
with status 2; a traceback means a bug in geopipe.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from geopipe.config import ClusterSpec, ConfigError, load_cluster

GiB = float(1 << 30)
EXIT_USAGE = 2


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


def _print_plan(spec: ClusterSpec, report, console) -> None:
    from rich.table import Table

    best = report.best
    plan = best.plan
    sim_costs = None
    if plan is not None:
        from geopipe.optimizer.evaluate import Evaluator

        sim_costs = Evaluator(spec).costs(plan)
    console.print(
        f"[bold]{spec.name}[/]: {plan.pipelines} pipeline(s) × {plan.num_stages} stages over "
        f"{' → '.join(dict.fromkeys(plan.stage_sites))}"
    )
    t = Table(title="placement (each stage's replicas form one ZeRO-1 group in its site)")
    for col in ("stage", "site", "layers", "replicas", "fwd", "bwd", "peak memory", "device"):
        t.add_column(col, justify="right" if col not in ("site", "layers") else "left")
    for k, (a, z) in enumerate(plan.partition):
        mem = best.memory[k].total / GiB
        lim = best.memory_limit_bytes[k] / GiB
        t.add_row(
            str(k),
            plan.stage_sites[k],
            f"[{a}, {z})",
            str(plan.pipelines),
            _fmt_time(sim_costs.fwd_s[k]),
            _fmt_time(sim_costs.bwd_s[k]),
            f"{mem:.2f} GiB ({mem / lim:.0%})",
            f"{lim:.0f} GiB",
        )
    console.print(t)
    wan = plan.wan_boundaries
    dn = ", ".join(
        f"{plan.stage_sites[j]}→{plan.stage_sites[j + 1]}: ΔN={plan.delta_n[j]} {plan.codecs[j]}"
        for j in wan
    )
    console.print(
        f"micro-batch {plan.micro_batch_size} × {plan.num_microbatches} per pipeline, "
        f"seq len {plan.seq_len}, schedule {plan.schedule}; WAN boundaries: {dn or 'none'}"
    )
    c = Table(title="predicted iteration (same micro-batch, seq len, codec)")
    for col in ("schedule", "iteration", "tokens/s", "bubble", "max peak mem", "speed-up"):
        c.add_column(col, justify="right")
    rows = [("look-ahead" if plan.schedule == "lookahead" else plan.schedule, best)]
    rows += list(report.baselines.items())
    for name, e in rows:
        c.add_row(
            name,
            _fmt_time(e.iteration_time_s),
            f"{e.tokens_per_s:,.0f}",
            f"{e.bubble_ratio:.1%}",
            f"{max(e.peak_memory_bytes) / GiB:.2f} GiB",
            f"{e.iteration_time_s / best.iteration_time_s:.2f}×",
        )
    console.print(c)
    if not best.feasible:
        console.print(f"[red]no feasible plan found[/]: {best.reason}")
    s = report.search
    line = (
        f"search: {s.method}, {s.evaluations} evaluations of {s.space_size:,} candidates "
        f"in {s.seconds:.2f} s"
    )
    if report.exhaustive is not None:
        ex = report.exhaustive
        gap = best.fitness / ex.best.fitness - 1
        line += f"; exhaustive: {ex.evaluations} evaluations in {ex.seconds:.2f} s, gap {gap:.3%}"
    console.print(line)


def cmd_plan(args: argparse.Namespace) -> int:
    from geopipe.optimizer.planner import plan_cluster

    spec = load_cluster(args.cluster)
    record = bool(args.trace or args.plot)
    report = plan_cluster(spec, exhaustive=args.exhaustive, record=record)
    if args.trace:
        from geopipe.timeline import write_chrome_trace

        write_chrome_trace(args.trace, report.best.sim.events, process=f"{spec.name} (simulated)")
    if args.plot:
        from geopipe.timeline import plot_timelines

        panels = [("1F1B", report.baselines["1f1b"].sim.events)]
        panels.append((f"{report.best.plan.schedule} (planned)", report.best.sim.events))
        plot_timelines(args.plot, panels, title=f"{spec.name}: simulated iteration")
    templates = None
    if args.templates:
        from geopipe.pipeline.templates import build_templates, format_templates

        templates = build_templates(spec, plan=report.best.plan)
    if args.json:
        doc = report.to_json()
        if templates is not None:
            doc["templates"] = format_templates(templates)
        print(json.dumps(doc, indent=None))
    else:
        from rich.console import Console

        _print_plan(spec, report, Console())
        if templates is not None:
            print("\npipeline templates (one pipeline's layout for each device count per site):")
            print(format_templates(templates))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from geopipe.optimizer.planner import evaluate_fixed

    spec = load_cluster(args.cluster)
    dn = [int(x) for x in str(args.delta_n).split(",")]
    try:
        e = evaluate_fixed(
            spec,
            args.schedule,
            args.micro_batch_size,
            args.seq_len,
            dn[0] if len(dn) == 1 else dn,
            pipelines=args.pipelines,
            codec=args.codec,
            record=bool(args.trace),
        )
    except ValueError as exc:
        print(f"geopipe simulate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.trace:
        from geopipe.timeline import write_chrome_trace

        write_chrome_trace(args.trace, e.sim.events, process=f"{spec.name} (simulated)")
    if args.json:
        print(json.dumps(e.summary()))
    else:
        s = e.summary()
        print(
            f"{spec.name}: {s['schedule']} D={s['pipelines']} b={s['micro_batch_size']} "
            f"s={s['seq_len']} ΔN={s['delta_n']} codecs={s['codecs']}\n"
            f"  iteration {_fmt_time(s['iteration_time_s'])}, {s['tokens_per_s']:,.0f} tokens/s, "
            f"bubble {s['bubble_ratio']:.1%}, peak memory "
            f"{max(s['peak_memory_bytes']) / GiB:.2f} GiB, feasible: {s['feasible']} "
            f"({s['reason']})"
        )
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from geopipe.runtime.cluster import LaunchError
    from geopipe.runtime.controller import Controller, LaunchOptions

    spec = load_cluster(args.cluster)
    console = Console(stderr=False)
    opts = LaunchOptions(
        steps=args.steps,
        schedule=args.schedule,
        run_dir=args.run_dir,
        metrics_out=args.metrics_out,
        trace=args.trace,
        progress=not args.no_progress,
        resume=args.resume,
        chaos_kill_every=args.chaos_kill_every,
    )
    ctl = Controller(spec, opts)
    interrupted = False
    try:
        console.print(f"[bold]geopipe[/] {spec.name}: planning …")
        ctl.launch()
        plan, pred = ctl.plan, ctl.predicted
        console.print(
            f"plan: {plan.pipelines} pipeline(s) × {plan.num_stages} stages over "
            f"{' → '.join(dict.fromkeys(plan.stage_sites))}; micro-batch "
            f"{plan.micro_batch_size} × {plan.num_microbatches}, seq len {plan.seq_len}, "
            f"{plan.schedule} ΔN={[plan.delta_n[j] for j in plan.wan_boundaries]} "
            f"codecs={[plan.codecs[j] for j in plan.wan_boundaries]}; predicted "
            f"{_fmt_time(pred.iteration_time_s)}/step"
        )
        if ctl.cluster and ctl.cluster.dashboard_url:
            console.print(f"Ray dashboard: {ctl.cluster.dashboard_url}")
        console.print(f"run dir: {ctl.run_dir}  (metrics: {ctl.sink.path})")
        result = ctl.train()
    except LaunchError as exc:
        print(f"geopipe launch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        interrupted = True
        print("\ngeopipe launch: interrupted; stopping the stage actors", file=sys.stderr)
        return 130
    finally:
        ctl.close(interrupted=interrupted)
    steps = result.steps
    if steps:
        tail = steps[len(steps) // 2 :]
        mean_t = sum(m.iteration_time_s for m in tail) / len(tail)
        console.print(
            f"done: {len(steps)} steps, loss {steps[0].loss:.4f} → {steps[-1].loss:.4f}; "
            f"{mean_t * 1e3:.0f} ms/step measured vs {ctl.predicted_s * 1e3:.0f} ms "
            f"predicted from the measured stage times (planner's nominal estimate "
            f"{pred.iteration_time_s * 1e3:.0f} ms); bubble "
            f"{sum(m.bubble_ratio for m in tail) / len(tail):.1%}"
        )
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from geopipe.checkpoint.store import list_checkpoints

    root = Path(args.run_dir)
    if (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    if not root.is_dir():
        print(f"geopipe checkpoints: no such directory {root}", file=sys.stderr)
        return EXIT_USAGE
    infos = list_checkpoints(root, verify=not args.fast)
    if args.json:
        print(json.dumps([
            {"path": str(i.path), "step": i.step, "status": i.status, "reason": i.reason,
             "time": i.time, "size_bytes": i.size_bytes} for i in infos
        ]))  # fmt: skip
        return 0
    if not infos:
        print(f"no checkpoints under {root}")
        return 0
    print(f"{'step':>8}  {'time':19}  {'size':>10}  status")
    for i in infos:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.time))
        reason = f" ({i.reason})" if i.reason else ""
        print(f"{i.step:>8}  {when}  {i.size_bytes / 1e6:>8.2f}MB  {i.status}{reason}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    paths = [Path(args.run_dir) / "status.json"] if args.run_dir else []
    if not paths:
        paths = sorted(Path("runs").glob("*/status.json"), key=lambda p: p.stat().st_mtime)
        paths = paths[-1:]
    if not paths or not paths[0].exists():
        where = args.run_dir or "runs/*"
        print(f"geopipe status: no run found under {where}", file=sys.stderr)
        return 1
    data = json.loads(paths[0].read_text())
    alive = data.get("pid") is not None and _pid_alive(data["pid"])
    state = data.get("state", "?") if not alive else "running"
    if args.json:
        print(json.dumps({**data, "state": state}))
        return 0
    print(f"run {data['run']}: {state}, step {data['step']}/{data['steps']}")
    if data.get("dashboard_url"):
        print(f"Ray dashboard: {data['dashboard_url']}")
    rec = data.get("recoveries") or []
    if rec:
        last = rec[-1]
        print(
            f"recovered in place {len(rec)} time(s); last: step {last['failed_step']} failed, "
            f"continued at step {last['step']} after {last['seconds']:.1f} s"
        )
    for st in data["stages"]:
        print(
            f"  stage {st['stage']:>2}  site {st['site']:<12} layers {st['layers']}  "
            f"{', '.join(st['actors'])}"
        )
    return 0


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


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
    sm.add_argument("--schedule", choices=("gpipe", "1f1b", "lookahead"), default="lookahead")
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
    la.add_argument("--schedule", choices=("gpipe", "1f1b", "lookahead"), default=None)
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


if __name__ == "__main__":
    sys.exit(main())
