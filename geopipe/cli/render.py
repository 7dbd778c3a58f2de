"""What the ``geopipe`` commands print: tables and lines of text (no logic of their own)."""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

from geopipe.config import GiB

if TYPE_CHECKING:
    from geopipe.config import ClusterSpec
    from geopipe.optimizer.templates import Template, TemplateSet

__all__ = [
    "fmt_time",
    "format_checkpoints",
    "format_model",
    "format_simulation",
    "format_status",
    "format_templates",
    "json_text",
    "model_summary",
    "print_plan",
    "print_strategy",
    "replication_lines",
]


def fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


def _finite(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def json_text(doc: Any) -> str:
    """Strict JSON for every ``--json``: an infinite time (a plan that cannot run) is null."""
    return json.dumps(_finite(doc), allow_nan=False)


def infeasible_note(e: Any) -> str:
    """Why an evaluation cannot run, for the tables (empty when it can)."""
    if e.feasible:
        return ""
    if e.plan is not None and e.memory:
        over = [
            (m / lim, k)
            for k, (m, lim) in enumerate(
                zip(e.peak_memory_bytes, e.memory_limit_bytes, strict=True)
            )
            if m > lim
        ]
        if over:
            _, k = max(over)
            return (
                f"infeasible: peak {e.peak_memory_bytes[k] / GiB:.3g} GiB > "
                f"{e.memory_limit_bytes[k] / GiB:.3g} GiB device memory (stage {k})"
            )
    return f"infeasible: {e.reason}"


def _count(n: int) -> str:
    """A parameter count for people: ``8.03 B``, ``124 M``, ``52,480``."""
    if n >= 10**9:
        return f"{n / 1e9:.3g} B"
    if n >= 10**6:
        return f"{n / 1e6:.3g} M"
    return f"{n:,}"


def model_summary(spec: ClusterSpec) -> dict[str, Any]:
    """The model `geopipe plan --json` reports for a `transformers` model (``model``)."""
    from geopipe.model.sizes import param_totals

    m = spec.model
    return {
        "family": m.family,
        "parameters": param_totals(m)[0],
        "n_layer": m.n_layer,
        "hidden": m.n_embd,
        "tie_embeddings": m.tie_embeddings,
        "pretrained_weights": m.hf_weights,
    }


def format_model(spec: ClusterSpec) -> str:
    """One line: ``model: llama, 8.03 B parameters (32 layers, hidden 4096)``."""
    from geopipe.model.sizes import param_totals

    m = spec.model
    extra = ", tied embeddings" if m.tie_embeddings else ""
    if m.is_hf:
        extra += ", pretrained weights" if m.hf_weights else ", random init"
    return (
        f"model: {m.family}, {_count(param_totals(m)[0])} parameters ({m.n_layer} layers, "
        f"hidden {m.n_embd}{extra})"
    )


def print_plan(spec: ClusterSpec, report: Any, console: Any) -> None:
    """The plan report as rich tables: placement, WAN boundaries, schedules compared."""
    from rich.table import Table

    best = report.best
    plan = best.plan
    if plan is None:
        console.print(f"[red]{spec.name}: no plan can run[/]: {best.reason}")
        return
    from geopipe.optimizer.evaluate import Evaluator

    sim_costs = Evaluator(spec).costs(plan)
    console.print(
        f"[bold]{spec.name}[/]: {plan.pipelines} pipeline(s) × {plan.num_stages} stages over "
        f"{' → '.join(dict.fromkeys(plan.stage_sites))}"
    )
    console.print(format_model(spec), highlight=False)
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
            fmt_time(sim_costs.fwd_s[k]),
            fmt_time(sim_costs.bwd_s[k]),
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
    table, notes = _comparison(report)
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True)
    if len(report.codecs) > 2:  # more than one setting to compare with the chosen one
        console.print(_codec_table(report))
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


