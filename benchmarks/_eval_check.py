"""``eval_loss_abs_diff_vs_transformers`` (issue 32, item 3): held-out evaluation through the
pipeline against `transformers` on the same batches.

A tied Llama written with ``save_pretrained`` trains 3 steps across two emulated sites (the
real runtime: Ray actors, DeepSpeed ZeRO-1, the direct data plane, codec none, fp32) with
``training.eval`` after every step on the held-out tail of the training data; the run is
exported (``geopipe export``) and `transformers` evaluates the same held-out micro-batches
with the exported weights. The figure is the largest absolute difference of the final
evaluation's loss (target <= 1e-5). ``benchmarks/trainer.py`` may call
:func:`eval_vs_transformers`; run alone, this prints one JSON line.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from geopipe.cli import main as cli
from geopipe.config import parse_cluster
from geopipe.model.data import TokenStream, open_corpus
from geopipe.model.gpt import lm_loss
from geopipe.runtime.actor.evaluate import EVAL_SEED_SALT, eval_samples, split_corpus
from geopipe.runtime.control.controller import Controller, LaunchOptions

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
SITE = {
    "nodes": 1,
    "devices_per_node": 1,
    "device_memory_gb": 2,
    "device_tflops": 0.05,
    "device_efficiency": 0.5,
    "device_mem_bw_gb_per_s": 10,
}


def _doc(model_dir: Path, batches: int) -> dict:
    # fmt: off
    return {
        "name": "bench-eval",
        "ray": {"address": "local", "emulate_links": True},
        "sites": [{"name": "east", **SITE}, {"name": "west", **SITE}],
        "links": [{"from": "east", "to": "west", "bandwidth_gbps": 1.0, "latency_ms": 5,
                   "codec": "none"}],
        "model": {"hf": str(model_dir)},
        "training": {"global_batch_size": 8, "steps": 3, "lr": 0.01, "warmup_steps": 1,
                     "data": "stdlib", "data_max_bytes": 200_000,
                     "eval": {"every_steps": 1, "batches": batches, "holdout": 0.1}},
        "plan": {"schedule": "1f1b", "pipelines": 1, "micro_batch_size": 2, "seq_len": 64,
                 "codecs": ["none"], "calibrate": False, "delta_n": 0},
    }
    # fmt: on


def eval_vs_transformers(tmp: Path, batches: int = 2) -> dict[str, float]:
    torch.manual_seed(0)
    model_dir = tmp / "model"
    AutoModelForCausalLM.from_config(LlamaConfig(**SMALL)).save_pretrained(model_dir)
    doc = _doc(model_dir, batches)
    ctl = Controller(
        parse_cluster(doc, "bench"), LaunchOptions(run_dir=str(tmp / "run"), progress=False)
    )
    try:
        ctl.launch()
        ctl.train()
        evals = list(ctl.evals.results)
    finally:
        ctl.close()
    if cli(["export", str(tmp / "run"), "--out", str(tmp / "hf")]) != 0:
        raise RuntimeError("geopipe export failed")
    model = AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    _, held = split_corpus(open_corpus("stdlib", max_bytes=200_000), 0.1, 64)
    stream = TokenStream(held, EVAL_SEED_SALT)
    with torch.no_grad():
        want = [
            lm_loss(model(input_ids=x).logits, y).item()
            for x, y in (stream.batch(mb, 64) for mb in eval_samples(8 * batches, 2, 1, 0))
        ]
    ref = sum(want) / len(want)
    return {
        "eval_loss_abs_diff_vs_transformers": abs(evals[-1]["eval_loss"] - ref),
        "eval_loss_final": evals[-1]["eval_loss"],
        "eval_loss_first": evals[0]["eval_loss"],
        "eval_micro_batches": float(evals[-1]["micro_batches"]),
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(eval_vs_transformers(Path(d))))
