"""LoRA against full fine-tuning, in the same run: bytes per version, the learner's peak memory, and
learning per sample (issue 40).

Three measurements, each on the real components (the `Learner`, the hub's `WeightPublisher` and
`Hub`, `WeightSync` into a `TorchEngine`, the task's reward), with nothing but the brokers left out:

* **bytes per version**: both learners take the same optimizer steps on the same groups (sampled
  once from the base model, rewards from the task) at lr 1e-5, and publish every step into a
  directory hub: full fine-tuning a bf16 delta of every weight, LoRA (rank 16, every linear layer
  but the head, alpha 32) the adapter's delta after its base was published once. The figure is
  the mean `bytes_written` of versions 2.. (the first version of either side is an anchor). Models:
  the tiny Qwen2 of the demo, and a ~100 M-parameter Qwen2 (Qwen2's vocabulary of 151,936 with
  tied embeddings, 8 layers of width 512).
* **peak memory**: a fresh process per side builds the learner on the ~100 M model and takes
  `PEAK_STEPS` steps (one with `--quick`; the two processes run side by side); the figure is its
  peak RSS less its RSS before the model was built (the interpreter and libraries), so the ratio
  compares what the learner itself holds. At micro-batch 2 (the result's `peak_ratio`) and 8
  (`peak_ratio_mb8`, full mode): the logits of Qwen2's 151,936-token vocabulary (and their
  log-softmax and gradients) are the same on both sides and grow with the micro-batch.
* **learning per sample**: a synchronous on-policy loop (generate with the engine from the newest
  version, score, train one step, publish, pull) on the `sort` task's partial-credit reward, 64
  samples a step. LoRA adapts a pretrained base, so the base is the tiny model first trained
  (supervised, `PRETRAIN_STEPS` steps, every weight) on the `copy` task, saved as a local Hugging Face
  folder and loaded through `model.path`: it knows the alphabet and the answer format, not how to
  sort. (On the random-init tiny model a frozen head keeps every logit within about +-1.3, and no
  adapter can make the policy confident: LoRA does not learn there at all.) Each side at its own
  learning rate (LoRA's about three times full fine-tuning's here; "LoRA Without Regret" finds about
  ten on large models), three seeds each (adapter init and prompts; one with `--quick`). The figure
  is the mean reward of the last `WINDOW` steps up to `--steps` (100; 30 with `--quick`); seed noise
  is each side's standard deviation over its seeds.

    .venv/bin/python bench/lora.py [--quick]
    .venv/bin/python bench/lora.py --bytes-steps 40   # bytes per version only, each printed (~10 min)

* **serving**: the torch engine decoding with an adapter merged into the weights against unmerged
  (`engine.lora_mode`), tokens per second and the time to apply the next version, on the tiny model
  (and the ~100 M one without `--quick`).

Last line: `result: bytes_ratio=... bytes_ratio_tiny=... peak_ratio=... [peak_ratio_mb8=...] reward_lora=...
reward_full=... reward_full_sd=... reward_lora_sd=... reward_gap_se=... merged_over_unmerged_tok_s=...`
(bytes_ratio: full over LoRA on the ~100 M model; peak_ratio: LoRA over full, at micro-batch 2;
reward_gap_se: full minus LoRA in standard errors of the difference; merged_over_unmerged_tok_s: on
the tiny model, per CPU second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
MID = {"vocab_size": 151936, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
       "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 256}
"""About 100 M parameters: 78 M in the tied embedding (Qwen2's vocabulary), 24 M in the layers."""
BYTES_LR = 1e-5
TASK, PRETRAIN_TASK = "sort", "copy"
PRETRAIN_STEPS, PRETRAIN_LR = 300, 3e-3
LR_FULL, LR_LORA = 3e-4, 1e-3
PEAK_STEPS = 2
WINDOW = 10


@dataclass
class Curve:
    rewards: list[float] = field(default_factory=list)
    bytes_per_version: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def tail(self, n: int) -> float:
        return statistics.fmean(self.rewards[-n:])


def _config(tmp: pathlib.Path, model: dict[str, Any], lr: float, lora: bool, seed: int, groups: int,
            samples: int, path: str | None = None) -> Any:
    from fleetrl.config import FleetConfig

    return FleetConfig.model_validate({
        "run": "bench-lora",
        "model": {"tiny": {**model, "seed": seed}, "lora": {**LORA, "seed": seed} if lora else None,
                  "path": path, "tokenizer": "char"},
        "algorithm": {"lr": lr, "groups_per_step": groups, "n_samples": samples, "max_new_tokens": 6,
                      "micro_batch_samples": 64},
        "hub": {"home_store": str(tmp / "hub"), "threads": 2, "anchor_interval": 1000,
                "signing": {"scheme": "hmac-sha256", "key": "bench-lora-" * 4}},
        "regions": [{"name": "r", "kafka": "127.0.0.1:9", "store": str(tmp / "hub")}],
    })


class Loop:
    """Learner -> hub -> WeightSync -> engine, one synchronous step at a time."""

    def __init__(self, config: Any, engine_lora_mode: str = "merged") -> None:
        from fleetrl.hub import Hub
        from fleetrl.rollout.tasks import get_task
        from fleetrl.rollout.tokenize import load_codec
        from fleetrl.rollout.torch_engine import TorchEngine
        from fleetrl.rollout.weights import WeightSync
        from fleetrl.trainer.dist import DistContext
        from fleetrl.trainer.learner import Learner
        from fleetrl.trainer.metrics import TrainerMetrics
        from fleetrl.trainer.publisher import WeightPublisher

        self.config, self.algo = config, config.algorithm
        self.learner = Learner(config.model, config.algorithm, DistContext())
        self.hub = Hub.from_config(config)
        self.publisher = WeightPublisher(self.hub, None, TrainerMetrics())
        self.engine = TorchEngine(config.model.build(), max_batch=64, lora_mode=engine_lora_mode)
        self.sync = WeightSync(self.hub, self.engine, fallback_poll_s=3600)
        self.task = get_task(TASK)
        self.codec = load_codec(config.model, sorted(self.engine.eos_ids))
        self.prompts = self.task.prompts(config.model.tiny.seed)
        self.version = 0

    async def start(self) -> None:
        if self.learner.lora is not None:
            await self.publisher.ensure_base(self.learner.base_state, self.learner.lora)
        await self.publish()

    async def publish(self) -> int:
        pv = await self.publisher.publish(self.learner.published_state())
        self.version = pv.version
        await self.sync.refresh(pv.version)
        return pv.bytes_written

    def groups(self, step: int) -> list[Any]:
        """One step's groups, sampled by the engine from the newest version and scored by the task."""
        from fleetrl.broker import GroupRecord, Sample, Sampling, ids
        from fleetrl.rollout.engine import GroupRequest

        wanted = {}
        for g in range(self.algo.groups_per_step):
            p = next(self.prompts)
            gid = f"s{step}-g{g}"
            wanted[gid] = p
            self.engine.submit(GroupRequest(gid, self.codec.encode(p.prompt), Sampling(
                temperature=1.0, top_p=1.0, max_new_tokens=self.algo.max_new_tokens), self.algo.n_samples,
                seed=step))
        out = []
        while wanted:
            for done in self.engine.step():
                p = wanted.pop(done.group_id)
                samples = [Sample(s.completion_ids, s.logprobs, s.versions,
                                  self.task.reward(self.codec.decode(s.completion_ids), p.reference),
                                  s.finish_reason or "length") for s in done.samples]
                out.append(GroupRecord(done.group_id, "bench-lora", TASK, 0, "r", "n",
                                       ids(self.codec.encode(p.prompt)), samples))
        return out

    def train(self, groups: list[Any]) -> float:
        from fleetrl.trainer.batch import build_step_batch

        batch = build_step_batch(groups, self.algo.advantage, self.version)
        self.learner.train_step(batch)
        return float(batch.stats["reward_mean"])

    def close(self) -> None:
        self.hub.close()


def pretrain(folder: pathlib.Path, steps: int) -> None:
    """The tiny model trained (supervised, every weight) on `PRETRAIN_TASK`'s answers, saved as a local
    Hugging Face folder: a base that knows the alphabet and the format, as a pretrained model would."""
    import torch

    from fleetrl.config import ModelConfig
    from fleetrl.rollout.tasks import get_task
    from fleetrl.rollout.tasks.tokenizer import EOS_ID, CharTokenizer

    tok, model = CharTokenizer(), ModelConfig(tiny=TINY).build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR)
    prompts = get_task(PRETRAIN_TASK).prompts(1234)
    for _ in range(steps):
        rows = [(tok.encode(p.prompt), [*tok.encode(p.reference, bos=False), EOS_ID])
                for p in (next(prompts) for _ in range(32))]
        width = max(len(a) + len(b) for a, b in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100)
        for i, (a, b) in enumerate(rows):
            x[i, : len(a) + len(b)] = torch.tensor(a + b)
            labels[i, len(a): len(a) + len(b)] = torch.tensor(b)
        model(input_ids=x, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(folder))


