"""``--set key.path=value``: one YAML key overridden from the command line, validated as if it
were written in the file (so a bad value is exit 2 naming the key and the --set)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geopipe.cli import main
from geopipe.config import ConfigError, load_cluster

LOCAL = str(Path(__file__).resolve().parents[2] / "clusters" / "local-2dc.yaml")


def test_a_set_is_the_same_as_the_value_written_in_the_file(tmp_path) -> None:
    import yaml

    spec = load_cluster(LOCAL, ["training.lr=1e-4", "plan.pipelines=1", "sites.1.nodes=2"])
    doc = yaml.safe_load(Path(LOCAL).read_text())
    doc["training"]["lr"], doc["plan"]["pipelines"] = 1e-4, 1
    doc["sites"][1]["nodes"] = 2
    written = tmp_path / "c.yaml"
    written.write_text(yaml.safe_dump(doc))
    same = load_cluster(written)
    assert spec.training.lr == 1e-4 and spec.plan.pipelines == 1 and spec.sites[1].devices == 4
    assert spec.digest == same.digest  # the override is config: the hash says so
    assert load_cluster(LOCAL, ["plan.outer.h=[10, 20]"]).plan.outer.h == [10, 20]


@pytest.mark.parametrize(
    ("item", "where"),
    [
        ("training.lr=-1", "training.lr"),  # validated like the file
        ("training.no_such_key=3", "training.no_such_key"),
        ("training.lr", "--set training.lr"),  # no value
        ("sites.9.nodes=1", "--set sites.9.nodes=1"),  # no such site
        ("name.x=1", "--set name.x=1"),  # a value, not a section
    ],
)
def test_a_bad_set_is_refused_naming_it(item: str, where: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_cluster(LOCAL, [item])
    assert where in str(exc.value)


def test_plan_takes_sets_and_exits_2_on_a_bad_one(capsys) -> None:
    assert main(["plan", LOCAL, "--json", "--set", "plan.pipelines=1"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["pipelines"] == 1
    assert main(["plan", LOCAL, "--set", "plan.pipelines=zero"]) == 2
    err = capsys.readouterr().err
    assert "plan.pipelines" in err and "Traceback" not in err
