"""FleetRL: cross-region, asynchronous RL post-training over message brokers.

The sub-packages follow DESIGN.md §2: `fleetrl.config` and `fleetrl.log` here; `fleetrl.broker`,
`fleetrl.hub`, `fleetrl.rollout`, `fleetrl.trainer` and `fleetrl.regions` from the folders of the
same names at the repository root. Importing `fleetrl` imports nothing heavy.
"""

__version__ = "0.1.0"
