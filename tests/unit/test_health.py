"""The hang timeout follows the measured step (pure)."""

from geopipe.runtime.control.health import HealthConfig, hang_timeout_s


def test_hang_timeout_follows_the_measured_step():
    """20 × the predicted step once it is calibrated from measured stage and link times (a
    slow WAN gets a long timeout), with a 30 s floor — 120 s before calibration."""
    cfg = HealthConfig()
    assert hang_timeout_s(0.05, calibrated=False, cfg=cfg) == 120.0
    assert hang_timeout_s(0.05, calibrated=True, cfg=cfg) == 30.0
    assert hang_timeout_s(10.0, calibrated=True, cfg=cfg) == 200.0
    assert hang_timeout_s(10.0, calibrated=False, cfg=cfg) == 200.0
