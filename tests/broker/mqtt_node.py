"""A node holding a control-plane connection with a last will, for the SIGKILL test.

    python mqtt_node.py FLEET_YAML REGION NODE

Publishes a retained "up" heartbeat, prints "ready", then waits until it is killed.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, for slowdown
from slowdown import scaled  # the suite's slowdown factor, inherited through the environment

from fleetrl.broker import ControlPlane, Heartbeat
from fleetrl.config import load_config


async def main(path: str, region: str, node: str) -> None:
    config = load_config(path)
    async with ControlPlane(config, f"node-{node}", will=(region, node), watch_nodes=False) as cp:
        await cp.heartbeat(region, node, Heartbeat(state="up", version=1, in_flight=2, engines=1))
        print("ready", flush=True)
        await asyncio.sleep(scaled(120))  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
