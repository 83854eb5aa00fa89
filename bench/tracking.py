"""What experiment tracking costs the trainer: step time with tracking off, with the local
metrics.jsonl alone, with an MLflow server nobody listens on, and with TensorBoard.

Each step is what the trainer loop does for one step of `examples/fleet.demo.yaml`'s shape (the tiny
Qwen2, 8 groups of 8 samples of 6 tokens): the real learner's `train_step` on the step's groups, then
`TrainerTracking.record_step` and `release` (the release a checkpoint triggers, every step by default).
A variant is one phase: start the tracking (its trackers open in their threads: an SDK import, MLflow's
failing connection and retries), run the steps, then close; the time counted is start to the last step,
on the wall clock, so a tracker thread contending for the GIL or the cores counts. Variants alternate
over rounds (the machine is shared: neighbours' load moves every variant alike); a variant's ratio is
the median over rounds of its time over `off`'s in the same round. `close_s` is each variant's median
close, apart (the trainer's exit, bounded by `tracking.close_timeout_s`).

    .venv/bin/python bench/tracking.py [--quick] [--rounds N] [--steps N]

Last line: `result: step_ms_off=... ratio_jsonl=... ratio_mlflow_down=... ratio_tensorboard=...
cpu_ratio_...=... close_s_mlflow_down=...` (wall and process-CPU ratios against `off`; the target for a
failing tracker is <= 1.01). CPU time (every thread of the process) is the steadier figure on shared
cores, where the neighbours' load moves wall time by tens of percent between phases.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = ("off", "jsonl", "mlflow_down", "tensorboard")


def _groups(config: Any, step: int) -> list[Any]:
    import numpy as np

    from fleetrl.broker import GroupRecord, Sample, floats, ids

    a = config.algorithm
    rng = np.random.default_rng(step)
    groups = []
    for g in range(a.groups_per_step):
        samples = [Sample(completion_ids=ids(rng.integers(3, 98, a.max_new_tokens)),
                          logprobs=floats(-rng.uniform(0.5, 4.0, a.max_new_tokens)),
                          versions=np.full(a.max_new_tokens, step, dtype=np.int32),
                          reward=float(rng.uniform(0, 1)), finish_reason="stop") for _ in range(a.n_samples)]
        groups.append(GroupRecord(group_id=f"demo-{step}-{g}", run=config.run, task="reverse", attempt=0,
                                  region=("local-a", "local-b")[g % 2], node="node-1",
                                  prompt_ids=ids(rng.integers(3, 98, 8)), samples=samples))
    return groups


def _config(variant: str, out: pathlib.Path) -> Any:
    from fleetrl.config import load_config
    from fleetrl.devstack import free_port

    config = load_config(ROOT / "examples" / "fleet.demo.yaml").model_copy(deep=True)
    config.trainer.checkpoint_dir = str(out / "ckpt")
    config.tracking.output_dir = str(out / "tracking")
    config.tracking.samples_every = 10
    if variant == "mlflow_down":
        config.tracking.report_to = ["mlflow"]
        config.tracking.mlflow_tracking_uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    elif variant == "tensorboard":
        config.tracking.report_to = ["tensorboard"]
    return config


def _phase(variant: str, learner: Any, steps: int, first_step: int, out: pathlib.Path
           ) -> tuple[float, float, float]:
    """Wall seconds per step (start to last step), CPU seconds per step of the whole process (every
    thread: the trackers' too), and seconds to close, for one variant."""
    from fleetrl.trainer.batch import build_step_batch
    from fleetrl.trainer.tracking import TrainerTracking

    config = _config(variant, out)
    t0, cpu0 = time.perf_counter(), time.process_time()
    tracking = TrainerTracking(config) if variant != "off" else None
    if tracking is not None:
        tracking.start()
    for step in range(first_step, first_step + steps):
        groups = _groups(config, step)
        s0 = time.perf_counter()
        batch = build_step_batch(groups, config.algorithm.advantage, step)
        stats = learner.train_step(batch)
        if tracking is not None:
            tracking.record_step(step, step, groups, batch_stats=batch.stats, stats=stats,
                                 seconds=time.perf_counter() - s0, cost_fields={})
            tracking.release(step)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    c0 = time.perf_counter()
    if tracking is not None:
        tracking.close()
        if variant == "mlflow_down":
            assert set(tracking.log.failed()) == {"mlflow"}, tracking.log.failed()
    return elapsed / steps, cpu / steps, time.perf_counter() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 30 steps (under 2 min on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per variant and round")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (30 if args.quick else 100)

    import torch

    from fleetrl.trainer.dist import DistContext
    from fleetrl.trainer.learner import Learner

    torch.set_num_threads(1)
    base = _config("off", pathlib.Path(tempfile.mkdtemp(prefix="fleetrl-bench-tracking-")))
    learner = Learner(base.model, base.algorithm, DistContext())
    per_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    close_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    step = 1
    with tempfile.TemporaryDirectory(prefix="fleetrl-bench-tracking-") as tmp:
        _phase("off", learner, 5, step, pathlib.Path(tmp) / "warm")  # first steps allocate AdamW's state
        step += 5
        for r in range(rounds):
            for variant in VARIANTS:
                s, cpu, c = _phase(variant, learner, steps, step, pathlib.Path(tmp) / f"{variant}-{r}")
                step += steps
                per_step[variant].append(s)
                cpu_step[variant].append(cpu)
                close_s[variant].append(c)
                print(f"round {r + 1}/{rounds} {variant:12s} {s * 1000:8.2f} ms/step wall {cpu * 1000:8.2f} ms/step "
                      f"cpu  close {c:6.2f} s", flush=True)
    def ratio(times: dict[str, list[float]], v: str) -> float:
        """Median over rounds of the variant's time over `off`'s in the same round (paired: a round's
        neighbours' load moves both)."""
        return statistics.median(t / base for t, base in zip(times[v], times["off"], strict=True))

    print(f"result: step_ms_off={statistics.median(per_step['off']) * 1000:.2f} "
          f"ratio_jsonl={ratio(per_step, 'jsonl'):.4f} ratio_mlflow_down={ratio(per_step, 'mlflow_down'):.4f} "
          f"ratio_tensorboard={ratio(per_step, 'tensorboard'):.4f} "
          f"cpu_ratio_jsonl={ratio(cpu_step, 'jsonl'):.4f} "
          f"cpu_ratio_mlflow_down={ratio(cpu_step, 'mlflow_down'):.4f} "
          f"cpu_ratio_tensorboard={ratio(cpu_step, 'tensorboard'):.4f} "
          f"close_s_mlflow_down={statistics.median(close_s['mlflow_down']):.2f} "
          f"close_s_tensorboard={statistics.median(close_s['tensorboard']):.2f}")


if __name__ == "__main__":
    sys.exit(main())
