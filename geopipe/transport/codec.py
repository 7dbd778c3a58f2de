"""Compression codecs for tensors crossing the WAN (their integrity seal: :mod:`.seal`).

Activations (forward) and their gradients (backward) are encoded into an `Encoded`: a small
dataclass of flat numpy arrays that pickles cheaply (Ray ships numpy buffers out of band).
`Encoded.payload_nbytes` equals `wire.wire_bytes(...)` exactly, so the planner's cost model
and the runtime agree on what is sent.

Decoding is done in numpy rather than torch because arrays that come back from Ray's object
store are read-only, and `torch.from_numpy` on them would alias read-only memory.
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from geopipe.transport import wire

__all__ = [
    "CODECS",
    "Codec",
    "Encoded",
    "GroupedCodec",
    "decode",
    "make_codec",
    "measure_speeds",
    "rotate",
    "unrotate",
]

CODECS = wire.CODECS

_FP16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class Encoded:
    """One encoded tensor: flat payload arrays plus what is needed to rebuild it.

    `dtype` is the original torch dtype name (e.g. "float32"); decoding always yields float32.
    """

    codec: str
    shape: tuple[int, ...]
    dtype: str
    direction: str
    arrays: tuple[np.ndarray, ...]

    @property
    def numel(self) -> int:
        """Element count of the original tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def row_len(self) -> int:
        """Last-dimension size (1 for a scalar), the row length int8 scales are taken over."""
        return self.shape[-1] if self.shape else 1

    @property
    def payload_nbytes(self) -> int:
        """Bytes on the wire excluding the header; equals `wire.wire_bytes` for this tensor."""
        return sum(int(a.nbytes) for a in self.arrays)


@runtime_checkable
class Codec(Protocol):
    """Encodes tensors for the wire and decodes them back to float32."""

    name: str

    def encode(
        self, t: torch.Tensor, key: str | None = None, direction: str = "forward"
    ) -> Encoded:
        """Encode `t`; `key` names the stream for stateful codecs (top-k error feedback)."""
        ...

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Rebuild a float32 tensor of the original shape."""
        ...


# --------------------------------------------------------------------------- helpers


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _prepare(t: torch.Tensor, direction: str) -> torch.Tensor:
    """Validate and detach; codecs only make sense for floating tensors."""
    wire.check_direction(direction)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"codecs encode floating tensors, got {t.dtype}")
    return t.detach().cpu()


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    """Round to bf16 (nearest-even) and return fresh 16-bit patterns that do not alias `t`."""
    return t.to(torch.bfloat16, copy=True).reshape(-1).view(torch.int16).numpy().view(np.uint16)


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an fp32, so widening is an exact shift (numpy has no bf16)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _as_torch(a: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Wrap a freshly computed (hence writable, unshared) float32 array as a tensor."""
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(shape))


def _check_codec_name(enc: Encoded, name: str) -> None:
    if enc.codec != name:
        raise ValueError(f"{name} codec cannot decode a {enc.codec!r} payload")


# --------------------------------------------------------------------------- codecs


class NoneCodec:
    """Sends the tensor's raw bytes in its own dtype: exact, and the baseline for the planner."""

    name = "none"

    def encode(
        self, t: torch.Tensor, key: str | None = None, direction: str = "forward"
    ) -> Encoded:
        """Copy the raw bytes, so later in-place writes to `t` cannot change what is sent."""
        t = _prepare(t, direction)
        flat = t.reshape(-1)
        if t.dtype == torch.bfloat16:
            payload = flat.view(torch.int16).numpy().view(np.uint16).copy()
        else:
            payload = flat.numpy().copy()
        return Encoded(self.name, tuple(t.shape), _dtype_name(t.dtype), direction, (payload,))

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Widen to float32 (exact for every float dtype except float64)."""
        _check_codec_name(enc, self.name)
        (payload,) = enc.arrays
        if enc.dtype == "bfloat16":
            out = _bf16_bits_to_f32(payload)
        else:
            out = payload.astype(np.float32, copy=True)
        return _as_torch(out, enc.shape)


class Fp16Codec:
    """Half precision: at most 2^-11 (~5e-4) relative error per value in fp16's normal range
    (above 6.1e-5), 2^-25 absolute below it; values beyond +-65504 overflow to inf like fp16."""

    name = "fp16"

    def encode(
        self, t: torch.Tensor, key: str | None = None, direction: str = "forward"
    ) -> Encoded:
        """Round to fp16."""
        t = _prepare(t, direction)
        payload = t.to(torch.float16, copy=True).reshape(-1).numpy()
        return Encoded(self.name, tuple(t.shape), _dtype_name(t.dtype), direction, (payload,))

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Widen to float32."""
        _check_codec_name(enc, self.name)
        (payload,) = enc.arrays
        return _as_torch(payload.astype(np.float32), enc.shape)


