"""What a trainer user checks beyond the pipeline (issue 32): each figure is one function
returning a dict of named results, ``main`` runs them and ends with one JSON line.

Activation recompute (``training.recompute``):

* ``recompute_loss_max_abs_diff``: the demo GPT pipelined over two emulated sites (the real
  runtime: Ray actors, DeepSpeed ZeRO-1, the WAN emulator), 5 steps with ``recompute: full``
  against the same run without it, under 1F1B and under ZB-H1's split backward; the largest
  per-step loss difference of the two schedules (target <= 1e-6; measured 0: the recomputed
  forward runs the same kernels on the same inputs).
* ``recompute_peak_activation_ratio``: a stage module alone (four decoder blocks of the demo
  GPT, and of a small Llama built from `transformers`' modules), forward and backward of one
  micro-batch of 8 × 128 tokens, with full recompute against none; the larger of the two
  ratios (target <= 0.6). Measured with :class:`LiveTensorBytes`, see its docstring for why
  that and not a process-level figure. The planner's prediction for the same stage
  (:mod:`geopipe.optimizer.memory`) is printed beside it.

Global clipping, the LR schedules and held-out evaluation (``benchmarks/_trainer_clip.py``,
``benchmarks/_eval_check.py``): ``global_clip_parity_max_abs_loss_diff`` (a 2-site pipelined
tied Llama with clipping active every step against `transformers` + ``clip_grad_norm_`` in
one process, 10 steps; target <= 1e-5), ``lr_schedule_max_abs_diff`` (the logged LR of each
schedule against `transformers`' scheduler of the same name; target <= 1e-9) and
``eval_loss_abs_diff_vs_transformers`` (target <= 1e-5).

Run: ``.venv/bin/python benchmarks/trainer.py`` (several minutes on 2 CPU cores).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from _common import json_line, run, spec_of, two_site_doc
from _eval_check import eval_vs_transformers
from _trainer_clip import global_clip_parity, lr_schedule_diffs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from geopipe.model.family import ModelDesc, build_stage
from geopipe.model.gpt import GPTConfig
from geopipe.optimizer.memory import stage_memory

BATCH, SEQ = 8, 128
LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
}


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensors the ops run under it create that are still alive, and their
    peak: each op's outputs are counted once per storage and uncounted when that storage
    is freed (a weakref finalizer on the storage, whose Python object torch keeps while
    the storage lives).

    Why this and not the process's memory: torch has no allocator statistics for the CPU
    (``torch.cuda.max_memory_allocated`` is CUDA's), RSS moves with glibc's caching and
    with everything else in the process, and ``saved_tensors_hooks`` see only what autograd
    saves outside a checkpoint (a checkpointed block installs its own hooks, so they would
    miss what the checkpoint keeps and everything the recompute rebuilds). Counting every
    tensor the forward and the backward create (activations, recomputed ones, gradients,
    temporaries) is what a caching GPU allocator's peak would see above the weights; the
    backward runs on this thread on the CPU, so its ops pass through the mode too."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._live:
                    self._live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._freed, key)
        return out


def _stage_peak(desc: ModelDesc, recompute: str) -> int:
    """Peak live bytes of one forward and backward of blocks 1-4 (a middle stage)."""
    stage = build_stage(desc, 1, 5, seed=0, recompute=recompute)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, SEQ, desc.hidden, generator=gen, requires_grad=True)
    grad = torch.randn(BATCH, SEQ, desc.hidden, generator=gen)
    meter = LiveTensorBytes()
    with meter:
        stage(x).backward(grad)
    return meter.peak


def _predicted(model: Any, recompute: str) -> float:
    """The planner's activation memory for the same stage and one micro-batch in flight."""
    mem = stage_memory(model, "fp32", (1, 5), 1, BATCH, SEQ, 1, recompute=recompute)
    return mem.activations + mem.recompute


def _shapes() -> dict[str, tuple[ModelDesc, Any]]:
    """Per model: what builds its stage, and the shape the planner's formulas read."""
    gpt = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 256}
    llama = SimpleNamespace(
        family="llama",
        n_layer=4,
        n_embd=LLAMA["hidden_size"],
        n_head=LLAMA["num_attention_heads"],
        n_kv_head=LLAMA["num_key_value_heads"],
        head_dim=None,
        intermediate_size=LLAMA["intermediate_size"],
        vocab_size=LLAMA["vocab_size"],
        max_seq_len=SEQ,
        tie_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    return {
        "gpt": (
            ModelDesc.from_gpt(GPTConfig(**gpt, block_size=SEQ)),
            SimpleNamespace(**gpt, max_seq_len=SEQ),
        ),
        "llama": (ModelDesc.from_hf(dict(LLAMA)), llama),
    }


def recompute_memory() -> dict[str, float]:
    """Measured peak activation memory of a stage, full recompute over none, per model;
    the headline is the larger ratio."""
    out: dict[str, float] = {}
    for name, (desc, shape) in _shapes().items():
        none, full = _stage_peak(desc, "none"), _stage_peak(desc, "full")
        out[f"recompute_{name}_peak_bytes_none"] = none
        out[f"recompute_{name}_peak_bytes_full"] = full
        out[f"recompute_{name}_peak_activation_ratio"] = full / none
        predicted = _predicted(shape, "full") / _predicted(shape, "none")
        out[f"recompute_{name}_predicted_ratio"] = predicted
        print(
            f"{name}: peak activation bytes {none:,} without recompute, {full:,} with: "
            f"x{full / none:.3f} (the planner predicts x{predicted:.3f})"
        )
    out["recompute_peak_activation_ratio"] = max(
        out[f"recompute_{n}_peak_activation_ratio"] for n in _shapes()
    )
    return out


def recompute_losses(tmp: Path, steps: int = 5) -> dict[str, float]:
    """Per-step losses of the pipelined demo with full recompute against none, per schedule."""
    out: dict[str, float] = {}
    for schedule in ("1f1b", "zb-h1"):
        losses = {}
        for setting in ("none", "full"):
            doc = two_site_doc(f"rc-{schedule}-{setting}", 5.0, 1.0, micro_batches=4)
            doc["training"]["recompute"] = setting
            _, res, _ = run(spec_of(doc), steps, tmp / doc["name"], schedule=schedule)
            losses[setting] = [m.loss for m in res.steps]
        diff = max(abs(a - b) for a, b in zip(losses["none"], losses["full"], strict=True))
        out[f"recompute_{schedule.replace('-', '_')}_loss_max_abs_diff"] = diff
        print(f"{schedule}: {steps} steps, max |loss(full) - loss(none)| = {diff:.2e}")
    out["recompute_loss_max_abs_diff"] = max(out.values())
    return out


def main() -> None:
    import ray

    result = recompute_memory()
    tmp = Path(tempfile.mkdtemp(prefix="geopipe-trainer-"))
    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="ERROR",
        resources={"site:east": 2, "site:west": 2},
    )
    try:
        result.update(recompute_losses(tmp))
        result.update(global_clip_parity(tmp / "clip"))  # item 1 (benchmarks/_trainer_clip.py)
        result.update(lr_schedule_diffs(tmp / "lr"))  # item 2
        result.update(eval_vs_transformers(tmp / "eval"))  # item 3 (benchmarks/_eval_check.py)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json_line(result))


if __name__ == "__main__":
    main()
