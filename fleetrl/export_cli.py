"""`fleetrl hub export` with the config a user has at hand, also right after `fleetrl demo`.

A demo run keeps its stores under its work directory and signs with a key pair made for the run: the
config the user gave (`examples/fleet.hf.yaml`) names neither. The demo writes the run's own config
to `<workdir>/fleet.yaml` and prints the export command with it; when the user passes their own
config instead, this finds the demo run under the default work directory (same run id) and exports
from it, saying so, or else names the config to use in the error.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from fleetrl.config import FleetConfig, load_config
from fleetrl.demo.procs import default_workdir
from fleetrl.hub.cli import export as hub_export
from fleetrl.hub.errors import HubError, SignatureError, UnknownVersion
from fleetrl.hub.publisher import read_latest
from fleetrl.hub.signing import load_keys
from fleetrl.hub.stores import open_store

_HINT = ("after `fleetrl demo`, export with the run's own config: --config <workdir>/fleet.yaml "
         "(the demo's summary prints the whole command)")


def export(args: argparse.Namespace, config: FleetConfig) -> int:
    demo = demo_run(pathlib.Path(args.config), config)
    if demo is not None:
        print(f"fleetrl: exporting from the demo run in {demo.parent} (its stores and public key): "
              f"--config {demo}", file=sys.stderr)
        config = load_config(demo)
    try:
        return hub_export(args, config)
    except UnknownVersion:
        raise  # a bad --version: refused as such, naming what the store holds
    except (SignatureError, HubError) as exc:
        if demo is None and _misses_run(config):
            raise type(exc)(f"{exc}; {_HINT}") from exc
        raise


def demo_run(config_path: pathlib.Path, config: FleetConfig) -> pathlib.Path | None:
    """`<default workdir>/fleet.yaml` of a demo run of this config, when the config cannot read the run
    itself (no verification key, or no version in its home store); None otherwise."""
    run_config = default_workdir(config_path) / "fleet.yaml"
    if not run_config.is_file() or not _misses_run(config):
        return None
    try:
        candidate = load_config(run_config)
    except Exception:  # a stale or foreign file: not ours to explain
        return None
    return run_config if candidate.run == config.run else None


def _misses_run(config: FleetConfig) -> bool:
    """Whether `config` alone cannot export its run: no key to verify manifests, or no version at home."""
    try:
        load_keys(config.hub.signing)
        return read_latest(open_store("home", config.hub.home_store), config.run) is None
    except HubError:
        return True