def _comparison(report: Any) -> tuple[Any, list[str]]:
    """The plan next to the baselines, one row per schedule, and why each one that does not
    fit cannot run (printed under the table: a narrow terminal would cut a column)."""
    from rich.table import Table

    best = report.best
    name = "look-ahead" if best.plan.schedule == "lookahead" else best.plan.schedule
    rows = [(name, best)]
    rows += [(k, e) for k, e in report.baselines.items() if k != best.plan.schedule]
    notes = [infeasible_note(e) for _, e in rows]
    c = Table(title="predicted iteration (same micro-batch, seq len, codec)")
    for col in ("schedule", "iteration", "tokens/s", "bubble", "max peak mem", "speed-up", "fits"):
        c.add_column(col, justify="right")
    for (name, e), note in zip(rows, notes, strict=True):
        ratio = e.iteration_time_s / best.iteration_time_s
        c.add_row(
            name,
            fmt_time(e.iteration_time_s),
            f"{e.tokens_per_s:,.0f}",
            f"{e.bubble_ratio:.1%}" if e.plan is not None else "-",
            f"{max(e.peak_memory_bytes, default=0.0) / GiB:.2f} GiB",
            f"{ratio:.2f}×" if math.isfinite(ratio) else "-",
            "no" if note else "yes",
        )
    lines = [f"{name}: {note}" for (name, _), note in zip(rows, notes, strict=True) if note]
    return c, lines


def _codec_table(report: Any) -> Any:
    """Each searched codec on every WAN boundary at the plan's structure: what binds."""
    from rich.table import Table

    best = report.best.iteration_time_s
    c = Table(title="codecs compared (same structure, ΔN to cover each; per iteration)")
    for col in ("codec", "iteration", "speed-up", "busiest WAN", "busiest stage"):
        c.add_column(col, justify="left" if col == "codec" else "right")
    c.add_column("bound by", overflow="fold")
    for r in report.codecs:
        t = r.evaluation.iteration_time_s
        ratio = t / best if math.isfinite(t) else math.nan
        c.add_row(
            r.setting,
            fmt_time(t),
            f"{ratio:.2f}×" if math.isfinite(ratio) else "-",
            fmt_time(r.wan_busy_s),
            fmt_time(r.compute_s),
            r.bound,
        )
    return c


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _penalty(p: Any) -> str:
    """A loss penalty and its standard error (what plan.max_loss_penalty is checked at)."""
    return f"{_pct(p.value)} ± {p.spread:.2%}" if p.priced and p.spread else _pct(p.value)


def print_strategy(report: Any, console: Any) -> None:
    """The strategy table (``plan.strategy`` outer or auto): every candidate, the chosen one
    marked, why it won and the loss penalty it assumes, and its groups' plans."""
    from rich.table import Table

    t = Table(title="strategies compared (score: time per token × (1 + loss penalty))")
    for col in (
        "",
        "strategy",
        "H",
        "F",
        "τ",
        "codec",
        "tokens/s",
        "device util",
        "loss penalty",
        "÷ (1 + penalty)",
    ):
        t.add_column(col, justify="left" if col in ("", "strategy", "codec") else "right")
    t.add_column("bound by / not chosen because", overflow="fold")
    for c in report.candidates:
        s = c.setting
        cells = [str(x) for x in (s.h, s.fragments, s.overlap)] if s else ["-"] * 3
        t.add_row(
            "→" if c is report.chosen else "",
            c.label,
            *cells,
            s.codec if s else "-",
            f"{c.tokens_per_s:,.0f}" if c.feasible else "-",
            f"{c.device_utilization:.0%}" if c.feasible else "-",
            _penalty(c.penalty),
            f"{c.effective_tokens_per_s:,.0f}" if c.score < math.inf else "-",
            c.reason or c.bound,
        )
    console.print(t)
    c = report.chosen
    console.print(f"chosen: {report.why}", soft_wrap=True, highlight=False)
    table = report.penalty.table
    source = f"no table at {report.penalty.path}"
    if table:
        source = (
            f"{table.path}: measured on {table.model}, {table.steps} steps, "
            f"synchronous noise {table.sync_noise:.2%}, one run's gap spread {table.run_sd:.2%}"
        )
    value = _penalty(c.penalty) if c.penalty.priced else "unknown"
    console.print(
        f"assumed loss penalty: {value} ({c.penalty.basis}); {source}",
        soft_wrap=True,
        highlight=False,
    )
    if c.kind != "pipeline":
        for g, (sites, e) in enumerate(zip(c.groups, c.evaluations, strict=True)):
            p = e.plan
            console.print(
                f"  group {g}: {' → '.join(sites)}: {p.pipelines} pipeline(s) × "
                f"{p.num_stages} stages, {c.shares[g]} sequences per step (micro-batch "
                f"{p.micro_batch_size} × {p.num_microbatches}), {p.schedule}, inner step "
                f"{fmt_time(e.iteration_time_s)}, bubble {e.bubble_ratio:.1%}",
                highlight=False,
                soft_wrap=True,
            )


