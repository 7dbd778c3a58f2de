"""Cross-checks: relations between fields that pydantic cannot see (links name real sites and
chain them, the model fits the devices, the planner's knobs are usable and the batch
divides). Each check returns ``(field path, message)`` pairs."""

from __future__ import annotations

import difflib
from typing import NamedTuple

from geopipe.config.modelspec import MAX_LAYERS
from geopipe.config.outer import MAX_OUTER_H, MAX_OUTER_VALUES
from geopipe.config.specs import (
    MAX_DELTA_N,
    MAX_SITE_DEVICES,
    Choice,
    ClusterSpec,
    GiB,
    Range,
)
from geopipe.model.sizes import num_layers, param_totals, train_bytes_per_param
from geopipe.pipeline.partition import order_sites
from geopipe.transport.wire import CODECS, check_codec

__all__ = ["OuterSetting", "choice_values", "cross_check", "outer_settings"]

Problems = list[tuple[str, str]]


def choice_values(
    choice: Choice | None,
    *,
    default: list[int],
    powers_of_two: bool = False,
    upper: int | None = None,
) -> list[int]:
    """Expand a planner knob into its candidate values (sorted, unique).

    ``upper`` drops values above it before a range is expanded, so a typo like
    ``{min: 1, max: 1000000000}`` costs nothing where only small values are usable.
    """
    if choice is None:
        vals = sorted(set(default))
    elif isinstance(choice, int):
        vals = [choice]
    elif isinstance(choice, list):
        vals = sorted(set(choice))
    else:
        top = choice.max if upper is None else min(choice.max, upper)
        if powers_of_two:
            return [1 << i for i in range(0, 31) if choice.min <= (1 << i) <= top]
        return list(range(choice.min, top + 1))
    return vals if upper is None else [v for v in vals if v <= upper]


def _choice_bounds(choice: Choice) -> tuple[int, int]:
    """Smallest and largest value of a non-empty knob, without expanding a range."""
    if isinstance(choice, int):
        return choice, choice
    if isinstance(choice, list):
        return min(choice), max(choice)
    return choice.min, choice.max


def cross_check(spec: ClusterSpec) -> Problems:
    problems: list[tuple[str, str]] = []
    names = [s.name for s in spec.sites]
    for i, name in enumerate(names):
        if names.index(name) != i:
            problems.append((f"sites[{i}].name", f"duplicate site name '{name}'"))
    seen_dirs: set[tuple[str, str]] = set()
    for i, lk in enumerate(spec.links):
        for end, val in (("from", lk.src), ("to", lk.dst)):
            if val not in names:
                hint = difflib.get_close_matches(val, names, n=1)
                extra = f" (did you mean '{hint[0]}'?)" if hint else f" (sites: {', '.join(names)})"
                problems.append((f"links[{i}].{end}", f"unknown site '{val}'{extra}"))
        if lk.src == lk.dst:
            problems.append(
                (f"links[{i}]", f"a link joins two different sites, got '{lk.src}' twice")
            )
        if (lk.src, lk.dst) in seen_dirs:
            problems.append((f"links[{i}]", f"link {lk.src} -> {lk.dst} is given twice"))
        seen_dirs.add((lk.src, lk.dst))
        if not _known_codec(lk.codec):
            problems.append((f"links[{i}].codec", f"unknown codec '{lk.codec}' (one of {CODECS})"))
    for i, c in enumerate(spec.plan.codecs or []):
        if not _known_codec(c):
            problems.append((f"plan.codecs[{i}]", f"unknown codec '{c}' (one of {CODECS})"))
    for i, site in enumerate(spec.sites):
        for c in site.codec_gb_per_s:
            if c not in CODECS:
                problems.append(
                    (f"sites[{i}].codec_gb_per_s.{c}", f"unknown codec '{c}' (one of {CODECS})")
                )
    if problems:
        return problems

    if len(spec.sites) > 1 and not _sites_form_a_chain(spec):
        problems.append(
            ("links", "the links do not connect the sites into one chain; add the missing links")
        )

    problems += _check_plan(spec)

    # Does the model fit at all? Static state (weights, grads, Adam) of the whole model must fit
    # in all devices together, and the largest single layer must fit in the largest device.
    m = spec.model
    total_params, largest_layer = param_totals(m)  # closed form: n_layer may be a typo
    # Weights, gradients and Adam state before ZeRO-1 shards the Adam part.
    bpp = train_bytes_per_param(spec.training.precision)
    total_need = total_params * bpp
    total_have = sum(s.devices * s.device_memory_gb * GiB for s in spec.sites)
    biggest_dev = max(s.device_memory_gb * GiB for s in spec.sites)
    if total_need > total_have:
        problems.append(
            (
                "model",
                f"the model's weights, gradients and Adam state need {total_need / GiB:.3g} GiB "
                f"but all devices together have {total_have / GiB:.3g} GiB",
            )
        )
    elif largest_layer * bpp > biggest_dev:
        problems.append(
            (
                "model",
                f"one layer needs {largest_layer * bpp / GiB:.3g} GiB but the largest device has "
                f"{biggest_dev / GiB:.3g} GiB",
            )
        )
    if m.n_layer > MAX_LAYERS:
        problems.append(
            ("model.n_layer", f"{m.n_layer} layers is above the supported {MAX_LAYERS} (a typo?)")
        )
    layers = num_layers(m.n_layer)
    if sum(s.devices for s in spec.sites) > 1 and layers < len(spec.sites):
        problems.append(("model.n_layer", f"{layers} layers cannot span {len(spec.sites)} sites"))
    return problems


