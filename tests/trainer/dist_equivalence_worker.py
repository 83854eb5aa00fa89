"""Run N learner steps on fixed synthetic batches and save the parameters (rank 0).

Launched by `test_trainer_dist.py` twice: as one plain process, and under
`torchrun --nproc-per-node 2` (FSDP2 over gloo). Halfway it round-trips the model and optimizer
state through `checkpoint_state` / `load_state`, as a resume does.
"""

from __future__ import annotations

import argparse

import torch
from trainer_groups import make_group  # the script's folder is on sys.path

from fleetrl.config import AlgorithmConfig, ModelConfig
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = DistContext.from_env("cpu")
    try:
        train(ctx, args.steps, args.out)
    finally:
        ctx.close()  # after the learner is gone (see DistContext.close)


def train(ctx: DistContext, steps: int, out: str) -> None:
    # 3 groups of 3 samples = 9 samples: ranks get 5 and 4, micro-batches of 2 -> rank 1 runs a
    # zero-loss stand-in in its third micro-batch. KL and clipping are on, so every path is used.
    algo = AlgorithmConfig(lr=1e-2, micro_batch_samples=2, kl_coef=0.05, grad_clip=0.5, aggregation="seq_mean")
    learner = Learner(ModelConfig(), algo, ctx)
    if not ctx.is_leader:
        learner.follow()
        return
    history = []
    for step in range(steps):
        groups = [make_group(f"g{step}-{i}", "r", n=3, seed=100 * step + i, length=6) for i in range(3)]
        stats = learner.train_step(build_step_batch(groups, "grpo", step))
        history.append([stats.loss, stats.grad_norm, stats.kl, float(stats.tokens)])
        if step == steps // 2:
            learner.load_state(*learner.checkpoint_state())
    msd, _ = learner.checkpoint_state()
    torch.save({"params": msd, "stats": history}, out)
    learner.stop_followers()


if __name__ == "__main__":
    main()
