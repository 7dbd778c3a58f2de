"""The CUDA path, kept ready for a machine that has one (issue 32, item 9).

The Llama demo (clusters/llama-tiny-2dc.yaml's model, widened so a GPU has work to do) over
two emulated sites, one stage actor each, on the GPUs of this machine: with one GPU the two
actors share it (``ray.gpus_per_actor: 0.5``), otherwise one GPU each. For bf16, and for
fp16 (DeepSpeed's dynamic loss scaling; one site, one stage: fp16 is refused across stages)
it reports:

* ``<precision>_peak_memory_over_predicted``: per stage, ``torch.cuda.max_memory_allocated``
  in the actor after the run against the planner's peak for that stage
  (:mod:`geopipe.optimizer.memory`, the figure ``geopipe plan`` prints), the worst stage;
* ``<precision>_tokens_per_s_over_forecast``: measured tokens/s over the steady steps
  against the forecast of the same plan after calibration;
* ``<precision>_final_loss`` and whether every loss was finite (fp16's loss scale skips
  overflowing steps; the loss must still fall).

Then the outer loop (DiLoCo) on the same device(s), bf16: ``plan.strategy: outer``, two
replica groups, one per site, each group the whole model on one stage actor (sharing one GPU
as above), codec none, outer lr 0.7 and momentum 0.9, a round every ``H`` steps
(``--steps`` / 6, at least 1). Its state (theta_global, the outer momentum) lives on the
host while the masters are on the device, the path the first GPU run never reached. It
reports ``outer_final_loss``, ``outer_losses_finite``, ``outer_rounds`` (as many as the
steps allow) and ``outer_digests_equal`` (theta_global bit-identical in both groups after
every round, from the run's ``outer_round`` events).

A check that raises is reported as ``<name>_error`` (its traceback, the actors' included,
on stderr) and the others still run; the exit status is then 1.

Elsewhere it prints a clear "no CUDA device" line and the JSON line ``{"cuda": false, ...}``
and exits 2: it is not part of CI. Figures go into benchmarks/README.md only when measured
on a GPU; none has been yet.

Run: ``.venv/bin/python benchmarks/gpu_check.py [--steps 30]``. ``--rehearse`` runs the same
path on CPU (bf16 and the outer loop, not fp16; the demo's width, no GPU resources asked of
Ray, memory and speed still printed but meaningless), so a device lease is not spent finding
a broken script.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import yaml
from _common import ROOT, spec_of

from geopipe.runtime.control.controller import Controller, LaunchOptions

# The demo's Llama, wider: enough work per step that a GPU's step is not all overhead.
WIDE = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16}


def model_dir(tmp: Path, wide: bool = True) -> Path:
    """clusters/models/llama-tiny's config, widened, as `save_pretrained` writes it."""
    cfg = json.loads((ROOT / "clusters" / "models" / "llama-tiny" / "config.json").read_text())
    if wide:
        cfg.update(WIDE, num_key_value_heads=4, num_hidden_layers=8)
    out = tmp / "llama-gpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def doc_for(precision: str, model: Path, steps: int, gpus: int) -> dict:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "llama-tiny-2dc.yaml").read_text()))
    doc["name"] = f"gpu-check-{precision}"
    doc["ray"]["dashboard"] = False
    if gpus:
        doc["ray"]["gpus_per_actor"] = 1.0 if gpus >= 2 else 0.5
    for s in doc["sites"]:
        # one H100-class device per site (the planner's nominal figures; calibration
        # replaces the speed with what it measures)
        s.update(devices_per_node=1, device_memory_gb=70, device_tflops=400.0)
        s.update(device_mem_bw_gb_per_s=2000.0, intra_bandwidth_gbps=400.0)
    doc["model"]["hf"] = str(model)
    doc["training"].update(precision=precision, steps=steps, global_batch_size=32)
    doc["training"]["checkpoint"] = {"every_steps": 0, "keep": 1}
    doc["plan"].update(pipelines=1, micro_batch_size=4, seq_len=256, codecs=["none"])
    doc["links"][0]["codec"] = "none"
    if precision == "fp16":
        # fp16 runs on one-stage pipelines only (runtime.control.cluster.check_precision:
        # the stages' loss scalers are not kept in step): the first site alone
        doc["sites"], doc["links"] = doc["sites"][:1], []
    return doc


