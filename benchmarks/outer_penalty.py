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
  data parallelism computes), at every seed of ``--seeds`` (init and data order): their
  largest relative spread is the noise;
* **outer**: ``M`` replica groups from the same initial model (the seed's), group ``g`` taking the
  ``g``-th of ``M`` contiguous slices of every global batch (the runtime's pipeline slices),
  each with its own inner Adam (never reset), meeting on the Streaming DiLoCo schedule through
  :mod:`geopipe.outer`: each group encodes its pseudo-gradient once with the codec, every
  group averages all encoded payloads, Nesterov SGD (lr 0.7, momentum 0.9) steps
  theta_global, the local weights are set to it. The parameters are one flat fp32 vector
  (one ZeRO-1 partition), fragments its equal contiguous slices (about consecutive layers).

Both see the same samples in the same steps, so tokens are equal. The measure is the held-out
loss of the final weights (theta_global for the outer loop, what ``geopipe export`` writes)
over 256 fixed held-out windows: ``rel_gap = (loss_outer - loss_sync) / loss_sync`` against
the sync run of the same seed. Every row is run at every seed of ``--seeds`` (default 0) and
written with its ``seed``: one seed's gap moves 1-2 % of loss between seeds here, as much as
a tight ``plan.max_loss_penalty`` separates, and the planner averages a row's seeds.

Run: ``nice .venv/bin/python benchmarks/outer_penalty.py [--steps 600] [--quick]`` (~25 min;
``--quick``: the M = 2, codec none rows only). Writes ``geopipe/optimizer/loss_penalty.json``
(``--out``; ``--no-write`` to leave it alone) and ends with one JSON line. ``--grid planner``
and ``--grid bounded`` (at ``--outer-lr``/``--outer-momentum``) merge their rows into the
table as each is measured (a killed run keeps them), rows of other settings or seeds
staying; ``--sync-loss a,b`` reuses the deterministic sync runs of the first seeds of
``--seeds`` (the rest are trained). With the default grid, ``--outer-lr`` and
``--outer-momentum`` (and ``--h 10,50``) make a comparison that is printed, never written.
"""

from __future__ import annotations

import argparse
import json
import sys
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
        streaming = self.fragments > 1 or self.overlap
        tail = f" F={self.fragments} tau={self.overlap}" if streaming else ""
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


def bounded_grid(outer_lr: float, outer_momentum: float) -> list[Setting]:
    """The M = 2, int8 candidates benchmarks/outer_loop.py's ``BOUNDED_OUTER`` offers the
    planner under a tight ``plan.max_loss_penalty`` (``--grid bounded``): F = 1 at H = 2, 5,
    10, 25, 50, 100; F = 5 with overlap 1 at H = 10 and overlap 4 at H = 25, 50, 100
    (torchft's constraints: H a multiple of F, overlap < H / F). Those nearest the bound
    first, so a killed run has measured them."""
    o = {"outer_lr": outer_lr, "outer_momentum": outer_momentum}
    rows = [Setting(2, h, "int8", 5, 4, **o) for h in (50, 25, 100)]
    rows += [Setting(2, h, "int8", **o) for h in (10, 25, 5, 2, 50, 100)]
    return [*rows, Setting(2, 10, "int8", 5, 1, **o)]


def overlap_grid(outer_lr: float, outer_momentum: float) -> list[Setting]:
    """The whole-model send overlapping 4 inner steps (``--grid overlap``): M = 2, int8,
    F = 1, overlap 4 at H = 50 and 100, the rounds the planner chooses on the bed's link.
    With them the planner may hide a round's transfer behind up to 4 steps at F = 1 too
    (the table takes the gap as independent of the overlap within a key, so these rows join
    the F = 1 curve; a larger overlap stays unpriced)."""
    o = {"outer_lr": outer_lr, "outer_momentum": outer_momentum}
    return [Setting(2, h, "int8", 1, 4, **o) for h in (100, 50)]


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


def seed_list(value: str) -> list[int]:
    """``--seeds``: distinct non-negative integers, comma-separated."""
    try:
        seeds = [int(x) for x in value.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"expected distinct non-negative integers separated by commas, got {value!r}"
        )
    return seeds


def float_list(value: str) -> list[float]:
    """``--sync-loss``: finite positive losses, comma-separated."""
    try:
        losses = [float(x) for x in value.split(",")]
    except ValueError:
        losses = []
    if not losses or not all(0 < x < float("inf") for x in losses):
        raise argparse.ArgumentTypeError(
            f"expected positive numbers separated by commas, got {value!r}"
        )
    return losses


def parse_args() -> argparse.Namespace:
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
        "--seeds",
        type=seed_list,
        default=[0],
        help="comma-separated seeds: every row runs at each, against the sync run of that seed",
    )
    ap.add_argument(
        "--sync-loss",
        type=float_list,
        default=[],
        help="the sync runs' held-out losses of an earlier run with the same settings "
        "(deterministic), one per seed in --seeds order; seeds past the list are trained",
    )
    ap.add_argument(
        "--grid",
        choices=("default", "planner", "bounded", "overlap"),
        default="default",
        help="planner: the rows the planner prices; bounded: the M = 2 int8 candidates under "
        "a tight plan.max_loss_penalty; overlap: F = 1 sends overlapping 4 steps; each at "
        "--outer-lr/--outer-momentum, merged into the table (rows of other settings and seeds "
        "stay)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if len(args.sync_loss) > len(args.seeds):
        ap.error(
            f"--sync-loss: {len(args.sync_loss)} losses for {len(args.seeds)} seeds "
            "(one per seed of --seeds, in its order)"
        )
    return args


def grid_of(args: argparse.Namespace) -> list[Setting]:
    """The settings to run; sets ``args.no_write`` for a comparison that is only printed."""
    outer = {}
    if (args.outer_lr, args.outer_momentum) != (OUTER_LR, OUTER_MOMENTUM):
        outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
        args.no_write |= args.grid == "default"  # a comparison, unless a merged grid
    if args.grid == "planner":
        return planner_grid(args.outer_lr, args.outer_momentum)
    if args.grid == "bounded":
        return bounded_grid(args.outer_lr, args.outer_momentum)
    if args.grid == "overlap":
        return overlap_grid(args.outer_lr, args.outer_momentum)
    return settings(args.quick, args.h, **outer)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    data = load_data(args.batch, args.seq_len, args.steps)
    grid = grid_of(args)
    merge = args.grid != "default"
    old = old_table(args.out, data) if merge and not args.no_write else {}
    given = dict(zip(args.seeds, args.sync_loss, strict=False))
    sync = {s: given[s] if s in given else sync_run(s, data) for s in args.seeds}
    sync_all = {**old.get("sync_loss", {}), **sync}
    rows: list[dict] = []
    for s in grid:  # every seed of a setting before the next: a killed run keeps whole rows
        for seed in args.seeds:
            t0 = time.perf_counter()
            loss, info = train_outer(s, data, seed)
            gap = (loss - sync[seed]) / sync[seed]
            rows.append({**row_of(s, seed), "rel_gap": round(gap, 5), "loss": round(loss, 5)})
            rows[-1].update(info)
            if merge and not args.no_write:  # each row as soon as it is measured
                report(args, data, sync_all, old, rows, time.perf_counter() - t_start, quiet=True)
            print(
                f"{s.name:<32} seed {seed}  held-out {loss:.4f}  rel gap {gap:+.4f} "
                f"({info['outer_steps']} outer steps, {time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    report(args, data, sync_all, old, rows, time.perf_counter() - t_start)


def row_of(s: Setting, seed: int) -> dict:
    return {
        "replicas": s.replicas,
        "h": s.h,
        "fragments": s.fragments,
        "overlap": s.overlap,
        "codec": s.codec,
        "outer_lr": s.outer_lr,
        "outer_momentum": s.outer_momentum,
        "seed": seed,
    }


def old_table(path: Path, data: Data) -> dict:
    """The table a merged grid adds to: its rows (each saying its outer optimizer and seed;
    rows written before they did are DiLoCo's defaults' and seed 0's) and its sync losses by
    seed (the first tables' list is seeds 0, 1, ...). Empty if there is none; exits 2 if it
    was measured with other steps or tokens per step (its gaps would not compare)."""
    try:
        doc = json.loads(path.read_text())
        rows, sync = doc["rows"], doc.get("sync_loss", [])
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    have = (doc.get("steps"), doc.get("tokens_per_step"))
    if have != (data.steps, data.batch * data.seq_len):
        print(
            f"error: --out {path}: its table has steps, tokens_per_step = {have}, this run "
            f"{data.steps}, {data.batch * data.seq_len}: another --out, or the same settings",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if isinstance(sync, list):
        sync = dict(enumerate(sync))
    defaults = {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM, "seed": 0}
    return {
        "rows": [{**defaults, **r} for r in rows],
        "sync_loss": {int(k): float(v) for k, v in sync.items()},
    }


def merged_rows(old: list[dict], rows: list[dict]) -> list[dict]:
    """The old table's rows with ``rows`` in the place of any of the same setting and seed."""

    def key(r: dict) -> tuple:
        return (
            r["outer_lr"],
            r["outer_momentum"],
            r["replicas"],
            r["h"],
            r["fragments"],
            r.get("overlap", 0),
            r["codec"],
            r.get("seed", 0),
        )

    new = {key(r) for r in rows}
    return [r for r in old if key(r) not in new] + rows


def sync_noise(sync: dict[int, float]) -> float:
    """The largest relative spread among the sync seeds (0 with one seed)."""
    v = list(sync.values())
    return (max(v) - min(v)) / min(v) if v else 0.0


def report(
    args,
    data: Data,
    sync: dict[int, float],
    old: dict,
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
        "sync_loss": {str(k): round(v, 5) for k, v in sorted(sync.items())},
        "sync_noise": round(sync_noise(sync), 5),
        "rows": merged_rows(old.get("rows", []), rows) if args.grid != "default" else rows,
    }
    if not args.no_write:
        args.out.write_text(json.dumps(table, indent=1) + "\n")
        if quiet:
            return
        print(f"wrote {args.out}")
    print(json.dumps(summary(args, data, sync, rows, runtime_s)))


def summary(args, data: Data, sync: dict[int, float], rows: list[dict], runtime_s: float) -> dict:
    """The closing JSON line: each setting's gap as the mean over this run's seeds (and each
    seed's beside it with ``_per_seed``)."""
    gaps: dict[str, list[float]] = {}
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
        gaps.setdefault(f"outer_loss_rel_gap_{tag}h{r['h']}", []).append(r["rel_gap"])
    line: dict[str, object] = {k: round(sum(g) / len(g), 5) for k, g in gaps.items()}
    if len(args.seeds) > 1:
        line.update({f"{k}_per_seed": g for k, g in gaps.items()})
    line.update(
        sync_noise=round(sync_noise({s: sync[s] for s in args.seeds}), 5),
        sync_loss=[round(sync[s], 5) for s in args.seeds],
        steps=data.steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        seeds=args.seeds,
        runtime_s=round(runtime_s),
    )
    return line


if __name__ == "__main__":
    main()
