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

Last line: `result: step_ms_off=... ratio_<v>=... cpu_ratio_<v>=... share_<v>=... close_s_...=...` per
variant <v>: wall and process-CPU ratios against `off` (the target for a failing tracker is <= 1.01),
and `share`: what tracking itself costs, as a fraction of `off`'s step time: the trainer thread's time
inside the tracking calls plus the CPU the tracker threads used. On shared cores the neighbours' load
moves the ratios by tens of percent between phases; `share` is measured directly and stays put.
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
    config.tracking.report_to = []  # (the example config feeds TensorBoard)
    if variant == "mlflow_down":
        config.tracking.report_to = ["mlflow"]
        config.tracking.mlflow_tracking_uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    elif variant == "tensorboard":
        config.tracking.report_to = ["tensorboard"]
    return config


def _phase(variant: str, learner: Any, steps: int, first_step: int, out: pathlib.Path) -> dict[str, float]:
    """One variant's phase, per step: `wall` (start to the last step), `cpu` (the whole process, every
    thread: the trackers' too), `calls` (the trainer thread's time inside the tracking calls), `bg_cpu`
    (CPU of the other threads: the trackers' feeds); and `close` (seconds)."""
    from fleetrl.trainer.batch import build_step_batch
    from fleetrl.trainer.tracking import TrainerTracking

    config = _config(variant, out)
    t0, cpu0, own0, calls = time.perf_counter(), time.process_time(), time.thread_time(), 0.0
    tracking = TrainerTracking(config) if variant != "off" else None
    if tracking is not None:
        tracking.start()
    for step in range(first_step, first_step + steps):
        groups = _groups(config, step)
        s0 = time.perf_counter()
        batch = build_step_batch(groups, config.algorithm.advantage, step)
        stats = learner.train_step(batch)
        if tracking is not None:
            c = time.perf_counter()
            tracking.record_step(step, step, groups, batch_stats=batch.stats, stats=stats,
                                 seconds=c - s0, cost_fields={})
            tracking.release(step)
            calls += time.perf_counter() - c
    elapsed, cpu, own = time.perf_counter() - t0, time.process_time() - cpu0, time.thread_time() - own0
    c0 = time.perf_counter()
    if tracking is not None:
        tracking.close()
        if variant == "mlflow_down":
            assert set(tracking.log.failed()) == {"mlflow"}, tracking.log.failed()
    return {"wall": elapsed / steps, "cpu": cpu / steps, "calls": calls / steps, "bg_cpu": max(cpu - own, 0) / steps,
            "close": time.perf_counter() - c0}


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
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    step = 1
    with tempfile.TemporaryDirectory(prefix="fleetrl-bench-tracking-") as tmp:
        _phase("off", learner, 5, step, pathlib.Path(tmp) / "warm")  # first steps allocate AdamW's state
        step += 5
        for r in range(rounds):
            for variant in VARIANTS:
                m = _phase(variant, learner, steps, step, pathlib.Path(tmp) / f"{variant}-{r}")
                step += steps
                runs[variant].append(m)
                print(f"round {r + 1}/{rounds} {variant:12s} {m['wall'] * 1e3:8.2f} ms/step wall "
                      f"{m['cpu'] * 1e3:8.2f} cpu  {m['calls'] * 1e6:7.1f} us in tracking calls  "
                      f"{m['bg_cpu'] * 1e3:6.2f} ms other threads' cpu  close {m['close']:6.2f} s", flush=True)
    def ratio(key: str, v: str) -> float:
        """Median over rounds of the variant's figure over `off`'s in the same round (paired: a round's
        neighbours' load moves both)."""
        return statistics.median(m[key] / base[key] for m, base in zip(runs[v], runs["off"], strict=True))

    def med(key: str, v: str) -> float:
        return statistics.median(m[key] for m in runs[v])

    step_s = med("wall", "off")
    fields = [f"step_ms_off={step_s * 1e3:.2f}"]
    for v in VARIANTS[1:]:
        fields += [f"ratio_{v}={ratio('wall', v):.4f}", f"cpu_ratio_{v}={ratio('cpu', v):.4f}",
                   f"share_{v}={(med('calls', v) + med('bg_cpu', v)) / step_s:.5f}"]
    fields += [f"close_s_mlflow_down={med('close', 'mlflow_down'):.2f}",
               f"close_s_tensorboard={med('close', 'tensorboard'):.2f}"]
    print("result: " + " ".join(fields))


if __name__ == "__main__":
    sys.exit(main())
