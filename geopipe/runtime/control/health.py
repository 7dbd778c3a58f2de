"""Is the step making progress? Actor errors, heartbeats and the hang timeout.

Three ways a step can fail, each found as early as it can be:

* an actor error (process killed, node gone, an exception) surfaces as soon as that
  actor's result is known, not when the others finish;
* a frozen process or an unreachable node answers no ping: while a step runs, every
  actor is pinged every ``heartbeat_s`` and an unfinished one that leaves a ping
  unanswered for ``unresponsive_s`` is lost — control-plane numbers, like Ray's own health
  checks;
* unless every actor of a site, finished ones too, is silent at once while the step still
  waits on one of them: that is what a WAN outage or a partition looks like from the driver
  (both sides alive, nothing passes; a frozen process leaves its site's other actors
  answering), and real WAN
  blips last seconds to a minute. Such a site is *suspected*, not lost: the step waits
  (no step is lost or half-applied; the data plane's TCP streams ride the outage out),
  the heartbeats go on, and only after ``wan_outage_s`` of silence is the site written
  off (the site-loss path). ``on_silence`` hears when a site goes silent, each beat it
  stays so, and when it answers again. A lone actor frozen in a site of its own looks
  the same and is waited for as long;
* a hang (actors answer, the step never ends) after :func:`hang_timeout_s`, which follows
  the measured step time, so a slow WAN gets a long timeout and a fast one a short one.

Every clock here is the YAML's ``health`` section (:class:`~geopipe.config.HealthSpec`,
its one home, defaults documented there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from geopipe.runtime.control.guards import RunStopped

if TYPE_CHECKING:
    from geopipe.config import HealthSpec
    from geopipe.runtime.control.workers import Actor, Pending, Workers

__all__ = [
    "ActorsUnresponsive",
    "ModelFailed",
    "ShardsUnwritten",
    "StepHung",
    "alive",
    "answers",
    "await_step",
    "hang_timeout_s",
    "quiet_get",
    "raise_model_error",
    "ref_failed",
    "shard_wait_s",
    "silent_sites",
]


class ModelFailed(RunStopped):
    """A stage's model raised in its forward or backward: the run ends with that message."""


# [Note: a model error is not a lost site]
# A stage whose own forward or backward raises (a bug in the model, a shape it refuses) is
# alive: re-forming the job around it would only raise again, and "layers lost their
# parameters" would hide the model's message. The engine tags such exceptions
# (geopipe.runtime.actor.gradnorm.ModelError, its message led by MODEL_ERROR_MARK) and the
# controller ends the run with the first tagged line; a lost process (WorkerLost), a peer's
# failure seen as a broken connection, a hang or a silent site still go to recovery.
MODEL_ERROR_MARK = "[model error]"  # == ModelError.MARK (a test checks)


def raise_model_error(exc: BaseException) -> None:
    """Raise :class:`ModelFailed` if ``exc`` (a step's failure) is a stage's model error."""
    from geopipe.runtime.control.workers import WorkerFailed

    if not isinstance(exc, WorkerFailed):
        return
    for line in str(exc).splitlines():
        if MODEL_ERROR_MARK in line:
            what = line[line.index(MODEL_ERROR_MARK) + len(MODEL_ERROR_MARK) :].strip()
            raise ModelFailed(
                f"the model raised in {what} (a model error, not a lost site: no recovery "
                "attempted)"
            ) from None


class ActorsUnresponsive(RuntimeError):
    """Stage actors stopped answering heartbeats (frozen process, lost or partitioned node)."""

    def __init__(self, indices: list[int], seconds: float) -> None:
        super().__init__(f"{len(indices)} actor(s) unanswered heartbeat for {seconds:.0f} s")
        self.indices = indices


class StepHung(TimeoutError):
    """The step did not finish within the hang timeout although its actors answer."""


class ShardsUnwritten(ActorsUnresponsive):
    """A checkpoint's shard writes did not all finish within :func:`shard_wait_s`: a frozen
    or wedged writer (e.g. its thread stuck in a gather that a failure cut short). Nothing
    of that save was committed. Its actors are handled as frozen ones are (recovery kills
    and replaces them; an outer run loses their groups): a writer that never finishes its
    shard may never finish anything else either, and the driver cannot tell which."""

    def __init__(self, indices: list[int], names: list[str], step: int, seconds: float) -> None:
        RuntimeError.__init__(
            self,
            f"checkpoint step {step}: the shard(s) of {', '.join(names)} were not written "
            f"within {seconds:.1f} s (a frozen or wedged writer); the save is dropped, the "
            "previous complete checkpoint stays the newest",
        )
        self.indices, self.names, self.step = indices, names, step