async def learn(model: dict[str, Any], lr: float, lora: bool, seed: int, steps: int, groups: int = 8,
                samples: int = 8, path: str | None = None) -> Curve:
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        loop = Loop(_config(pathlib.Path(tmp), model, lr, lora, seed, groups, samples, path))
        t0 = time.monotonic()
        await loop.start()
        curve = Curve()
        for step in range(steps):
            curve.rewards.append(loop.train(loop.groups(step)))
            curve.bytes_per_version.append(await loop.publish())
        curve.seconds = time.monotonic() - t0
        loop.close()
    return curve


async def version_bytes(model: dict[str, Any], steps: int, each: bool = False) -> tuple[float, float]:
    """Mean bytes of versions 2.. for full fine-tuning and LoRA, trained on the same groups at lr 1e-5;
    `each`: print every version's bytes as it is published."""
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        full = Loop(_config(pathlib.Path(tmp) / "full", model, BYTES_LR, False, 0, 2, 8))
        adapter = Loop(_config(pathlib.Path(tmp) / "lora", model, BYTES_LR, True, 0, 2, 8))
        await full.start()
        await adapter.start()
        sizes: dict[str, list[int]] = {"full": [], "lora": []}
        for step in range(steps):
            # Groups with spread rewards: a random-init model's own samples mostly score alike, and a
            # group of equal rewards has no advantage, so no gradient.
            groups = _synthetic_groups(2, vocab=model["vocab_size"], seed=step)
            for name, side in (("full", full), ("lora", adapter)):
                side.train(groups)
                sizes[name].append(await side.publish())
            if each:
                print(f"version {step}: full {sizes['full'][-1]} bytes, lora {sizes['lora'][-1]} bytes, "
                      f"ratio {sizes['full'][-1] / sizes['lora'][-1]:.1f}", flush=True)
        full.close()
        adapter.close()
    return statistics.fmean(sizes["full"][1:]), statistics.fmean(sizes["lora"][1:])


