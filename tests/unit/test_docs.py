"""The documentation says what the code does: every YAML key and command-line flag that
``docs/*.md`` (and, for keys and flag names, ``README.md``) mention exists, and every key of
the schema and every flag of every subcommand is documented in ``docs/``.

Conventions (docs/README.md states them for the writers):

* **YAML keys** are written in backticks as full paths from the top of the file:
  `plan.delta_n`, `training.checkpoint.every_steps`. A key of every item of a list section
  carries ``[]``: `sites[].device_tflops`, `links[].from` (the YAML's own names: links say
  ``from``/``to``, never the Python attributes ``src``/``dst``). `plan.outer.{h, lr}` names
  several keys of one section, and `training.data: stdlib` names the key before the colon.
  A span is a key path when it is made of lowercase names and starts with a section of the
  schema (``ray``, ``sites``, ``links``, ``model``, ``training``, ``plan``, ``security``,
  ``health``) followed by ``.`` or ``[]``; a bare section name is not checked. Values of a
  knob (`{min, max}` of a range) are not keys. Every fenced ``yaml`` block is parsed and each
  key in it checked too.
* **Flags** are written in backticks. A span that starts with ``geopipe <command>``, or with a
  command's name followed by a flag (`launch --dry-run`, `set --cut` of the test bed), names
  flags of that command; a span that starts with ``--`` names a flag of some command; a span
  that starts with another program (`ray start --head`) is not checked. In fenced blocks a
  line that starts with ``geopipe`` (after an optional ``$``, ``sudo`` and path) is a command,
  and the indented lines after it continue it; each flag belongs to the nearest
  ``geopipe <command>`` before it (so ``testbed exec east -- geopipe launch … --steps 5``
  gives ``--steps`` to launch). ``geopipe testbed [options] <sub> [flags]``: flags before the
  test bed's subcommand are the test bed's own, flags after it the subcommand's.
* README.md is checked for existence only (every key path it names is in the schema, every
  flag it names belongs to some command): the lead slims it into a front door that links
  the pages here, which must document everything.
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from pathlib import Path

import pytest
import yaml

from geopipe.cli.main import build_parser
from geopipe.config.fields import Spec
from geopipe.config.specs import ClusterSpec
from geopipe.testbed.cli import build_parser as build_testbed_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
EVERY_FILE = [*PAGES, ROOT / "README.md"]  # the pages, and the README's names
EXPECTED_PAGES = {
    "README.md",
    "planning.md",
    "cluster.md",
    "models-and-data.md",
    "checkpoints-and-recovery.md",
    "security.md",
    "testbed.md",
    "cli.md",
    "glossary.md",
}

# Spans that look like key paths but are not (with where they are and what they name).
NOT_KEYS = {
    "model.sizes": "README's layout prose: the module geopipe/model/sizes.py",
}
# Schema fields that need not be documented, each with its reason (none today: even the
# fields config.json fills are listed in docs/models-and-data.md as not to be written).
UNDOCUMENTED: dict[str, str] = {}


# -- the schema -------------------------------------------------------------------------------
def _spec_of(annotation: object) -> tuple[type[Spec] | None, bool]:
    """The section model an annotation holds (``X``, ``X | None`` or ``list[X]``), and
    whether it is a list of them; ``(None, False)`` for a plain value."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _spec_of(args[0]) if len(args) == 1 else (None, False)
    if origin is list:
        inner, _ = _spec_of(typing.get_args(annotation)[0])
        return inner, inner is not None
    if isinstance(annotation, type) and issubclass(annotation, Spec):
        return annotation, False
    return None, False


def _fields(model: type[Spec]) -> dict[str, typing.Any]:
    """A section's YAML keys (aliases where the YAML name differs) and their fields."""
    return {f.alias or name: f for name, f in model.model_fields.items()}


def schema_paths(model: type[Spec] = ClusterSpec, prefix: str = "") -> dict[str, bool]:
    """Every key path of the schema -> whether it is a section (has keys of its own)."""
    out: dict[str, bool] = {}
    for key, f in _fields(model).items():
        sub, is_list = _spec_of(f.annotation)
        path = f"{prefix}.{key}" if prefix else key
        path += "[]" if is_list else ""
        out[path] = sub is not None
        if sub is not None:
            out.update(schema_paths(sub, path))
    return out


SCHEMA = schema_paths()
SECTIONS = [k for k, is_section in SCHEMA.items() if is_section and "." not in k]
_SECTION = "|".join(re.escape(s.removesuffix("[]")) for s in SECTIONS)
_NAME = r"[a-z_][a-z0-9_]*(?:\[\])?"
_KEY = rf"(?:{_SECTION})(?:\[\])?(?:\.{_NAME})+|(?:{_SECTION})\[\]"
KEY_SPAN = re.compile(rf"(?P<key>{_KEY})(?::(?:\s.*)?)?", re.S)
BRACE_SPAN = re.compile(rf"(?P<key>{_KEY}|{_SECTION})\.\{{(?P<names>[a-z0-9_,\s]+)\}}")


