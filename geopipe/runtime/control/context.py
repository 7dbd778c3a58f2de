"""The run context: everything the driver's components are built from, in one immutable value.

[Note: one context, passed on] A component gets what it needs from the context at
construction and is never patched afterwards. A measurement taken mid-launch (the link
probe) makes a new context (:meth:`RunContext.measured`), which the controller hands to the
components it builds after it. The three views of the configuration each have one job:

* ``spec`` — the YAML exactly as loaded. Its digest is the run's config hash, so two
  launches of one YAML record the same hash however fast their machines measure.
* ``settings`` — ``spec`` with the command line's overrides (``--steps``, ``--schedule``,
  the caller's health clocks): what the run executes.
* ``priced`` — ``settings`` with the measurements in the place of the YAML's nominal
  speeds (:func:`~geopipe.optimizer.measurements.costed`): what the cost model reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from geopipe.config import ClusterSpec, HealthSpec
from geopipe.optimizer.evaluate import Evaluation
from geopipe.optimizer.measurements import Measurements, costed
from geopipe.optimizer.runplan import Overrides, with_overrides
from geopipe.plan import Plan
from geopipe.runtime.control.models import model_manifest

__all__ = ["RunContext"]


@dataclass(frozen=True)
class RunContext:
    spec: ClusterSpec
    overrides: Overrides = field(default_factory=Overrides)
    health: HealthSpec | None = None  # the caller's control-plane clocks; None: the YAML's
    measurements: Measurements = field(default_factory=Measurements)
    run_id: str = ""
    lineage: dict[str, int | None] = field(default_factory=dict)
    plan: Plan | None = None  # the plan the launch chose (the running layout is the controller's)
    predicted: Evaluation | None = None  # its prediction under ``measurements``

    @property
    def config_hash(self) -> str:
        """What every checkpoint records: the digest of the YAML as loaded."""
        return self.spec.digest

    @cached_property
    def settings(self) -> ClusterSpec:
        """The spec the run executes: the YAML with the command line's overrides."""
        spec = with_overrides(self.spec, self.overrides)
        if self.health is not None:
            spec = spec.model_copy(update={"health": self.health})
        return spec

    @cached_property
    def priced(self) -> ClusterSpec:
        """The settings with the measured speeds in place of the nominal ones."""
        return costed(self.settings, self.measurements)

    def measured(self, newer: Measurements) -> RunContext:
        """A new context with ``newer`` measurements taking the place of older ones."""
        return replace(self, measurements=self.measurements.merged(newer))

    def planned(self, plan: Plan, predicted: Evaluation) -> RunContext:
        return replace(self, plan=plan, predicted=predicted)

    def resumed(self, lineage: dict[str, int | None]) -> RunContext:
        return replace(self, lineage=lineage)

    def plan_event(
        self,
        plan: Plan,
        predicted: Evaluation,
        planned_with: Measurements,
        links_measured: list[dict],
        outer: dict | None,
    ) -> dict:
        """The launch's ``plan`` event: identity, what was planned with what, and the plan's
        prediction under the measurements as they are now."""
        return {
            "run_id": self.run_id,
            "lineage": self.lineage,
            "config_hash": self.config_hash,
            "overrides": self.overrides.to_dict(),
            "plan": plan.to_dict(),
            "predicted": predicted.summary(),
            "outer": outer,
            "links_measured": links_measured,
            "planned_with": planned_with.to_dict(),
            "measurements": self.measurements.to_dict(),
            "codec_gb_per_s": {s.name: s.codec_gb_per_s for s in self.priced.sites},
        }

    def manifest(self, plan: Plan, step: int, data_digest: str | None) -> dict:
        """The run's fields of a checkpoint manifest at ``step`` (identity: the config hash
        of the YAML as loaded, run id and lineage; what runs: the settings and ``plan``)."""
        m, t = self.settings.model, self.settings.training
        return {
            "config_hash": self.config_hash,
            "run_id": self.run_id,
            "lineage": self.lineage,
            "plan": plan.to_dict(),
            "data": {"seed": t.seed, "step": step, "source": t.data, "digest": data_digest},
            "model": model_manifest(self.settings),
            "run": self.settings.name,
            "lr": t.lr,
            "steps_total": t.steps,
            "global_batch_size": t.global_batch_size,
            "n_embd": m.n_embd,
        }