def _short(vals: list[int]) -> str:
    """A candidate list for a message, elided in the middle when long."""
    if len(vals) <= 8:
        return str(vals)
    return f"[{vals[0]}, {vals[1]}, {vals[2]}, …, {vals[-1]}]"


def _show_choice(choice: Choice) -> str:
    if isinstance(choice, Range):
        return f"{{min: {choice.min}, max: {choice.max}}}"
    return _short(sorted(set(choice))) if isinstance(choice, list) else str(choice)


def _check_plan(spec: ClusterSpec) -> Problems:
    """The planner knobs: non-empty, in range, and some combination divides the batch.

    Ranges are never expanded beyond what is useful: pipelines above the smallest site's
    device count cannot be placed (every site hosts a stage of every pipeline), and ΔN is
    capped at :data:`MAX_DELTA_N`.
    """
    pl = spec.plan
    problems: Problems = []
    empty = set()
    for name in ("micro_batch_size", "seq_len", "delta_n", "pipelines"):
        val = getattr(pl, name)
        if isinstance(val, list) and not val:
            empty.add(name)
            problems.append(
                (f"plan.{name}", "the list is empty: give at least one value (or omit the key)")
            )
    for i, s in enumerate(spec.sites):
        if s.devices > MAX_SITE_DEVICES:
            problems.append(
                (
                    f"sites[{i}]",
                    f"{s.devices} devices (nodes × devices_per_node) is above the supported "
                    f"{MAX_SITE_DEVICES} per site (a typo?)",
                )
            )
    if "seq_len" not in empty:
        problems += _check_seq_len(spec)
    mb_ok: list[int] = []  # the usable micro-batch sizes
    batch_divides = True
    if "micro_batch_size" not in empty:
        mb_problems, mb_ok = _check_micro_batch(spec)
        batch_divides = not any(path == "training.global_batch_size" for path, _ in mb_problems)
        problems += mb_problems
    if pl.pipelines is not None and "pipelines" not in empty:
        problems += _check_pipelines(spec, mb_ok if batch_divides else [])
    if "delta_n" not in empty:
        problems += _check_delta_n(spec)
    problems += _check_outer(spec)
    return problems


def _check_seq_len(spec: ClusterSpec) -> Problems:
    m = spec.model
    seq_vals = choice_values(spec.plan.seq_len, default=[m.max_seq_len], powers_of_two=True)
    problems: Problems = []
    bad = [v for v in seq_vals if v > m.max_seq_len or v < 2]
    if bad:
        problems.append(
            ("plan.seq_len", f"seq_len {bad[0]} is outside [2, model.max_seq_len={m.max_seq_len}]")
        )
    if not seq_vals:
        problems.append(("plan.seq_len", "the range contains no power of two"))
    return problems


