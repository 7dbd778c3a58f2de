"""Shared pieces of benchmarks/outer_loop.py: the job every part trains, its YAML, and what
a run's metrics say about it.

The job is the one the shipped loss-penalty table was measured on (benchmarks/
outer_penalty.py), so the planner's penalty for it is that table's and the gaps measured
here can be compared with it: the demo GPT (4 layers, n_embd 128, 4 heads, byte vocabulary
256), a global batch of 16 sequences of 64 bytes, Adam lr 3e-3 (warm-up over 5 % of the
steps, then a half cosine), the stdlib corpus's first 3.6 MB for training and the next
0.4 MB held out (outer_penalty.py's 90 / 10 split of its first 4 MB).
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH, MICRO_BATCH, SEQ = 16, 8, 64
TRAIN_BYTES, CORPUS_BYTES = 3_600_000, 4_000_000
EVAL_SAMPLES, EVAL_SEED = 256, 12345
# The outer settings the runs use when the caller names none (plan.outer's own keys).
OUTER_KEYS = ("h", "fragments", "overlap", "codec", "lr", "momentum")


def job_doc(
    name: str,
    steps: int,
    sites: tuple[str, ...] = ("east", "west"),
    latency_ms: float = 40.0,
    rate_mbit: float = 50.0,
    seed: int = 0,
) -> dict:
    """clusters/local-2dc.yaml with one device per site and the job above, strategy
    pipeline (callers set ``plan.strategy`` and ``plan.outer``). One site: no link."""
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text()))
    doc["name"] = name
    doc["ray"]["dashboard"] = False  # its processes blur timings on 2 cores
    doc["sites"] = [s for s in doc["sites"] if s["name"] in sites]
    for s in doc["sites"]:
        s["devices_per_node"] = 1
    if len(sites) == 1:
        doc["links"] = []
    else:
        doc["links"][0].update(latency_ms=latency_ms, bandwidth_gbps=rate_mbit / 1e3, codec="none")
    doc["training"].update(
        global_batch_size=GLOBAL_BATCH,
        steps=steps,
        warmup_steps=max(1, steps // 20),
        seed=seed,
        data_max_bytes=TRAIN_BYTES,
        checkpoint={"every_steps": 0, "keep": 1},
    )
    doc["plan"].update(
        pipelines=1,
        micro_batch_size=MICRO_BATCH,
        seq_len=SEQ,
        codecs=["none", "int8"],
        delta_n={"min": 0, "max": 16},
    )
    return doc


def outer_doc(name: str, steps: int, outer: dict, strategy: str = "outer", **link) -> dict:
    """The two-site job as an outer loop (``outer``: plan.outer's keys, values or lists)."""
    doc = job_doc(name, steps, **link)
    doc["plan"].update(strategy=strategy, outer=dict(outer))
    return doc


def metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step lines, event lines) of a run's metrics.jsonl."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "event" not in x], [x for x in lines if "event" in x]


def wall_per_step(steps: list[dict], skip: int) -> float | None:
    """Wall time per inner step after the first ``skip`` steps: the span between step
    completions over the steps counted, so the outer rounds' applies, the controller's own
    work and any wait between steps count (an iteration's ``iteration_time_s`` leaves them
    out)."""
    done = [s["completed_at"] for s in steps if s["step"] >= skip - 1]
    if len(done) < 2:
        return None
    return (done[-1] - done[0]) / (len(done) - 1)


def forecast_error(steps: list[dict], skip: int) -> float | None:
    """The median of |the controller's forecast of a step / the step - 1| after ``skip``."""
    errs = [
        abs(s["predicted_iteration_time_s"] / s["iteration_time_s"] - 1)
        for s in steps
        if s["step"] >= skip and s.get("predicted_iteration_time_s")
    ]
    return statistics.median(errs) if errs else None


def held_out_loss(params: dict, model_doc: dict) -> float:
    """The final weights' mean loss over EVAL_SAMPLES fixed held-out windows (the bytes after
    the training corpus), the measure outer_penalty.py uses."""
    import torch

    from geopipe.model.data import Corpus, TokenStream
    from geopipe.model.gpt import GPTConfig, GPTStage, lm_loss, num_layers

    cfg = GPTConfig(
        n_layer=model_doc["n_layer"],
        n_embd=model_doc["n_embd"],
        n_head=model_doc["n_head"],
        vocab_size=model_doc["vocab_size"],
        block_size=model_doc["max_seq_len"],
    )
    model = GPTStage(cfg, 0, num_layers(cfg), seed=0)
    own = dict(model.named_parameters())
    missing = set(own) - set(params)
    if missing:
        raise ValueError(f"the run's state lacks {sorted(missing)[:3]}")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(params[k].to(p.dtype).reshape(p.shape))
    tokens = Corpus("stdlib", max_bytes=CORPUS_BYTES).tokens
    held = Corpus.from_bytes(tokens[TRAIN_BYTES:].tobytes(), "stdlib held out")
    stream, total = TokenStream(held, EVAL_SEED), 0.0
    with torch.no_grad():
        for start in range(0, EVAL_SAMPLES, 32):
            x, y = stream.batch(range(start, start + 32), SEQ)
            total += float(lm_loss(model(x), y)) * 32
    return total / EVAL_SAMPLES
