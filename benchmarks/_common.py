"""Shared pieces of the runtime benchmarks: specs derived from the embedded default, and
running a Controller against one embedded Ray that several settings share."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import yaml

from geopipe.config import ClusterSpec, parse_cluster
from geopipe.runtime.control.controller import Controller, LaunchOptions, RunResult

ROOT = Path(__file__).resolve().parents[1]


def two_site_doc(
    name: str,
    latency_ms: float,
    bandwidth_gbps: float,
    micro_batches: int,
    codec: str = "none",
    micro_batch_size: int = 1,
) -> dict:
    """clusters/local-2dc.yaml with one device per site (one stage each), D = 1."""
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["name"] = name
    # No dashboard: on a 2-core machine its processes steal enough CPU to blur timings.
    doc["ray"]["dashboard"] = False
    for s in doc["sites"]:
        s["devices_per_node"] = 1
    doc["links"][0].update(latency_ms=latency_ms, bandwidth_gbps=bandwidth_gbps, codec=codec)
    doc["training"].update(global_batch_size=micro_batches * micro_batch_size, warmup_steps=0)
    doc["training"]["checkpoint"] = {"every_steps": 0, "keep": 1}
    doc["plan"].update(
        pipelines=1,
        micro_batch_size=micro_batch_size,
        seq_len=128,
        codecs=[codec],
        delta_n={"min": 0, "max": 32},
    )
    return doc


def spec_of(doc: dict) -> ClusterSpec:
    return parse_cluster(doc, doc["name"])


def run(
    spec: ClusterSpec, steps: int, run_dir: Path, schedule: str | None = None
) -> tuple[Controller, RunResult, list[dict]]:
    """Train ``steps`` steps; the embedded Ray stays up for the next setting."""
    ctl = Controller(
        spec, LaunchOptions(steps=steps, schedule=schedule, run_dir=str(run_dir), progress=False)
    )
    try:
        ctl.launch()
        res = ctl.train()
    finally:
        ctl.close()  # stops the actors; the embedded Ray (not the controller's) stays up
    events = [
        json.loads(x)
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"event"' in x
    ]
    return ctl, res, events


def json_line(result: dict) -> str:
    """A benchmark's closing JSON line: floats to 6 significant digits, others as they are."""
    return json.dumps(
        {
            k: float(f"{v:.6g}") if isinstance(v, float) and math.isfinite(v) else v
            for k, v in result.items()
        }
    )