def serving(model: dict[str, Any], rounds: int, groups: int = 8) -> dict[str, tuple[float, float]]:
    """Per mode (`merged`, `unmerged`): decoded tokens per CPU second with an adapter served, and CPU ms
    to apply the next adapter version (between two steps). CPU time of this one-threaded process, not
    wall time: the cores are shared, and other processes stretch wall time by whatever they take.
    Rounds alternate the modes; each keeps its best."""
    import torch

    from fleetrl.broker import Sampling
    from fleetrl.config import LoraAdapterConfig, ModelConfig
    from fleetrl.hub import AdapterInfo
    from fleetrl.rollout.adapters import LoraWeights
    from fleetrl.rollout.engine import GroupRequest
    from fleetrl.rollout.torch_engine import TorchEngine
    from fleetrl.trainer import lora

    cfg = ModelConfig.model_validate({"tiny": model})
    peft_model = lora.wrap(cfg.build(), LoraAdapterConfig.model_validate(LORA))
    info = AdapterInfo(base=0, r=int(LORA["r"]), lora_alpha=int(LORA["lora_alpha"]))
    with torch.no_grad():
        for p in (p for _, p in peft_model.named_parameters() if p.requires_grad):
            p.normal_(0, 0.01)
    adapter = {k: v.detach().to(torch.bfloat16) for k, v in lora.adapter_state(peft_model).items()}
    base = {k: v.to(torch.bfloat16) for k, v in cfg.build().state_dict().items()}
    best: dict[str, tuple[float, float]] = {}
    engines = {mode: TorchEngine(cfg.build(), max_batch=64, lora_mode=mode, eos_ids=[cfg.tiny.vocab_size + 1])
               for mode in ("merged", "unmerged")}
    for engine in engines.values():
        engine.stage_adapter(LoraWeights(1, info, adapter), base=base)
        engine.step()
    for r in range(rounds):
        for mode, engine in engines.items():
            t0 = time.thread_time()
            engine.stage_adapter(LoraWeights(2 + r, info, adapter))
            engine.step()  # applies it (no work yet)
            apply_ms = (time.thread_time() - t0) * 1e3
            before = engine.tokens_sampled
            t0 = time.thread_time()
            for g in range(groups):
                engine.submit(GroupRequest(f"r{r}g{g}", [1, *range(40, 48)], Sampling(max_new_tokens=24), 8, seed=g))
            while engine.has_work():
                engine.step()
            rate = (engine.tokens_sampled - before) / (time.thread_time() - t0)
            old = best.get(mode, (0.0, float("inf")))
            best[mode] = (max(old[0], rate), min(old[1], apply_ms))
    return best