class Bf16Codec:
    """bfloat16: fp32's range with ~4e-3 relative error, so it never overflows."""

    name = "bf16"

    def encode(
        self, t: torch.Tensor, key: str | None = None, direction: str = "forward"
    ) -> Encoded:
        """Round to bf16 and keep the 16-bit patterns."""
        t = _prepare(t, direction)
        return Encoded(self.name, tuple(t.shape), _dtype_name(t.dtype), direction, (_bf16_bits(t),))

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Widen to float32 exactly."""
        _check_codec_name(enc, self.name)
        (payload,) = enc.arrays
        return _as_torch(_bf16_bits_to_f32(payload), enc.shape)


class Int8Codec:
    """Symmetric per-row absmax int8 over the last dimension, one fp32 scale per row.

    Per-row scales keep one outlier channel row from crushing the precision of every other
    row. Max error per element is scale/2 with scale = absmax/127. A row containing a
    non-finite value decodes to NaN, so overflow stays visible downstream.
    """

    name = "int8"

    def encode(
        self, t: torch.Tensor, key: str | None = None, direction: str = "forward"
    ) -> Encoded:
        """Quantise each row to [-127, 127] with scale absmax/127 (zero rows get scale 0)."""
        t = _prepare(t, direction)
        shape = tuple(t.shape)
        row_len = shape[-1] if shape else 1
        rows = wire.int8_rows(t.numel(), row_len)
        if rows == 0:
            q = np.zeros(0, dtype=np.int8)
            scale = np.zeros(0, dtype=np.float32)
        else:
            x = t.to(torch.float32).reshape(rows, row_len)
            scale_t = x.abs().amax(dim=1) / 127.0
            safe = torch.where(scale_t > 0, scale_t, torch.ones_like(scale_t))
            qf = torch.nan_to_num(x / safe[:, None], nan=0.0, posinf=127.0, neginf=-127.0)
            q = qf.round_().clamp_(-127, 127).to(torch.int8).reshape(-1).numpy()
            scale = scale_t.numpy()
        return Encoded(self.name, shape, _dtype_name(t.dtype), direction, (q, scale))

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Multiply each row by its scale."""
        _check_codec_name(enc, self.name)
        q, scale = enc.arrays
        if scale.size == 0:
            return torch.zeros(enc.shape, dtype=torch.float32)
        x = q.astype(np.float32).reshape(scale.size, -1)
        with np.errstate(invalid="ignore"):  # 0 * inf in a non-finite row is meant to be NaN
            x *= scale[:, None]
        return _as_torch(x, enc.shape)


class TopKCodec:
    """Top-k sparsification with error feedback for gradients; bf16 for activations.

    Only the k largest-magnitude entries of (gradient + residual) are sent, as fp16 values and
    int32 indices; what was not sent (including fp16 rounding) is kept as the residual for
    `key` and added to the next gradient encoded under that key. Error feedback is what makes
    top-k converge, so `key` must name a stream whose tensors line up step after step (e.g.
    link + micro-batch slot). Activations have no such correction, so forward uses bf16.
    """

    name = "topk"

    def __init__(self, topk_ratio: float = 0.01) -> None:
        wire.check_topk_ratio(topk_ratio)
        self.topk_ratio = topk_ratio
        self._residuals: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def encode(
        self, t: torch.Tensor, key: str | None = None, direction: str = "forward"
    ) -> Encoded:
        """bf16 for "forward"; top-k with the per-key residual for "backward"."""
        t = _prepare(t, direction)
        shape = tuple(t.shape)
        dtype = _dtype_name(t.dtype)
        if direction == "forward":
            return Encoded(self.name, shape, dtype, direction, (_bf16_bits(t),))
        if key is None:
            raise ValueError(
                "topk backward encoding needs a key to keep its error-feedback residual"
            )
        numel = t.numel()
        if numel > wire.MAX_TOPK_NUMEL:
            raise ValueError(f"topk indices are int32; numel {numel} is too large")
        k = wire.topk_count(numel, self.topk_ratio)
        with self._lock:
            acc = t.to(torch.float32).reshape(-1).clone()
            residual = self._residuals.get(key)
            if residual is not None:
                if residual.numel() != numel:
                    raise ValueError(
                        f"topk key {key!r}: residual has {residual.numel()} elements but the "
                        f"new tensor has {numel}; use a distinct key or reset({key!r})"
                    )
                acc += residual
            idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
            # Clamp so an outlier cannot become inf in fp16; error feedback keeps the excess.
            vals = acc[idx].clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
            acc[idx] -= vals.to(torch.float32)
            self._residuals[key] = acc
        payload = (vals.numpy(), idx.to(torch.int32).numpy())
        return Encoded(self.name, shape, dtype, direction, payload)

    def decode(self, enc: Encoded) -> torch.Tensor:
        """Scatter the kept values into zeros (backward) or widen bf16 (forward)."""
        _check_codec_name(enc, self.name)
        if enc.direction == "forward":
            (payload,) = enc.arrays
            return _as_torch(_bf16_bits_to_f32(payload), enc.shape)
        vals, idx = enc.arrays
        out = np.zeros(enc.numel, dtype=np.float32)
        out[idx] = vals.astype(np.float32)
        return _as_torch(out, enc.shape)

    def reset(self, key: str | None = None) -> None:
        """Drop the residual of `key` (or of every key), e.g. when a stream's shape changes."""
        with self._lock:
            if key is None:
                self._residuals.clear()
            else:
                self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals by key, so checkpoints can resume without losing unsent gradient."""
        with self._lock:
            return {k: v.clone() for k, v in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore residuals saved by `state_dict`."""
        with self._lock:
            self._residuals = {
                k: v.detach().to(torch.float32).reshape(-1).clone() for k, v in state.items()
            }


