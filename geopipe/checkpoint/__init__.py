"""Checkpoint format: atomic, checksummed, partition-independent safetensors shards."""

from geopipe.checkpoint.rng import capture_rng, restore_rng
from geopipe.checkpoint.store import (
    EXP_AVG,
    EXP_AVG_SQ,
    FORMAT_VERSION,
    MODEL_FIELDS,
    PARAMS,
    CheckpointError,
    CheckpointInfo,
    LoadedCheckpoint,
    ShardInfo,
    StageShard,
    check_compatible,
    latest_complete,
    list_checkpoints,
    load_checkpoint,
    load_state_for_layers,
    prune,
    step_dirname,
)
from geopipe.checkpoint.writer import CheckpointWriter, write_shard_file

__all__ = [
    "EXP_AVG",
    "EXP_AVG_SQ",
    "FORMAT_VERSION",
    "MODEL_FIELDS",
    "PARAMS",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWriter",
    "LoadedCheckpoint",
    "ShardInfo",
    "StageShard",
    "capture_rng",
    "check_compatible",
    "latest_complete",
    "list_checkpoints",
    "load_checkpoint",
    "load_state_for_layers",
    "prune",
    "restore_rng",
    "step_dirname",
    "write_shard_file",
]
