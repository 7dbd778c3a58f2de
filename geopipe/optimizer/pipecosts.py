"""One plan's cost model: the seconds every action of a pipeline takes (the
:class:`~geopipe.optimizer.simulator.PipelineCosts` the simulator replays), the bytes an
iteration sends over the WAN, and the tied embedding's gradient swap.

Its own module because these are pure functions of the cluster spec and a plan: they hold
none of the search's state (its candidates, caches, pruning bound) that
:class:`~geopipe.optimizer.evaluate.Evaluator` keeps, and the calibration, the ΔN ladder, the
outer loop's pricing and the rendering read them for a plan the search did not make.
"""

from __future__ import annotations

from itertools import pairwise

from geopipe.config import ClusterSpec, SiteSpec
from geopipe.model.sizes import (
    elem_bytes,
    layer_forward_flops,
    stage_param_count,
    tied_embedding_elems,
)
from geopipe.optimizer.costs import boundary_message_elems, norm_exchange_s, stage_backward
from geopipe.optimizer.simulator import PipelineCosts
from geopipe.plan import Plan
from geopipe.transport.wire import (
    MAX_TOPK_NUMEL,
    codec_throughput_bytes_per_s,
    direction_codec,
    wire_bytes,
)

__all__ = ["codec_speed", "pipeline_costs", "tie_exchange", "wan_bytes"]

_ADAM_BYTES_PER_PARAM = 28.0  # read p, g, m, v; write p, m, v (fp32) per optimizer step


def codec_speed(site: SiteSpec, codec: str) -> float:
    """Encode + decode bytes (of the uncompressed tensor) per second of ``codec`` on
    ``site``: measured at launch (``plan.calibrate``) or given in the YAML, else nominal."""
    measured = site.codec_gb_per_s.get(codec)
    return measured * 1e9 if measured else codec_throughput_bytes_per_s(codec)


def pipeline_costs(spec: ClusterSpec, plan: Plan) -> PipelineCosts:
    """Seconds per action for one pipeline of ``plan`` (see the simulator's docstring)."""
    model = spec.model
    b, s, d = plan.micro_batch_size, plan.seq_len, plan.pipelines
    flops = layer_forward_flops(model, s)
    prec = spec.training.precision
    e = elem_bytes(prec)
    fwd, bwd, step, inp, wgt = [], [], [], [], []
    for k, (a, z) in enumerate(plan.partition):
        site = spec.site(plan.stage_sites[k])
        overhead = (z - a) * site.layer_overhead_ms / 1e3  # fixed, per micro-batch
        fwd.append(f := sum(flops[a:z]) * b * s / site.flops_per_s + overhead)
        args = (flops, (a, z), spec.training.recompute)  # recomputed blocks: F once more
        b_s, i, w = stage_backward(f, site.backward_forward_ratio, k == 0, *args)
        bwd.append(b_s)
        inp.append(i)
        wgt.append(w)
        params = stage_param_count(model, (a, z))
        t = params / d * _ADAM_BYTES_PER_PARAM / (site.device_mem_bw_gb_per_s * 1e9)
        if d > 1:  # ZeRO-1: reduce-scatter gradients, all-gather updated weights
            moved = 2.0 * (d - 1) / d * params * e * 8
            t += moved / (site.intra_bandwidth_gbps * 1e9)
            t += 2 * (d - 1) * site.intra_latency_ms / 1e3
        step.append(t)
    tie_s = tie_exchange(spec, plan)[0]  # both copies wait for the swap before their step
    step[0] += tie_s
    step[-1] += tie_s
    step = [t + norm_exchange_s(spec, plan.stage_sites) for t in step]  # global clip
    elems = boundary_message_elems(model, b, s)
    raw = elems * e
    ser_f, lat_f, ser_b, lat_b = [], [], [], []
    for j in range(plan.num_stages - 1):
        src, dst = plan.stage_sites[j], plan.stage_sites[j + 1]
        if src == dst:
            site = spec.site(src)
            t = raw * 8 / (site.intra_bandwidth_gbps * 1e9)
            ser_f.append(t)
            ser_b.append(t)
            lat_f.append(site.intra_latency_ms / 1e3)
            lat_b.append(site.intra_latency_ms / 1e3)
            continue
        for direction, (a_, z_), ser, lat in (
            ("forward", (src, dst), ser_f, lat_f),
            ("backward", (dst, src), ser_b, lat_b),
        ):
            codec = direction_codec(plan.codecs[j], direction)
            if codec == "topk" and elems > MAX_TOPK_NUMEL:
                codec = "bf16"  # topk cannot send it (_evaluate rejects such plans)
            # encoded at the sending site, decoded at the receiving one
            codec_s = raw / codec_speed(spec.site(a_), codec)
            lk = spec.link(a_, z_)
            nbytes = wire_bytes(codec, elems, model.n_embd, e, direction, spec.plan.topk_ratio)
            # D pipelines share the link: each gets 1/D of the bandwidth.
            ser.append(nbytes * 8 * d / lk.bandwidth_bps / (1 - lk.loss) + codec_s)
            lat.append(lk.latency_s)
    return PipelineCosts(
        tuple(fwd),
        tuple(bwd),
        tuple(step),
        tuple(ser_f),
        tuple(lat_f),
        tuple(ser_b),
        tuple(lat_b),
        tuple(inp),
        tuple(wgt),
    )


