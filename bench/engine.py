"""Torch engine (continuous batching) vs `model.generate` on static batches, in the same run.

Workload, long-tailed as RL rollouts are. The model is the tiny Qwen2 of `ModelConfig()` (random
init, seed 0) with one deterministic weight edit, the same for both sides: the EOS row (id 2, the
model's `eos_token_id`) of the output embedding is pushed along the mean direction of the final
hidden states (`EOS_PUSH` times the unit vector, measured on fixed random token sequences), which
raises the EOS logit at every step by ~1.2 nats on average. Sampling at temperature 1, top-p 1,
`max_new_tokens`=96, every sample ends at EOS with a per-step probability of a few percent:
lengths are long-tailed (mean ~29, median ~20, p90 ~70, ~4% reach the cap; the run prints the
measured distribution of both sides). A static batch runs until its longest sample is done, so
most of its rows idle after their EOS; the engine refills a finished slot with a waiting sample
at the next step.

Both sides generate the same number of samples from the same prompts (random token ids, 8 to 16
long; left-padded for `generate`) with the same model and sampling settings on one CPU thread.
Useful tokens are each sample's tokens up to and including its EOS (for `generate`, the padding
after EOS is not counted); the figure is useful tokens per second of wall time. Each side's best
of 2-3 alternating rounds is kept (other processes on shared cores only ever slow a round down).

    .venv/bin/python bench/engine.py [--quick]

Last line: `result: speedup_b1=... speedup_b8=... speedup_b32=... engine_tok_s_b32=... generate_tok_s_b32=...`
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from fleetrl.broker import Sampling
from fleetrl.config import ModelConfig
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.torch_engine import TorchEngine

MAX_NEW_TOKENS = 96
EOS_PUSH = 1.0
"""How far the EOS output row moves along the mean final-hidden direction (sets the mean length)."""


@dataclass
class Run:
    """One side's round: useful tokens, seconds, decoding steps (forward passes), sample lengths."""

    tokens: int
    seconds: float
    steps: int
    lengths: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def build_model() -> torch.nn.Module:
    """The tiny Qwen2 with its EOS logit raised (see the module docstring); same for both sides."""
    model = ModelConfig().build().eval()
    model.generation_config.top_k = None  # plain sampling on both sides (no default top-k)
    eos = int(model.config.eos_token_id)
    probe = torch.randint(3, model.config.vocab_size, (64, 48), generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        hidden = model.model(input_ids=probe).last_hidden_state.flatten(0, 1)
        direction = hidden.mean(dim=0)
        model.get_output_embeddings().weight[eos] += EOS_PUSH * direction / direction.norm()
    return model


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (n,), generator=g).tolist()
    return [[1, *torch.randint(7, 128, (k,), generator=g).tolist()] for k in lengths]


def useful(tokens: list[int], eos: int) -> int:
    """Tokens up to and including the first EOS (all of them when none)."""
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def run_generate(model: torch.nn.Module, prompts: list[list[int]], batch: int) -> Run:
    eos = int(model.config.eos_token_id)
    run, started = Run(0, 0.0, 0), time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=0)
        run.steps += out.shape[1] - width  # one forward pass per generated position
        run.lengths += [useful(row[width:].tolist(), eos) for row in out]
    run.seconds = time.perf_counter() - started
    run.tokens = sum(run.lengths)
    return run


def run_engine(model: torch.nn.Module, prompts: list[list[int]], batch: int) -> Run:
    engine = TorchEngine(model, max_batch=batch)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS)
    run, started = Run(0, 0.0, 0), time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(GroupRequest(f"g{i}", p, sampling, n_samples=1, seed=0))
    while engine.has_work():
        run.steps += 1  # one forward pass per step (admitted prompts ride along in it)
        for group in engine.step():
            run.lengths += [len(s.completion_ids) for s in group.samples]  # they end at their EOS
    run.seconds = time.perf_counter() - started
    run.tokens = sum(run.lengths)
    return run


def describe(lengths: list[int]) -> str:
    a = np.asarray(lengths)
    return (f"mean {a.mean():.1f} p50 {np.median(a):.0f} p90 {np.percentile(a, 90):.0f} "
            f"at max_new_tokens {100 * (a >= MAX_NEW_TOKENS).mean():.1f}%")


def measure(model: torch.nn.Module, batch: int, n_samples: int, rounds: int) -> tuple[Run, Run]:
    """Alternate the two sides `rounds` times; each side's best round."""
    prompts = make_prompts(n_samples, seed=batch)
    run_engine(model, prompts[:batch], batch)  # warm-up: first-call allocations on both sides
    run_generate(model, prompts[:batch], batch)
    best: dict[str, Run] = {}
    sampled: list[int] = []  # generate draws new samples every round (torch's RNG); pool them
    for _ in range(rounds):
        for side, fn in (("engine", run_engine), ("generate", run_generate)):
            run = fn(model, prompts, batch)
            if side == "generate":
                sampled += run.lengths
            print(f"batch {batch:2d} {side:8s}: {run.tokens} tokens in {run.seconds:.2f} s = {run.rate:.0f} tok/s, "
                  f"{run.steps} steps, {1e3 * run.seconds / run.steps:.2f} ms/step")
            if side not in best or run.rate > best[side].rate:
                best[side] = run
    # The engine's samples are the same every round (counter-based randomness, fixed seed).
    print(f"batch {batch:2d} lengths: engine {describe(best['engine'].lengths)} ({n_samples} samples); "
          f"generate {describe(sampled)} ({len(sampled)} samples over {rounds} rounds)")
    return best["engine"], best["generate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (under two minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None, help="measurement rounds per batch size")
    args = parser.parse_args()
    rounds = args.rounds or 3
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model()
    per_slot = 48 if args.quick else 96  # samples per slot: the queue outlasts the batch many times over
    results: dict[str, float] = {}
    for batch in (1, 8, 32):
        engine, generate = measure(model, batch, max(per_slot * batch, 32), rounds)
        speedup = engine.rate / generate.rate
        print(f"batch {batch:2d}: best engine {engine.rate:.0f} tok/s, best generate {generate.rate:.0f} tok/s, "
              f"speedup {speedup:.2f}x = {generate.steps / engine.steps * engine.tokens / generate.tokens:.2f}x "
              f"fewer steps per token x {generate.seconds / generate.steps / (engine.seconds / engine.steps):.2f}x "
              f"cost per step")
        results[f"speedup_b{batch}"] = round(speedup, 2)
        if batch == 32:
            results["engine_tok_s_b32"], results["generate_tok_s_b32"] = round(engine.rate), round(generate.rate)
    print("result: " + " ".join(f"{k}={v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
