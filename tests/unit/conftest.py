"""The unit tier's shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small text corpus for the runs on the fake worker group (tests/unit/fakes.py; a
    module's own ``corpus`` fixture, as test_data's, takes its place there)."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"line {i} of a small corpus for the fake\n" for i in range(2000)))
    return path