def _check_micro_batch(spec: ClusterSpec) -> tuple[Problems, list[int]]:
    """Problems, and the usable micro-batch sizes."""
    gbs = spec.training.global_batch_size
    mb_vals = choice_values(spec.plan.micro_batch_size, default=[1], powers_of_two=True)
    mb_ok = [b for b in mb_vals if b >= 1]
    problems: Problems = []
    if not mb_vals:
        problems.append(("plan.micro_batch_size", "the range contains no power of two"))
    if len(mb_ok) < len(mb_vals):
        problems.append(("plan.micro_batch_size", "micro-batch sizes must be at least 1"))
    if mb_ok and not any(gbs % b == 0 for b in mb_ok):
        problems.append(
            (
                "training.global_batch_size",
                f"{gbs} is not divisible by any micro-batch size in {_short(mb_ok)}",
            )
        )
    return problems, mb_ok


def _check_pipelines(spec: ClusterSpec, mb_ok: list[int]) -> Problems:
    """``mb_ok``: the usable micro-batch sizes when one divides the batch (else empty: the
    batch is reported already)."""
    pl, gbs = spec.plan, spec.training.global_batch_size
    devices = {s.name: s.devices for s in spec.sites}
    smallest = min(devices, key=lambda n: (devices[n], n))
    max_d = devices[smallest]
    lo, _ = _choice_bounds(pl.pipelines)
    # Values above max_d are dropped before a range is expanded (and max_d itself is
    # capped: an oversized site is reported on its own).
    top = min(max_d, MAX_SITE_DEVICES)
    d_ok = [d for d in choice_values(pl.pipelines, default=[], upper=top) if d >= 1]
    if lo < 1:
        return [("plan.pipelines", "the number of pipelines must be at least 1")]
    if not d_ok:
        return [
            (
                "plan.pipelines",
                f"at most {max_d} pipeline{'s fit' if max_d != 1 else ' fits'}: every site "
                f"hosts a stage of every pipeline and site '{smallest}' has {max_d} "
                f"device{'s' * (max_d != 1)} (got {_show_choice(pl.pipelines)})",
            )
        ]
    if mb_ok and not any(gbs % (d * b) == 0 for d in d_ok for b in mb_ok):
        return [
            (
                "training.global_batch_size",
                f"{gbs} is not divisible by pipelines × micro-batch for any of "
                f"pipelines {_short(d_ok)} and micro-batch sizes {_short(mb_ok)}",
            )
        ]
    return []


def _check_delta_n(spec: ClusterSpec) -> Problems:
    lo, hi = _choice_bounds(spec.plan.delta_n)
    problems: Problems = []
    if lo < 0:
        problems.append(("plan.delta_n", f"ΔN must be at least 0 (got {lo})"))
    if hi > MAX_DELTA_N:
        problems.append(
            (
                "plan.delta_n",
                f"ΔN {hi} is above the supported {MAX_DELTA_N} (each extra micro-batch in "
                f"flight holds its activations; a typo?)",
            )
        )
    return problems


def _sites_form_a_chain(spec: ClusterSpec) -> bool:
    """Can one pipeline visit every site over the links (a Hamiltonian path)?"""

    def hop(a: str, b: str) -> float | None:
        return 0.0 if spec.link(a, b) is not None else None

    try:
        order_sites([s.name for s in spec.sites], hop)
    except ValueError:
        return False
    return True


def _known_codec(codec: str) -> bool:
    try:
        check_codec(codec)
    except ValueError:
        return False
    return True


class OuterSetting(NamedTuple):
    """One outer-loop candidate's knobs: ``h`` inner steps per round, ``fragments`` synced
    on staggered steps, each send overlapping ``overlap`` inner steps, in ``codec``, and the
    outer Nesterov SGD's ``lr`` and ``momentum`` (the loss penalty depends on them all)."""

    h: int
    fragments: int
    overlap: int
    codec: str
    lr: float = 0.7
    momentum: float = 0.9