def check(precision: str, model: Path, steps: int, gpus: int, tmp: Path) -> dict:
    spec = spec_of(doc_for(precision, model, steps, gpus))
    ctl = Controller(spec, LaunchOptions(run_dir=str(tmp / precision), progress=False))
    try:
        ctl.launch()
        res = ctl.train()
        import ray

        peaks = ray.get(
            [
                a.__ray_call__.remote(
                    lambda self: (
                        torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
                    )
                )
                for a in ctl.flat_actors()
            ]
        )
        predicted = ctl.predicted.peak_memory_bytes
        forecast_s = ctl.predicted_s
    finally:
        ctl.close()
    steady = res.steps[len(res.steps) // 3 :]
    measured = sum(m.tokens for m in steady) / sum(m.iteration_time_s for m in steady)
    tokens_per_step = spec.training.global_batch_size * ctl.plan.seq_len
    losses = [m.loss for m in res.steps]
    ratios = [p / q for p, q in zip(peaks, predicted, strict=True)]
    for k, (p, q) in enumerate(zip(peaks, predicted, strict=True)):
        print(f"{precision} stage {k}: peak {p / 2**30:.2f} GiB, predicted {q / 2**30:.2f} GiB")
    print(f"{precision}: {measured:,.0f} tokens/s, forecast {tokens_per_step / forecast_s:,.0f}")
    return {
        f"{precision}_peak_memory_over_predicted": max(ratios),
        f"{precision}_tokens_per_s_over_forecast": measured / (tokens_per_step / forecast_s),
        f"{precision}_final_loss": losses[-1],
        f"{precision}_losses_finite": all(math.isfinite(x) for x in losses),
        f"{precision}_loss_fell": losses[-1] < losses[0],
    }


def outer_doc(model: Path, steps: int, gpus: int, h: int) -> dict:
    """The bf16 check's run as an outer loop: one group per site, each one stage actor."""
    doc = doc_for("bf16", model, steps, gpus)
    doc["name"] = "gpu-check-outer"
    doc["plan"].update(
        strategy="outer",
        calibrate=False,
        outer={"h": h, "codec": "none", "lr": 0.7, "momentum": 0.9},
    )
    return doc


def penalty_table(tmp: Path, h: int) -> Path:
    """A loss-penalty table with the one row this run's outer plan needs priced (the check
    is of the runtime, not of the planner's choice)."""
    row = {"replicas": 2, "h": h, "fragments": 1, "codec": "none", "rel_gap": 0.01}
    row.update(outer_lr=0.7, outer_momentum=0.9)
    doc = {"source": "gpu_check", "model": "llama-gpu", "steps": 1, "tokens_per_step": 1}
    path = tmp / "penalty.json"
    path.write_text(json.dumps({**doc, "sync_noise": 0.0, "rows": [row]}))
    return path


def check_outer(model: Path, steps: int, gpus: int, tmp: Path) -> dict:
    """The outer loop on the device: losses finite, theta_global equal in both groups."""
    h = max(1, steps // 6)
    steps -= steps % h  # the last round must end with the run
    os.environ["GEOPIPE_LOSS_PENALTY"] = str(penalty_table(tmp, h))
    spec = spec_of(outer_doc(model, steps, gpus, h))
    run_dir = tmp / "outer"
    ctl = Controller(spec, LaunchOptions(run_dir=str(run_dir), progress=False))
    try:
        ctl.launch()
        if ctl.plan.num_groups != 2 or ctl.outer is None:
            raise RuntimeError(f"expected an outer loop of 2 groups, got {ctl.plan.num_groups}")
        res = ctl.train()
    finally:
        ctl.close()
    losses = [m.loss for m in res.steps]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if x.get("event") == "outer_round"]
    print(f"outer: {len(rounds)} rounds of H={h}, losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    return {
        "outer_final_loss": losses[-1],
        "outer_losses_finite": all(math.isfinite(x) for x in losses),
        "outer_rounds": len(rounds),
        "outer_rounds_expected": steps // h,
        "outer_digests_equal": bool(rounds) and all(r["digests_equal"] for r in rounds),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rehearse", action="store_true", help="the same path on CPU, bf16 only")
    ap.add_argument("--keep", type=Path, help="keep each run's directory (metrics.jsonl) here")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.rehearse:
        why = "torch.cuda.is_available() is False on this machine"
        print(f"gpu_check: no CUDA device ({why}); nothing was run", file=sys.stderr)
        print(json.dumps({"cuda": False, "why": why}))
        return 2
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # as the tests: Ray reads it at import
    import ray

    gpus = torch.cuda.device_count()
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="geopipe-gpu-"))
    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="ERROR",
        num_gpus=gpus,
        resources={"site:east": 1, "site:west": 1},
    )
    device = torch.cuda.get_device_name(0) if gpus else "cpu (rehearsal)"
    precisions = ("bf16", "fp16") if gpus else ("bf16",)
    out: dict = {"cuda": bool(gpus), "device": device, "gpus": gpus}
    try:
        model = model_dir(tmp, wide=bool(gpus))
        checks = [(p, check, (p, model, args.steps, gpus, tmp)) for p in precisions]
        checks.append(("outer", check_outer, (model, args.steps, gpus, tmp)))
        for name, fn, fn_args in checks:
            try:
                out.update(fn(*fn_args))
            except Exception as exc:  # the next checks still run; the traceback is printed
                traceback.print_exc()
                out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        ray.shutdown()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))
    return 1 if any(k.endswith("_error") for k in out) else 0


if __name__ == "__main__":
    sys.exit(main())
