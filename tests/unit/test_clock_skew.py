"""The clock skew a launch reports from its WAN handshakes (runtime.control.linkprobe)."""

from __future__ import annotations

import pytest

from geopipe.runtime.control.linkprobe import SKEW_WARN_S, skew_report

DAY = 86400.0


def test_the_worst_link_is_reported_with_its_uncertainty() -> None:
    fields, line = skew_report(
        {"stage0/r0": {"down": (0.4, 0.02)}, "stage1/r0": {"up": (-3.5, 0.05)}}, DAY
    )
    assert fields["measured"] and fields["max_abs_offset_s"] == 3.5
    assert fields["error_s"] == 0.05 and fields["worst"] == "stage1/r0 up"
    assert [p["actor"] for p in fields["pairs"]] == ["stage0/r0", "stage1/r0"]
    assert line is None  # seconds of skew: reported in the event, not on the console


@pytest.mark.parametrize("offset", [SKEW_WARN_S + 1, -(SKEW_WARN_S + 1), 3 * 3600.0])
def test_minutes_of_skew_are_said_on_the_console(offset: float) -> None:
    fields, line = skew_report({"stage1/r0": {"up": (offset, 0.01)}}, DAY)
    assert fields["max_abs_offset_s"] == abs(offset)
    assert line is not None and "stage1/r0" in line and "24 h" in line
    assert f"{offset:+.1f} s" in line


def test_nothing_measured_says_so() -> None:
    """No WAN connection (one site, or a run without credentials): no figure invented."""
    fields, line = skew_report({"stage0/r0": {}}, DAY)
    assert fields == {"measured": False, "tolerance_s": DAY, "pairs": []} and line is None
