"""The loss penalty of the outer loop (DiLoCo) against synchronous data parallelism, at equal
tokens, measured on the demo GPT: the table the planner reads (``loss_penalty.json``).

One process, no Ray, no DeepSpeed, one thread. The demo model of ``clusters/local-2dc.yaml``
(4 layers, n_embd 128, 4 heads, byte vocabulary 256) on the demo's corpus (the stdlib's
sources, its first 4 MB as ``training.data_max_bytes`` takes them), split by position: the
first 90 % is trained on through the runtime's token stream (every sample a pure function of
``(seed, index)``, step ``s`` taking samples ``s * B .. (s + 1) * B - 1``), the last 10 % (other
modules of the stdlib) is held out. The inner optimizer is the runtime's: Adam(W) with the
demo's lr 3e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0 (the demo's; the runtime then uses
plain Adam, the same numbers), no clipping, and the runtime's LR schedule itself
(:class:`geopipe.runtime.actor.lr.LRFactor`: transformers' cosine, warmup from 0, then a
half cosine to the last step).

* **sync**: one model on the whole global batch of ``B`` sequences per step (what synchronous
  data parallelism computes), seeds 0 and 1: their relative difference is the noise;
* **outer**: ``M`` replica groups from the same initial model (seed 0), group ``g`` taking the
  ``g``-th of ``M`` contiguous slices of every global batch (the runtime's pipeline slices),
  each with its own inner Adam (never reset), meeting on the Streaming DiLoCo schedule through
  :mod:`geopipe.outer`: each group encodes its pseudo-gradient once with the codec, every
  group averages all encoded payloads, Nesterov SGD (lr 0.7, momentum 0.9) steps
  theta_global, the local weights are set to it. The parameters are one flat fp32 vector
  (one ZeRO-1 partition), fragments its equal contiguous slices (about consecutive layers).

Both see the same samples in the same steps, so tokens are equal. The measure is the held-out
loss of the final weights (theta_global for the outer loop, what ``geopipe export`` writes)
over 256 fixed held-out windows: ``rel_gap = (loss_outer - loss_sync) / loss_sync`` against
the sync run of the same seed.

Run: ``nice .venv/bin/python benchmarks/outer_penalty.py [--steps 600] [--quick]`` (~25 min;
``--quick``: the M = 2, codec none rows only). Writes ``geopipe/optimizer/loss_penalty.json``
(``--out``; ``--no-write`` to leave it alone) and ends with one JSON line. ``--outer-lr``
and ``--outer-momentum`` (with ``--h 10,50``, and ``--sync-loss a,b`` to reuse the
deterministic sync runs) measure other outer settings, ``--seed 1`` the outer runs' own
spread; those runs are printed, never written to the table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from geopipe.model.data import Corpus, TokenStream, global_indices
from geopipe.model.gpt import GPTConfig, GPTStage, lm_loss, num_layers
from geopipe.outer import OuterOptimizer, StreamingSchedule, average_encoded, encode_delta
from geopipe.runtime.actor.lr import LRFactor  # the runtime's schedule (no DeepSpeed import)
from geopipe.transport.codec import make_codec

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "geopipe" / "optimizer" / "loss_penalty.json"
CFG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=128)
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.0
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
HELD_OUT_SHARE, EVAL_SAMPLES, EVAL_SEED = 0.1, 256, 12345


@dataclass(frozen=True)
class Setting:
    """One outer-loop run: ``replicas`` groups, round ``h``, ``fragments`` with ``overlap``."""

    replicas: int
    h: int
    codec: str = "none"
    fragments: int = 1
    overlap: int = 0
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM

    @property
    def name(self) -> str:
        tail = f" F={self.fragments} tau={self.overlap}" if self.fragments > 1 else ""
        if (self.outer_lr, self.outer_momentum) != (OUTER_LR, OUTER_MOMENTUM):
            tail += f" outer {self.outer_lr}/{self.outer_momentum}"
        return f"M={self.replicas} H={self.h} {self.codec}{tail}"


def planner_grid(outer_lr: float, outer_momentum: float) -> list[Setting]:
    """The rows the planner prices (``--grid planner``): M = 2, 4, 8 at H = 10, 50, 100, codecs
    none and int8, streaming (F = 5, tau = 4) at H = 50 and 100 with int8, and M = 2 at H = 2
    and 5 (the rounds a user who bounds the penalty tightly, ``plan.max_loss_penalty``, can
    still choose)."""
    o = {"outer_lr": outer_lr, "outer_momentum": outer_momentum}
    rows = [Setting(m, h, "int8", 5, 4, **o) for m in (8, 4, 2) for h in (50, 100)]
    rows += [
        Setting(m, h, c, **o) for m in (8, 4, 2) for c in ("int8", "none") for h in (100, 50, 10)
    ]
    rows += [Setting(2, h, c, **o) for c in ("int8", "none") for h in (5, 2)]
    return rows


def settings(quick: bool, hs: list[int] | None = None, **outer: float) -> list[Setting]:
    """The grid, the rows the acceptance keys need first; ``quick`` (or ``hs``, the H
    values to run): M = 2, codec none, F = 1 only. ``outer``: non-default outer lr and
    momentum, for a comparison that is printed, never written to the table."""
    core = [Setting(2, h, **outer) for h in (hs or (1, 10, 50))]
    if quick or hs or outer:
        return core
    return [
        *core,
        *(Setting(2, h, "int8") for h in (1, 10, 50)),
        Setting(2, 100),
        Setting(2, 100, fragments=4, overlap=1),
        *(Setting(4, h) for h in (1, 10, 50)),
        *(Setting(2, h, "int4h") for h in (1, 10, 50)),
    ]


@dataclass
class Data:
    train: Corpus
    held_out: Corpus
    batch: int
    seq_len: int
    steps: int

    @property
    def warmup(self) -> int:
        return max(1, self.steps // 20)


def load_data(batch: int, seq_len: int, steps: int) -> Data:
    tokens = Corpus("stdlib", max_bytes=4_000_000).tokens
    cut = int(len(tokens) * (1 - HELD_OUT_SHARE))
    train = Corpus.from_bytes(tokens[:cut].tobytes(), "stdlib[:90%]")
    held = Corpus.from_bytes(tokens[cut:].tobytes(), "stdlib[90%:]")
    return Data(train, held, batch, seq_len, steps)


class Replica:
    """One model and its inner Adam with the runtime's parameter groups and LR schedule."""

    def __init__(self, seed: int, data: Data) -> None:
        self.model = GPTStage(CFG, 0, num_layers(CFG), seed=seed)
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, LRFactor("cosine", data.warmup, data.steps)
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.sched.step()
        return float(loss.detach())

    def flat(self) -> torch.Tensor:
        return parameters_to_vector(self.model.parameters()).detach().clone()

    def set_flat(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(flat, self.model.parameters())


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, data: Data) -> float:
    stream = TokenStream(data.held_out, EVAL_SEED)
    total = 0.0
    for start in range(0, EVAL_SAMPLES, 32):
        x, y = stream.batch(range(start, start + 32), data.seq_len)
        total += float(lm_loss(model(x), y)) * 32
    return total / EVAL_SAMPLES


