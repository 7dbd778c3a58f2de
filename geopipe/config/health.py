"""The control plane's clocks: the YAML's ``health`` section, and the SIGKILL grace of the
Ray clusters geopipe starts. None changes what training computes."""

from __future__ import annotations

from pydantic import Field

from geopipe.config.fields import Spec

__all__ = ["RAY_KILL_WORKER_TIMEOUT_MS", "HealthSpec"]

# Ray's grace between asking an actor's worker to exit and SIGKILLing it, for the clusters
# geopipe starts (the embedded one, the test bed's): [Note: killing a frozen actor] in
# geopipe.runtime.control.cluster.
RAY_KILL_WORKER_TIMEOUT_MS = 1000


class HealthSpec(Spec):
    """The control plane's clocks: how a step is watched, how long silence, a hang, a stuck
    survivor or a checkpoint copy is waited for. Control-plane numbers, like Ray's own
    health checks: none changes what training computes (outside the config digest)."""

    heartbeat_s: float = Field(
        1.0,
        gt=0.0,
        le=60.0,
        description="each actor is pinged this often while a step runs",
    )
    unresponsive_s: float = Field(
        10.0,
        gt=0.0,
        le=3_600.0,
        description="an actor leaving a ping unanswered this long is lost (a frozen process, "
        "a dead node); its site's other actors answering tells it from a WAN outage",
    )
    hang_factor: float = Field(
        20.0,
        ge=1.0,
        le=1_000.0,
        description="a step may take this many predicted step times before it is a hang …",
    )
    hang_floor_s: float = Field(
        30.0, gt=0.0, le=86_400.0, description="… but at least this long once calibrated …"
    )
    hang_floor_uncalibrated_s: float = Field(
        120.0,
        gt=0.0,
        le=86_400.0,
        description="… and this long before (warm-up steps, the first compilations)",
    )
    wan_outage_s: float = Field(
        60.0,
        ge=1.0,
        le=86_400.0,
        description="a site whose every actor stops answering mid-step (a WAN outage or "
        "partition) is waited for this long, the step paused, before the site-loss path "
        "re-forms the job without it; WAN blips last seconds to a minute",
    )
    stuck_release_s: float = Field(
        60.0,
        gt=0.0,
        le=3_600.0,
        description="in a recovery, how long a survivor blocked in a collective with a dead "
        "replica is waited for when it holds state no one else does (the dead replica's "
        "exit releases it; Ray SIGKILLs a frozen process after its kill grace, 1 s on the "
        "clusters geopipe starts and 5 s by Ray's default)",
    )
    copy_wait_s: float = Field(
        120.0,
        gt=0.0,
        le=86_400.0,
        description="how long re-sent per-site checkpoint copies are waited for before the "
        "copy is abandoned (the previous complete checkpoint stays); also the least deadline "
        "of any checkpoint pull between sites (hang_factor x its bytes over the link's rate "
        "if longer)",
    )
    settle_s: float = Field(
        10.0,
        gt=0.0,
        le=3_600.0,
        description="at the end of a run or before a recovery, how long a checkpoint still "
        "being written is waited for before it is left incomplete (never marked good)",
    )
