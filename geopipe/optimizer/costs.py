"""Analytic costs of the model's layers for the planner: activation and message sizes.

Pure arithmetic on :class:`~geopipe.config.ModelSpec`; the simulator, the memory model and
the partitioner read their numbers from here and from :mod:`geopipe.model.sizes` (parameter
counts, FLOPs, bytes per element), so they agree.

Layer indexing matches :mod:`geopipe.model.gpt`: layer 0 is the embedding,
layers ``1..n_layer`` the transformer blocks, layer ``n_layer + 1`` the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Protocol

from geopipe.model.recompute import checkpointed
from geopipe.model.sizes import elem_bytes, is_gated, num_layers

__all__ = [
    "INPUT_GRAD_SHARE",
    "activation_bytes",
    "boundary_message_elems",
    "gated_block_activation_elems",
    "norm_exchange_s",
    "recompute_share",
    "split_backward",
    "stage_backward",
]


class _Model(Protocol):
    n_layer: int
    n_embd: int
    vocab_size: int


def boundary_message_elems(m: _Model, micro_batch: int, seq_len: int) -> int:
    """Elements of one activation (or its gradient) crossing a stage boundary."""
    return micro_batch * seq_len * m.n_embd


def activation_bytes(
    m: _Model, layer: int, micro_batch: int, seq_len: int, precision: str
) -> float:
    """Bytes kept for backward by one layer for one micro-batch.

    Per GPT block ~16·b·s·h elements (LN inputs/outputs, qkv, attention output, MLP hidden
    4h twice, residuals) with a fused attention kernel that does not store the s×s matrix;
    the head keeps its logits and their softmax (2·b·s·V). A gated (Llama-like) block keeps
    :func:`gated_block_activation_elems` per token.
    """
    e = elem_bytes(precision)
    bsh = micro_batch * seq_len * m.n_embd
    if layer == 0:
        return float(bsh * e)
    if layer == num_layers(m.n_layer) - 1:
        return float(bsh * e + 2 * micro_batch * seq_len * m.vocab_size * e)
    if is_gated(m):
        return float(micro_batch * seq_len * gated_block_activation_elems(m) * e)
    return float(16 * bsh * e)


def gated_block_activation_elems(m) -> int:
    """Elements per token one gated (Llama-like) block keeps for backward, counted as the
    GPT's are: the block input and the residual (2h), both RMSNorm outputs (2h), the rotated
    q and k and v (``(H + 2·kv)·hd``), the attention output (``H·hd``, o_proj's input; fused
    SDPA keeps no s×s matrix), and the MLP's gate, up, SiLU(gate) and product (4·I)."""
    h, heads = m.n_embd, m.n_head
    kv, hd = m.n_kv_head or heads, m.head_dim or h // heads
    return 4 * h + (2 * heads + 2 * kv) * hd + 4 * (m.intermediate_size or 0)


# The input-gradient pass's share of a stage's backward when it is split (I + W = B). Qi et
# al. (ZB, ICLR 2024) find I ≈ W ≈ F for transformer layers: every matmul's backward is one
# matmul for the input gradient and one for the weight gradient.
INPUT_GRAD_SHARE = 0.5
# What splitting costs on top: I + W = (1 + SPLIT_OVERHEAD) · B on every stage but the first.
# Measured with the runtime's split (benchmarks/wsplit.py --testbed, the last stage's
# calibrated times): I + W = 1.02 × B, W adding into the accumulated gradients in place
# ([Note: W accumulates in place] in geopipe.runtime.actor.backward). What it pays is W's own
# entry into DeepSpeed's backward (its hooks run twice per micro-batch) and I's separate
# graph walk. The planner's choice between look-ahead and look-ahead with split
# backward (schedule: auto) hinges on it; calibration replaces it with the measured I and W
# once a split schedule runs.
SPLIT_OVERHEAD = 0.03


def split_backward(
    bwd_s: float, first: bool, share: float = INPUT_GRAD_SHARE, recompute_s: float = 0.0
) -> tuple[float, float]:
    """``(I, W)`` seconds of a stage whose full backward takes ``bwd_s`` without recompute.
    The first stage has no upstream to send a gradient to, so its ``I`` does nothing and
    ``W`` is the whole backward (what the runtime does, as ``torch.distributed.pipelining``
    does). ``recompute_s``, the blocks' second forward (:func:`recompute_share`), lands
    where the runtime runs it: in ``I``, whose autograd pass unpacks the saved tensors
    first; in the first stage's ``W``, its whole backward."""
    if first:
        return 0.0, bwd_s + recompute_s
    total = (1.0 + SPLIT_OVERHEAD) * bwd_s
    return share * total + recompute_s, (1.0 - share) * total


def recompute_share(
    flops: Sequence[float], layers: tuple[int, int], recompute: str, n_layer: int
) -> float:
    """The share of layers ``[a, b)``'s forward FLOPs (``flops[i]`` per layer) that their
    backward runs again under ``recompute``: a checkpointed block's backward begins with its
    forward once more (:mod:`geopipe.model.recompute`), so a stage's backward costs
    ``backward_forward_ratio × F + share × F``."""
    a, b = layers
    total = sum(flops[a:b])
    again = sum(flops[i] for i in range(a, b) if checkpointed(recompute, i, n_layer))
    return again / total if total > 0 else 0.0


def stage_backward(
    fwd_s: float,
    ratio: float,
    first: bool,
    flops: Sequence[float],
    layers: tuple[int, int],
    recompute: str,
) -> tuple[float, float, float]:
    """``(B, I, W)`` seconds of a stage of layers ``layers`` whose forward takes ``fwd_s``
    (``flops[i]``: each global layer's forward FLOPs), backward ``ratio`` times its forward
    plus the forward of its recomputed blocks once more (:func:`recompute_share`), split
    as :func:`split_backward` says."""
    again = fwd_s * recompute_share(flops, layers, recompute, len(flops) - 2)
    return (ratio * fwd_s + again, *split_backward(ratio * fwd_s, first, recompute_s=again))


def norm_exchange_s(spec: Any, sites: Sequence[str]) -> float:
    """Seconds the global gradient norm adds before every stage's optimizer step, for a
    pipeline whose stages sit in ``sites`` (0 without it: no clipping, per-stage clipping,
    one stage).

    Each stage sends its norm to every other stage and waits for theirs
    ([Note: global gradient clipping] in geopipe.runtime.actor.gradnorm): all pairs at once,
    so the step waits the slowest pair's one-way latency (a site's own network inside one;
    hop by hop along the pipeline's sites where no link joins two). The message is 12 bytes
    in a frame of about a hundred: under a microsecond at 1 Gbit/s, so no bandwidth term.
    The wait for the slowest stage's reduction is not modelled (the stages' steps differ by
    far less than a WAN latency in the plans the planner prefers)."""
    t = spec.training
    if t.grad_clip <= 0 or t.grad_clip_scope != "global" or len(sites) < 2:
        return 0.0
    chain = list(dict.fromkeys(sites))

    def one_way(a: str, b: str) -> float:
        if a == b:
            return spec.site(a).intra_latency_ms / 1e3
        lk = spec.link(a, b)
        if lk is not None:
            return lk.latency_s
        i, j = sorted((chain.index(a), chain.index(b)))
        return sum(spec.link(x, y).latency_s for x, y in pairwise(chain[i : j + 1]))

    return max(one_way(a, b) for a in chain for b in chain)
