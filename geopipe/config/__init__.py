"""Cluster YAML -> typed, validated specs.

The YAML is validated once, at load (:mod:`.load`), and everything downstream takes these
frozen models (:mod:`.specs`) or plain values pulled out of them. Every error names the
file, the field path (``links[0].latency_ms``) and what is wrong; unknown keys are errors
with a did-you-mean. pydantic does the type checking and gives us field paths; the
cross-checks (links name real sites, the model fits, the batch divides) live in
:mod:`.checks`.
"""

from geopipe.config.checks import OuterSetting, choice_values, outer_settings
from geopipe.config.health import RAY_KILL_WORKER_TIMEOUT_MS, HealthSpec
from geopipe.config.load import load_cluster, parse_cluster, parse_yaml
from geopipe.config.modelspec import MAX_LAYERS, ModelSpec
from geopipe.config.specs import (
    MAX_DELTA_N,
    MAX_GA_POPULATION,
    MAX_GLOBAL_BATCH,
    MAX_SITE_DEVICES,
    MAX_STEPS,
    RECOVERY_SNAPSHOTS_KEPT,
    SITE_PLACEHOLDER,
    CheckpointSpec,
    Choice,
    ClusterSpec,
    ConfigError,
    GASpec,
    GiB,
    LinkSpec,
    OuterSpec,
    PlanSpec,
    Range,
    RaySpec,
    SecuritySpec,
    SiteSpec,
    TrainingSpec,
)

__all__ = [
    "MAX_DELTA_N",
    "MAX_GA_POPULATION",
    "MAX_GLOBAL_BATCH",
    "MAX_LAYERS",
    "MAX_SITE_DEVICES",
    "MAX_STEPS",
    "RAY_KILL_WORKER_TIMEOUT_MS",
    "RECOVERY_SNAPSHOTS_KEPT",
    "SITE_PLACEHOLDER",
    "CheckpointSpec",
    "Choice",
    "ClusterSpec",
    "ConfigError",
    "GASpec",
    "GiB",
    "HealthSpec",
    "LinkSpec",
    "ModelSpec",
    "OuterSetting",
    "OuterSpec",
    "PlanSpec",
    "Range",
    "RaySpec",
    "SecuritySpec",
    "SiteSpec",
    "TrainingSpec",
    "choice_values",
    "load_cluster",
    "outer_settings",
    "parse_cluster",
    "parse_yaml",
]
