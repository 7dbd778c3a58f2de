"""Time the model on this machine so the planner predicts the run it will actually see.

On the embedded cluster every "device" is one CPU process of this machine, so a quick
single-threaded profile here (the actors run with one thread each) replaces the YAML's
nominal ``device_tflops × device_efficiency`` and backward/forward ratio. On a real
cluster the YAML's numbers stand (``plan.calibrate: false`` is the default there).
"""

from __future__ import annotations

import time

import torch

from geopipe.config import ClusterSpec
from geopipe.model.gpt import GPTConfig, GPTStage
from geopipe.optimizer.costs import layer_forward_flops

__all__ = ["calibrate", "should_calibrate"]


def should_calibrate(spec: ClusterSpec) -> bool:
    c = spec.plan.calibrate
    return spec.ray.address == "local" if c is None else c


def _model_cfg(spec: ClusterSpec) -> GPTConfig:
    m = spec.model
    return GPTConfig(m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.max_seq_len)


def measure(
    spec: ClusterSpec, micro_batch: int, seq_len: int, reps: int = 5
) -> tuple[float, float]:
    """Median seconds of one forward and one backward of the whole model, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = _model_cfg(spec)
        model = GPTStage(cfg, 0, cfg.n_layer + 2, seed=spec.training.seed)
        x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
        fwd, bwd = [], []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            out = model(x)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        fwd, bwd = sorted(fwd[1:]), sorted(bwd[1:])
        return fwd[reps // 2], bwd[reps // 2]
    finally:
        torch.set_num_threads(threads)


def calibrate(spec: ClusterSpec, micro_batch: int, seq_len: int) -> ClusterSpec:
    """A copy of ``spec`` whose sites compute at the measured speed of this machine."""
    f, b = measure(spec, micro_batch, seq_len)
    flops = sum(layer_forward_flops(spec.model, seq_len)) * micro_batch * seq_len
    sites = []
    for s in spec.sites:
        eff = flops / f / (s.device_tflops * 1e12)
        if not 0 < eff <= 1:  # the nominal peak was wrong: keep the measured speed anyway
            sites.append(
                s.model_copy(
                    update={"device_tflops": flops / f / 1e12, "device_efficiency": 1.0,
                            "backward_forward_ratio": b / f}
                )
            )  # fmt: skip
        else:
            sites.append(
                s.model_copy(update={"device_efficiency": eff, "backward_forward_ratio": b / f})
            )
    return spec.model_copy(update={"sites": sites})
