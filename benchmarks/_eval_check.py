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
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

# tests/_hfdoc.py: the document tests/integration/test_eval_runtime.py launches, built once
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _hfdoc import LLAMA, two_site_hf_doc

from geopipe.cli import main as cli
from geopipe.config import parse_cluster
from geopipe.model.data import TokenStream, open_corpus
from geopipe.model.gpt import lm_loss
from geopipe.runtime.actor.evaluate import EVAL_SEED_SALT, eval_samples, split_corpus
from geopipe.runtime.control.controller import Controller, LaunchOptions

# tests/_hfdoc.py's Llama, twice as wide and deep, its embedding tied
SMALL = {
    **LLAMA,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "tie_word_embeddings": True,
}


def _doc(model_dir: Path, batches: int) -> dict:
    eval_ = {"every_steps": 1, "batches": batches, "holdout": 0.1}
    return two_site_hf_doc("bench-eval", model_dir, seq_len=64, eval=eval_)


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