def format_simulation(name: str, s: dict) -> str:
    """One evaluated configuration (``geopipe simulate``), from its JSON summary."""
    return (
        f"{name}: {s['schedule']} D={s['pipelines']} b={s['micro_batch_size']} "
        f"s={s['seq_len']} ΔN={s['delta_n']} codecs={s['codecs']}\n"
        f"  iteration {fmt_time(s['iteration_time_s'])}, {s['tokens_per_s']:,.0f} tokens/s, "
        f"bubble {s['bubble_ratio']:.1%}, peak memory "
        f"{max(s['peak_memory_bytes'], default=0.0) / GiB:.2f} GiB, feasible: {s['feasible']} "
        f"({s['reason']})"
    )


def format_checkpoints(infos: list) -> str:
    """The checkpoint table of ``geopipe checkpoints`` (``infos`` non-empty)."""
    lines = [f"{'step':>8}  {'time':19}  {'size':>10}  {'run':22}  status"]
    for i in infos:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.time))
        reason = f" ({i.reason})" if i.reason else ""
        run = getattr(i, "run_id", None) or "-"
        lines.append(
            f"{i.step:>8}  {when}  {i.size_bytes / 1e6:>8.2f}MB  {run:22}  {i.status}{reason}"
        )
    return "\n".join(lines)


def format_status(data: dict, state: str) -> str:
    """A run's status file as ``geopipe status`` prints it."""
    run_id = f" (run id {data['run_id']})" if data.get("run_id") else ""
    lines = [f"run {data['run']}{run_id}: {state}, step {data['step']}/{data['steps']}"]
    wait = data.get("waiting")
    if state == "waiting" and wait:
        lines.append(
            f"waiting for link {wait['link']} (silent {wait['silent_s']:.0f} s of "
            f"{wait['limit_s']:.0f} s)"
        )
    if data.get("dashboard_url"):
        lines.append(f"Ray dashboard: {data['dashboard_url']}")
    if data.get("set"):
        lines.append("launched with --set " + " --set ".join(data["set"]))
    rec = data.get("recoveries") or []
    if rec:
        last = rec[-1]
        lines.append(
            f"recovered in place {len(rec)} time(s); last: step {last['failed_step']} failed, "
            f"continued at step {last['step']} after {last['seconds']:.1f} s"
        )
    pipes = data.get("pipelines") or []
    if data.get("plan", {}).get("mix") and pipes:  # mixed templates: each pipeline its own
        lines.append(f"layout: {data.get('layout', '')}")
        for p in pipes:
            sites: dict[str, int] = {}
            for st in p["stages"]:
                sites[st["site"]] = sites.get(st["site"], 0) + 1
            per = " + ".join(f"{n} {s}" for s, n in sites.items())
            lines.append(
                f"  pipeline {p['pipeline']}: {per} stage(s), {p['microbatches']} micro-batches"
            )
            for k, st in enumerate(p["stages"]):
                lines.append(
                    f"    stage {k:>2}  site {st['site']:<12} layers {st['layers']}  "
                    f"{st['actor'] or '-'}"
                )
    else:
        for st in data["stages"]:
            lines.append(
                f"  stage {st['stage']:>2}  site {st['site']:<12} layers {st['layers']}  "
                f"{', '.join(st['actors'])}"
            )
    lines += _checkpoint_lines(data)
    return "\n".join(lines)


