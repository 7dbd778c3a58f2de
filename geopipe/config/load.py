"""Loading a cluster YAML: parse, validate with pydantic, cross-check, and turn every error
into ``(field path, message)`` pairs that name the field (``links[0].latency_ms``), with a
did-you-mean for unknown keys."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from geopipe.config.checks import cross_check
from geopipe.config.specs import ClusterSpec, ConfigError

__all__ = ["load_cluster", "parse_cluster", "parse_yaml"]


def _is_branch(part: Any) -> bool:
    """Is this location part a union-branch marker pydantic inserts for `Choice` (or for a
    bounded number that may also be a list of them, like ``plan.outer.lr``)?"""
    return isinstance(part, str) and (
        part in ("int", "list[int]", "Range")
        or part.endswith((", Range]", ", int]", ", int]]"))
        or part.startswith(("function-after[", "list[function-after["))
    )


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_branch(part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """Walk the spec classes along an error location (for did-you-mean suggestions)."""
    model: Any = ClusterSpec
    for part in loc:
        if isinstance(part, int) or _is_branch(part):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    args = getattr(tp, "__args__", None)
    if not args:
        return tp
    for a in args:
        inner = _unwrap(a)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return tp


def _field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _describe(err: dict[str, Any]) -> tuple[str, str]:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        key = str(loc[-1])
        msg = "unknown key"
        if parent is not None:
            close = difflib.get_close_matches(key, _field_names(parent), n=1, cutoff=0.6)
            if close:
                msg += f" (did you mean '{close[0]}'?)"
            else:
                msg += f" (allowed: {', '.join(_field_names(parent))})"
        return _format_loc(loc), msg
    if kind == "missing":
        return _format_loc(loc), "required field is missing"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if kind in _BOUND_KINDS:
        msg = _range_message(loc) or msg
    elif kind in ("float_parsing", "float_type", "finite_number"):
        span = _span(loc)
        msg = f"must be a finite number in {span}" if span else msg
    if "input" in err and kind not in ("model_type", "dict_type"):
        got = err["input"]
        if not isinstance(got, (dict, list)):
            msg += f" (got {_show(got)})"
    return _format_loc(loc), msg


_BOUND_KINDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _span(loc: tuple[Any, ...]) -> str | None:
    """The physical range a bounded float field states (config.fields.bounded), if any."""
    parent = _model_at(loc[:-1])
    field = parent.model_fields.get(loc[-1]) if parent and isinstance(loc[-1], str) else None
    for m in field.metadata if field else ():
        span = getattr(getattr(m, "func", None), "span", None)
        if span:
            return span
    return None


def _range_message(loc: tuple[Any, ...]) -> str | None:
    """``must be an integer in [1, 10000]`` from the field's own bounds (pydantic names one)."""
    parent = _model_at(loc[:-1])
    if parent is None or not isinstance(loc[-1], str):
        return None
    field = parent.model_fields.get(loc[-1])
    if field is None:
        return None
    lo = hi = None
    lo_open = hi_open = False
    for m in field.metadata:
        for attr, is_lo, is_open in (("ge", 1, 0), ("gt", 1, 1), ("le", 0, 0), ("lt", 0, 1)):
            v = getattr(m, attr, None)
            if v is None:
                continue
            if is_lo:
                lo, lo_open = v, bool(is_open)
            else:
                hi, hi_open = v, bool(is_open)
    if lo is None and hi is None:
        return None
    ints = field.annotation is int or int in getattr(field.annotation, "__args__", ())
    kind = "an integer" if ints else "a number"
    left = f"{'(' if lo_open else '['}{lo}" if lo is not None else "(-inf"
    right = f"{hi}{')' if hi_open else ']'}" if hi is not None else "inf)"
    return f"must be {kind} in {left}, {right}"


