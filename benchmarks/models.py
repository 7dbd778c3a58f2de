"""Real models on real data: what the Hugging Face path costs and how exact it is.

Settings, in one process sharing one embedded Ray (two emulated sites, 25 ms / 200 Mbit/s):

1. **Parity**: a tiny tied Llama (GQA) trained 10 steps across the two sites (one stage
   each, fp32, codec none) against `transformers` trained in this process on the same
   batches with torch Adam: the largest per-step loss difference.
2. **Export round trip**: `geopipe export` of that run, loaded with `transformers`: its loss
   on a held-out batch against geopipe's own model loaded from the same checkpoint, and
   against the untrained model's.
3. **bf16 vs fp32**: clusters/llama-tiny-2dc.yaml (1.3 M-parameter Llama, stdlib-bpe data,
   2 pipelines × 2 stages, micro-batch 1, ΔN 4, codec none) for 60 steps in each
   precision: final-loss
   relative difference, WAN bytes ratio, activation bytes ratio, tokens/s of each.
4. **Single process**: the same Llama trained by `transformers` alone in this process on
   the same 60 steps of batches (torch Adam, same schedule, fp32): tokens/s, and the
   pipelined run's over it. On this 2-core host four stage actors share two cores and an
   emulated 25 ms WAN link, so the ratio says what the machinery costs here, not what
   sites add on real devices.
5. **prepare-data**: `benchmarks/prepare_data.py`'s measurement on 20 MB of JSONL.

Run: ``.venv/bin/python benchmarks/models.py`` (about 4 minutes on a quiet 2-core machine).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import yaml
from _common import ROOT, json_line, run, spec_of

sys.path.insert(0, str(ROOT / "tests"))
from _hfdoc import LLAMA
from prepare_data import write_jsonl
from transformers import AutoModelForCausalLM, LlamaConfig

from geopipe.cli.commands import export_run
from geopipe.model.builtin import ensure_stdlib_bpe
from geopipe.model.data import TokenStream, global_indices, open_corpus
from geopipe.model.gpt import lm_loss
from geopipe.model.prepare import default_processes, prepare_data
from geopipe.runtime.actor.lr import lr_factor

SMALL = {**LLAMA, "tie_word_embeddings": True}  # the tests' Llama (tests/_hfdoc.py), tied


def reference(spec, plan, model: torch.nn.Module, steps: int) -> tuple[list[float], float]:
    """`transformers` alone on the batches ``plan`` trains on (every pipeline's
    micro-batches, the same global sample indices): per-step mean loss and tokens/s."""
    t, pl = spec.training, plan
    opt = torch.optim.Adam(model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, partial(lr_factor, warmup_steps=t.warmup_steps, total_steps=t.steps)
    )
    stream = TokenStream(open_corpus(t.data, max_bytes=t.data_max_bytes), t.seed)
    b, s = pl.micro_batch_size, pl.seq_len
    d = pl.pipelines
    micro = t.global_batch_size // d // b
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        opt.zero_grad()
        step_losses = []
        for r in range(d):
            for mb in range(micro):
                x, y = stream.batch(global_indices(step, t.global_batch_size, r, d, mb, b), s)
                loss = lm_loss(model(input_ids=x).logits, y)
                (loss / (micro * d)).backward()
                step_losses.append(loss.item())
        opt.step()
        sched.step()
        losses.append(sum(step_losses) / len(step_losses))
    tokens = steps * t.global_batch_size * pl.seq_len
    return losses, tokens / (time.perf_counter() - t0)


def parity(tmp: Path) -> dict:
    torch.manual_seed(0)
    model_dir = tmp / "tiny-llama"
    AutoModelForCausalLM.from_config(LlamaConfig(**SMALL)).save_pretrained(model_dir)
    doc = yaml.safe_load((ROOT / "clusters" / "local-2dc.yaml").read_text())
    doc.update(name="parity", model={"hf": str(model_dir)})
    doc["ray"]["dashboard"] = False
    for s in doc["sites"]:
        s["devices_per_node"] = 1
    doc["training"].update(
        global_batch_size=8, steps=10, lr=0.01, warmup_steps=1, data_max_bytes=200_000
    )
    doc["training"]["checkpoint"] = {"every_steps": 0, "keep": 1}
    doc["plan"] = {
        "schedule": "1f1b",
        "pipelines": 1,
        "micro_batch_size": 2,
        "seq_len": 32,
        "codecs": ["none"],
        "calibrate": False,
        "delta_n": 0,
    }
    spec = spec_of(doc)
    ctl, res, _ = run(spec, 10, tmp / "parity")
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_model.config._attn_implementation = "sdpa"
    ref, _ = reference(spec, ctl.plan, ref_model, 10)
    loss_diff = max(abs(m.loss - r) for m, r in zip(res.steps, ref, strict=True))
    export_run(str(tmp / "parity"), str(tmp / "parity-hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp / "parity-hf")
    stream = TokenStream(open_corpus("stdlib", max_bytes=None), seed=12345)  # held out
    x, y = stream.batch(list(range(8)), 32)
    with torch.no_grad():
        hf_loss = lm_loss(exported(input_ids=x).logits, y).item()
        untrained = AutoModelForCausalLM.from_pretrained(model_dir)
        untrained_loss = lm_loss(untrained(input_ids=x).logits, y).item()
    ours = geopipe_eval(tmp / "parity", x, y)
    print(
        f"held-out loss: exported {hf_loss:.6f}, geopipe's stages on the checkpoint "
        f"{ours:.6f}, untrained {untrained_loss:.6f}"
    )
    return {
        "hf_parity_max_abs_loss_diff": loss_diff,
        "export_roundtrip_max_abs_loss_diff": abs(hf_loss - ours),
        "export_trained_over_untrained_loss": hf_loss / untrained_loss,
    }


def geopipe_eval(run_dir: Path, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss geopipe's own model (all layers in one stage) computes with the run's
    newest checkpoint's weights."""
    from geopipe.checkpoint.store import load_checkpoint
    from geopipe.cli.commands import _find_checkpoint
    from geopipe.model.family import ModelDesc, build_stage

    ckpt = load_checkpoint(_find_checkpoint(run_dir, None))
    params: dict = {}
    for shard in ckpt.stages:
        params.update(shard.tensors("params/"))
    desc = ModelDesc.from_hf(ckpt.manifest["model"]["hf_config"])
    stage = build_stage(desc, 0, desc.num_layers, seed=0, load_weights=False)
    state = stage.state_dict()
    state.update({k: params[k] for k in state})
    stage.load_state_dict(state)
    with torch.no_grad():
        return lm_loss(stage(x), y).item()


