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
import copy
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fleetrl.broker import Sampling
from fleetrl.config import ModelConfig, SpeculativeConfig
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


def describe(lengths: list[int], cap: int = MAX_NEW_TOKENS) -> str:
    a = np.asarray(lengths)
    return (f"mean {a.mean():.1f} p50 {np.median(a):.0f} p90 {np.percentile(a, 90):.0f} "
            f"at max_new_tokens {100 * (a >= cap).mean():.1f}%")


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


# -- history-drafted speculative decoding ---------------------------------------------------------

SPEC_VOCAB = 512
SPEC_NEW_TOKENS = 64
P_HABIT = 0.97
"""The Markov language the spec workload's policy is trained on: each token is followed by its habitual
successor with this probability, else by one alternative."""


def markov_policy(train_steps: int, seed: int = 0) -> torch.nn.Module:
    """A tiny untied Qwen2 trained (cross-entropy, a few seconds) on a sparse Markov language: at T=1 its
    per-token distribution is peaked with occasional forks, as an RL-trained policy's is, and its answers
    to one prompt differ between samples only where it forked."""
    rng = np.random.default_rng(seed)
    habit, other = rng.integers(3, SPEC_VOCAB, SPEC_VOCAB), rng.integers(3, SPEC_VOCAB, SPEC_VOCAB)
    torch.manual_seed(seed)
    model = ModelConfig(tiny={"vocab_size": SPEC_VOCAB, "tie_word_embeddings": False, "seed": seed}).build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(train_steps):
        x = np.zeros((16, 48), dtype=np.int64)
        x[:, 0] = rng.integers(3, SPEC_VOCAB, 16)
        for j in range(1, 48):
            x[:, j] = np.where(rng.random(16) < P_HABIT, habit[x[:, j - 1]], other[x[:, j - 1]])
        ids = torch.from_numpy(x)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SPEC_VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def rl_update(model: torch.nn.Module, groups: dict[str, list[Any]], prompts: dict[str, list[int]],
              lr: float) -> float:
    """One policy-gradient step as in RL (GRPO advantages, token-mean loss) on an epoch's samples; the
    reward favours the lower half of the vocabulary. Returns the mean |change| of the samples' logprobs."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    seqs, advs, spans = [], [], []
    for gid, samples in groups.items():
        rewards = torch.tensor([float((s.completion_ids < SPEC_VOCAB // 2).mean()) for s in samples])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for s, a in zip(samples, adv.tolist(), strict=True):
            seqs.append(prompts[gid] + s.completion_ids.tolist())
            advs.append(a)
            spans.append((len(prompts[gid]), len(s.completion_ids)))
    ids = torch.tensor(seqs)  # equal lengths: prompts of one length, completions at the cap
    logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
    mask = torch.zeros_like(logp)
    for i, (p, n) in enumerate(spans):
        mask[i, p - 1:p - 1 + n] = 1
    loss = -(torch.tensor(advs)[:, None] * logp * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        after = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
    return float(((after - logp.detach()).abs() * mask).sum() / mask.sum())


def run_epoch(engine: TorchEngine, prompts: dict[str, list[int]], epoch: int, n_samples: int) -> tuple[Run, dict]:
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=SPEC_NEW_TOKENS)
    run, groups, started = Run(0, 0.0, 0), {}, time.perf_counter()
    for gid, p in prompts.items():
        engine.submit(GroupRequest(f"{gid}-e{epoch}", p, sampling, n_samples=n_samples, seed=epoch))
    while engine.has_work():
        run.steps += 1
        for group in engine.step():
            groups[group.group_id.rsplit("-e", 1)[0]] = group.samples
            run.lengths += [len(s.completion_ids) for s in group.samples]
    run.seconds = time.perf_counter() - started
    run.tokens = sum(run.lengths)
    return run, groups


def measure_spec(quick: bool, batch: int, rounds: int) -> dict[str, Any]:
    """Epochs over one prompt set with the policy trained between them (the same weights for both sides),
    `rounds` times from the same start (each round computes the same tokens; each side's best time per
    epoch is kept: other processes on shared cores only ever slow a round down). Returns the speedup
    over epochs >= 1 and the acceptance per epoch."""
    start = markov_policy(train_steps=120 if quick else 200)
    g = torch.Generator().manual_seed(7)
    prompts = {f"p{i}": [1, *torch.randint(3, SPEC_VOCAB, (12,), generator=g).tolist()]
               for i in range(8 if quick else 16)}
    n_samples, epochs = 8, (4 if quick else 6)
    best: dict[tuple[str, int], Run] = {}
    acceptance: list[float] = []
    for _ in range(rounds):
        acceptance = spec_round(start, prompts, n_samples, epochs, batch, best)
    best_sides = ("plain", "spec")
    totals = {side: sum(best[side, e].tokens for e in range(1, epochs)) /
              sum(best[side, e].seconds for e in range(1, epochs)) for side in ("plain", "spec")}
    steps = {side: sum(best[side, e].steps for e in range(1, epochs)) for side in best_sides}
    speedup = totals["spec"] / totals["plain"]
    print(f"spec b{batch}: epochs 1-{epochs - 1}, best of {rounds} round(s): spec {totals['spec']:.0f} tok/s vs plain "
          f"{totals['plain']:.0f} tok/s = {speedup:.2f}x: {steps['plain'] / steps['spec']:.2f}x fewer steps at "
          f"{steps['plain'] / steps['spec'] / speedup:.2f}x the cost per step")
    return {"speedup": totals["spec"] / totals["plain"], "acceptance": acceptance}


def spec_round(start: torch.nn.Module, prompts: dict[str, list[int]], n_samples: int, epochs: int, batch: int,
               best: dict[tuple[str, int], Run]) -> list[float]:
    """One run of the epochs from `start`; keeps each side's fastest run per epoch in `best`."""
    policy = copy.deepcopy(start)
    off = SpeculativeConfig(enabled=False)
    plain = TorchEngine(copy.deepcopy(start), max_batch=batch, eos_ids=[2], speculative=off)
    spec = TorchEngine(copy.deepcopy(start), max_batch=batch, eos_ids=[2])
    assert spec.speculator is not None
    acceptance, same = [], 0
    for epoch in range(epochs):
        before = copy.deepcopy(spec.speculator.stats)
        order = (("plain", plain), ("spec", spec)) if epoch % 2 else (("spec", spec), ("plain", plain))
        outs = {}
        for side, engine in order:
            run, outs[side] = run_epoch(engine, prompts, epoch, n_samples)
            if (side, epoch) not in best or run.rate > best[side, epoch].rate:
                best[side, epoch] = run
            print(f"spec b{batch} epoch {epoch} {side:5s}: {run.tokens} tokens in {run.seconds:.2f} s = "
                  f"{run.rate:.0f} tok/s, {run.steps} steps, lengths {describe(run.lengths, SPEC_NEW_TOKENS)}")
        st = spec.speculator.stats
        drafted, accepted = st.drafted - before.drafted, st.accepted - before.accepted
        acceptance.append(accepted / drafted if drafted else 0.0)
        same += sum(np.array_equal(a.completion_ids, b.completion_ids)
                    for gid in prompts for a, b in zip(outs["plain"][gid], outs["spec"][gid], strict=True))
        moved = rl_update(policy, outs["plain"], prompts, lr=0.5)
        state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        for engine in (plain, spec):
            engine.stage_weights(state, version=epoch + 1)
        print(f"spec b{batch} epoch {epoch}: acceptance {acceptance[-1]:.3f} ({accepted}/{drafted} drafted tokens); "
              f"the policy step after it moved the samples' logprobs by {moved:.4f} on average")
    print(f"spec b{batch}: {same} of {epochs * len(prompts) * n_samples} samples identical token for token "
          f"(same uniforms)")
    return acceptance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (under two minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None, help="measurement rounds per batch size")
    parser.add_argument("--part", choices=["all", "batching", "spec"], default="all",
                        help="batching: engine vs generate; spec: history drafts vs none; all: both")
    args = parser.parse_args()
    rounds = args.rounds or 3
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    if args.part in ("all", "spec"):
        for batch in (8,) if args.quick else (8, 32):
            out = measure_spec(args.quick, batch, 2 if args.quick else rounds)
            suffix = "" if batch == 8 else f"_b{batch}"
            results[f"speedup_spec{suffix}"] = round(out["speedup"], 2)
            results[f"acceptance{suffix}"] = ",".join(f"e{e}:{a:.3f}" for e, a in enumerate(out["acceptance"]) if e)
    if args.part in ("all", "batching"):
        batching(args.quick, rounds, results)
    print("result: " + " ".join(f"{k}={v}" for k, v in results.items()))


def batching(quick: bool, rounds: int, results: dict[str, Any]) -> None:
    model = build_model()
    per_slot = 48 if quick else 96  # samples per slot: the queue outlasts the batch many times over
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


if __name__ == "__main__":
    main()