@functools.lru_cache(maxsize=1)
def _hadamard() -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of one group (symmetric: its own inverse)."""
    h = torch.ones(1, 1)
    while h.shape[0] < wire.GROUP:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(wire.GROUP)


@functools.lru_cache(maxsize=256)
def _signs(seed: int) -> torch.Tensor:
    """The random ±1 diagonal of a link's rotation, a pure function of its seed."""
    g = torch.Generator().manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randint(0, 2, (wire.GROUP,), generator=g).to(torch.float32) * 2 - 1


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """(groups, 64) -> the randomized Hadamard rotation of each row: spreads an outlier over
    its group, so one fp16 scale serves all 64 elements (the TAH-Quant/QuaRot idea)."""
    return (x * _signs(seed)) @ _hadamard()


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """The exact inverse of :func:`rotate` (H is orthonormal and symmetric)."""
    return (y @ _hadamard()) * _signs(seed)


_FP16_TINY = 2.0**-24  # the smallest fp16 subnormal: smaller scales flush to zero


class GroupedCodec:
    """Group-wise low-bit quantisation: each group of 64 consecutive elements (the last one
    zero-padded; along the last dimension whenever it is a multiple of 64, as hidden sizes
    are) gets one fp16 scale, each element a 4- or 2-bit code, packed two or four per byte.

    * ``int4``: symmetric levels -7..7 × scale, scale = the group's absmax / 7 (error per
      element at most scale / 2);
    * ``int4h``: the same after a seeded randomized Hadamard rotation of each group, which
      makes the group's values near-Gaussian and tames outlier channels; the seed travels
      with the message, so any receiver inverts it exactly;
    * ``int2h``: rotated, four levels ±0.5·s, ±1.5·s with s the group's RMS — close to the
      Lloyd–Max quantiser of the Gaussian the rotation makes (±0.45σ, ±1.51σ) — for the
      slowest links.

    Non-finite input is refused (a scale cannot carry it); a group whose scale exceeds
    fp16's range is refused too (use int8 or none there). ``stochastic`` rounds gradients
    (direction "backward") up or down at random in proportion, so the error is unbiased;
    its generator is seeded and part of the codec's state.
    """

    def __init__(self, name: str, seed: int = 0, stochastic: bool = False) -> None:
        self.name = name
        self.bits = wire.GROUPED[name]
        self.rotated = name.endswith("h")
        self.seed = int(seed)
        self.stochastic = stochastic
        self._gen = torch.Generator().manual_seed(self.seed + 1)

    def encode(
        self, t: torch.Tensor, key: str | None = None, direction: str = "forward"
    ) -> Encoded:
        t = _prepare(t, direction)
        shape = tuple(t.shape)
        x = t.to(torch.float32).reshape(-1)
        if not bool(torch.isfinite(x).all()):
            raise ValueError(
                f"{self.name}: the tensor holds NaN or inf, which a scale cannot "
                "carry; send it with none, fp16 or int8"
            )
        n = x.numel()
        g = wire.groups(n)
        x = torch.nn.functional.pad(x, (0, g * wire.GROUP - n)).reshape(g, wire.GROUP)
        if self.rotated:
            x = rotate(x, self.seed)
        # int4: absmax / 7 (no clipping); int2: the RMS (the Gaussian's optimum, see above)
        scale = x.abs().amax(dim=1) / 7.0 if self.bits == 4 else x.pow(2).mean(dim=1).sqrt()
        if bool((scale > _FP16_MAX).any()):
            raise ValueError(
                f"{self.name}: a group's scale {float(scale.max()):.3g} exceeds "
                "fp16's range; send this tensor with int8 or none"
            )
        scale = torch.where(scale < _FP16_TINY, torch.zeros_like(scale), scale)
        scale = scale.to(torch.float16).to(torch.float32)  # quantise with what is sent
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        y = x / safe
        sr = self.stochastic and direction == "backward"
        if self.bits == 4:
            q = torch.floor(y + torch.rand(y.shape, generator=self._gen)) if sr else y.round()
            codes = (q.clamp_(-7, 7) + 8).to(torch.uint8)  # 1..15
            codes = torch.where(scale[:, None] > 0, codes, torch.full_like(codes, 8))
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        else:
            if sr:  # between the two levels around y, up with the distance's probability
                z = (y + 1.5).clamp(0, 3)
                c = torch.floor(z + torch.rand(z.shape, generator=self._gen))
            else:  # the nearest of -1.5, -0.5, 0.5, 1.5: boundaries at -1, 0, 1
                c = torch.floor(y) + 2
            codes = c.clamp_(0, 3).to(torch.uint8)
            packed = (
                codes[:, 0::4]
                | (codes[:, 1::4] << 2)
                | (codes[:, 2::4] << 4)
                | (codes[:, 3::4] << 6)
            )
        arrays = [packed.reshape(-1).numpy(), scale.to(torch.float16).numpy()]
        if self.rotated:
            arrays.append(np.array([self.seed], dtype=np.int64))
        return Encoded(self.name, shape, _dtype_name(t.dtype), direction, tuple(arrays))

    def decode(self, enc: Encoded) -> torch.Tensor:
        _check_codec_name(enc, self.name)
        packed = torch.from_numpy(np.ascontiguousarray(enc.arrays[0]).copy())
        scale = torch.from_numpy(enc.arrays[1].astype(np.float32))
        g = scale.numel()
        if g == 0:
            return torch.zeros(enc.shape, dtype=torch.float32)
        packed = packed.reshape(g, -1)
        if self.bits == 4:
            codes = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(g, wire.GROUP)
            y = codes.to(torch.float32) - 8
        else:
            parts = [(packed >> s) & 0x3 for s in (0, 2, 4, 6)]
            codes = torch.stack(parts, dim=2).reshape(g, wire.GROUP)
            y = codes.to(torch.float32) - 1.5
        x = y * scale[:, None]
        if self.rotated:
            x = unrotate(x, int(enc.arrays[2][0]))
        return x.reshape(-1)[: int(np.prod(enc.shape, dtype=np.int64))].reshape(enc.shape)

    def state_dict(self) -> dict:
        return {"generator": self._gen.get_state()} if self.stochastic else {}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self._gen.set_state(state["generator"])