def train_sync(seed: int, data: Data) -> float:
    """Synchronous training on the whole global batch; the final held-out loss."""
    rep, stream = Replica(seed, data), TokenStream(data.train, seed)
    for step in range(data.steps):
        rep.step(*stream.batch(range(step * data.batch, (step + 1) * data.batch), data.seq_len))
    return held_out_loss(rep.model, data)


def train_outer(s: Setting, data: Data, seed: int = 0) -> tuple[float, dict]:
    """The outer loop of setting ``s``; the final held-out loss of theta_global and counts."""
    sched = StreamingSchedule(s.h, s.fragments, s.overlap)
    reps = [Replica(seed, data) for _ in range(s.replicas)]
    stream = TokenStream(data.train, seed)
    outer = OuterOptimizer(reps[0].flat(), s.outer_lr, s.outer_momentum, s.fragments)
    codecs = [make_codec(s.codec, seed=1 + g) for g in range(s.replicas)]
    in_flight: dict[int, list] = {}
    per, payload_bytes = data.batch // s.replicas, 0
    for step in range(data.steps):
        for g, rep in enumerate(reps):
            idx = global_indices(step, data.batch, g, s.replicas, 0, per)
            rep.step(*stream.batch(idx, data.seq_len))
        done = step + 1  # inner steps completed: the schedule counts from 1
        f = sched.sends_at(done)
        if f is not None:  # each group encodes its pseudo-gradient once
            in_flight[f] = [
                encode_delta(outer.pseudo_gradient(rep.flat(), f), c, key=f"outer/{f}")
                for rep, c in zip(reps, codecs, strict=True)
            ]
            payload_bytes += sum(e.payload_nbytes for e in in_flight[f])
        f = sched.applies_at(done)
        if f is not None:  # every group: the same payloads, in group order
            outer.step(average_encoded(in_flight.pop(f), outer.fragment_numel(f)), f)
            for rep in reps:
                flat = rep.flat()
                outer.copy_to(flat, f)
                rep.set_flat(flat)
    model = GPTStage(CFG, 0, num_layers(CFG), seed=seed)
    with torch.no_grad():
        vector_to_parameters(outer.theta[0], model.parameters())
    rounds = sum(outer.steps(f) for f in range(s.fragments))
    return held_out_loss(model, data), {"outer_steps": rounds, "payload_bytes": payload_bytes}


