"""fleet.yaml loading: examples validate, errors name field, file and line, env overrides apply."""

from __future__ import annotations

import pathlib

import pytest

from fleetrl.config import ConfigError, FleetConfig, load_config, parse_config
from fleetrl.config_cli import render_reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
MINIMAL = "run: r1\nregions:\n  - name: eu-west\n    kafka: 127.0.0.1:9092\n    store: ./stores/eu\n"


@pytest.mark.parametrize("name", ["fleet.demo.yaml", "fleet.aws.yaml", "fleet.agent.yaml"])
def test_examples_validate(name: str) -> None:
    config = load_config(ROOT / "examples" / name, env={})
    assert config.regions and config.run


def test_defaults_fill_everything_but_run_and_regions(tmp_path: pathlib.Path) -> None:
    config = parse_config(MINIMAL, base_dir=tmp_path, env={})
    assert config.algorithm.max_staleness == 1
    assert config.kafka.max_message_bytes == 16 * 1024 * 1024
    assert config.kafka.idempotent_producer is False
    # relative store paths resolve against the config file's folder
    assert config.regions[0].store.url == (tmp_path / "stores/eu").resolve().as_uri()
    assert set(config.stores()) == {"home", "eu-west"}


@pytest.mark.parametrize(
    ("text", "field", "line"),
    [
        ("run: r1\nalgorithm:\n  lr: fast\nregions: []\n", "algorithm.lr", 3),
        ("run: r1\nregions:\n  - name: a\n    store: ./x\n", "regions[a].kafka", 3),
        ("run: r1\nregions:\n  - name: a\n    kafka: h:1\n    store: ./x\n    link_costs: {mars: 2}\n",
         "regions[a].link_costs", 6),
        ("run: r1\nregions:\n  - name: a\n    kafka: nohost\n    store: ./x\n", "regions[a].kafka.bootstrap", 4),
        ("run: r1\nregions:\n  - name: a\n    kafka: h:1\n    store: ./x\n    engine: {kind: torch, max_batch: 0}\n",
         "regions[a].engine.max_batch", 6),
        ("run: r1\nhub:\n  anchor_intervl: 3\nregions: []\n", "hub.anchor_intervl", 3),
    ],
)
def test_errors_name_field_file_and_line(text: str, field: str, line: int) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="fleet.yaml", env={})
    err = info.value
    assert (err.field, err.line, err.file) == (field, line, "fleet.yaml")
    assert "\n" not in str(err) and str(err).startswith(f"fleet.yaml:{line}: {field}: ")


def test_duplicate_region_is_refused() -> None:
    text = MINIMAL + "  - name: eu-west\n    kafka: h:2\n    store: ./y\n"
    with pytest.raises(ConfigError, match=r"regions\[eu-west\]\.name: region 'eu-west' is defined twice"):
        parse_config(text, env={})


def test_bad_yaml_names_the_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("run: [unclosed\nregions: []\n", source="f.yaml", env={})
    assert info.value.line is not None and "not valid YAML" in str(info.value)


def test_env_overrides_nested_fields_and_list_items_by_name() -> None:
    env = {
        "FLEETRL_ALGORITHM__LR": "0.5",
        "FLEETRL_REGIONS__EU_WEST__KAFKA__BOOTSTRAP": "10.0.0.1:9093",
        "FLEETRL_HUB_KEY": "not-a-config-field",  # a signing key, left alone
    }
    config = parse_config(MINIMAL, env=env)
    assert config.algorithm.lr == 0.5
    assert config.regions[0].kafka.bootstrap == "10.0.0.1:9093"


def test_env_override_with_bad_value_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.max_staleness"):
        parse_config(MINIMAL, env={"FLEETRL_ALGORITHM__MAX_STALENESS": "-3"})


def test_missing_file_is_a_config_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_readme_reference_is_current() -> None:
    """The README's configuration reference is docs/config.md (issue 47): the README links it and keeps no
    copy of its own that could go stale, and the page holds every row the models render today."""
    readme = (ROOT / "README.md").read_text()
    assert "(docs/config.md)" in readme and "<!-- BEGIN config-reference -->" not in readme
    page = (ROOT / "docs" / "config.md").read_text().splitlines()
    stale = "docs/config.md is stale: run `fleetrl config reference --update docs/config.md`"
    assert [row for row in render_reference().splitlines() if row not in page] == [], stale


def test_every_field_is_documented() -> None:
    reference = render_reference()
    undocumented = [row.split("|")[1].strip() for row in reference.splitlines()[2:] if row.endswith("|  |")]
    assert undocumented == [], f"fields without a docstring: {undocumented}"


def test_model_round_trips_through_its_dump(tmp_path: pathlib.Path) -> None:
    config = parse_config(MINIMAL, base_dir=tmp_path, env={})
    assert FleetConfig.model_validate(config.model_dump()) == config
