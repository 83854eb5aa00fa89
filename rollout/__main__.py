"""`python -m fleetrl.rollout --config fleet.yaml --region R --node N`: one node's rollout worker.

Parses the config before importing torch; SIGTERM and SIGINT start the token-level handover
(every unfinished group published to `partials`, offsets committed), after which the process
exits 0. A fatal error exits 1 with one clear line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetrl.rollout", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="fleet.yaml")
    parser.add_argument("--region", required=True)
    parser.add_argument("--node", required=True)
    args = parser.parse_args(argv)

    from fleetrl.config import ConfigError, load_config
    from fleetrl.log import configure

    configure(json=True)
    try:
        config = load_config(args.config)
        config.region(args.region)
    except (ConfigError, KeyError) as exc:
        print(f"fleetrl rollout: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(config, args.region, args.node))
    except Exception as exc:  # the one place that turns any fatal error into one clear line
        print(f"fleetrl rollout: fatal: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: object, region: str, node: str) -> None:
    import torch

    from fleetrl.rollout.worker import RolloutWorker

    torch.set_num_threads(1)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await RolloutWorker(config, region, node).run(stop)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