_CODEC_CLASSES: dict[str, type] = {
    "none": NoneCodec,
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
}


def make_codec(
    name: str, topk_ratio: float = 0.01, seed: int = 0, stochastic: bool = False
) -> Codec:
    """Build the codec called `name`: "topk" keeps error feedback (`topk_ratio`); the
    grouped low-bit ones take the link's rotation `seed` and optional stochastic rounding
    of gradients."""
    wire.check_codec(name)
    if name == "topk":
        return TopKCodec(topk_ratio)
    if name in wire.GROUPED:
        return GroupedCodec(name, seed, stochastic)
    return _CODEC_CLASSES[name]()


# Stateless decoders: decoding never needs the encoder's residuals.
_DECODERS: dict[str, Codec] = {name: make_codec(name) for name in CODECS}


def decode(enc: Encoded) -> torch.Tensor:
    """Decode any `Encoded` by its codec name, without needing the encoding codec object."""
    wire.check_codec(enc.codec)
    return _DECODERS[enc.codec].decode(enc)


def measure_speeds(
    codecs: list[str], shape: tuple[int, ...], reps: int = 5, max_bytes: int = 4 << 20
) -> dict[str, float]:
    """Median encode + decode speed (GB/s of the fp32 tensor) of each codec on one thread
    (as a stage actor runs them), on a tensor of the boundary message's ``shape`` (fewer rows
    above ``max_bytes``: the speed per byte is what the planner charges)."""
    rows = max(1, min(math.prod(shape[:-1]), max_bytes // (4 * shape[-1])))
    x = torch.randn(rows, shape[-1], generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, float] = {}
    try:
        for name in codecs:
            codec = make_codec(name, seed=1)
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                codec.decode(codec.encode(x, key="probe", direction="backward"))
                times.append(time.perf_counter() - t0)
            out[name] = x.numel() * 4 / statistics.median(times[1:]) / 1e9
    finally:
        torch.set_num_threads(threads)
    return out
