"""A learner that fits: peak resident memory and time of one step, whole logits vs chunked logprobs.

One step of the real learner (`trainer/learner.py`, GRPO, one micro-batch of every sample) on a Qwen2
of ~50 M parameters with a 32k vocabulary (hidden 512, 12 layers, tied embeddings), 4,096 tokens per
step (16 samples of 64 prompt + 192 completion tokens), fp32 on the CPU. The variants differ only in
`algorithm.logprob_chunk_tokens`: 0 builds the micro-batch's whole `[tokens, vocab]` logits (the
baseline), 1,024 runs the head and log-softmax chunk by chunk (trainer/logprobs.py). A third variant
adds `activation_checkpointing` to the chunks.

Each variant runs in its own process, so one's allocations never count in another's peak: the child
builds the learner, resets the kernel's resident high-water mark (`/proc/self/clear_refs`), runs one
step (the first: AdamW's state is allocated in it, the same in every variant) and reports `VmHWM`, the
process's peak resident size during the step, and the step's time. The time is the process's CPU time
(user + system, one thread): on shared cores wall time swings by 2x with the neighbours' load (measured
here: the same step took 17 to 50 s), CPU time much less; page faults and zeroing of fresh memory count
in it. Wall time is printed too. Variants alternate over rounds; each keeps its best time and its
highest peak (the allocator's placement moves a variant's peak by up to ~0.3 GiB between rounds).

    .venv/bin/python bench/learner.py [--quick] [--rounds N] [--threads T]

Last line: `result: peak_gib_full=... peak_gib_chunked=... peak_ratio=... step_time_ratio=...
peak_gib_chunked_ckpt=... peak_ratio_ckpt=... step_time_ratio_ckpt=...` (ratios against `full`).

What to expect on this shape: the logits are ~1.2 GiB of the full step's ~4.3 GiB peak, the decoder
layers' activations ~1.9 GiB (12 layers x 4,096 tokens x ~44 KB in fp32), so chunking alone takes the
peak to ~0.7 of the full one at about the same step time, and only activation checkpointing takes the
activations too (~0.45), for about one more forward pass of the decoder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {"full": (0, False), "chunked": (1024, False), "chunked_ckpt": (1024, True)}
SHAPE = {"vocab_size": 32768, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 12,
         "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096}
"""~50.6 M parameters: 16.8 M in the tied embedding, 2.8 M per layer."""
SAMPLES, PROMPT, COMPLETION = 16, 64, 192


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(variant: str, threads: int) -> None:
    import numpy as np
    import torch

    from fleetrl.broker import GroupRecord, Sample, floats, ids
    from fleetrl.config import AlgorithmConfig, ModelConfig
    from fleetrl.trainer.batch import build_step_batch
    from fleetrl.trainer.dist import DistContext
    from fleetrl.trainer.learner import Learner

    torch.set_num_threads(threads)
    chunk, ckpt = VARIANTS[variant]
    algo = AlgorithmConfig(lr=1e-6, micro_batch_samples=64, logprob_chunk_tokens=chunk,
                           activation_checkpointing=ckpt)
    learner = Learner(ModelConfig(tiny=SHAPE), algo, DistContext())
    params = sum(p.numel() for p in learner.model.parameters())
    rng = np.random.default_rng(0)
    groups = []
    for g in range(SAMPLES // 8):
        samples = [Sample(ids(rng.integers(3, SHAPE["vocab_size"], COMPLETION).tolist()),
                          floats(np.full(COMPLETION, -10.0, np.float32)), np.zeros(COMPLETION, np.int32),
                          float(i % 2), "length") for i in range(8)]
        groups.append(GroupRecord(f"g{g}", "r", "t", 0, "a", "n",
                                  ids(rng.integers(3, SHAPE["vocab_size"], PROMPT).tolist()), samples))
    batch = build_step_batch(groups, "grpo", 0)
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    started, cpu = time.perf_counter(), time.process_time()
    stats = learner.train_step(batch)
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    print(json.dumps({"variant": variant, "peak_kib": _kib("VmHWM"), "before_kib": before, "step_s": cpu_s,
                      "wall_s": seconds,
                      "loss": stats.loss, "params": params, "tokens": SAMPLES * (PROMPT + COMPLETION)}))


def run_variant(variant: str, threads: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--threads", str(threads)],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round (under two minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the variants (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per child")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.threads)
        return
    rounds = args.rounds or (1 if args.quick else 3)
    best: dict[str, dict[str, float]] = {}
    peak_kib: dict[str, int] = {}
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else list(VARIANTS)[::-1]:
            got = run_variant(variant, args.threads)
            print(f"round {r} {variant:12s}: peak {got['peak_kib'] / 2**20:.2f} GiB (resident before the step "
                  f"{got['before_kib'] / 2**20:.2f} GiB), step {got['step_s']:.2f} s CPU ({got['wall_s']:.2f} s wall), "
                  f"loss {got['loss']:.6f}, "
                  f"{got['params'] / 1e6:.1f} M params, {got['tokens']} tokens", flush=True)
            if variant not in best or got["step_s"] < best[variant]["step_s"]:
                best[variant] = got
            peak_kib[variant] = max(peak_kib.get(variant, 0), int(got["peak_kib"]))
    gib = {v: peak_kib[v] / 2**20 for v in VARIANTS}
    full_s = best["full"]["step_s"]
    print("result: " + " ".join([
        f"peak_gib_full={gib['full']:.2f}", f"peak_gib_chunked={gib['chunked']:.2f}",
        f"peak_ratio={gib['chunked'] / gib['full']:.2f}",
        f"step_time_ratio={best['chunked']['step_s'] / full_s:.2f}",
        f"peak_gib_chunked_ckpt={gib['chunked_ckpt']:.2f}", f"peak_ratio_ckpt={gib['chunked_ckpt'] / gib['full']:.2f}",
        f"step_time_ratio_ckpt={best['chunked_ckpt']['step_s'] / full_s:.2f}",
    ]))


if __name__ == "__main__":
    main()
