"""The collector pause of a stage actor's imports (geopipe.runtime.actor.coldstart).

Its pause happens on import, so each case runs in a fresh interpreter; a leak would leave
the driver, which imports the stage module too, without cyclic garbage collection.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.strip()


def test_importing_pauses_the_collector_and_imports_done_freezes_and_resumes_it_once():
    code = (
        "import gc\n"
        "from geopipe.runtime.actor import coldstart\n"
        "print(gc.isenabled(), gc.get_freeze_count() == 0)\n"
        "coldstart.imports_done(); print(gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "gc.disable(); coldstart.imports_done(); print(gc.isenabled())\n"
    )
    assert _run(code).split() == ["False", "True", "True", "True", "False"]


def test_a_collector_disabled_before_the_import_stays_disabled():
    code = (
        "import gc\n"
        "gc.disable()\n"
        "from geopipe.runtime.actor import coldstart\n"
        "coldstart.imports_done(); print(gc.isenabled())\n"
    )
    assert _run(code) == "False"


@pytest.mark.parametrize("frozen_before", [False, True])
def test_settle_heap_collects_cycles_and_freezes_what_survives(frozen_before):
    code = (
        "import gc\n"
        "from geopipe.runtime.actor import coldstart\n"
        "coldstart.imports_done()\n"
        "class Node: pass\n"
        "a = Node(); a.self = a; del a\n"  # a cycle: only the collector frees it
        f"if {frozen_before}: gc.freeze()\n"  # as after an earlier setup: it must go too
        "keep = [Node() for _ in range(10)]\n"
        "coldstart.settle_heap()\n"
        "print(sum(type(o).__name__ == 'Node' for o in gc.get_objects()),\n"
        "      gc.get_freeze_count() > 0, gc.isenabled())\n"
    )
    # The cycle is gone (also when an earlier settle froze it); the survivors are
    # frozen out of later scans (gc.get_objects no longer lists them).
    assert _run(code).split() == ["0", "True", "True"]