def sync_run(seed: int, data: Data) -> float:
    t0 = time.perf_counter()
    loss = train_sync(seed, data)
    print(
        f"sync seed {seed}: held-out loss {loss:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True
    )
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="only M = 2, codec none, F = 1")
    ap.add_argument(
        "--h",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="comma-separated H values (M = 2, codec none, F = 1)",
    )
    ap.add_argument("--outer-lr", type=float, default=OUTER_LR)
    ap.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM)
    ap.add_argument(
        "--sync-loss",
        type=lambda v: [float(x) for x in v.split(",")],
        help="the two sync seeds' held-out losses of an earlier run with the same "
        "settings (deterministic), instead of training them again",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        choices=(0, 1),
        help="the outer runs' seed, compared with that sync seed",
    )
    ap.add_argument(
        "--grid",
        choices=("default", "planner"),
        default="default",
        help="planner: the rows the planner prices, at --outer-lr/--outer-momentum, "
        "merged into the table (rows of other outer settings stay)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    data = load_data(args.batch, args.seq_len, args.steps)
    outer = {}
    if (args.outer_lr, args.outer_momentum) != (OUTER_LR, OUTER_MOMENTUM):
        outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
        args.no_write |= args.grid != "planner"  # a comparison, unless it is the planner's grid
    args.no_write |= args.seed != 0  # the table is seed 0's: another seed's runs are a check
    grid = (
        planner_grid(args.outer_lr, args.outer_momentum)
        if args.grid == "planner"
        else settings(args.quick, args.h, **outer)
    )
    sync = args.sync_loss or [sync_run(seed, data) for seed in (0, 1)]
    noise = abs(sync[1] - sync[0]) / sync[0]
    rows = []
    for s in grid:
        t0 = time.perf_counter()
        loss, info = train_outer(s, data, args.seed)
        gap = (loss - sync[args.seed]) / sync[args.seed]
        rows.append(
            {
                "replicas": s.replicas,
                "h": s.h,
                "fragments": s.fragments,
                "overlap": s.overlap,
                "codec": s.codec,
                "outer_lr": s.outer_lr,
                "outer_momentum": s.outer_momentum,
                "rel_gap": round(gap, 5),
                "loss": round(loss, 5),
                **info,
            }
        )
        if args.grid == "planner" and not args.no_write:  # each row as soon as it is measured
            report(args, data, sync, noise, rows, time.perf_counter() - t_start, quiet=True)
        ratio = gap / noise if noise else float("nan")
        print(
            f"{s.name:<24} held-out {loss:.4f}  rel gap {gap:+.4f} ({ratio:+.1f}x the sync "
            f"noise; {info['outer_steps']} outer steps, {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    report(args, data, sync, noise, rows, time.perf_counter() - t_start)


def merged_rows(path: Path, rows: list[dict]) -> list[dict]:
    """The table's rows with ``rows`` in the place of any of the same setting (rows written
    before outer settings were recorded per row are DiLoCo's defaults')."""

    def key(r: dict) -> tuple:
        return (
            r.get("outer_lr", OUTER_LR),
            r.get("outer_momentum", OUTER_MOMENTUM),
            r["replicas"],
            r["h"],
            r["fragments"],
            r.get("overlap", 0),
            r["codec"],
        )

    try:
        old = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        old = []
    old = [{"outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM, **r} for r in old]
    new = {key(r) for r in rows}
    return [r for r in old if key(r) not in new] + rows


def report(
    args,
    data: Data,
    sync: list[float],
    noise: float,
    rows: list[dict],
    runtime_s: float,
    quiet: bool = False,
) -> None:
    n_params = sum(p.numel() for p in GPTStage(CFG, 0, num_layers(CFG)).parameters())
    table = {
        "source": "benchmarks/outer_penalty.py",
        "model": f"demo GPT (4 layers, n_embd 128, 4 heads, vocab 256 bytes, {n_params} params)"
        f", stdlib bytes, global batch {data.batch} x seq {data.seq_len}, inner Adam lr {LR}"
        " cosine; each row's outer Nesterov SGD lr and momentum are its own",
        "steps": data.steps,
        "tokens_per_step": data.batch * data.seq_len,
        "sync_loss": [round(x, 5) for x in sync],
        "sync_noise": round(noise, 5),
        "rows": merged_rows(args.out, rows) if args.grid == "planner" else rows,
    }
    if not args.no_write:
        args.out.write_text(json.dumps(table, indent=1) + "\n")
        if quiet:
            return
        print(f"wrote {args.out}")
    line: dict[str, object] = {}
    for r in rows:
        tag = (
            ""
            if (r["replicas"], r["codec"], r["fragments"]) == (2, "none", 1)
            else (
                ("" if r["replicas"] == 2 else f"m{r['replicas']}_")
                + ("" if r["codec"] == "none" else f"{r['codec']}_")
                + ("" if r["fragments"] == 1 else f"f{r['fragments']}_")
            )
        )
        line[f"outer_loss_rel_gap_{tag}h{r['h']}"] = r["rel_gap"]
    line.update(
        sync_noise=round(noise, 5),
        sync_loss=round(sync[args.seed], 5),
        steps=data.steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        seed=args.seed,
        runtime_s=round(runtime_s),
    )
    print(json.dumps(line))


if __name__ == "__main__":
    main()
