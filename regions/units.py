"""The systemd units of FleetRL's daemons, shipped in the package (`fleetrl/regions/systemd/`).

`fleetrl units install --dest /etc/systemd/system` writes `fleetrl-agent.service`, the template
`fleetrl-replicator@.service` (one instance per region: `fleetrl-replicator@eu-west-1.service`) and
`fleetrl-trainer.service`, so a node runs exactly the units of the FleetRL version it has installed
(and enables the ones its role needs); provisioning (Terraform's node-bootstrap module) adds only
drop-ins for what the package cannot know. Without `--dest` the units are printed. `--prefix` and
`--config` rewrite the virtualenv and fleet.yaml paths of every `ExecStart`/`ExecStartPre` for
installs elsewhere than `/opt/fleetrl/venv` and `/etc/fleetrl/fleet.yaml`. Each unit is sandboxed
(docs/security.md lists every directive and why).

Nothing here imports torch or the daemons: this runs on a node before anything else is set up.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import tempfile
from importlib import resources

__all__ = ["DEFAULT_CONFIG", "DEFAULT_VENV", "UNIT_NAMES", "install", "run_units", "unit_text"]

UNIT_NAMES = ("fleetrl-agent.service", "fleetrl-replicator@.service", "fleetrl-trainer.service")
DEFAULT_VENV = "/opt/fleetrl/venv"
DEFAULT_CONFIG = "/etc/fleetrl/fleet.yaml"
# An ExecStart argument systemd takes literally: absolute, no spaces, quotes, `$` or `%` specifiers.
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9._/+-]*$")


def _check_path(what: str, path: str) -> str:
    if not _PLAIN_PATH.match(path):
        raise ValueError(f"{what} {path!r} must be an absolute path of letters, digits and ._/+- "
                         "(systemd would split or expand anything else)")
    return path.rstrip("/") or "/"


def unit_text(name: str, *, venv: str = DEFAULT_VENV, config: str = DEFAULT_CONFIG) -> str:
    """The packaged unit `name`, with its ExecStart pointed at `venv` and `config`."""
    if name not in UNIT_NAMES:
        raise ValueError(f"no packaged unit {name!r}; FleetRL ships {', '.join(UNIT_NAMES)}")
    text = resources.files("fleetrl.regions").joinpath("systemd", name).read_text(encoding="utf-8")
    venv, config = _check_path("virtualenv prefix", venv), _check_path("config path", config)
    # Every Exec line (ExecStart=, ExecStartPre=) starts the packaged `fleetrl` with the packaged config.
    text = re.sub(rf"^(Exec[A-Za-z]*=){re.escape(DEFAULT_VENV)}/bin/fleetrl ", rf"\g<1>{venv}/bin/fleetrl ",
                  text, flags=re.MULTILINE)
    return text.replace(f" --config {DEFAULT_CONFIG} ", f" --config {config} ")


def _write_atomic(path: pathlib.Path, text: str) -> None:
    """Temp file in the same folder, fsync, rename: systemd never reads half a unit."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def install(dest_dir: str | os.PathLike[str], *, venv: str = DEFAULT_VENV,
            config: str = DEFAULT_CONFIG) -> list[pathlib.Path]:
    """Write every packaged unit into `dest_dir` (which must exist); returns the paths written."""
    dest = pathlib.Path(dest_dir)
    if not dest.is_dir():
        raise FileNotFoundError(f"unit folder {dest} does not exist (systemd's is /etc/systemd/system)")
    texts = {name: unit_text(name, venv=venv, config=config) for name in UNIT_NAMES}  # all checked first
    written = []
    for name, text in texts.items():
        _write_atomic(dest / name, text)
        written.append(dest / name)
    return written


def run_units(args: argparse.Namespace, config: None) -> int:
    """`fleetrl units install [--dest DIR] [--prefix VENV] [--config PATH]`."""
    try:
        if args.dest is None:
            for name in UNIT_NAMES:
                print(f"# {name}\n{unit_text(name, venv=args.prefix, config=args.unit_config)}")
            return 0
        for path in install(args.dest, venv=args.prefix, config=args.unit_config):
            print(path)
    except (ValueError, OSError) as exc:
        print(f"fleetrl units: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
