"""Outer-loop data parallelism between replica groups (the DiLoCo family): the numerics.

M replica groups train on disjoint slices of each global batch and meet every H inner steps:
each sends its pseudo-gradient (theta_global - theta_local), the groups average them, and an
outer optimizer (Nesterov SGD) updates theta_global identically in every group. Streaming
DiLoCo splits the parameters into F fragments synced on staggered steps, each send hidden
behind tau inner steps.

This package holds only the numerics, with no Ray, DeepSpeed or runtime import, so the
planner's checks, the runtime and the loss-penalty benchmark share one definition:

* :mod:`.fragments`: the schedule (which fragment is sent and applied after which inner
  step) and the validation of ``plan.outer.{h, fragments, overlap}``;
* :mod:`.optimizer`: theta_global, the outer Nesterov momentum, the pseudo-gradient;
* :mod:`.exchange`: encoding one group's pseudo-gradient once and averaging all groups'
  encoded payloads, bit-identically in every group.

The inner optimizer's state is not reset at a round (see :mod:`.optimizer`).
"""

from geopipe.outer.exchange import ROW_LEN, average_encoded, decode_delta, encode_delta
from geopipe.outer.fragments import StreamingSchedule, check_outer_settings, fragment_bounds
from geopipe.outer.optimizer import OuterOptimizer, pseudo_gradient

__all__ = [
    "ROW_LEN",
    "OuterOptimizer",
    "StreamingSchedule",
    "average_encoded",
    "check_outer_settings",
    "decode_delta",
    "encode_delta",
    "fragment_bounds",
    "pseudo_gradient",
]
