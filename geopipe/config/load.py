"""Loading a cluster YAML: parse, validate with pydantic, cross-check, and turn every error
into ``(field path, message)`` pairs that name the field (``links[0].latency_ms``), with a
did-you-mean for unknown keys."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from geopipe.config.checks import cross_check
from geopipe.config.specs import ClusterSpec, ConfigError

__all__ = ["load_cluster", "parse_cluster"]


def _is_branch(part: Any) -> bool:
    """Is this location part a union-branch marker pydantic inserts for `Choice`?"""
    return isinstance(part, str) and (
        part in ("int", "list[int]", "Range") or part.endswith(", Range]")
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
    if "input" in err and kind not in ("model_type", "dict_type"):
        got = err["input"]
        if not isinstance(got, (dict, list)):
            msg += f" (got {got!r})"
    return _format_loc(loc), msg


def parse_cluster(data: Any, source: str = "<cluster>") -> ClusterSpec:
    """Validate a parsed YAML document; raise :class:`ConfigError` listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(source, [("", "the file must be a mapping of sections (name, sites, …)")])
    try:
        spec = ClusterSpec.model_validate(data)
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


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster YAML file."""
    p = Path(path)
    source = str(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(source, [("", "file not found")]) from None
    except OSError as exc:
        raise ConfigError(source, [("", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(source, [("", f"not valid YAML{where}: {problem}")]) from None
    return parse_cluster(data, source)