def wan_bytes(spec: ClusterSpec, plan: Plan, elems: int) -> float:
    """Bytes one iteration sends over the WAN: every boundary's activations and
    gradients, each direction in its codec, for all pipelines; and the tie exchange."""
    e, out = elem_bytes(spec.training.precision), 0.0
    for j in plan.wan_boundaries:
        per_mb = sum(
            wire_bytes(plan.codecs[j], elems, spec.model.n_embd, e, d, spec.plan.topk_ratio)
            for d in ("forward", "backward")
        )
        out += per_mb * plan.num_microbatches * plan.pipelines
    return out + tie_exchange(spec, plan)[1]


def tie_exchange(spec: ClusterSpec, plan: Plan) -> tuple[float, float]:
    """``(seconds, WAN bytes)`` per iteration of swapping a tied embedding's gradients.

    When the embedding (layer 0) and the head sit on different stages, each holds a copy
    of the tied matrix, and before the optimizer step the first and the last stage of
    every pipeline send each other their copy's gradient (``V·h`` elements in the
    training precision; [Note: tied embeddings across stages] in
    :mod:`geopipe.model.hf`). Both directions run at once, so the step waits one one-way
    transfer: latency + bytes / bandwidth, the D pipelines sharing a WAN link as their
    activations do (and its loss costing retransmissions as theirs). Sites not joined by
    one link are reached hop by hop along the pipeline's sites (store and forward); two
    stages in one site use the site's network. The WAN bytes count both directions over
    every WAN hop, for all D pipelines. Nothing without a tie or with one stage.
    """
    elems = tied_embedding_elems(spec.model)
    if not elems or plan.num_stages < 2:
        return 0.0, 0.0
    nbytes = elems * elem_bytes(spec.training.precision)
    src, dst = plan.stage_sites[0], plan.stage_sites[-1]
    if src == dst:
        site = spec.site(src)
        return site.intra_latency_ms / 1e3 + nbytes * 8 / (site.intra_bandwidth_gbps * 1e9), 0.0
    lk = spec.link(src, dst)
    if lk is not None:
        hops = [lk]
    else:  # along the pipeline's sites (they form a chain: config.checks)
        sites = list(dict.fromkeys(plan.stage_sites))
        hops = [spec.link(x, y) for x, y in pairwise(sites)]
    d = plan.pipelines
    seconds = sum(h.latency_s + nbytes * 8 * d / h.bandwidth_bps / (1 - h.loss) for h in hops)
    return seconds, 2.0 * nbytes * d * len(hops)
