"""What a receiver's plan expects from its peers: frames are checked against it before their
payload is allocated, and anything else is refused.

Every peer of the data plane proved the run's secret (:mod:`.security`), so a frame that
does not fit is a bug or a compromised node of the run, not a stranger; still, its header
decides what the receiver allocates, and its key decides what the consumer is handed.
`ExpectedFrames` is the receiver's side of the plan: per kind of message (``key[0]``) the
shapes, tensor dtypes, codecs and key length allowed, the window of steps the consumer can
be waiting for (``at_step``: a frame filed early under a future key would otherwise sit in
the inbox until the genuine one came and was taken for a duplicate) and whether the values
must be finite. The runtime builds one from its plan, for example for a stage receiving
activations and gradients of shape ``(mb, seq, hidden)`` in bf16::

    spec = FrameSpec(shapes=frozenset({(mb, seq, hidden)}), dtypes=frozenset({"bfloat16"}),
                     key_len=3, step_at=1)
    expect = ExpectedFrames({"F": spec, "B": spec}, ahead=1, finite=True)
    links.listen(host, expect=expect)   # then expect.at_step(step) as each step begins

This module knows no key names: those are the runtime's.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from geopipe.transport.codec import Encoded
from geopipe.transport.frames import FrameInfo, FrameRefusedError

__all__ = ["ExpectedFrames", "FrameSpec", "all_finite"]


@dataclass(frozen=True)
class FrameSpec:
    """One kind of message: None allows anything (within the transport's own bounds)."""

    shapes: frozenset[tuple[int, ...]] | None = None
    dtypes: frozenset[str] | None = None  # torch dtype names: "float32", "bfloat16", ...
    codecs: frozenset[str] | None = None
    key_len: int | None = None
    step_at: int | None = None  # where the key holds its step: checked against the window
    max_numel: int | None = None
    finite: bool | None = None  # None: as the `ExpectedFrames` says for every kind


class ExpectedFrames:
    """The frames a receiver accepts (see the module's note); called with each frame's
    `FrameInfo` on the reader's thread, it raises `FrameRefusedError` for anything else.

    ``ahead``/``behind``: how many steps after/before the consumer's current step (set by
    `at_step`; None: no window yet) a frame's step may be. ``finite``: a frame holding NaN
    or inf is refused for its key (the stream itself is sound); a kind's own
    `FrameSpec.finite` overrides it."""

    def __init__(
        self,
        kinds: Mapping[str, FrameSpec],
        ahead: int = 1,
        behind: int = 0,
        finite: bool = False,
    ) -> None:
        self.kinds = dict(kinds)
        self.ahead, self.behind, self.finite = ahead, behind, finite
        self._step: int | None = None
        self._lock = threading.Lock()

    def at_step(self, step: int | None) -> None:
        """The consumer's current step: frames of steps ``[step - behind, step + ahead]``
        are accepted from now on."""
        with self._lock:
            self._step = step

    def drop(self, *kinds: str) -> None:
        """Expect no more messages of ``kinds`` (e.g. a launch-time probe, once it is over)."""
        for kind in kinds:
            self.kinds.pop(kind, None)  # one dict operation: safe beside a reader's lookup

    def wants_finite(self, key: Hashable) -> bool:
        """Whether a frame under ``key`` must hold only finite values."""
        kind = key[0] if isinstance(key, tuple) and key else key
        spec = self.kinds.get(kind) if isinstance(kind, str) else None
        return self.finite if spec is None or spec.finite is None else spec.finite

    def __call__(self, info: FrameInfo) -> None:
        reason = self.why_not(info)
        if reason is not None:
            raise FrameRefusedError(f"frame {info.key!r} not expected: {reason}")

    def why_not(self, info: FrameInfo) -> str | None:
        """Why ``info`` is not expected, or None if it is."""
        key = info.key
        kind = key[0] if isinstance(key, tuple) and key else key
        spec = self.kinds.get(kind) if isinstance(kind, str) else None
        if spec is None:
            return f"no message of kind {kind!r} is expected"
        if spec.key_len is not None and len(key) != spec.key_len:  # type: ignore[arg-type]
            return f"key of {len(key)} items, expected {spec.key_len}"  # type: ignore[arg-type]
        if spec.shapes is not None and info.shape not in spec.shapes:
            return f"shape {list(info.shape)}, expected one of {sorted(spec.shapes)}"
        if spec.dtypes is not None and info.dtype not in spec.dtypes:
            return f"dtype {info.dtype}, expected one of {sorted(spec.dtypes)}"
        if spec.codecs is not None and info.codec not in spec.codecs:
            return f"codec {info.codec}, expected one of {sorted(spec.codecs)}"
        if spec.max_numel is not None and info.numel > spec.max_numel:
            return f"{info.numel} elements, at most {spec.max_numel} expected"
        return self._outside_window(key, spec)

    def _outside_window(self, key: Hashable, spec: FrameSpec) -> str | None:
        if spec.step_at is None:
            return None
        with self._lock:
            step = self._step
        at = key[spec.step_at] if isinstance(key, tuple) and len(key) > spec.step_at else None
        if type(at) is not int:
            return f"no step at position {spec.step_at} of the key"
        if step is not None and not step - self.behind <= at <= step + self.ahead:
            return f"step {at} outside the window [{step - self.behind}, {step + self.ahead}]"
        return None


def all_finite(enc: Encoded) -> bool:
    """Whether every value ``enc`` carries is finite, read from its encoding (no decode):
    float arrays directly, 16-bit patterns as bf16 (how the codecs send bf16), integer
    codes trivially (their scales are float arrays)."""
    for a in enc.arrays:
        if a.dtype.kind == "f":
            if a.size and not bool(np.isfinite(a).all()):
                return False
        elif a.dtype == np.uint16 and a.size and bool(((a & 0x7F80) == 0x7F80).any()):
            return False
    return True