def outer_settings(spec: ClusterSpec) -> list[OuterSetting]:
    """Every consistent combination of the ``plan.outer`` knobs, the planner's grid: ``h`` a
    multiple of ``fragments``, ``overlap < h / fragments`` (so at most one fragment is in
    flight: the runtime's streaming schedule, ``geopipe.outer.fragments``), and, unless
    the strategy is ``pipeline``, ``h`` dividing ``training.checkpoint.every_steps`` (a
    checkpoint falls on a round boundary, where no fragment is in flight). Combinations of
    listed values that break a rule are left out; :func:`cross_check` reports a knob only
    when nothing is left."""
    o = spec.plan.outer
    every = spec.training.checkpoint.every_steps if spec.plan.strategy != "pipeline" else 0
    out = []
    for h in choice_values(o.h, default=[]):
        if every and every % h:
            continue
        for f in choice_values(o.fragments, default=[]):
            if f < 1 or h % f:
                continue
            out += [
                OuterSetting(h, f, tau, c, lr, mu)
                for tau in choice_values(o.overlap, default=[])
                if 0 <= tau < h // f
                for c in o.codecs
                for lr in o.lrs
                for mu in o.momenta
            ]
    return out


def _check_outer(spec: ClusterSpec) -> Problems:
    """``plan.outer``: each knob usable on its own, then together (:func:`outer_settings`)."""
    o = spec.plan.outer
    problems: Problems = []
    lows = {"h": 1, "fragments": 1, "overlap": 0}
    for name, low in lows.items():
        choice, path = getattr(o, name), f"plan.outer.{name}"
        if isinstance(choice, list) and not choice:
            problems.append((path, "the list is empty: give at least one value (or omit the key)"))
            continue
        lo, hi = _choice_bounds(choice)
        count = hi - lo + 1 if isinstance(choice, Range) else len(choice_values(choice, default=[]))
        if lo < low or hi > MAX_OUTER_H:
            problems.append(
                (path, f"must be in [{low}, {MAX_OUTER_H}] (got {_show_choice(choice)})")
            )
        elif count > MAX_OUTER_VALUES:
            problems.append(
                (
                    path,
                    f"{count} values: the planner prices each for every grouping "
                    f"of the sites; give at most {MAX_OUTER_VALUES}",
                )
            )
    if not o.codec:
        problems.append(("plan.outer.codec", "the list is empty: give at least one codec"))
    for i, c in enumerate(o.codec):
        if c not in CODECS:
            problems.append(
                (
                    f"plan.outer.codec[{i}]" if len(o.codec) > 1 else "plan.outer.codec",
                    f"unknown codec '{c}' (one of {CODECS}; the pseudo-gradient "
                    "travels one way, so one name)",
                )
            )
    if problems or outer_settings(spec):
        return problems
    return [_why_no_outer_setting(spec)]


def _why_no_outer_setting(spec: ClusterSpec) -> tuple[str, str]:
    """The knob to blame when no combination of ``plan.outer`` is consistent."""
    o = spec.plan.outer
    hs = choice_values(o.h, default=[])
    fs = choice_values(o.fragments, default=[])
    pairs = [(h, f) for h in hs for f in fs if h % f == 0]
    if not pairs:
        return (
            "plan.outer.fragments",
            f"h ({_show_choice(o.h)}) must be a multiple of the fragments "
            f"({_show_choice(o.fragments)}): each fragment is synced every h inner steps, "
            "staggered by h / fragments",
        )
    taus = choice_values(o.overlap, default=[])
    if not any(tau < h // f for h, f in pairs for tau in taus):
        return (
            "plan.outer.overlap",
            f"overlap ({_show_choice(o.overlap)}) must be below h / fragments "
            f"({_short(sorted({h // f for h, f in pairs}))}): a fragment's send starts "
            "after the previous fragment's apply",
        )
    every = spec.training.checkpoint.every_steps
    return (
        "training.checkpoint.every_steps",
        f"{every} is not a multiple of plan.outer.h ({_show_choice(o.h)}) with strategy "
        f"{spec.plan.strategy}: a checkpoint must fall on an outer round's boundary, "
        "where no fragment is in flight",
    )
