"""Averaging the groups' pseudo-gradients through the WAN codecs, identically in every group.

The design is an all-gather of *encoded* pseudo-gradients, not a ring reduce: each group
encodes its own pseudo-gradient once (:func:`encode_delta`), sends the same bytes to every
other group, and every group decodes all ``M`` payloads in the same order (by group id) and
averages them (:func:`average_encoded`). Every group therefore computes the average from the
same bytes with the same operations, so theta_global stays bit-identical in every group
under every codec, lossy ones included. A ring reduce would re-encode partial sums at each
hop, stacking the codec's error ``M - 1`` times and giving each group a different rounding.

Codecs come from :mod:`geopipe.transport.codec`. Pseudo-gradients are encoded as gradients
(direction ``"backward"``): top-k then keeps its error feedback, per group (the residual
lives in the group's own codec object, keyed by fragment) and per fragment, so what one
round's top-k leaves out is sent in a later round.

Why rows: a fragment is a flat vector (slices of ZeRO-1 partitions), and int8's scales are
per row of the last dimension, so a flat vector would get one scale for all its elements
and one outlier would crush the rest. :func:`encode_delta` lays the vector out as rows of
:data:`ROW_LEN` (zero-padded), so int8 keeps one scale per ``ROW_LEN`` elements (1.6 %
overhead); the grouped low-bit codecs use their own groups of 64 either way. Chunking a
payload into frames under the data plane's bound is the transport's job, not this module's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from geopipe.transport.codec import Codec, Encoded, decode

__all__ = ["ROW_LEN", "average_encoded", "decode_delta", "encode_delta"]

ROW_LEN = 256  # elements per int8 scale of a pseudo-gradient


def _padded_rows(flat: Tensor) -> Tensor:
    n = flat.numel()
    rows = -(-n // ROW_LEN)
    return torch.nn.functional.pad(flat, (0, rows * ROW_LEN - n)).reshape(rows, ROW_LEN)


def encode_delta(delta: Tensor, codec: Codec, key: str = "outer") -> Encoded:
    """Encode one group's flat fp32 pseudo-gradient of a fragment, as rows of ``ROW_LEN``.

    ``key`` names the error-feedback stream of a stateful codec (top-k): use one key per
    fragment, e.g. ``"outer/3"``, on the group's own codec object. The rows are laid out on
    the host, where the codecs work, whatever device ``delta`` is on."""
    flat = delta.detach().to("cpu", torch.float32).reshape(-1)
    return codec.encode(_padded_rows(flat), key=key, direction="backward")


def decode_delta(enc: Encoded, numel: int) -> Tensor:
    """The flat fp32 pseudo-gradient of ``numel`` elements that ``enc`` carries (on the host,
    as every codec decodes)."""
    rows = -(-numel // ROW_LEN)
    if tuple(enc.shape) != (rows, ROW_LEN):
        raise ValueError(
            f"a pseudo-gradient of {numel} elements travels as ({rows}, {ROW_LEN}) rows, "
            f"got a payload of shape {enc.shape}"
        )
    return decode(enc).reshape(-1)[:numel]


def average_encoded(
    payloads: Sequence[Encoded], numel: int, weights: Sequence[float] | None = None
) -> Tensor:
    """The mean of the groups' decoded pseudo-gradients, summed in the order given;
    ``weights`` (one per payload: the groups' batch shares, when they differ) make it the
    weighted mean, so that a group training on more of each global batch counts for more
    (with ``H = 1``, outer lr 1 and momentum 0 the outer loop stays synchronous training).

    Every group must pass the same payloads and weights in the same order (by group id); the
    result is then bit-identical in every group. The sum runs in fp32, one payload at a time,
    and is divided once at the end (so with codec ``none`` and ``M = 1`` it is exact); equal
    weights take the unweighted path, bit for bit."""
    if not payloads:
        raise ValueError("average_encoded needs at least one group's payload")
    if weights is not None and len(weights) != len(payloads):
        raise ValueError(f"{len(weights)} weights for {len(payloads)} payloads")
    if weights is None or len(set(weights)) == 1:
        acc = decode_delta(payloads[0], numel).clone()
        for enc in payloads[1:]:
            acc.add_(decode_delta(enc, numel))
        return acc.div_(len(payloads))
    if min(weights) <= 0:
        raise ValueError(f"weights must be > 0, got {list(weights)}")
    acc = decode_delta(payloads[0], numel).mul(float(weights[0]))
    for enc, w in zip(payloads[1:], weights[1:], strict=True):
        acc.add_(decode_delta(enc, numel), alpha=float(w))
    return acc.div_(float(sum(weights)))
