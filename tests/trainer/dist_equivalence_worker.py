"""Run N learner steps on fixed synthetic batches and save the parameters (rank 0).

Launched by `test_trainer_dist.py` twice: as one plain process, and under
`torchrun --nproc-per-node 2` (FSDP2 over gloo). Halfway it round-trips the model and optimizer
state through `checkpoint_state` / `load_state`, and writes a sharded checkpoint (each rank its own
shards, then the atomic commit); at the end it loads those shards back and takes the second half's
steps again, as a resume does: the result must be the same parameters, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import pathlib

import torch
from trainer_groups import make_group  # the script's folder is on sys.path

from fleetrl.config import AlgorithmConfig, ModelConfig
from fleetrl.trainer import checkpoint
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ppo-epochs", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = DistContext.from_env("cpu")
    try:
        train(ctx, args.steps, args.out, args.ppo_epochs)
    finally:
        ctx.close()  # after the learner is gone (see DistContext.close)


def train(ctx: DistContext, steps: int, out: str, ppo_epochs: int = 1) -> None:
    # 3 groups of 3 samples = 9 samples: ranks get 5 and 4, micro-batches of 2 -> rank 1 runs a
    # zero-loss stand-in in its third micro-batch. KL and clipping are on, so every path is used.
    # With ppo_epochs 2 (one mini-batch: the same samples per update on any number of ranks), the
    # step's old logprobs are computed on every rank and the second update's ratio moves off 1.
    algo = AlgorithmConfig(lr=1e-2, micro_batch_samples=2, kl_coef=0.05, grad_clip=0.5, aggregation="seq_mean",
                           ppo_epochs=ppo_epochs)
    learner = Learner(ModelConfig(), algo, ctx)
    if not ctx.is_leader:
        learner.follow()
        return
    batches = [build_step_batch([make_group(f"g{step}-{i}", "r", n=3, seed=100 * step + i, length=6)
                                 for i in range(3)], "grpo", step) for step in range(steps)]
    history, half = [], steps // 2
    ckpt_dir = pathlib.Path(out).parent / "ckpt"
    for step in range(steps):
        stats = learner.train_step(batches[step])
        history.append([stats.loss, stats.grad_norm, stats.kl, float(stats.tokens), stats.approx_kl,
                        stats.clip_fraction])
        if step == half:
            learner.load_state(*learner.checkpoint_state())
            tmp = checkpoint.begin(ckpt_dir, step + 1)
            learner.save_shards(str(tmp / checkpoint.WEIGHTS_DIR))
            saved = checkpoint.commit(ckpt_dir, tmp, {"run": "r", "step": step + 1, "version": step + 1}, keep=1)
    msd, _ = learner.checkpoint_state()
    learner.load_shards(str(saved / checkpoint.WEIGHTS_DIR))  # resume from the sharded checkpoint
    for step in range(half + 1, steps):
        learner.train_step(batches[step])
    resumed, _ = learner.checkpoint_state()
    torch.save({"params": msd, "stats": history, "resumed": resumed,
                "shard_files": sorted(os.listdir(saved / checkpoint.WEIGHTS_DIR))}, out)
    learner.stop_followers()


if __name__ == "__main__":
    main()
