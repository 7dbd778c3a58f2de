"""Names the checkpoint format and the runtime's state hand-off share: one home for each.

A stage's full state is a dict ``{group: {parameter name: tensor}}`` for the groups below,
plus the Adam step count (``"step"``) and the LR scheduler's step (``"lr_step"``). In a
shard file each tensor is stored as ``<group>/<name>``.
"""

from __future__ import annotations

__all__ = [
    "ADAM_MOMENTS",
    "ADAM_STATE_GROUPS",
    "EXP_AVG",
    "EXP_AVG_SQ",
    "PARAMS",
    "PARAMS_GROUP",
]

PARAMS_GROUP = "params"  # the fp32 weights
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's first and second moments
ADAM_STATE_GROUPS = (PARAMS_GROUP, *ADAM_MOMENTS)  # fp32 weights, then the moments
PARAMS, EXP_AVG, EXP_AVG_SQ = (f"{g}/" for g in ADAM_STATE_GROUPS)  # shard key prefixes
