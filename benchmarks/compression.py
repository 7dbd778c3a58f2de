"""WAN compression during real training: codec none vs fp16, bf16, int8, top-k.

Two emulated sites, one stage each, the same data and seed for every codec. Reports the
bytes that crossed the WAN and the final loss (mean of the last 5 steps, to average out
per-batch noise) per codec. int8 sends 1 byte per element plus one fp32 scale per row of
``n_embd`` elements: 4 / (1 + 4/256) = 3.94× fewer bytes than fp32 at n_embd = 256.

Run: ``.venv/bin/python benchmarks/compression.py [--steps N]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _common import run, spec_of, two_site_doc

CODECS = ("none", "fp16", "bf16", "int8", "topk")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--codecs", default=",".join(CODECS))
    args = ap.parse_args()
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="geopipe-codec-"))
    out: dict[str, dict] = {}
    try:
        for codec in args.codecs.split(","):
            doc = two_site_doc(f"codec-{codec}", 5.0, 1.0, 16, codec=codec)
            doc["model"].update(n_embd=256, n_head=4)
            doc["training"].update(lr=0.002, warmup_steps=3)
            doc["plan"].update(micro_batch_size=2, seq_len=64, topk_ratio=0.1)
            _, res, _ = run(spec_of(doc), args.steps, tmp / codec, "lookahead")
            losses = [m.loss for m in res.steps]
            out[codec] = {
                "wan_bytes": sum(m.wan_bytes for m in res.steps),
                "final_loss": statistics.mean(losses[-5:]),
                "first_loss": losses[0],
            }
            r = out[codec]
            print(
                f"{codec:>5}: WAN {r['wan_bytes'] / 1e6:8.2f} MB, loss {r['first_loss']:.3f} -> "
                f"{r['final_loss']:.4f}"
            )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    base = out["none"]
    result: dict = dict(out)
    for r in out.values():
        r["bytes_ratio"] = base["wan_bytes"] / r["wan_bytes"]
        r["loss_delta"] = r["final_loss"] / base["final_loss"] - 1
    if "int8" in out:
        result["int8_bytes_ratio"] = out["int8"]["bytes_ratio"]
        result["int8_loss_delta"] = out["int8"]["loss_delta"]
        print(
            f"int8: {result['int8_bytes_ratio']:.3f}x fewer WAN bytes, final loss "
            f"{result['int8_loss_delta']:+.2%} vs none"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
