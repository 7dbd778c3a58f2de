"""LAUNCHING, the controller's one constructive state: check what the plan needs, connect
to Ray, place and wire the actors, probe the real links, re-price the plan with them, load
a resumed checkpoint and build the components that then run the training (outer rounds,
recovery with its templates, the calibrator).

Its own module because it is one long sequence whose order matters (the links are probed
before the plan event is written, the checkpoint loaded before the outer loop's theta_global
is taken from the weights) and which runs once, while
:class:`~geopipe.runtime.control.controller.Controller` keeps the state machine that runs
again and again. ``ctl`` is that Controller, as in :mod:`geopipe.runtime.control.innerrun`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geopipe.optimizer.runplan import RunPlan, repriced
from geopipe.runtime.control.calibration import Calibrator
from geopipe.runtime.control.cluster import (
    check_precision,
    check_sites,
    gpus_per_actor,
    plaintext_warning,
)
from geopipe.runtime.control.evaluation import Evaluator
from geopipe.runtime.control.linkprobe import measure_clock_skew, probe_links
from geopipe.runtime.control.models import check_data_source
from geopipe.runtime.control.outerloop import OuterRounds
from geopipe.runtime.control.placement import Placement
from geopipe.runtime.control.recovery import Recovery
from geopipe.runtime.control.states import Running, State
from geopipe.transport.runca import CERT_BACKDATE

CERT_TOLERANCE_S = CERT_BACKDATE.total_seconds()  # how far behind a node's clock may be


def launch_components(ctl: Any) -> State:
    """LAUNCHING: check what the plan needs, connect to Ray, place and wire the actors,
    probe the real links, and build the components that run the training from the
    context as measured."""
    check_data_source(ctl.spec)
    ctl.cluster = ctl.workers.connect(ctl.spec)
    ctl.reporter.dashboard_url = ctl.cluster.dashboard_url
    ctl.reporter.ray_address = ctl.cluster.address
    check_sites(ctl.spec, ctl.plan, ctl.workers.resources())
    gpus = gpus_per_actor(ctl.spec, ctl.workers.resources(), len(ctl.plan.actors()))
    check_precision(ctl.spec.training.precision, gpus > 0, ctl.plan.num_stages)
    if (plaintext := plaintext_warning(ctl.spec)) is not None:
        ctl.reporter.say(plaintext)
    # Placement reads settings only (names, data, the emulated links' YAML figures).
    ctl.placement = Placement(ctl.spec, ctl.lr_horizon, gpus, ctl.creds, ctl.workers)
    ctl.placement.place(ctl.plan)
    ctl.placement.wire()
    ctl.evals = Evaluator.ready(ctl.spec, ctl.workers, ctl.reporter, ctl.flat_actors())
    ctl.data_digest = ctl.placement.check_data(ctl._resume and ctl._resume.data_digest)
    if not ctl.spec.ray.links_emulated:  # emulated links are the YAML's by construction
        probed, ctl.links_measured = probe_links(
            ctl.workers, ctl.spec, ctl.plan, ctl.placement, ctl.reporter.say
        )
        ctl.ctx = ctl.ctx.measured(probed)
        placed = RunPlan(ctl.plan, ctl.predicted, outer=ctl.outer_run)
        ctl.predicted = repriced(ctl.ctx.spec, ctl.ctx.measurements, ctl.overrides, placed)
        ctl.ctx = ctl.ctx.planned(ctl.plan, ctl.predicted)
    _opened_events(ctl)
    sites = ctl.plan.stage_sites
    ctl.checkpoints.check_storage(ctl.placement.first_actor_per_site())
    if ctl._resume is not None:
        ctl.checkpoints.load_into(ctl._resume, ctl.actors, list(sites))
    from geopipe.optimizer.templates import build_templates

    priced = ctl.ctx.priced
    if ctl.outer_run is not None:  # theta_global from the weights every group now holds
        ctl.outer = OuterRounds(
            priced, ctl.outer_run, ctl.workers, ctl.reporter.say, ctl.reporter.event
        )
        sites = [site for _, site in ctl.placement.actor_sites()]
        ctl.outer.begin([a for a, _ in ctl.placement.actor_sites()], sites)
        ctl.checkpoints.begin_outer(ctl.outer, ctl._resume)
    # Pipeline templates for every device count are ready before anything fails (an
    # outer-loop run drops a lost group instead: runtime.control.outerfail).
    templates = None if ctl.outer is not None else build_templates(priced, plan=ctl.plan)
    ctl.recovery = Recovery(
        priced,
        ctl.placement,
        ctl.checkpoints,
        ctl.reporter,
        priced.health,
        ctl.history,
        templates,
        ctl.workers,
    )
    predicted_s, fixed = ctl.predicted.iteration_time_s, ctl.opts.plan is not None
    ctl.calibrator = Calibrator(priced, fixed, predicted_s, ctl.links_measured, ctl.outer)
    if ctl._resume is not None:
        ctl.reporter.event("resumed", path=ctl._resume.path, step=ctl.start_step)
    ctl._status(ctl.start_step)  # `geopipe status` works from the first step on
    return Running(ctl.start_step)


def _opened_events(ctl: Any) -> None:
    """Open the metrics and write the launch's security and plan events."""
    metrics = Path(ctl.opts.metrics_out or ctl.run_dir / "metrics.jsonl")
    ctl.reporter.open(metrics, ctl.workers.ray_metrics, ctl.spec)
    said = ctl.creds.protection(outer_groups=ctl.plan.num_groups)  # outer: signed
    ctl.reporter.event("security", **said, listen=ctl.spec.security.listen)
    skew, line = measure_clock_skew(ctl.workers, ctl.placement.roles(), CERT_TOLERANCE_S)
    ctl.reporter.event("clock_skew", **skew)
    if line:
        ctl.reporter.say(line)
    outer = ctl.outer_run.to_dict() if ctl.outer_run else None
    links = [m.to_dict() for m in ctl.links_measured]
    fields = ctl.ctx.plan_event(ctl.plan, ctl.predicted, ctl.planned_with, links, outer)
    ctl.reporter.event("plan", **fields)
