"""Publish a learner's weights sharded (every rank its own tensors) and, from rank 0, as one process.

Launched by `test_trainer_dist.py` as one plain process and under `torchrun --nproc-per-node 2`
(FSDP2 over gloo). Versions 0, 1 and 2 (after a training step each) go into two stores: `sharded`
through `Learner.publish_sharded`, `single` through one `Hub.publish` of the gathered weights.
Version 2 is published sharded by a fresh publisher on rank 0 (its parent read back from the store).
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from trainer_groups import make_group  # the script's folder is on sys.path

from fleetrl.config import AlgorithmConfig, FleetConfig, ModelConfig
from fleetrl.hub import Hub
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner


def hub_config(root: pathlib.Path, name: str) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "sharded", "hub": {"home_store": (root / name).as_uri(), "frame_bytes": 65536, "threads": 1},
        "regions": [{"name": "r1", "kafka": "127.0.0.1:9", "store": (root / f"{name}-r1").as_uri()}],
    })


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = DistContext.from_env("cpu")
    try:
        run(ctx, pathlib.Path(args.out))
    finally:
        ctx.close()  # after the learner is gone (see DistContext.close)


def run(ctx: DistContext, out: pathlib.Path) -> None:
    learner = Learner(ModelConfig(), AlgorithmConfig(lr=1e-2, micro_batch_samples=2), ctx)
    with Hub.from_config(hub_config(out, "sharded")) as hub:
        publisher = hub.shard_publisher()
        learner.attach_publisher(publisher)
        if not ctx.is_leader:
            learner.follow()
            return
        with Hub.from_config(hub_config(out, "single")) as single:
            for step in range(3):
                if step:
                    groups = [make_group(f"g{step}-{i}", "r", n=3, seed=100 * step + i, length=6) for i in range(3)]
                    learner.train_step(build_step_batch(groups, "grpo", step))
                if step == 2:
                    publisher = hub.shard_publisher()  # nothing in memory on rank 0: reads version 1 back
                pv = learner.publish_sharded(publisher, version=step)
                assert pv is not None and pv.version == step
                assert single.publish(learner.published_state()).version == step
        learner.stop_followers()


if __name__ == "__main__":
    main()
