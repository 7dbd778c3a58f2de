"""The peer: torch.distributed.pipelining (Schedule1F1B / ScheduleGPipe over gloo), same job.

The demo GPT (clusters/local-2dc.yaml's model) split into the same two stages as geopipe's
plan (``--split``: first global layer of stage 1), one stage per process, the same
micro-batches (``--micro-batches`` × ``--micro-batch-size`` × ``--seq-len``) from the same
token stream, Adam at the same learning rate, one optimizer step per iteration, one
thread per process (as geopipe's actors). Each rank times every step (schedule step plus
optimizer step) back to back; a step's time is the slower rank's.

Standalone, both ranks on 127.0.0.1::

    .venv/bin/python benchmarks/torch_pipe_baseline.py --schedule 1f1b

On the test bed (rank 0 in the first site's namespace, rank 1 in the second's; used by
``benchmarks/real_wan.py``, or by hand on a bed that is up)::

    sudo .venv/bin/python benchmarks/torch_pipe_baseline.py --testbed --schedule gpipe

Ends with one JSON line: per-step seconds, their median after ``--warmup`` steps, losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PORT = 29631


def _role(a: argparse.Namespace) -> None:
    """One rank: build its stage, run the schedule for ``a.steps`` steps, print RESULT."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from geopipe.config import load_cluster
    from geopipe.model.data import Corpus, TokenStream, global_indices
    from geopipe.model.family import build_stage
    from geopipe.model.gpt import lm_loss
    from geopipe.runtime.control.models import model_desc

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    dist.init_process_group(
        "gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=2
    )
    # the demo's model, as geopipe's side of the comparison trains it
    desc = model_desc(load_cluster(ROOT / "clusters" / "local-2dc.yaml").model)
    start, end = (0, a.split) if a.rank == 0 else (a.split, desc.num_layers)
    model = build_stage(desc, start, end, seed=0)
    stage = PipelineStage(model, a.rank, 2, torch.device("cpu"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[a.schedule]
    sched = kind(stage, n_microbatches=a.micro_batches, loss_fn=lm_loss)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    stream = TokenStream(Corpus("stdlib"), 0)
    gb = a.micro_batches * a.micro_batch_size
    times, losses = [], []
    for step in range(a.steps):
        idx = [
            i
            for mb in range(a.micro_batches)
            for i in global_indices(step, gb, 0, 1, mb, a.micro_batch_size)
        ]
        x, y = stream.batch(idx, a.seq_len)
        t0 = time.perf_counter()
        if a.rank == 0:
            sched.step(x)
        else:
            out: list = []
            sched.step(target=y, losses=out)
            losses.append(float(torch.stack(out).detach().mean()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    print("RESULT " + json.dumps({"times": times, "losses": losses}), flush=True)
    dist.destroy_process_group()


def _args(a: argparse.Namespace, rank: int, master: str, ifname: str) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--role",
        "rank",
        "--rank",
        str(rank),
        "--master",
        master,
        "--ifname",
        ifname,
        "--port",
        str(a.port),
        "--schedule",
        a.schedule,
        "--steps",
        str(a.steps),
        "--split",
        str(a.split),
        "--micro-batches",
        str(a.micro_batches),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--seq-len",
        str(a.seq_len),
    ]


def _result(p: subprocess.Popen) -> dict:
    out, _ = p.communicate(timeout=1800)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"rank exited ({p.returncode}) without a result")


def run(a: argparse.Namespace, bed: object | None = None) -> dict:
    """Both ranks, on loopback or in the test bed's first two sites; the summary."""
    if bed is None:
        procs = [
            subprocess.Popen(
                _args(a, r, "127.0.0.1", "lo"), stdout=subprocess.PIPE, text=True, cwd=ROOT
            )
            for r in (1, 0)
        ]
    else:
        sites = bed.plan.sites
        master = bed.plan.address(sites[0])
        procs = [
            bed.popen(
                sites[r], _args(a, r, master, "wan0"), stdout=subprocess.PIPE, text=True, cwd=ROOT
            )
            for r in (1, 0)
        ]
    r1, r0 = (_result(p) for p in procs)
    per_step = [max(x, y) for x, y in zip(r0["times"], r1["times"], strict=True)]
    return {
        "schedule": a.schedule,
        "step_s": per_step,
        "median_s": statistics.median(per_step[a.warmup :]),
        "losses": r1["losses"],
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["rank"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--ifname", default="lo", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--split", type=int, default=3, help="first global layer of stage 1")
    ap.add_argument("--micro-batches", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--testbed", action="store_true", help="run in the test bed that is up")
    return ap


def main() -> None:
    a = parser().parse_args()
    if a.role == "rank":
        return _role(a)
    bed = None
    if a.testbed:
        from geopipe.testbed import Bed

        bed = Bed.load()
    res = run(a, bed)
    print(
        f"torch {a.schedule}: median {res['median_s']:.3f} s/step "
        f"(steps {', '.join(f'{t:.2f}' for t in res['step_s'])})",
        file=sys.stderr,
    )
    print(json.dumps({"benchmark": "torch_pipe_baseline", **res}))


if __name__ == "__main__":
    main()
