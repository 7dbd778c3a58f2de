"""A tiny Hugging Face Llama pipelined over two emulated sites: the launch document and the
`transformers` reference with global clipping, shared by the integration tests
(test_hf_runtime, test_eval_runtime, test_trainer_runtime) and the trainer benchmarks
(benchmarks/_trainer_clip.py, benchmarks/_eval_check.py), so that a figure a benchmark
reports and the check a test asserts are made on one setup, built in one place.

Importing this module imports neither geopipe nor torch (the benchmarks put tests/ on
``sys.path`` to import it); :func:`clipped_reference` imports them when called.
"""

from __future__ import annotations

from pathlib import Path

# The Llama every one of them trains (GQA: 4 heads, 2 key-value heads); callers add
# ``tie_word_embeddings`` and any other override.
LLAMA = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
SITE = {
    "nodes": 1,
    "devices_per_node": 1,
    "device_memory_gb": 2,
    "device_tflops": 0.05,
    "device_efficiency": 0.5,
    "device_mem_bw_gb_per_s": 10,
}


def two_site_hf_doc(
    name: str,
    model_dir: Path,
    *,
    steps: int = 3,
    precision: str = "fp32",
    seq_len: int = 32,
    data_max_bytes: int = 200_000,
    **training,
) -> dict:
    """Two sites of one device each, one 1F1B pipeline of two stages (4 micro-batches of 2
    a step), codec none, on the built-in stdlib data; ``training`` keys (``eval``,
    ``grad_clip``, ``checkpoint``, ...) are added to the document's ``training``."""
    # fmt: off
    return {
        "name": name,
        "ray": {"address": "local", "emulate_links": True},
        "sites": [{"name": "east", **SITE}, {"name": "west", **SITE}],
        "links": [{"from": "east", "to": "west", "bandwidth_gbps": 1.0, "latency_ms": 5,
                   "codec": "none"}],
        "model": {"hf": str(model_dir)},
        "training": {"global_batch_size": 8, "steps": steps, "lr": 0.01, "warmup_steps": 1,
                     "precision": precision, "data": "stdlib", "data_max_bytes": data_max_bytes,
                     **training},
        "plan": {"schedule": "1f1b", "pipelines": 1, "micro_batch_size": 2, "seq_len": seq_len,
                 "codecs": ["none"], "calibrate": False, "delta_n": 0},
    }
    # fmt: on


def clipped_reference(doc: dict, model_dir: Path) -> tuple[list[float], list[float]]:
    """`transformers` in one process on ``doc``'s batches, ``clip_grad_norm_`` every step:
    each step's mean loss and (pre-clip) global gradient norm, with torch Adam and the LR
    schedule as the YAML says (transformers' cosine over its steps)."""
    import torch
    from transformers import AutoModelForCausalLM, get_scheduler

    from geopipe.config import parse_cluster
    from geopipe.model.data import TokenStream, global_indices, open_corpus
    from geopipe.model.gpt import lm_loss

    spec = parse_cluster(doc, "ref")
    t, pl = spec.training, spec.plan
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.Adam(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps)
    sched = get_scheduler("cosine", opt, t.warmup_steps, t.steps)
    stream = TokenStream(open_corpus(t.data, max_bytes=t.data_max_bytes), t.seed)
    b, s = pl.micro_batch_size, pl.seq_len
    micro = t.global_batch_size // b
    losses, norms = [], []
    for step in range(t.steps):
        opt.zero_grad()
        total = 0.0
        for mb in range(micro):
            x, y = stream.batch(global_indices(step, t.global_batch_size, 0, 1, mb, b), s)
            loss = lm_loss(model(input_ids=x).logits, y)
            (loss / micro).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        opt.step()
        sched.step()
        losses.append(total / micro)
    return losses, norms
