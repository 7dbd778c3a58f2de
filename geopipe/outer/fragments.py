"""The Streaming DiLoCo schedule: which fragment is sent and applied after which inner step.

Pure Python, so the planner's checks and the runtime's driver read one definition. The
order of operations is torchft's (``torchft/local_sgd.py``, class ``DiLoCo``), the reference
for the semantics, not a dependency:

* the parameters split into ``F`` fragments; each fragment is synced once every ``H`` inner
  steps, and the fragments are staggered by ``H / F`` steps, round robin: fragment ``f`` is
  applied after inner steps ``(f + 1) * H / F + k * H`` for ``k = 0, 1, ...`` (with ``F = 1``:
  after every ``H``-th step, plain DiLoCo);
* fragment ``f``'s pseudo-gradient is taken, encoded and sent ``tau`` inner steps before its
  apply (torchft's ``fragment_sync_delay``), so the transfer hides behind ``tau`` inner steps:
  the outer loop's counterpart of the pipeline's delta-N. With ``tau = 0`` the send blocks at
  the apply step, as in plain DiLoCo;
* hence ``H`` must be a multiple of ``F`` and ``0 <= tau < H / F``: a fragment's send must
  start after the previous fragment's apply, so at most one fragment is in flight.

Inner steps are counted from 1: "after inner step ``s``" means once ``s`` inner optimizer
steps have completed since the start of training (the outer state at step 0 is the initial
model).

How the parameters split: fragment ``f`` of a tensor is the ``f``-th of ``F`` equal contiguous
slices of its flattened elements (:func:`fragment_bounds`). The outer step is elementwise, so
any split is valid; equal slices of each ZeRO-1 partition let every rank of a group apply its
own share of every fragment without gathering the model, and keep the fragments' sizes (so
their transfer times) equal.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StreamingSchedule", "check_outer_settings", "fragment_bounds"]


def _check_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    return value


def check_outer_settings(h: int, fragments: int = 1, overlap: int = 0) -> None:
    """Raise ``ValueError`` naming the YAML field (``plan.outer.h``, ``plan.outer.fragments``,
    ``plan.outer.overlap``) when ``h``, ``fragments`` and ``overlap`` cannot form a schedule."""
    h = _check_int(h, "plan.outer.h")
    fragments = _check_int(fragments, "plan.outer.fragments")
    overlap = _check_int(overlap, "plan.outer.overlap")
    if h < 1:
        raise ValueError(f"plan.outer.h must be >= 1 inner step, got {h}")
    if fragments < 1:
        raise ValueError(f"plan.outer.fragments must be >= 1, got {fragments}")
    if h % fragments:
        raise ValueError(
            f"plan.outer.h ({h}) must be a multiple of plan.outer.fragments ({fragments}): "
            "each fragment is synced every h steps, staggered by h / fragments"
        )
    period = h // fragments
    if not 0 <= overlap < period:
        raise ValueError(
            f"plan.outer.overlap must be in [0, h / fragments) = [0, {period}), got {overlap}: "
            "a fragment's send starts after the previous fragment's apply"
        )


@dataclass(frozen=True)
class StreamingSchedule:
    """``h`` inner steps per round, ``fragments`` staggered fragments, ``overlap`` (tau) inner
    steps between a fragment's send and its apply. Validated on construction."""

    h: int
    fragments: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        check_outer_settings(self.h, self.fragments, self.overlap)

    @property
    def period(self) -> int:
        """Inner steps between two consecutive fragment applies (``h / fragments``)."""
        return self.h // self.fragments

    def apply_step(self, fragment: int, round_: int = 0) -> int:
        """The inner step after which ``fragment``'s ``round_``-th outer step is applied."""
        self._check_fragment(fragment)
        if round_ < 0:
            raise ValueError(f"round must be >= 0, got {round_}")
        return (fragment + 1) * self.period + round_ * self.h

    def send_step(self, fragment: int, round_: int = 0) -> int:
        """The inner step after which ``fragment``'s ``round_``-th pseudo-gradient is sent."""
        return self.apply_step(fragment, round_) - self.overlap

    def applies_at(self, step: int) -> int | None:
        """The fragment applied after inner step ``step`` (>= 1), or None."""
        if step < 1 or step % self.period:
            return None
        return (step // self.period - 1) % self.fragments

    def sends_at(self, step: int) -> int | None:
        """The fragment whose send starts after inner step ``step`` (>= 1), or None."""
        return self.applies_at(step + self.overlap) if step >= 1 else None

    def round_of(self, step: int) -> int:
        """The round (0-based) a fragment applied after ``step`` belongs to."""
        if self.applies_at(step) is None:
            raise ValueError(f"no fragment is applied after inner step {step}")
        return (step - self.period) // self.h

    def events(self, steps: int) -> list[tuple[int, str, int]]:
        """``(step, "send" | "apply", fragment)`` for every inner step in ``1..steps``, sends
        before applies of the same step (with ``overlap = 0`` both happen at the apply step)."""
        out: list[tuple[int, str, int]] = []
        for step in range(1, steps + 1):
            sent = self.sends_at(step)
            if sent is not None:
                out.append((step, "send", sent))
            applied = self.applies_at(step)
            if applied is not None:
                out.append((step, "apply", applied))
        return out

    def _check_fragment(self, fragment: int) -> None:
        if not 0 <= fragment < self.fragments:
            raise ValueError(f"fragment {fragment} out of range [0, {self.fragments})")


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``fragments`` contiguous slices of ``numel`` elements: sizes
    differ by at most one, the longer ones first (as ``torch.tensor_split``)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if fragments < 1:
        raise ValueError(f"plan.outer.fragments must be >= 1, got {fragments}")
    base, extra = divmod(numel, fragments)
    bounds, start = [], 0
    for f in range(fragments):
        end = start + base + (1 if f < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