def _rss_kib() -> tuple[int, int]:
    """(RSS now, peak RSS) of this process in KiB, from /proc (`ru_maxrss` would count the parent's peak:
    Linux carries it across fork and exec)."""
    fields = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines()
                  if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def peak_child(lora: bool, steps: int, micro: int) -> None:
    """In a fresh process: build the learner on the ~100 M model, train, print RSS before and peak (KiB)."""
    import torch

    from fleetrl.config import AlgorithmConfig, ModelConfig
    from fleetrl.trainer.dist import DistContext
    from fleetrl.trainer.learner import Learner

    torch.set_num_threads(1)
    cfg = ModelConfig.model_validate({"tiny": MID, "lora": LORA if lora else None})
    algo = AlgorithmConfig(lr=BYTES_LR, micro_batch_samples=micro)
    before = _rss_kib()[0]
    learner = Learner(cfg, algo, DistContext())
    groups = _synthetic_groups(steps, vocab=MID["vocab_size"])
    from fleetrl.trainer.batch import build_step_batch

    for step, group in enumerate(groups):
        learner.train_step(build_step_batch([group], "grpo", step))
    print(json.dumps({"before_kib": before, "peak_kib": _rss_kib()[1]}))


def _synthetic_groups(n: int, vocab: int, seed: int = 0) -> list[Any]:
    """Groups of 8 samples of 48 random tokens with spread rewards, the same for both sides."""
    import numpy as np

    from fleetrl.broker import GroupRecord, Sample, floats, ids

    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        # Behaviour logprobs near a random-init model's own (near-uniform: -log(vocab)), so that the
        # truncated importance weights are about 1, as on-policy samples have them.
        logprobs = (-np.log(vocab) + 0.1 * rng.standard_normal(48)).astype(np.float32)
        samples = [Sample(ids(rng.integers(3, vocab, 48).tolist()), floats(logprobs), np.zeros(48, np.int32),
                          float(i % 3), "length") for i in range(8)]
        out.append(GroupRecord(f"g{g}", "bench-lora", TASK, 0, "r", "n", ids(rng.integers(3, vocab, 16).tolist()),
                               samples))
    return out