def shard_wait_s(stall_s: float, cfg: HealthSpec) -> float:
    """How long the driver waits for a save's shard writes once it needs them (the next
    save, the run's last save): the rule of a hung step before calibration with the save's
    own measured snapshot stall as its predicted time — ``hang_factor`` × the stall, at
    least ``hang_floor_uncalibrated_s`` (120 s by default). Writing a shard scales with the
    state, not the step, so the step's prediction would be the wrong yardstick; the
    snapshot copies the same state, so its stall is one."""
    return hang_timeout_s(stall_s, False, cfg)


def hang_timeout_s(predicted_s: float, calibrated: bool, cfg: HealthSpec) -> float:
    """How long a step may run before it counts as hung: ``hang_factor`` × the predicted
    step — after calibration a prediction from the measured stage times and link delays —
    but at least the floor (a longer one before calibration, whose steps include warm-up).
    A call running a span of steps (:mod:`.innerrun`) passes the span's predicted time."""
    floor = cfg.hang_floor_s if calibrated else cfg.hang_floor_uncalibrated_s
    return max(floor, cfg.hang_factor * predicted_s)


OnSilence = Callable[[str, str, float], None]  # (event, site, silent seconds)


def silent_sites(stale: list[int], pending: list[int], sites: list[str]) -> set[str]:
    """The sites with an unfinished actor where every actor — finished ones too — is stale
    (no ping answered): a link down, not a frozen process, which leaves its site's other
    actors answering whether or not they have finished the step."""
    stale_set, pending_set = set(stale), set(pending)
    by_site: dict[str, list[int]] = {}
    for i, site in enumerate(sites):
        by_site.setdefault(site, []).append(i)
    return {
        s
        for s, members in by_site.items()
        if all(i in stale_set for i in members) and any(i in pending_set for i in members)
    }


def _same(a: Any, b: Any) -> bool:
    """Whether two pending calls are one (a Ray ref may come back as an equal object)."""
    return a is b or a == b


def _take(workers: Workers, pending: list[Pending], wait_s: float, side: Any) -> list[Pending]:
    """Wait up to ``wait_s`` for one of ``pending`` or of ``side``'s calls; an answered
    step call's error raises at once (not when the others finish), an answered side call
    goes to ``side.ready``. Returns the step calls still pending."""
    extra = side.refs() if side is not None else []
    ready, _ = workers.wait(pending + extra, num_returns=1, timeout=wait_s)
    mine = [r for r in ready if any(_same(r, p) for p in pending)]
    workers.get(mine)
    for r in ready:
        if not any(_same(r, m) for m in mine):
            side.ready(r)
    return [p for p in pending if not any(_same(p, r) for r in mine)]


