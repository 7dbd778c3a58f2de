"""Names the checkpoint format and the runtime's state hand-off share: one home for each.

A stage's full state is a dict ``{group: {parameter name: tensor}}`` for the groups below,
plus the Adam step count (``"step"``) and the LR scheduler's step (``"lr_step"``). In a
shard file each tensor is stored as ``<group>/<name>``.

On-disk format (``FORMAT_VERSION = 1``)::

    <root>/
      step-00000020/                 one checkpoint; exists only after a complete save
        stage-0.safetensors          one shard per pipeline stage
        stage-1.safetensors
        manifest.json                written last: a step dir without a valid one is corrupt
      .tmp-step-00000030-<pid>-<token>/  a save in progress or a killed one ("partial")

A shard ``stage-<k>.safetensors`` holds contiguous tensors (no shared storage):

* ``params/<name>``                        parameters, e.g. ``params/blocks.7.attn.qkv.weight``
* ``exp_avg/<name>``, ``exp_avg_sq/<name>``  the full (unsharded) Adam moments of ``<name>``
* ``rng/torch``                            the torch CPU RNG state (uint8), if saved with ``rng=``
* any other stage state, e.g. ``codec/<stream>`` error-feedback residuals

and safetensors string metadata ``geopipe.format`` (``"1"``), ``geopipe.stage`` (``"<k>"``)
and ``geopipe.meta``: JSON of the stage's small state (Adam step, LR-scheduler step,
``"rng": {"python": [...], "numpy": [...]}``, ...). JSON turns tuples into lists.

``manifest.json`` (keys beyond these are the caller's and are kept as given)::

    {"format_version": 1, "step": 20, "time": 1767225600.0, "time_iso": "2026-01-01T00:00:00Z",
     "config_hash": "...", "plan": {...}, "data": {...},
     "model": {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256, "max_seq_len": 128},
     "num_stages": 2,
     "stages": [{"stage": 0, "file": "stage-0.safetensors", "sha256": "<64 hex>",
                 "bytes": 123456, "tensors": 14}, ...]}
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
