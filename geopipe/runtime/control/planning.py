"""What a launch measures before it plans: this machine's speed (``plan.calibrate``).

The plan itself is :func:`geopipe.optimizer.runplan.plan_run`'s, the one planning function
``geopipe plan`` and ``launch --dry-run`` call too; this module only adds the measurement
that needs torch.
"""

from __future__ import annotations

from typing import Any

from geopipe.config import ClusterSpec, Range, choice_values
from geopipe.optimizer.measurements import Measurements
from geopipe.optimizer.runplan import Overrides
from geopipe.runtime.control.calibration import profile_machine, should_profile

__all__ = ["measure_before_planning"]


def measure_before_planning(spec: ClusterSpec, overrides: Overrides) -> Measurements:
    """This machine's compute and codec speeds when the run profiles it (the embedded
    cluster by default), at the shape the run will most likely use; else nothing."""
    if not should_profile(spec):
        return Measurements()
    fixed = overrides.plan
    b = fixed.micro_batch_size if fixed else max(1, _first(spec.plan.micro_batch_size))
    s = fixed.seq_len if fixed else _first(spec.plan.seq_len, spec.model.max_seq_len)
    mbs = choice_values(spec.plan.micro_batch_size, default=[1], powers_of_two=True)
    largest = b if fixed else max(mbs, default=b)  # the plan's choices: two sizes timed
    return profile_machine(spec, b, s, largest)


def _first(choice: Any, default: int = 1) -> int:
    """The first value a plan knob may take (a fixed int, a list, or a range)."""
    if choice is None:
        return default
    if isinstance(choice, int):
        return choice
    if isinstance(choice, list):
        return choice[0]
    if isinstance(choice, Range):
        return max(1, choice.min)
    return default
