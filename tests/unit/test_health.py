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


def test_a_site_is_silent_only_when_every_actor_there_is() -> None:
    """A frozen process leaves its site's other actors answering — finished with the step
    or not — so it is lost, not waited for; a site none of whose actors answer is a link
    down (waited for) if it still owes the step something."""
    from geopipe.runtime.control.health import silent_sites

    sites = ["east", "east", "west", "west"]
    # west r1 frozen mid-step, west r0 finished and answering: not an outage
    assert silent_sites(stale=[3], pending=[3], sites=sites) == set()
    # both west actors silent, one of them unfinished: the link
    assert silent_sites(stale=[2, 3], pending=[3], sites=sites) == {"west"}
    # both silent but the step owes nothing there: nothing to wait for
    assert silent_sites(stale=[2, 3], pending=[0], sites=sites) == set()