def _show(value: Any, limit: int = 60) -> str:
    """A short repr of a bad value: huge integers by their size (printing one of more than
    4300 digits raises in Python ≥ 3.11), long strings cut."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_cluster(
    data: Any, source: str = "<cluster>", base_dir: str | Path | None = None
) -> ClusterSpec:
    """Validate a parsed YAML document; raise :class:`ConfigError` listing every problem.

    Relative paths in it (``model.hf``) are taken from ``base_dir``: by default the
    directory of ``source`` when that names an existing file, else the working directory.
    """
    if not isinstance(data, dict):
        raise ConfigError(source, [("", "the file must be a mapping of sections (name, sites, …)")])
    if base_dir is None:
        src = Path(source)
        base_dir = src.parent if src.is_file() else Path.cwd()
    try:
        spec = ClusterSpec.model_validate(data, context={"base_dir": str(base_dir)})
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        for err in _matching_branch(exc.errors()):
            item = _describe(err)
            if item not in problems:
                problems.append(item)
        raise ConfigError(source, _collapse_union_noise(problems)) from None
    problems = cross_check(spec)
    if problems:
        raise ConfigError(source, problems)
    return spec


# Error kinds that only say "the input is not of this branch's shape".
_WRONG_SHAPE = {"int_type", "int_parsing", "list_type", "model_type", "dict_type"}


def _matching_branch(errors: list[Any]) -> list[Any]:
    """Keep only the errors of the `Choice` branch that accepted the input's shape.

    A bad `Choice` fails all three union branches; for a mapping (or a list) the other two
    only complain about the type, which would hide the real message ("min (5) is larger
    than max (2)", a bad list item). Fields where no branch took the shape are left alone.
    """

    def split(err: Any) -> tuple[tuple[Any, ...], Any] | None:
        loc = tuple(err["loc"])
        i = next((i for i, part in enumerate(loc) if _is_branch(part)), None)
        return None if i is None else (loc[:i], loc[i])

    matched: dict[tuple[Any, ...], Any] = {}
    for err in errors:
        where = split(err)
        if where is None:
            continue
        deeper = len(err["loc"]) > len(where[0]) + 1
        if deeper or err["type"] not in _WRONG_SHAPE:
            matched.setdefault(*where)
    out = []
    for err in errors:
        where = split(err)
        if where is not None and matched.get(where[0], where[1]) != where[1]:
            continue
        out.append(err)
    return out


def _collapse_union_noise(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A bad `Choice` fails all three union branches; report one line per field."""
    seen: dict[str, str] = {}
    for path, msg in problems:
        if path in seen:
            if "int, a list of ints or {min, max}" not in seen[path]:
                seen[path] = "expected an int, a list of ints or {min, max}: " + seen[path]
            continue
        seen[path] = msg
    return list(seen.items())


# Caps on what a cluster file may make the loader do. A real cluster file is a few KiB with a
# handful of levels; these stop hostile or broken input (a billion-laughs alias bomb, a
# 100 000-level nest, a stray multi-GB file) before it costs memory or time.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000  # YAML nodes after expanding aliases


def load_cluster(path: str | Path, sets: Sequence[str] = ()) -> ClusterSpec:
    """Read and validate a cluster YAML file (UTF-8; see the caps above), with the command
    line's ``--set key.path=value`` overrides (:func:`apply_sets`) applied before validation,
    so an override is checked exactly as the same value written in the file would be."""
    p = Path(path)
    source = str(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(source, [("", "file not found")]) from None
    except OSError as exc:
        raise ConfigError(source, [("", f"cannot read: {exc.strerror or exc}")]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(
            source, [("", f"file is larger than {MAX_FILE_BYTES >> 10} KiB: not a cluster file")]
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 1].hex()
        raise ConfigError(
            source,
            [("", f"not UTF-8 text: byte 0x{bad} at offset {exc.start} cannot be decoded")],
        ) from None
    data = apply_sets(parse_yaml(text, source), sets, source)
    return parse_cluster(data, source, base_dir=p.parent)


def apply_sets(data: Any, sets: Sequence[str], source: str = "<cluster>") -> Any:
    """``data`` (a parsed YAML document) with each ``key.path=value`` of ``sets`` applied:
    the value is read as YAML (``1e-4``, ``[1, 2]``, ``{min: 1, max: 4}``, ``true``); the path's
    sections are made where the file omits them; a list item is addressed by its index
    (``sites.0.devices_per_node=4``). Errors name the ``--set`` at fault."""
    if not sets:
        return data
    if not isinstance(data, dict):
        return data  # parse_cluster names the problem
    data = copy.deepcopy(data)
    for item in sets:
        key, eq, text = item.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(parts):
            raise ConfigError(source, [(f"--set {item}", "expected KEY.PATH=VALUE")])
        value = parse_yaml(text, f"--set {key}")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            node = _descend(node, part, parts[: i + 1], source, item)
        last = parts[-1]
        if isinstance(node, list):
            node[_index(node, last, source, item)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(source, [(f"--set {item}", f"{'.'.join(parts[:-1])} is a value")])
    return data


def _descend(node: Any, part: str, path: list[str], source: str, item: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, source, item)]
    if not isinstance(node, dict):
        raise ConfigError(source, [(f"--set {item}", f"{'.'.join(path[:-1])} is a value")])
    if node.get(part) is None:
        node[part] = {}
    return node[part]


def _index(node: list, part: str, source: str, item: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(
            source, [(f"--set {item}", f"{part!r} is not an index of a list of {len(node)}")]
        )
    return int(part)


def parse_yaml(text: str, source: str = "<cluster>") -> Any:
    """YAML text -> Python data, with the caps above; errors are :class:`ConfigError`."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                _check_size(node, source)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        elif getattr(exc, "position", None) is not None:  # the reader's errors
            where = f" at character {exc.position}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(source, [("", f"not valid YAML{where}: {problem}")]) from None
    except RecursionError:
        raise ConfigError(source, [("", f"nested more than {MAX_DEPTH} levels deep")]) from None
    except ValueError as exc:  # an integer literal of more than 4300 digits
        why = str(exc).split(";")[0]
        raise ConfigError(source, [("", f"not a usable YAML value: {why}")]) from None
    return data


def _check_size(root: yaml.Node, source: str) -> None:
    """Refuse documents nested deeper than :data:`MAX_DEPTH` or, with aliases expanded, of
    more than :data:`MAX_NODES` nodes (each shared node is measured once)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ConfigError(source, [("", f"nested more than {MAX_DEPTH} levels deep")])
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = MAX_NODES + 1  # a cycle (recursive alias) counts as too large
        n = 1
        if isinstance(node, yaml.SequenceNode):
            for child in node.value:
                n += size(child, depth + 1)
        elif isinstance(node, yaml.MappingNode):
            for key, child in node.value:
                n += size(key, depth + 1) + size(child, depth + 1)
        n = min(n, MAX_NODES + 1)
        sizes[id(node)] = n
        return n

    if size(root, 0) > MAX_NODES:
        raise ConfigError(
            source,
            [("", f"more than {MAX_NODES} values once aliases are expanded (an alias bomb?)")],
        )
