"""The ``geopipe`` subcommands: load the YAML, call the planner or the runtime, print.

Heavy imports (the runtime, rich, matplotlib) happen inside the command that needs them, so
``geopipe plan`` starts without Ray, DeepSpeed or torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from geopipe.cli.render import (
    fmt_time,
    format_checkpoints,
    format_simulation,
    format_status,
    format_templates,
    json_text,
    model_summary,
    print_plan,
    print_strategy,
    replication_lines,
)
from geopipe.config import ClusterSpec, load_cluster

__all__ = [
    "EXIT_USAGE",
    "cmd_checkpoints",
    "cmd_launch",
    "cmd_plan",
    "cmd_prepare_data",
    "cmd_simulate",
    "cmd_status",
]

EXIT_USAGE = 2


def cmd_plan(args: argparse.Namespace) -> int:
    from geopipe.optimizer.runplan import plan_run
    from geopipe.optimizer.strategy import as_pipeline

    spec = load_cluster(args.cluster, args.set)
    record = bool(args.trace or args.plot)
    # The one planning function launch and --dry-run call: the pipeline across the sites,
    # the launch-time mix, and (strategy outer or auto) the strategy table.
    rp = plan_run(
        spec, exhaustive=args.exhaustive, record=record, strict=False, source=args.cluster
    )
    report, strategy = rp.report, rp.strategy
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
        from geopipe.optimizer.templates import build_templates

        templates = build_templates(as_pipeline(spec), plan=report.best.plan)
    if args.json:
        doc = report.to_json()
        if spec.model.is_hf:  # the GPT's documents stay as they were
            doc["model"] = model_summary(spec)
        if templates is not None:
            doc["templates"] = format_templates(templates)
        if strategy is not None:
            doc["strategy"] = strategy.to_json()
        if rp.mixed:  # what launch runs: a mix of templates over all devices
            doc["plan"], doc["mixed"] = rp.plan.to_dict(), True
            doc["best"] = {**doc["best"], "launch_mix": rp.predicted.summary()}
        print(json_text(doc))
    else:
        from rich.console import Console

        print_run_plan(spec, rp, Console())
        if templates is not None:
            print("\npipeline templates (one pipeline's layout for each device count per site):")
            print(format_templates(templates))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from geopipe.optimizer.planner import evaluate_fixed

    spec = load_cluster(args.cluster, args.set)
    dn = args.delta_n
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
    if args.trace:
        from geopipe.timeline import write_chrome_trace

        write_chrome_trace(args.trace, e.sim.events, process=f"{spec.name} (simulated)")
    if args.json:
        print(json_text(e.summary()))
    else:
        print(format_simulation(spec.name, e.summary()))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from rich.console import Console

    spec = load_cluster(args.cluster, args.set)
    if args.dry_run:
        return _dry_run(spec, args)

    from geopipe.runtime.control.cluster import LaunchError
    from geopipe.runtime.control.controller import Controller, LaunchOptions
    from geopipe.runtime.control.guards import RunStopped

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
        sets=tuple(args.set or ()),
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
            f"{fmt_time(pred.iteration_time_s)}/step"
        )
        if ctl.cluster and ctl.cluster.dashboard_url:
            console.print(f"Ray dashboard: {ctl.cluster.dashboard_url}")
        console.print(f"run dir: {ctl.run_dir}  (metrics: {ctl.metrics_path})")
        result = ctl.train()
    except LaunchError as exc:
        print(f"geopipe launch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunStopped as exc:  # diverged (exit 3), the model raised (exit 1): said, no trace
        print(f"geopipe launch: {exc}", file=sys.stderr)
        return exc.exit_code
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
    for line in replication_lines(ctl.reporter.replication):  # fewer copies than promised
        console.print(f"checkpoint copies: {line.strip()}")
    return 0


def _dry_run(spec: ClusterSpec, args: argparse.Namespace) -> int:
    """``launch --dry-run``: plan with the one planning function launch calls
    (:func:`~geopipe.optimizer.runplan.plan_run`: the search, ``auto`` pinned, the
    launch-time mix) and run every launch-time check that needs no Ray; start nothing.

    Launch first times the model on this machine when ``plan.calibrate`` is on (the default
    for an embedded Ray); a dry run keeps the YAML's nominal device speeds and says so.
    """
    from rich.console import Console

    from geopipe.optimizer.runplan import Overrides, plan_run
    from geopipe.runtime.control.cluster import LaunchError
    from geopipe.runtime.control.controller import OUTER_NOT_LAUNCHED, run_dir_for
    from geopipe.runtime.control.preflight import preflight

    overrides = Overrides(steps=args.steps, schedule=args.schedule)
    try:
        notes = preflight(spec, run_dir_for(spec, args.run_dir))
    except LaunchError as exc:
        print(f"geopipe launch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    rp = plan_run(spec, overrides=overrides, source=args.cluster)  # PlanningError: exit 2
    print_run_plan(spec, rp, Console())
    if rp.outer_refused:
        print(f"geopipe launch: {OUTER_NOT_LAUNCHED}: {rp.outer_refused}", file=sys.stderr)
        return EXIT_USAGE
    if rp.outer is not None:
        print(f"launch runs {rp.plan.describe()}, meeting every {rp.outer.h} steps")
    for note in notes:
        print(f"note: {note}")
    calibrate = spec.plan.calibrate
    if spec.ray.address == "local" if calibrate is None else calibrate:
        print(
            "note: launch first times the model on this machine (plan.calibrate); this dry "
            "run used the YAML's nominal device speeds"
        )
    print(f"dry run: {spec.name} is valid and plannable; nothing was started")
    return 0


def print_run_plan(spec: ClusterSpec, rp: Any, console: Any) -> None:
    """What `geopipe plan` and `launch --dry-run` both print of one
    :func:`~geopipe.optimizer.runplan.plan_run`: the search's table, the mix launch runs,
    and the strategy table (one printer, so the two views cannot drift apart)."""
    print_plan(spec, rp.report, console)
    if rp.mixed:
        print(format_mix(rp.plan, rp.predicted.iteration_time_s))
    if rp.strategy is not None:
        print_strategy(rp.strategy, console)


def format_mix(plan: object, iteration_time_s: float) -> str:
    """One line per pipeline of a launch-time mix of templates."""
    lines = [
        f"launch runs a mix of pipeline templates over all devices (predicted "
        f"{fmt_time(iteration_time_s)}/step):"
    ]
    for r, p in enumerate(plan.mix):
        lines.append(
            f"  pipeline {r}: {len(p.stage_sites)} stages over {' → '.join(p.stage_sites)}, "
            f"layers {[list(x) for x in p.partition]}, {p.num_microbatches} micro-batches"
        )
    return "\n".join(lines)


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from pathlib import Path

    from geopipe.checkpoint.store import list_checkpoints

    root = Path(args.run_dir)
    roots = _checkpoint_dirs(root)  # per-site copies: one directory per site
    if not roots:
        if (root / "checkpoints").is_dir():
            root = root / "checkpoints"
        if not root.is_dir():
            print(f"geopipe checkpoints: no such directory {root}", file=sys.stderr)
            return EXIT_USAGE
        roots = {"": str(root)}
    listed = {
        site: list_checkpoints(d, verify=not args.fast) if Path(d).is_dir() else None
        for site, d in roots.items()
    }
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "path": str(i.path),
                        "step": i.step,
                        "status": i.status,
                        "reason": i.reason,
                        "time": i.time,
                        "size_bytes": i.size_bytes,
                        "run_id": i.run_id,
                        **({"site": s} if s else {}),
                    }
                    for s, infos in listed.items()
                    for i in infos or []
                ]
            )
        )
        return 0
    for site, infos in listed.items():
        where = f"site {site}: {roots[site]}" if site else str(roots[site])
        if infos is None:
            print(f"{where}: not visible from here (on the site's own disk?)")
        elif not infos:
            print(f"no checkpoints under {where}")
        else:
            print((f"{where}\n" if site else "") + format_checkpoints(infos))
    return 0


def _checkpoint_dirs(run_dir: object) -> dict[str, str]:
    """The per-site checkpoint directories a run's status file names (empty for one shared
    directory: that one is looked for under RUN_DIR, so a copied run dir lists its own)."""
    from pathlib import Path

    status = Path(str(run_dir)) / "status.json"
    try:
        dirs = json.loads(status.read_text()).get("checkpoint_dirs") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return dirs if len(set(dirs.values())) > 1 else {}


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from geopipe.runtime.control.preflight import pid_alive

    paths = [Path(args.run_dir) / "status.json"] if args.run_dir else []
    if not paths:
        paths = sorted(Path("runs").glob("*/status.json"), key=lambda p: p.stat().st_mtime)
        paths = paths[-1:]
    if not paths or not paths[0].exists():
        where = args.run_dir or "runs/*"
        print(f"geopipe status: no run found under {where}", file=sys.stderr)
        return 1
    try:
        data = json.loads(paths[0].read_text())
        pid = data.get("pid")
        alive = isinstance(pid, int) and pid > 0 and pid_alive(pid)
        state = data.get("state", "?")
        if alive and state not in _LIVE_STATES:  # the file's word for a live run, else running
            state = "running"
        text = json_text({**data, "state": state}) if args.json else format_status(data, state)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"geopipe status: {paths[0]} is not a readable status file ({exc})", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    return 0


# What status.json says while its driver runs (the controller's states that are not ends).
_LIVE_STATES = (
    "planning",
    "launching",
    "running",
    "waiting",
    "recovering",
    "growing",
    "checkpointing",
)


def cmd_prepare_data(args: argparse.Namespace) -> int:
    """Tokenize the inputs into a token dataset; bad input is one line and exit 2."""
    import time

    from geopipe.model.prepare import prepare_data
    from geopipe.model.tokens import DatasetError

    t0 = time.perf_counter()
    try:
        m = prepare_data(
            args.inputs,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            processes=args.processes,
            progress=not args.no_progress,
            overwrite=args.overwrite,
        )
    except DatasetError as exc:
        print(f"geopipe: {exc}", file=sys.stderr)
        return EXIT_USAGE
    secs = max(time.perf_counter() - t0, 1e-9)
    mb = m["input_bytes"] / 1e6
    print(
        f"{args.out}: {m['documents']:,} documents, {m['token_count']:,} tokens "
        f"({m['dtype']}, vocab {m['vocab_size']:,}) in {len(m['shards'])} shard(s); "
        f"{mb:.1f} MB in {secs:.1f} s ({mb / secs:.1f} MB/s)"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A run's checkpoint as a directory ``transformers`` loads; bad input is one line, exit 2."""
    from geopipe.checkpoint.store import CheckpointError
    from geopipe.model.export import ExportError
    from geopipe.model.tokens import DatasetError

    try:
        out, note = export_run(
            args.run_dir,
            args.out,
            step=args.step,
            dtype=args.dtype,
            force=args.force,
            max_shard_bytes=args.max_shard_bytes,
        )
    except (CheckpointError, ExportError, DatasetError, OSError) as exc:
        print(f"geopipe: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{out}: {note}")
    return 0