def _checkpoint_lines(data: dict) -> list[str]:
    """Where the latest checkpoint's copies are (one line per copy)."""
    ck = data.get("checkpoint")
    if not ck:
        dirs = data.get("checkpoint_dirs") or {}
        return [f"checkpoints: none yet ({', '.join(sorted(set(dirs.values())))})"] if dirs else []
    copies = ck.get("copies") or {}
    lines = [f"latest checkpoint: step {ck['step']}, {len(copies)} copy(ies)"]
    for site, path in copies.items():
        lines.append(f"  {'shared directory' if site == 'shared' else 'site ' + site:<17} {path}")
    for site, why in (ck.get("failed") or {}).items():
        lines.append(f"  site {site:<12} copy failed: {why}")
    return lines + replication_lines(data.get("replication"))


def replication_lines(rep: dict | None) -> list[str]:
    """Per-site copies short of what ``replicate`` promises: sites whose newest copy is
    behind the newest checkpoint, and how many saves committed too few copies."""
    if not rep or not (rep.get("behind") or rep.get("short_saves")):
        return []
    lines = []
    for site, step in (rep.get("behind") or {}).items():
        has = f"newest copy step {step}" if step is not None else "no copy"
        lines.append(
            f"  site {site:<12} behind: {has}, newest checkpoint step {rep['newest_step']}"
        )
    if rep.get("short_saves"):
        last = rep.get("last_short") or {}
        why = "; ".join(f"{s}: {w}" for s, w in (last.get("failed") or {}).items())
        lines.append(
            f"replication short: {rep['short_saves']} save(s) committed fewer than "
            f"{rep['promised']} copies (last: step {last.get('step')}, {why})"
        )
    return lines


def _fmt_s(t: float) -> str:
    if not math.isfinite(t):
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _fmt_partition(t: Template, width: int = 48) -> str:
    """Layers per stage, grouped by site: ``2+2|1+3`` (elided when long)."""
    parts: list[str] = []
    cur, run = None, []
    for (a, z), s in zip(t.partition, t.stage_sites, strict=True):
        if s != cur and run:
            parts.append("+".join(run))
            run = []
        cur = s
        run.append(str(z - a))
    parts.append("+".join(run))
    text = "|".join(parts)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_templates(ts: TemplateSet) -> str:
    """A table of the feasible templates for ``geopipe plan --templates``."""
    head = (
        f"templates: micro-batch {ts.micro_batch_size}, seq len {ts.seq_len}, "
        f"{ts.schedule}; time = one pipeline alone running all {ts.num_microbatches} "
        f"micro-batches"
    )
    lines = [head, "sites (pipeline order): " + " > ".join(ts.sites)]
    ok = ts.feasible()
    n_bad = sum(1 for t in ts.templates.values() if not t.feasible)
    enum = "every vector" if ts.exhaustive else "bounded set (see geopipe.optimizer.templates)"
    lines.append(f"{len(ts.templates)} vectors evaluated ({enum}); {len(ok)} fit in memory")
    if not ok:
        lines.append("no template fits: the model needs more devices than these sites have")
        return "\n".join(lines)
    smallest = ts.smallest() or ok[0]
    lines.append(
        f"smallest: {smallest.num_devices} device{'s' * (smallest.num_devices != 1)} "
        f"({_fmt_counts(smallest)})"
    )
    rows = [("devices/stages per site", "p", "layers per stage", "ΔN (WAN)", "time", "peak mem")]
    for t in ok:
        wan = [
            t.delta_n[j]
            for j in range(t.num_stages - 1)
            if t.stage_sites[j] != t.stage_sites[j + 1]
        ]
        peak = max(t.peak_memory_bytes, default=0.0) / GiB
        rows.append(
            (
                _fmt_counts(t),
                str(t.num_stages),
                _fmt_partition(t),
                ",".join(map(str, wan)) or "-",
                _fmt_s(t.iteration_time_s),
                f"{peak:.2f} GiB",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if n_bad:
        lines.append(f"({n_bad} vector{'s' * (n_bad != 1)} do not fit in memory)")
    return "\n".join(lines)


def _fmt_counts(t: Template) -> str:
    order = list(dict.fromkeys(t.stage_sites))
    return " ".join(f"{s}={t.devices[s]}" for s in order)