def await_step(
    workers: Workers,
    actors: list[Actor],
    refs: list[Pending],
    hang_s: float,
    cfg: HealthSpec,
    sites: list[str] | None = None,
    on_silence: OnSilence | None = None,
    side: Any = None,
) -> list:
    """The step's results (``refs[i]`` is ``actors[i]``'s call, in site ``sites[i]``), failing
    fast: an actor error (:class:`~geopipe.runtime.control.workers.WorkerLost`,
    :class:`~geopipe.runtime.control.workers.WorkerFailed`) as soon as one is known,
    :class:`ActorsUnresponsive` after ``cfg.unresponsive_s`` of unanswered heartbeats (a
    whole silent site: after ``cfg.wan_outage_s``), :class:`StepHung` after ``hang_s`` (not
    counting outages, nor the time ``side`` is stalled). ``side``: work the step needs from
    the driver meanwhile, awaited beside it (an outer run's
    :class:`~geopipe.runtime.control.outerdecide.Decisions`: its ``refs()`` are awaited
    with the step's, each answered one handed to its ``ready``, which may raise)."""
    deadline = time.monotonic() + hang_s
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    pings: dict[int, tuple[Any, float]] = {}  # actor index -> (ping in flight, sent at)
    silent_since: dict[str, float] = {}  # site -> when its first unanswered ping went out
    outage_s = cfg.wan_outage_s
    beat = time.monotonic() + cfg.heartbeat_s
    while pending:
        t0 = time.monotonic()
        pending = _take(workers, pending, max(0.0, beat - t0), side)
        now = time.monotonic()
        if side is not None and side.stalled():  # the WAN's wait, not a hang
            deadline += now - t0
        if now < beat or not pending:
            continue
        if silent_since:  # an outage pauses the hang clock
            deadline += now - (beat - cfg.heartbeat_s)
        beat = now + cfg.heartbeat_s
        if now > deadline:
            raise StepHung(f"step unfinished after {hang_s:.0f} s: a hang")
        stale, sent_at = [], {}
        waiting = [index[ref] for ref in pending]
        # every actor is pinged: a finished one answering tells a frozen process from a
        # silent site (and only an unfinished one can be lost)
        for i in range(len(actors)):
            ping, sent = pings.get(i, (None, now))
            if ping is not None and not workers.wait([ping], timeout=0)[0]:
                if now - sent > cfg.unresponsive_s:
                    stale.append(i)
                    sent_at[i] = sent
                continue
            pings[i] = (workers.call(actors[i], "ping"), now)
        silent = silent_sites(stale, waiting, sites) if sites else set()
        for s in list(silent_since):
            if s not in silent:  # it answers again: the link healed
                if on_silence is not None:
                    on_silence("healed", s, now - silent_since.pop(s))
                else:
                    silent_since.pop(s)
        unfinished = set(waiting)
        stale_waiting = [i for i in stale if i in unfinished]
        lost = [i for i in stale_waiting if sites is None or sites[i] not in silent]
        for s in sorted(silent):
            first = s not in silent_since
            since = silent_since.setdefault(
                s, min(t for i, t in sent_at.items() if sites and sites[i] == s)
            )
            if on_silence is not None:
                on_silence("silent" if first else "waiting", s, now - since)
            if now - since > outage_s:  # past the deadline: the site-loss path
                lost += [i for i in stale_waiting if sites and sites[i] == s]
        if lost:
            raise ActorsUnresponsive(sorted(lost), cfg.unresponsive_s)
    for s, since in silent_since.items():  # the step finished: every site answered
        if on_silence is not None:
            on_silence("healed", s, time.monotonic() - since)
    return workers.get(refs)


def alive(workers: Workers, actors: list[Actor], timeout: float) -> list[bool]:
    """Which actors answer a ping within ``timeout`` (all pinged at once)."""
    refs = [workers.call(a, "ping") for a in actors]
    ready, _ = workers.wait(refs, num_returns=len(refs), timeout=timeout)
    return [r in ready and quiet_get(workers, [r], 0)[0] is not None for r in refs]


def answers(
    workers: Workers,
    actors: list[Actor],
    refs: list[Pending],
    health: HealthSpec,
    who: Callable[[list[Actor]], tuple[list[int], list[str]]],
) -> list:
    """The answers to ``refs`` (a call to each of ``actors``), for a call that is quick on a
    live actor and that no step's heartbeat watches (a save's snapshot). Every
    ``heartbeat_s`` the actors yet to answer are pinged; those silent past
    ``unresponsive_s`` (a frozen process, a partitioned node) raise
    :class:`ActorsUnresponsive` naming their layout indices (``who``) instead of the save
    waiting for ever. Either error (that, or the first call's that failed) is raised only
    once every other live actor has answered (bounded by ``settle_s``), so no call of a
    failed save runs after the recovery's save of the same step and is taken for it."""
    while True:
        _, rest = workers.wait(refs, num_returns=len(refs), timeout=health.heartbeat_s)
        if not rest:
            return workers.get(refs)
        waiting = [(a, r) for a, r in zip(actors, refs, strict=True) if r in rest]
        up = alive(workers, [a for a, _ in waiting], health.unresponsive_s)
        frozen = [a for (a, _), ok in zip(waiting, up, strict=True) if not ok]
        if frozen:
            live = [r for (_, r), ok in zip(waiting, up, strict=True) if ok]
            workers.wait(live, num_returns=len(live), timeout=health.settle_s)
            raise ActorsUnresponsive(who(frozen)[0], health.unresponsive_s)


def ref_failed(workers: Workers, ref: Pending) -> bool:
    """Whether a finished call's result is an error."""
    try:
        workers.get([ref], timeout=0)
    except Exception:
        return True
    return False


def quiet_get(workers: Workers, refs: list[Pending], timeout: float) -> list:
    """``get`` that turns each failure into None (best-effort calls on survivors)."""
    out = []
    for ref in refs:
        try:
            out.append(workers.get([ref], timeout=timeout)[0])
        except Exception:
            out.append(None)
    return out
