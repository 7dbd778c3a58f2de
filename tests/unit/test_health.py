"""The hang timeout follows the measured step (pure)."""

from geopipe.config import HealthSpec
from geopipe.runtime.control.health import hang_timeout_s


def test_hang_timeout_follows_the_measured_step():
    """20 × the predicted step once it is calibrated from measured stage and link times (a
    slow WAN gets a long timeout), with a 30 s floor — 120 s before calibration."""
    cfg = HealthSpec()
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


def test_the_clocks_are_the_yaml_s_health_section() -> None:
    """Every control-plane timeout has one home, the YAML's ``health``: set there it reaches
    the functions that use it, out of range it is refused naming the field, and none of it
    changes the config digest (a checkpoint's numbers do not depend on it)."""
    from pathlib import Path

    import pytest
    import yaml

    from geopipe.config import ConfigError, parse_cluster

    doc = yaml.safe_load((Path(__file__).parents[2] / "clusters" / "local-2dc.yaml").read_text())
    base = parse_cluster(doc)
    doc["health"] = {"hang_factor": 2.0, "hang_floor_s": 5.0, "stuck_release_s": 7.0}
    spec = parse_cluster(doc)
    assert hang_timeout_s(10.0, calibrated=True, cfg=spec.health) == 20.0
    assert hang_timeout_s(1.0, calibrated=True, cfg=spec.health) == 5.0
    assert spec.health.stuck_release_s == 7.0 and base.health.stuck_release_s == 60.0
    assert spec.digest == base.digest
    doc["health"] = {"heartbeat_s": 0}
    with pytest.raises(ConfigError) as info:
        parse_cluster(doc)
    assert "health.heartbeat_s" in str(info.value)
