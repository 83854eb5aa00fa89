"""FleetRL: cross-region, asynchronous RL post-training over message brokers.

The sub-packages follow DESIGN.md §2: `fleetrl.config` and `fleetrl.log` here; `fleetrl.broker`,
`fleetrl.hub`, `fleetrl.rollout`, `fleetrl.trainer` and `fleetrl.regions` from the folders of the
same names at the repository root. Importing `fleetrl` imports nothing heavy.
"""

import os as _os

__version__ = "0.1.0"

# Installed, the sub-packages sit inside this folder. From a source checkout (the repository root
# first on sys.path, as with `python -m ...` run there) they are the sibling folders: let the
# package find them there too, the way `[tool.setuptools.package-dir]` maps them.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "broker")):
    __path__.append(_root)
