"""Torch engine (continuous batching) vs `model.generate` on static batches, in the same run.

Workload, long-tailed as RL rollouts are: the tiny Qwen2 of `ModelConfig()` (random init) samples
at temperature 1 from a nearly flat distribution; five token ids count as EOS for both sides, so
every token ends a sample with probability ~4%. Lengths are geometric (mean ~23 tokens) and capped
at `max_new_tokens`=96, which ~2% of samples reach. A static batch runs until its longest sample
is done, so most of its rows idle after their EOS; the engine refills a finished slot with a
waiting sample at the next step.

Both sides decode the same prompts (random token ids, 8 to 16 long, left-padded for `generate`)
with the same model on one CPU thread. Useful tokens are the tokens each sample generated up to
and including its EOS; the figure is useful tokens per second of wall time.

    .venv/bin/python bench/engine.py [--quick]

Last line: `result: speedup_b1=... speedup_b8=... speedup_b32=... engine_tok_s_b32=... generate_tok_s_b32=...`
"""

from __future__ import annotations

import argparse
import time

import torch

from fleetrl.broker import Sampling
from fleetrl.config import ModelConfig
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.torch_engine import TorchEngine

EOS_IDS = [2, 3, 4, 5, 6]
MAX_NEW_TOKENS = 96


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (n,), generator=g).tolist()
    return [[1, *torch.randint(7, 128, (k,), generator=g).tolist()] for k in lengths]


def useful(tokens: list[int]) -> int:
    """Tokens up to and including the first EOS (all of them when none)."""
    for i, t in enumerate(tokens):
        if t in EOS_IDS:
            return i + 1
    return len(tokens)


def run_generate(model: torch.nn.Module, prompts: list[list[int]], batch: int) -> tuple[int, float]:
    tokens, started = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=EOS_IDS, pad_token_id=0)
        tokens += sum(useful(row[width:].tolist()) for row in out)
    return tokens, time.perf_counter() - started


def run_engine(model: torch.nn.Module, prompts: list[list[int]], batch: int) -> tuple[int, float]:
    engine = TorchEngine(model, max_batch=batch, eos_ids=EOS_IDS)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS)
    started = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(GroupRequest(f"g{i}", p, sampling, n_samples=1, seed=0))
    tokens = 0
    while engine.has_work():
        for group in engine.step():
            tokens += sum(len(s.completion_ids) for s in group.samples)
    return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (under two minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None, help="measurement rounds per batch size")
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 3)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ModelConfig().build().eval()
    model.generation_config.top_k = None  # plain sampling on both sides (no default top-k)
    per_slot = 12 if args.quick else 32  # samples per slot: the queue outlasts the batch many times over
    results: dict[str, float] = {}
    for batch in (1, 8, 32):
        prompts = make_prompts(max(per_slot * batch, 24), seed=batch)
        run_engine(model, prompts[:batch], batch)  # warm-up: first-call allocations on both sides
        run_generate(model, prompts[:batch], batch)
        # Alternate the two and keep each one's best round: other processes on shared cores only
        # ever slow a round down, so the best is the least disturbed measurement.
        e_rate = g_rate = 0.0
        for _ in range(args.rounds):
            e_tok, e_s = run_engine(model, prompts, batch)
            g_tok, g_s = run_generate(model, prompts, batch)
            e_rate, g_rate = max(e_rate, e_tok / e_s), max(g_rate, g_tok / g_s)
            print(f"batch {batch:2d}: engine {e_tok} tokens in {e_s:.2f} s = {e_tok / e_s:.0f} tok/s | "
                  f"generate {g_tok} tokens in {g_s:.2f} s = {g_tok / g_s:.0f} tok/s")
        print(f"batch {batch:2d}: best engine {e_rate:.0f} tok/s, best generate {g_rate:.0f} tok/s, "
              f"speedup {e_rate / g_rate:.2f}x")
        results[f"speedup_b{batch}"] = round(e_rate / g_rate, 2)
        if batch == 32:
            results["engine_tok_s_b32"], results["generate_tok_s_b32"] = round(e_rate), round(g_rate)
    print("result: " + " ".join(f"{k}={v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