def export_run(
    run_dir: str,
    out: str,
    step: int | None = None,
    dtype: str | None = None,
    force: bool = False,
    max_shard_bytes: int | None = None,
) -> tuple[str, str]:
    """Export ``run_dir``'s newest complete checkpoint (or ``step``'s) to ``out``; returns
    (out, a one-line summary). What ``geopipe export`` runs; benchmarks call it too."""
    import shutil
    from pathlib import Path

    import torch

    from geopipe.checkpoint.store import CheckpointError, load_checkpoint
    from geopipe.model.export import DTYPES, SHARD_BYTES, export_model, write_model_dir

    found = _find_checkpoint(Path(run_dir), step)
    ckpt = load_checkpoint(found)
    params: dict[str, torch.Tensor] = {}
    for shard in ckpt.stages:
        params.update(shard.tensors("params/"))
    if not params:
        raise CheckpointError(f"checkpoint {found} holds no parameters")
    stored = next(iter(params.values())).dtype
    want = DTYPES[dtype] if dtype else stored
    manifest = ckpt.manifest
    config, generation, tensors = export_model(manifest.get("model", {}), params, want)
    tokenizer = _run_tokenizer(manifest.get("data", {}).get("source"))
    target = Path(out)
    if force and target.exists():
        shutil.rmtree(target)
    write_model_dir(target, config, generation, tensors, tokenizer, max_shard_bytes or SHARD_BYTES)
    n = sum(t.numel() for t in tensors.values())
    kind = config.get("architectures", ["?"])[0]
    tok = "with the run's tokenizer" if tokenizer else "no tokenizer (byte-level data)"
    return str(target), (
        f"{kind} from {found.name}, {n / 1e6:.2f} M parameters in {config['dtype']}, {tok}"
    )