def peaks(steps: int, micro: int) -> tuple[int, int]:
    """(full, LoRA) learner peaks in KiB, each side in a fresh process (the two run side by side)."""
    procs = [subprocess.Popen([sys.executable, __file__, "--peak-child", side, "--steps", str(steps), "--micro",
                               str(micro)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for side in ("full", "lora")]
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"peak child {proc.args} exited {proc.returncode}")
        line = json.loads(stdout.strip().splitlines()[-1])
        out.append(int(line["peak_kib"]) - int(line["before_kib"]))
    return out[0], out[1]


async def main_async(args: argparse.Namespace) -> None:
    quick = args.quick
    print(f"load before: {os.getloadavg()}", flush=True)
    full_tiny, lora_tiny = await version_bytes(TINY, steps=4 if quick else 8)
    print(f"bytes/version tiny: full {full_tiny:.0f} lora {lora_tiny:.0f} ratio {full_tiny / lora_tiny:.1f}",
          flush=True)
    full_mid, lora_mid = await version_bytes(MID, steps=3 if quick else 6)
    print(f"bytes/version ~100M: full {full_mid:.0f} lora {lora_mid:.0f} ratio {full_mid / lora_mid:.1f}", flush=True)
    peak: dict[int, tuple[int, int]] = {}
    for micro in (2,) if quick else (2, 8):
        peak[micro] = peaks(1 if quick else PEAK_STEPS, micro)
        print(f"learner peak RSS ~100M, micro-batch {micro}: full {peak[micro][0] / 1024:.0f} MiB "
              f"lora {peak[micro][1] / 1024:.0f} MiB", flush=True)

    serve = serving(TINY, rounds=3)
    for mode, (rate, apply_ms) in serve.items():
        print(f"serving tiny {mode}: {rate:.0f} tokens per CPU s, next version applied in {apply_ms:.2f} CPU ms",
              flush=True)
    serve_mid = {} if quick else serving(MID, rounds=2, groups=4)
    for mode, (rate, apply_ms) in serve_mid.items():
        print(f"serving ~100M {mode}: {rate:.0f} tokens per CPU s, next version applied in {apply_ms:.1f} CPU ms",
              flush=True)

    steps, seeds = (30, [0]) if quick else (args.steps, [0, 1, 2])
    finals: dict[str, list[float]] = {"full": [], "lora": []}
    base = pathlib.Path(tempfile.mkdtemp(prefix="bench-lora-base-"))
    pretrain(base, PRETRAIN_STEPS)
    for seed in seeds:
        for name, lr, lora in (("full", LR_FULL, False), ("lora", LR_LORA, True)):
            curve = await learn(TINY, lr, lora, seed, steps, path=str(base))
            finals[name].append(curve.tail(WINDOW))
            marks = [round(statistics.fmean(curve.rewards[i:i + WINDOW]), 3) for i in range(0, steps, WINDOW)]
            print(f"learning {name} seed {seed}: reward by {WINDOW} steps {marks} ({curve.seconds:.0f} s)", flush=True)
    shutil.rmtree(base, ignore_errors=True)
    sd = {k: statistics.stdev(v) if len(v) > 1 else float("nan") for k, v in finals.items()}
    # The gap in standard errors of the difference of the two means (Welch): |gap| below ~2 is seed noise.
    se = (sd["full"] ** 2 / len(seeds) + sd["lora"] ** 2 / len(seeds)) ** 0.5
    gap_se = (statistics.fmean(finals["full"]) - statistics.fmean(finals["lora"])) / se if se > 0 else float("nan")
    print(f"load after: {os.getloadavg()}")
    print(f"result: bytes_ratio={full_mid / lora_mid:.1f} bytes_ratio_tiny={full_tiny / lora_tiny:.1f} "
          f"peak_ratio={peak[2][1] / peak[2][0]:.2f} "
          + (f"peak_ratio_mb8={peak[8][1] / peak[8][0]:.2f} " if 8 in peak else "")
          + f"reward_lora={statistics.fmean(finals['lora']):.3f} "
          f"reward_full={statistics.fmean(finals['full']):.3f} reward_full_sd={sd['full']:.3f} "
          f"reward_lora_sd={sd['lora']:.3f} reward_gap_se={gap_se:.1f} "
          f"merged_over_unmerged_tok_s={serve['merged'][0] / serve['unmerged'][0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one seed (under two minutes)")
    parser.add_argument("--steps", type=int, default=100, help="learning steps per run (full mode)")
    parser.add_argument("--bytes-steps", type=int, default=None,
                        help="only the ~100 M model's bytes per version, over this many steps, each version "
                             "printed (the ratio changes as training goes on); ends with `result: bytes_ratio=...`")
    parser.add_argument("--peak-child", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.peak_child:
        peak_child(args.peak_child == "lora", args.steps, args.micro)
        return
    import torch

    torch.set_num_threads(1)
    if args.bytes_steps:
        full, lora = asyncio.run(version_bytes(MID, args.bytes_steps, each=True))
        print(f"result: bytes_ratio={full / lora:.1f} bytes_full={full:.0f} bytes_lora={lora:.0f} "
              f"steps={args.bytes_steps}")
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
