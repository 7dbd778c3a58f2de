"""The README's Layout section lists every module under ``geopipe/`` exactly once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layout_paths(readme: str) -> list[str]:
    """The module paths the Layout block names, from its indentation (folders end in /)."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    out: list[str] = []
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        token = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = token if token.startswith("geopipe/") else stack[-1][1] + token
        if token.endswith("/"):
            stack.append((indent, path))
        elif token.endswith(".py"):
            out.append(path)
    return out


def test_every_module_is_listed_once() -> None:
    listed = layout_paths((ROOT / "README.md").read_text())
    twice = [p for p, n in Counter(listed).items() if n > 1]
    assert not twice, f"listed more than once: {twice}"
    tree = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "geopipe").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert not tree - set(listed), f"missing from the README's Layout: {sorted(tree - set(listed))}"
    assert not set(listed) - tree, f"listed but absent: {sorted(set(listed) - tree)}"