def _find_checkpoint(run_dir: object, step: int | None) -> Path:
    """The checkpoint directory to export: RUN_DIR may be a run directory (its
    ``checkpoints/`` or per-site directories), a checkpoints directory or one checkpoint."""
    from pathlib import Path

    from geopipe.checkpoint.store import CheckpointError, list_checkpoints

    root = Path(str(run_dir))
    if (root / "manifest.json").is_file():
        return root
    roots = list(_checkpoint_dirs(root).values()) or [root / "checkpoints", root]
    infos = [i for r in roots if Path(r).is_dir() for i in list_checkpoints(r)]
    complete = sorted((i for i in infos if i.status == "complete"), key=lambda i: i.step)
    if not complete:
        raise CheckpointError(f"no complete checkpoint under {root}")
    if step is None:
        return complete[-1].path
    for info in complete:
        if info.step == step:
            return info.path
    have = ", ".join(str(s) for s in sorted({i.step for i in complete}))
    raise CheckpointError(f"no complete checkpoint of step {step} under {root} (steps: {have})")


def _run_tokenizer(source: object) -> object:
    """The tokenizer directory of the dataset a run trained on (None: bytes, no tokenizer)."""
    from geopipe.model.data import STDLIB_BPE
    from geopipe.model.tokens import TokenDataset, is_token_dataset

    if source == STDLIB_BPE:
        from geopipe.model.builtin import ensure_stdlib_bpe  # cached; rebuilt identically

        return TokenDataset(ensure_stdlib_bpe()).tokenizer_dir
    if isinstance(source, str) and is_token_dataset(source):
        return TokenDataset(source).tokenizer_dir
    return None
