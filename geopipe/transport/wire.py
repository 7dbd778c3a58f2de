"""Pure cost model of what crosses the WAN: encoded sizes, codec speed and link transfer time.

This module is imported by the planner, which must stay cheap to import and free of heavy
dependencies, so it uses only the standard library (no torch, no numpy). The byte counts here
are the contract that `geopipe.transport.codec` is tested against: a plan built from these
numbers describes exactly the bytes the runtime sends.
"""

from __future__ import annotations

import math

CODECS: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "int4", "int4h", "int2h", "topk")
# Group-wise low-bit codecs: GROUP consecutive elements share one fp16 scale; the "h" ones
# rotate each group by a seeded randomized Hadamard transform first.
GROUPED: dict[str, int] = {"int4": 4, "int4h": 4, "int2h": 2}  # codec -> bits per element
GROUP = 64
SEED_BYTES = 8  # the rotation's seed travels with every "h" message (int64)
DIRECTIONS: tuple[str, ...] = ("forward", "backward")

# Top-k indices are sent as int32, so a tensor larger than this cannot be top-k encoded.
MAX_TOPK_NUMEL = 2**31 - 1


def check_codec(codec: str) -> None:
    """Reject unknown codec names early, so a typo in a config fails before training starts.
    A boundary's setting may name one codec per direction: ``"forward/backward"``."""
    parts = codec.split("/")
    if len(parts) > 2 or any(c not in CODECS for c in parts):
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS} (or 'fwd/bwd')")


def codec_pair(codec: str) -> tuple[str, str]:
    """``(forward, backward)`` codecs of a boundary's setting: activations downstream use the
    first, gradients upstream the second; one name means the same codec both ways."""
    f, _, b = codec.partition("/")
    return f, b or f


def pair_name(forward: str, backward: str) -> str:
    """The setting naming ``forward`` and ``backward`` (one name when they agree)."""
    return forward if forward == backward else f"{forward}/{backward}"


# Codecs from the coarsest to exact, by the relative error they add to a tensor: top-k sends
# 1 % (its error feedback catches up later), then 2, 4 and 8 bits per element, half floats.
FINENESS: tuple[str, ...] = ("topk", "int2h", "int4", "int4h", "int8", "bf16", "fp16", "none")


def finer_codec(codec: str, allowed: tuple[str, ...] | list[str] | set[str] = CODECS) -> str:
    """The next codec after ``codec`` on the fineness ladder among ``allowed`` (``none``,
    exact, is always allowed); ``none`` stays ``none``."""
    check_codec(codec)
    rest = FINENESS[FINENESS.index(codec) + 1 :]
    return next((c for c in rest if c in allowed), "none")


def direction_codec(codec: str, direction: str) -> str:
    """The codec a boundary's setting ``codec`` uses in ``direction``."""
    check_direction(direction)
    return codec_pair(codec)[direction == "backward"]


def check_direction(direction: str) -> None:
    """Reject unknown directions; top-k behaves differently for activations and gradients."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")


def check_topk_ratio(topk_ratio: float) -> None:
    """A ratio outside (0, 1] would ask for no values or more values than the tensor holds."""
    if not 0.0 < topk_ratio <= 1.0:
        raise ValueError(f"topk_ratio must be in (0, 1], got {topk_ratio}")


def topk_count(numel: int, topk_ratio: float) -> int:
    """Number of values top-k keeps; shared by the cost model and the codec so they agree."""
    check_topk_ratio(topk_ratio)
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(topk_ratio * numel)))


def int8_rows(numel: int, row_len: int) -> int:
    """Rows (one fp32 scale each) of a tensor quantised per row of its last dimension."""
    if numel <= 0 or row_len <= 0:
        return 0
    if numel % row_len:
        raise ValueError(f"numel {numel} is not a multiple of row_len {row_len}")
    return numel // row_len


def groups(numel: int) -> int:
    """Groups of :data:`GROUP` elements (the last one zero-padded) of a grouped codec."""
    return -(-numel // GROUP) if numel > 0 else 0


def wire_bytes(
    codec: str,
    numel: int,
    row_len: int,
    elem_bytes: int = 4,
    direction: str = "forward",
    topk_ratio: float = 0.01,
) -> int:
    """Exact payload bytes of one encoded tensor (excluding the small fixed header); a
    per-direction setting (``"int4h/int8"``) counts ``direction``'s codec.

    `row_len` is the size of the last dimension (1 for a scalar); `elem_bytes` is the size of
    the tensor's own dtype, which only matters for the uncompressed "none" codec. Top-k is only
    applied to gradients ("backward"), where error feedback makes it sound; activations sent
    with "topk" go as bf16.
    """
    check_codec(codec)
    codec = direction_codec(codec, direction)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if codec == "none":
        return numel * elem_bytes
    if codec in ("fp16", "bf16"):
        return numel * 2
    if codec == "int8":
        return numel + int8_rows(numel, row_len) * 4
    if codec in GROUPED:  # packed codes + one fp16 scale per group (+ the rotation's seed)
        g = groups(numel)
        seed = SEED_BYTES if codec.endswith("h") else 0
        return g * (GROUP * GROUPED[codec] // 8 + 2) + seed
    # topk
    if direction == "forward":
        return numel * 2
    if numel > MAX_TOPK_NUMEL:
        raise ValueError(f"topk indices are int32; numel {numel} is too large")
    return topk_count(numel, topk_ratio) * 6  # fp16 value + int32 index per kept element


# Nominal encode+decode throughput (bytes of the original fp32 tensor per second) for each
# codec, which the planner charges against WAN time when nothing better is known: a launch
# with `plan.calibrate` measures each searched codec on its machine, and a site's YAML may
# give `codec_gb_per_s` (`geopipe.optimizer.pipecosts.codec_speed`).
_NOMINAL_CODEC_THROUGHPUT: dict[str, float] = {
    "none": math.inf,
    "fp16": 8e9,
    "bf16": 8e9,
    "int8": 4e9,
    "int4": 1.5e9,
    "int4h": 1e9,
    "int2h": 1e9,
    "topk": 1e9,
}


def codec_throughput_bytes_per_s(codec: str) -> float:
    """Nominal encode+decode speed of `codec`, so the planner can price compression CPU time."""
    check_codec(codec)
    if "/" in codec:
        raise ValueError(f"{codec!r} names a codec per direction: price each direction's")
    return _NOMINAL_CODEC_THROUGHPUT[codec]


def transfer_time(nbytes: int, bandwidth_bps: float, latency_s: float, loss: float = 0.0) -> float:
    """Expected one-way time of one message on an otherwise idle link.

    Latency plus serialisation; packet loss is modelled as retransmission of the lost packets
    (each of which may be lost again), which stretches serialisation by 1 / (1 - loss). The
    link emulator samples this same process, so its mean matches this value.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps}")
    if not latency_s >= 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s}")
    if not 0.0 <= loss < 1.0:
        raise ValueError(f"loss must be in [0, 1), got {loss}")
    return latency_s + nbytes * 8 / bandwidth_bps / (1.0 - loss)