def demo_doc(precision: str) -> dict:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "clusters" / "llama-tiny-2dc.yaml").read_text()))
    doc["name"] = f"llama-tiny-{precision}"
    doc["ray"]["dashboard"] = False
    doc["model"]["hf"] = str(ROOT / "clusters" / "models" / "llama-tiny")
    doc["training"]["precision"] = precision
    doc["training"]["checkpoint"] = {"every_steps": 0, "keep": 1}
    # One plan for both precisions (the planner prices bf16 differently and could pick
    # another micro-batch or ΔN), codec none: the bytes compared are the dtype's.
    doc["links"][0]["codec"] = "none"
    doc["plan"].update(micro_batch_size=1, delta_n=4, codecs=["none"])
    return doc


def precision_and_single(tmp: Path) -> dict:
    out: dict = {}
    runs = {}
    for precision in ("fp32", "bf16"):
        spec = spec_of(demo_doc(precision))
        ctl, res, _ = run(spec, spec.training.steps, tmp / precision)
        plan = ctl.plan
        steady = res.steps[5:]
        runs[precision] = {
            "final_loss": res.steps[-1].loss,
            "tokens_per_s": sum(m.tokens for m in steady) / sum(m.iteration_time_s for m in steady),
            "wan_bytes": sum(m.wan_bytes for m in res.steps),
            "activation_bytes": sum(res.steps[-1].peak_activation_bytes),
        }
        print(
            f"{precision}: final loss {runs[precision]['final_loss']:.4f}, "
            f"{runs[precision]['tokens_per_s']:,.0f} tokens/s"
        )
    f, b = runs["fp32"], runs["bf16"]
    out["bf16_final_loss_rel_diff"] = abs(b["final_loss"] - f["final_loss"]) / f["final_loss"]
    out["bf16_wan_bytes_ratio"] = b["wan_bytes"] / f["wan_bytes"]
    out["bf16_activation_bytes_ratio"] = b["activation_bytes"] / f["activation_bytes"]
    out["bf16_tokens_per_s_over_fp32"] = b["tokens_per_s"] / f["tokens_per_s"]
    spec = spec_of(demo_doc("fp32"))
    cfg = json.loads((ROOT / "clusters" / "models" / "llama-tiny" / "config.json").read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg))
    model.config._attn_implementation = "sdpa"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the whole machine, as the four actors share it
    try:
        losses, single = reference(spec, plan, model, spec.training.steps)
    finally:
        torch.set_num_threads(threads)
    out["single_process_tokens_per_s"] = single
    out["single_process_final_loss"] = losses[-1]
    out["pipelined_tokens_per_s_over_single_process"] = f["tokens_per_s"] / single
    out["fp32_tokens_per_s"] = f["tokens_per_s"]
    out["fp32_final_loss"] = f["final_loss"]
    return out


def prepare_throughput(tmp: Path) -> dict:
    data = tmp / "synthetic.jsonl"
    size = write_jsonl(data, 20_000_000)
    tokenizer = ensure_stdlib_bpe(tmp / "cache") / "tokenizer"
    t0 = time.perf_counter()
    prepare_data([data], tokenizer, tmp / "ds", processes=default_processes(), progress=False)
    return {"prepare_data_mb_per_s": size / 1e6 / (time.perf_counter() - t0)}


def main() -> None:
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="geopipe-models-"))
    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="ERROR",
        resources={"site:east": 2, "site:west": 2},
    )
    try:
        result = parity(tmp)
        print(
            f"parity: max |loss - transformers'| over 10 steps "
            f"{result['hf_parity_max_abs_loss_diff']:.2e}; exported model's held-out loss vs "
            f"geopipe's {result['export_roundtrip_max_abs_loss_diff']:.2e}"
        )
        result.update(precision_and_single(tmp))
    finally:
        ray.shutdown()
    print(
        f"bf16 vs fp32 after 60 steps: final loss {result['bf16_final_loss_rel_diff']:.2%} "
        f"apart; WAN bytes x{result['bf16_wan_bytes_ratio']:.2f}, activations "
        f"x{result['bf16_activation_bytes_ratio']:.2f}, tokens/s "
        f"x{result['bf16_tokens_per_s_over_fp32']:.2f}"
    )
    print(
        f"pipelined (2x2 over an emulated 25 ms link) {result['fp32_tokens_per_s']:,.0f} "
        f"tokens/s vs one process {result['single_process_tokens_per_s']:,.0f}: "
        f"x{result['pipelined_tokens_per_s_over_single_process']:.2f}"
    )
    result.update(prepare_throughput(tmp))
    print(f"prepare-data: {result['prepare_data_mb_per_s']:.1f} MB/s")
    shutil.rmtree(tmp, ignore_errors=True)
    print(json_line(result))


if __name__ == "__main__":
    main()
