"""The peer benchmarks/outer_loop.py measures the outer loop against: torchft's DiLoCo
(PyPI torchft 0.2.0, the ``[peer]`` extra), one replica group per site of the test bed, as
torchft runs it: a lighthouse in the first site, each replica's Manager with its own TCPStore,
and torchft's gloo process group carrying the pseudo-gradients' allreduce across the bed's
link. Where torchft cannot run, a plain DiLoCo written directly in torch over gloo (the
same order of operations: every ``H`` inner steps, allreduce θ_global − θ_local, average,
the outer SGD step, the local weights set to θ_global) takes its place and the result
says why.

Both train the job of :mod:`_outer_runs`: the demo GPT as one module, replica ``g`` taking
the ``g``-th half of every global batch of the token stream the runtime reads, inner AdamW
with the runtime's parameter groups, lr and cosine schedule, one thread per replica (the
runtime's stage actors run one), codec none (torchft quantizes on GPU only).

    <bed> python benchmarks/_outer_peer.py --replica G --peers 2 --lighthouse ADDR ...

prints one ``RESULT {json}`` line: seconds per inner step over whole rounds after the
first, and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _outer_runs import GLOBAL_BATCH, SEQ, TRAIN_BYTES

LR, BETAS, EPS = 3e-3, (0.9, 0.95), 1e-8


def _job(a: argparse.Namespace):
    """Model, inner optimizer, LR schedule and a batch function for replica ``a.replica``."""
    import torch

    from geopipe.model.data import Corpus, TokenStream, global_indices
    from geopipe.model.gpt import GPTConfig, GPTStage, lm_loss, num_layers
    from geopipe.runtime.actor.lr import LRFactor  # the runtime's own schedule

    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=128)
    model = GPTStage(cfg, 0, num_layers(cfg), seed=0)  # every replica starts equal
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.0},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    inner = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    warm = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, LRFactor("cosine", warm, a.steps))
    stream = TokenStream(Corpus("stdlib", max_bytes=TRAIN_BYTES), 0)
    per = GLOBAL_BATCH // a.peers

    def batch(step: int):
        return stream.batch(global_indices(step, GLOBAL_BATCH, a.replica, a.peers, 0, per), SEQ)

    def step(i: int) -> float:
        x, y = batch(i)
        inner.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        inner.step()
        sched.step()
        return float(loss.detach())

    return model, inner, step


def _outer_opt(params, a: argparse.Namespace):
    import torch

    # torch's Nesterov needs a momentum > 0; at momentum 0 it is plain SGD (DiLoCo's outer
    # step with lr 1 and no momentum is the average of the replicas)
    return torch.optim.SGD(
        params, lr=a.outer_lr, momentum=a.outer_momentum, nesterov=a.outer_momentum > 0
    )


def _timed(step, a: argparse.Namespace) -> dict:
    """Run ``a.steps`` inner steps; seconds per step over whole rounds after the first."""
    stamps, losses = [], []
    for i in range(a.steps):
        losses.append(step(i))
        stamps.append(time.perf_counter())
    first = a.h - 1  # the end of the first round: warm-up (connections, quorum) before it
    n = (a.steps - 1 - first) // a.h * a.h
    per_step = (stamps[first + n] - stamps[first]) / n if n else None
    return {"step_s": per_step, "losses": losses[:: max(1, a.steps // 20)]}


def run_torchft(a: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    model, inner, step = _job(a)
    store = dist.TCPStore(a.address, 0, is_master=True, wait_for_workers=False)
    t = timedelta(seconds=120)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=t),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=a.peers,
        use_async_quorum=False,
        replica_id=f"replica{a.replica}",
        store_addr=a.address,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=a.lighthouse,
        hostname=a.address,
        timeout=t,
        quorum_timeout=t,
        connect_timeout=t,
        # every replica starts from the same seeded model; the first quorum's healing would
        # fetch the primary's checkpoint over HTTP at socket.gethostname(), which on the bed
        # is the host's name, not the site's address (another namespace cannot reach it)
        init_sync=False,
    )
    outer = _outer_opt(model.parameters(), a)
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=a.h, pin_memory=False):
            out = _timed(step, a)
        out["outer_steps"] = manager.current_step()
    finally:
        manager.shutdown(wait=False)
    return out


def run_plain(a: argparse.Namespace) -> dict:
    """DiLoCo in plain torch over gloo: the order of torchft's, no fault tolerance."""
    import torch
    import torch.distributed as dist
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    model, _inner, step = _job(a)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}",
        rank=a.replica,
        world_size=a.peers,
        timeout=timedelta(seconds=120),
    )
    theta = parameters_to_vector(model.parameters()).detach().clone().requires_grad_(True)
    outer = _outer_opt([theta], a)
    done = [0]

    def with_rounds(i: int) -> float:
        loss = step(i)
        if (i + 1) % a.h == 0:
            with torch.no_grad():
                delta = theta.detach() - parameters_to_vector(model.parameters())
                dist.all_reduce(delta)
                theta.grad = delta / a.peers
                outer.step()
                vector_to_parameters(theta.detach(), model.parameters())
            done[0] += 1
        return loss

    try:
        out = _timed(with_rounds, a)
        out["outer_steps"] = done[0]
    finally:
        dist.destroy_process_group()
    return out


def lighthouse_main(a: argparse.Namespace) -> None:
    """Run torchft's lighthouse until stdin closes (printing its port first)."""
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind=f"[::]:{a.port}", min_replicas=a.peers)
    print(f"LIGHTHOUSE {lh.address()}", flush=True)
    sys.stdin.read()
    lh.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("torchft", "plain", "lighthouse"), required=True)
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--address", default="127.0.0.1", help="this replica's address")
    ap.add_argument("--lighthouse", default="", help="http://host:port")
    ap.add_argument("--master", default="", help="plain: host:port of rank 0's store")
    ap.add_argument("--port", type=int, default=29510)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--h", type=int, default=50)
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    a = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "wan0" if a.address != "127.0.0.1" else "lo")
    if a.mode == "lighthouse":
        return lighthouse_main(a)
    try:
        out = run_torchft(a) if a.mode == "torchft" else run_plain(a)
        out["ok"] = True
    except Exception as exc:  # the caller falls back to the plain peer and says why
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
