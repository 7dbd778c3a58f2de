"""The cyclic collector paused while :mod:`.stage` imports torch and DeepSpeed.

[Note: no collections while the actor imports]
    Importing :mod:`.stage` imports torch and DeepSpeed: ~240 k objects, every allocation
    counted towards Python's cyclic collector, which meanwhile runs some 400 times and
    rescans the growing heap of modules at each of its full collections. Merely pausing it
    moves that work to after the import (the new objects still age through every
    generation), so the import ends by freezing what it made (``gc.freeze``: a generation
    the collector never scans) before the collector resumes: the actor's import 2.0 s ->
    1.6 s of CPU, its engine build and everything after it scan less too (getrusage in
    fresh processes, medians of 6 on the shared 2-core machine). The actor collects and
    freezes its whole heap after setup anyway ([Note: garbage collection off the step] in
    :mod:`.stage`; ``settle_heap`` unfreezes first), so it keeps no garbage. A driver
    importing :mod:`.stage` keeps the import's own cyclic garbage (~7 k objects, once)
    and whatever garbage it had before the import, frozen.

This module pauses the collector *when imported*: :mod:`.stage` imports it first (before
torch: an ``# isort: split`` keeps it there) and calls :func:`imports_done` after its last
import. No other module may import it: nothing else would resume the collector. It also
settles the heap once the actor is set up (:func:`settle_heap`).
"""

from __future__ import annotations

import gc

__all__ = ["imports_done", "settle_heap"]

_paused = gc.isenabled()  # only resume what this module paused
gc.disable()


def imports_done() -> None:
    """Freeze what the imports made and resume the collector paused by this module's
    import (once; a no-op after, and when the collector was off before the import)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def settle_heap() -> None:
    """Collect, then freeze what survives ([Note: garbage collection off the step] in
    :mod:`.stage`). Unfreezing first lets a re-setup after a failure collect the previous
    engine."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
