"""A consumer-group member in its own process, for tests that SIGKILL it before it commits.

    python kafka_member.py FLEET_YAML GROUP N

Joins GROUP on region r1's `prompts`, polls until it holds N records, prints their keys as one JSON
line, and then waits (never committing) until it is killed.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, for slowdown
from slowdown import scaled  # the suite's slowdown factor, inherited through the environment

from fleetrl.broker import Consumer, Producer, RecordLimits
from fleetrl.config import load_config


async def main(path: str, group: str, n: int) -> None:
    config = load_config(path)
    limits = RecordLimits.from_config(config)
    async with Producer(config, "r1", "member-dlq") as dlq, Consumer(
        config, "r1", ["prompts"], group, limits, dlq, "member", session_timeout_s=3.0, heartbeat_interval_s=0.5
    ) as consumer:
        got: list[str] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(60)
        while len(got) < n and loop.time() < deadline:
            got += [d.key or "" for d in await consumer.poll(max_records=100, timeout_s=0.5)]
        print(json.dumps(sorted(got)), flush=True)
        await asyncio.sleep(scaled(120))  # holding the records, uncommitted, until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