# -- reading Markdown -------------------------------------------------------------------------
FENCE = re.compile(
    r"^[ \t]*```[ \t]*(?P<lang>\S*)[^\n]*\n(?P<body>.*?)^[ \t]*```[ \t]*$", re.M | re.S
)
SPAN = re.compile(r"`([^`]+)`")


def fenced(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return [(m["lang"], m["body"]) for m in FENCE.finditer(text)]


def spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    return SPAN.findall(FENCE.sub("", text))


def documented_keys(text: str) -> set[str]:
    """The key paths a page names in backticks and in its fenced yaml blocks."""
    out = set()
    for span in spans(text):
        span = span.strip()
        if span in NOT_KEYS:
            continue
        if m := BRACE_SPAN.fullmatch(span):
            out |= {f"{m['key']}.{n.strip()}" for n in m["names"].split(",") if n.strip()}
        elif m := KEY_SPAN.fullmatch(span):
            out.add(m["key"])
    for lang, body in fenced(text):
        if lang == "yaml":
            try:
                doc = yaml.safe_load(body)
            except yaml.YAMLError:  # test_yaml_blocks_parse says so
                continue
            out |= yaml_keys(doc, ClusterSpec, "")
    return out


def yaml_keys(doc: object, model: type[Spec], prefix: str) -> set[str]:
    """The key paths of a YAML document (fragment) as the schema would read them; a key the
    section does not have is returned as it is, so the existence check names it."""
    if not isinstance(doc, dict):
        return set()
    out, fields = set(), _fields(model)
    for key, value in doc.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            out.add(path)
            continue
        sub, is_list = _spec_of(fields[key].annotation)
        if is_list:
            path += "[]"
            for item in value if isinstance(value, list) else []:
                out |= yaml_keys(item, sub, path)
        elif sub is not None:
            out |= yaml_keys(value, sub, path)
        out.add(path)
    return out


# -- the command line -------------------------------------------------------------------------
def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_flags() -> dict[str, set[str]]:
    """Every command's flags: ``launch``, …, ``testbed`` (its own options) and ``testbed up``."""
    out = {name: _flags(p) for name, p in _subparsers(build_parser()).items()}
    tb = build_testbed_parser()
    out["testbed"] = _flags(tb)
    out.update({f"testbed {name}": _flags(p) for name, p in _subparsers(tb).items()})
    return out


COMMANDS = command_flags()
TESTBED_SUBS = [c.split()[1] for c in COMMANDS if c.startswith("testbed ")]
_MAIN = "|".join(re.escape(c) for c in COMMANDS if " " not in c)
ANCHOR = re.compile(rf"(?<![\w-])geopipe\s+({_MAIN})(?![\w-])")
TB_SUB = re.compile(rf"(?<![\w-])({'|'.join(TESTBED_SUBS)})(?![\w-])")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND_LINE = re.compile(r"^(?:\$\s+)?(?:sudo\s+)?(?:\S*/)?geopipe\s")


def attributed(text: str) -> list[tuple[str | None, str]]:
    """``(command, flag)`` for each flag in ``text`` (a span or a command line): the
    command is the nearest ``geopipe <command>`` before it, else the command the text starts
    with; None for a text that starts with the flag (any command's). Texts that start with
    another program give nothing."""
    anchors = list(ANCHOR.finditer(text))
    first = text.split(maxsplit=1)[0] if text.split() else ""
    if first in COMMANDS:
        lead: str | None = first
    elif first in TESTBED_SUBS:
        lead = f"testbed {first}"
    elif first.startswith("--"):
        lead = None
    elif not anchors:
        return []
    else:
        lead = None
    out = []
    for m in FLAG.finditer(text):
        before = [a for a in anchors if a.end() <= m.start()]
        if not before:
            out.append((lead, m.group()))
            continue
        anchor = before[-1]
        command = anchor.group(1)
        if command == "testbed":
            sub = TB_SUB.search(text, anchor.end(), m.start())
            command = f"testbed {sub.group(1)}" if sub else "testbed"
        out.append((command, m.group()))
    return out


def flag_mentions(text: str) -> list[tuple[str | None, str]]:
    """Every flag a page names, attributed (see the module docstring)."""
    out = []
    for span in spans(text):
        out += attributed(span.strip())
    for _lang, body in fenced(text):
        command: list[str] = []
        for line in [*body.splitlines(), ""]:
            line = re.sub(r"\s#.*$", "", line)
            if command and line[:1].isspace() and line.strip():
                command.append(line)
                continue
            if command:
                out += attributed(" ".join(command))
            command = [line] if COMMAND_LINE.match(line) else []
    return out


# -- the tests --------------------------------------------------------------------------------
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_the_pages_exist_and_the_index_links_each() -> None:
    names = {p.name for p in PAGES}
    assert names >= EXPECTED_PAGES, f"missing pages: {sorted(EXPECTED_PAGES - names)}"
    index = _read(DOCS / "README.md")
    unlinked = [n for n in sorted(names - {"README.md"}) if f"]({n})" not in index]
    assert not unlinked, f"docs/README.md does not link {unlinked}"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", EVERY_FILE, ids=_rel)
def test_every_documented_key_is_in_the_schema(path: Path) -> None:
    unknown = sorted(documented_keys(_read(path)) - set(SCHEMA))
    assert not unknown, (
        f"{path.name} names key paths the schema (geopipe/config/specs.py) does not have: {unknown}"
    )


@pytest.mark.parametrize("path", EVERY_FILE, ids=_rel)
def test_yaml_blocks_parse(path: Path) -> None:
    """A YAML example must load: geopipe reads cluster files with the same YAML parser."""
    bad = []
    for lang, body in fenced(_read(path)):
        if lang != "yaml":
            continue
        try:
            yaml.safe_load(body)
        except yaml.YAMLError as exc:
            bad.append(" ".join(str(exc).split()))
    assert not bad, f"{path.name}: yaml blocks that do not parse (quote values with braces): {bad}"


def test_every_schema_key_is_documented() -> None:
    documented = set().union(*(documented_keys(_read(p)) for p in PAGES))
    # A section counts as documented when one of its keys is.
    documented |= {p.rsplit(".", 1)[0] for p in documented if "." in p}
    wanted = {path for path in SCHEMA if "." in path} - set(UNDOCUMENTED)
    missing = sorted(wanted - documented)
    assert not missing, (
        f"schema keys no page of docs/ documents (write them in backticks): {missing}"
    )


def test_the_allow_lists_are_well_formed() -> None:
    assert set(UNDOCUMENTED) <= set(SCHEMA), "UNDOCUMENTED names a key the schema lost"
    for span in NOT_KEYS:
        assert KEY_SPAN.fullmatch(span), f"NOT_KEYS: {span!r} would not be read as a key"


@pytest.mark.parametrize("path", PAGES, ids=_rel)
def test_every_documented_flag_exists(path: Path) -> None:
    wrong = []
    for command, flag in flag_mentions(_read(path)):
        if command is None:
            if not any(flag in flags for flags in COMMANDS.values()):
                wrong.append(f"{flag} (no command has it)")
        elif flag not in COMMANDS[command]:
            wrong.append(f"{flag} is not a flag of `geopipe {command}`")
    assert not wrong, f"{path.name}: {wrong}"


def test_every_flag_the_readme_names_exists() -> None:
    known = set().union(*COMMANDS.values())
    unknown = sorted({f for _, f in flag_mentions(_read(ROOT / "README.md"))} - known)
    assert not unknown, f"README.md names flags no command has: {unknown}"


def test_every_flag_is_documented() -> None:
    seen = {m for p in PAGES for m in flag_mentions(_read(p))}
    missing = sorted(
        f"geopipe {command} {flag}"
        for command, flags in COMMANDS.items()
        for flag in flags
        if (command, flag) not in seen
    )
    assert not missing, f"flags docs/ does not document for their command: {missing}"


def test_the_readers_read_what_the_conventions_say() -> None:
    """The extraction itself, on the cases the conventions name."""
    text = (
        "`plan.delta_n` `sites[].device_tflops` `links[].from` `plan.outer.{h, lr}` "
        "`training.data: stdlib` `plan` `model.safetensors.index` `ray.init()`\n"
        '```yaml\ntraining:\n  checkpoint: {dir: "/x/{site}", every_steps: 10}\n'
        "sites:\n  - {name: east, bogus: 1}\n```\n"
    )
    spans_read = "plan.delta_n sites[].device_tflops links[].from plan.outer.h plan.outer.lr"
    from_yaml = (
        "training training.checkpoint training.checkpoint.dir training.checkpoint.every_steps "
        "sites[] sites[].name sites[].bogus"
    )
    # `model.safetensors.index` reads as a key (and fails the existence test): such names
    # go in NOT_KEYS or are written as paths.
    expected = {*spans_read.split(), *from_yaml.split(), "training.data", "model.safetensors.index"}
    assert documented_keys(text) == expected
    testbed = [("testbed", "--prefix"), ("testbed up", "--sites")]
    assert attributed("geopipe testbed --prefix p up --sites a,b") == testbed
    assert attributed("sudo geopipe testbed exec east -- geopipe launch x.yaml --steps 5") == [
        ("launch", "--steps")
    ]
    assert attributed("sudo .venv/bin/geopipe testbed set --cut") == [("testbed set", "--cut")]
    assert attributed("launch --dry-run") == [("launch", "--dry-run")]
    assert attributed("set --cut") == [("testbed set", "--cut")]
    assert attributed("--resume PATH") == [(None, "--resume")]
    assert attributed("ray start --head --resources='{}'") == []
    block = (
        "```\ngeopipe launch C.yaml [--steps N]\n        [--run-dir DIR]\nray start --head\n```\n"
    )
    assert flag_mentions(block) == [("launch", "--steps"), ("launch", "--run-dir")]
