"""WAN compression during real training: codec none vs fp16, bf16, int8, int4, int4h,
int2h, top-k; and each codec's encode + decode speed.

Two emulated sites, one stage each, the same data and seed for every codec. Reports the
bytes that crossed the WAN and the final loss (mean of the last 5 steps, to average out
per-batch noise) per codec. int8 sends 1 byte per element plus one fp32 scale per row of
``n_embd`` elements: 4 / (1 + 4/256) = 3.94× fewer bytes than fp32 at n_embd = 256; int4
and int4h 4 bits plus one fp16 scale per 64 elements (7.53×, int4h + an 8-byte seed per
message), int2h 2 bits (14.2×).

``codec_encode_decode_ms_per_mib``: encode + decode of a 4 MiB fp32 tensor ([8, 128, 1024]),
median of 9, in this process (``--speed-only`` measures just that).

The per-step loss curves of every codec are drawn into ``--plot`` (a PNG; matplotlib).

Run: ``.venv/bin/python benchmarks/compression.py [--steps 300] [--speed-only] [--plot F]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _common import run, spec_of, two_site_doc

from geopipe.transport.codec import CODECS


def codec_speed() -> dict[str, float]:
    """Milliseconds per MiB of fp32 input to encode and decode, per codec."""
    import time

    import torch

    from geopipe.transport.codec import decode, make_codec

    x = torch.randn(8, 128, 1024, generator=torch.Generator().manual_seed(0))  # 4 MiB
    mib = x.numel() * 4 / 2**20
    out = {}
    for name in CODECS:
        c = make_codec(name, topk_ratio=0.1, seed=1)
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            decode(c.encode(x, key="s", direction="backward"))
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3 / mib
    return out


def plot_losses(path: Path, curves: dict[str, list[float]]) -> None:
    """Loss against step, one line per codec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for codec, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=codec, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Two emulated sites, one stage each: loss per WAN codec", loc="left")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--speed-only", action="store_true", help="encode/decode speed only")
    ap.add_argument(
        "--plot",
        type=Path,
        default=Path("compression_losses.png"),
        help="PNG of every codec's loss curve",
    )
    args = ap.parse_args()
    speed = codec_speed()
    for name, ms in speed.items():
        print(f"{name:>6}: encode + decode {ms:.2f} ms per MiB of fp32")
    if args.speed_only:
        print(json.dumps({"codec_encode_decode_ms_per_mib": speed}))
        return
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="geopipe-codec-"))
    out: dict[str, dict] = {}
    curves: dict[str, list[float]] = {}
    try:
        for codec in args.codecs.split(","):
            doc = two_site_doc(f"codec-{codec}", 5.0, 1.0, 16, codec=codec)
            doc["model"].update(n_embd=256, n_head=4)
            doc["training"].update(lr=0.002, warmup_steps=3)
            doc["plan"].update(micro_batch_size=2, seq_len=64, topk_ratio=0.1)
            _, res, _ = run(spec_of(doc), args.steps, tmp / codec, "lookahead")
            losses = curves[codec] = [m.loss for m in res.steps]
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
    for name in ("int8", "int4", "int4h", "int2h"):
        if name in out:
            result[f"{name}_bytes_ratio"] = out[name]["bytes_ratio"]
            result[f"{name}_loss_delta"] = out[name]["loss_delta"]
            print(
                f"{name}: {result[f'{name}_bytes_ratio']:.3f}x fewer WAN bytes, final loss "
                f"{result[f'{name}_loss_delta']:+.2%} vs none"
            )
    result["codec_encode_decode_ms_per_mib"] = speed
    plot_losses(args.plot, curves)
    result["loss_curves_png"] = str(args.plot)
    print(f"loss curves: {args.plot}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
