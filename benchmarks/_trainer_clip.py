"""Issue 32's global clipping and LR schedule figures, for ``benchmarks/trainer.py``.

* :func:`global_clip_parity`: ``global_clip_parity_max_abs_loss_diff``, a tied Hugging Face
  Llama pipelined over two emulated sites (the real runtime; the tied embedding split over
  the sites, counted once in the norm) with ``grad_clip`` 0.05, which clips on every step,
  against `transformers` in one process with ``clip_grad_norm_`` on the same batches, 10
  steps (target <= 1e-5).
* :func:`lr_schedule_diffs`: ``lr_schedule_max_abs_diff``, the LR each step's metrics line
  logs for every ``training.lr_schedule`` against `transformers`' scheduler of the same name
  stepping a torch optimizer, over the YAML's horizon and past it (held at the minimum LR),
  target <= 1e-9.

Both need an embedded Ray with sites ``east`` and ``west`` running (``trainer.py`` starts
one); run alone: ``.venv/bin/python benchmarks/_trainer_clip.py`` (about 3 minutes).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from _common import run, spec_of, two_site_doc

# tests/_hfdoc.py: the Llama, document and reference of tests/integration/
# test_trainer_runtime.py's clipping test, built once
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _hfdoc import LLAMA, clipped_reference, two_site_hf_doc

# geopipe's name -> (transformers' name, its scheduler_specific_kwargs) for lr 0.01
SCHEDULES = {
    "cosine": ("cosine_with_min_lr", {"min_lr": 0.001}),
    "linear": ("linear", None),
    "constant": ("constant_with_warmup", None),
    "wsd": ("warmup_stable_decay", {"num_decay_steps": 2, "min_lr_ratio": 0.1}),
}


def _doc(name: str, steps: int) -> dict:
    doc = two_site_doc(name, latency_ms=5.0, bandwidth_gbps=1.0, micro_batches=4)
    doc["training"].update(steps=steps, lr=0.01, warmup_steps=1, data_max_bytes=200_000)
    doc["plan"].update(micro_batch_size=2, seq_len=32, schedule="1f1b", delta_n=0)
    doc["training"]["global_batch_size"] = 8
    return doc


def global_clip_parity(tmp: Path, steps: int = 10) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model_dir = tmp / "clip-llama"
    config = LlamaConfig(**LLAMA, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    no_ckpt = {"every_steps": 0, "keep": 1}
    doc = two_site_hf_doc(
        "bench-global-clip", model_dir, steps=steps, grad_clip=0.05, checkpoint=no_ckpt
    )
    _, res, _ = run(spec_of(doc), steps, tmp / "clip-run")
    ref, _ = clipped_reference(doc, model_dir)
    return {
        "global_clip_parity_max_abs_loss_diff": max(
            abs(m.loss - r) for m, r in zip(res.steps, ref, strict=True)
        ),
        "global_clip_min_norm_over_clip": min(m.grad_norm for m in res.steps) / 0.05,
    }


def _library_lrs(name: str, kw: dict | None, horizon: int, steps: int) -> list[float]:
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    sched = get_scheduler(name, opt, 1, horizon, scheduler_specific_kwargs=kw)
    out = []
    for _ in range(horizon):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    final = {"constant_with_warmup": 0.01, "linear": 0.0}.get(name, 0.001)
    return out + [final] * (steps - horizon)


def lr_schedule_diffs(tmp: Path, horizon: int = 6, steps: int = 8) -> dict[str, float]:
    worst: dict[str, float] = {}
    for ours, (name, kw) in SCHEDULES.items():
        doc = _doc(f"bench-lr-{ours}", horizon)
        doc["training"]["lr_schedule"] = ours
        if ours == "cosine":
            doc["training"]["min_lr"] = 0.001
        if ours == "wsd":
            doc["training"].update(min_lr=0.001, wsd_decay_steps=2)
        _, res, _ = run(spec_of(doc), steps, tmp / f"lr-{ours}")
        want = _library_lrs(name, kw, horizon, steps)
        worst[ours] = max(abs(m.lr - w) for m, w in zip(res.steps, want, strict=True))
    return {"lr_schedule_max_abs_diff": max(worst.values())} | {
        f"lr_schedule_abs_diff_{k}": v for k, v in worst.items()
    }


def main() -> None:
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="geopipe-clip-"))
    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="ERROR",
        resources={"site:east": 2, "site:west": 2},
    )
    try:
        print(json.dumps(global_clip_parity(tmp) | lr_schedule_diffs(tmp)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
