"""`python -m fleetrl.rollout --config fleet.yaml --region R --node N`: one node's rollout worker.

Parses the config before importing torch; SIGTERM and SIGINT start the token-level handover
(every unfinished group published to `partials`, offsets committed), after which the process
exits 0. A fatal error exits 1 with one clear line on stderr.

Standalone, the worker follows the control plane's version announcements itself. With
`--supervised --engine-index I` it is engine I of a node run by the region agent, which forwards the
announcements and reads its progress over a pipe pair (see `fleetrl.rollout.supervised`).
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
    parser.add_argument("--engine-index", type=int, default=0, help="which of the node's engines (engine.devices)")
    parser.add_argument("--supervised", action="store_true",
                        help="run under a region agent: commands on stdin, progress on stdout")
    args = parser.parse_args(argv)
    from fleetrl.runtime import no_progress_bars

    no_progress_bars()  # before torch and transformers import tqdm
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
        from fleetrl.runtime import run_daemon

        run_daemon(_serve(config, args.region, args.node, args.engine_index, args.supervised), "rollout")
    except Exception as exc:  # the one place that turns any fatal error into one clear line
        print(f"fleetrl rollout: fatal: {args.region}/{args.node}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: object, region: str, node: str, engine_index: int, supervised: bool) -> None:
    import torch

    from fleetrl.config import FleetConfig

    assert isinstance(config, FleetConfig)
    torch.set_num_threads(1)
    if supervised:
        from fleetrl.rollout.supervised import serve_supervised

        await serve_supervised(config, region, node, engine_index)
        return
    from fleetrl.rollout.announcements import follow_announcements
    from fleetrl.rollout.worker import RolloutWorker, build_engine

    worker = RolloutWorker(config, region, node, engine=build_engine(config, region, node, engine_index))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listener = asyncio.create_task(follow_announcements(config, region, f"{worker.client_id}-{engine_index}",
                                                        worker.weights.notify))
    try:
        await worker.run(stop)
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)


if __name__ == "__main__":
    sys.exit(main())
