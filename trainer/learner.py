"""The learner: fp32 master weights, GRPO/PPO-TIS loss, AdamW, gradient clipping (DESIGN.md §6).

One loop for CPU and CUDA, one process or many: the distributed difference lives in `DistContext`.
Rank 0 calls the public methods; each first names the operation with `ctx.command`, so ranks > 0,
parked in `follow()`, run the same collectives in the same order. Maths lives in `losses.py` and
`advantages.py`; this file only moves tensors through them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from fleetrl.config import AlgorithmConfig, LearnerEmulation, ModelConfig
from fleetrl.hub import PublishedVersion, ShardPublisher
from fleetrl.log import get_logger
from fleetrl.trainer import lora
from fleetrl.trainer.activations import SelectiveCheckpointing, activation_dtype_bytes, enable_checkpointing
from fleetrl.trainer.batch import MicroBatch, StepBatch, TrainSample, collate
from fleetrl.trainer.dist import DistContext, get_state, load_shards, save_shards, set_state
from fleetrl.trainer.errors import TrainerError
from fleetrl.trainer.fused import apply_liger, choose_liger, compile_layers, compiles, liger_head_logprobs
from fleetrl.trainer.logprobs import causal_lm_logprobs
from fleetrl.trainer.losses import ClipConfig, aggregate, kl_k3, ppo_tis_token_loss
from fleetrl.trainer.sharded_publish import publish_sharded
from fleetrl.trainer.snapshots import SnapshotRing

log = get_logger(__name__)

_PUBLISH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DUMMY = TrainSample(
    input_ids=torch.zeros(2, dtype=torch.long).numpy(), prompt_len=1,
    behaviour_logprobs=torch.zeros(1).numpy(), versions=torch.zeros(1, dtype=torch.int32).numpy(),
    advantage=0.0,
)
"""Stand-in micro-batch (zero loss) for a rank with fewer samples: FSDP's collectives need each
rank to run the same number of forward and backward passes."""
_N_SUMS = 7
"""Per-update sums: loss, kl, clipped, truncated, tis weight, tokens, approx kl."""


@dataclass(slots=True)
class StepStats:
    loss: float
    kl: float
    clip_fraction: float
    tis_truncated_fraction: float
    tis_weight_mean: float
    grad_norm: float
    """Mean over the step's updates."""
    tokens: int
    approx_kl: float = 0.0
    """Mean per-token KL estimate (k3) between the step's starting weights and each update's; 0 for
    one update per step."""
    updates: int = 1
    """Optimizer updates in the step (`ppo_epochs` x `mini_batches`)."""


_FUSED_DEVICES = ("cpu", "cuda")
"""Devices with a fused AdamW kernel in torch >= 2.4."""


class Learner:
    """Owns the model, its optimizer and (with `kl_coef > 0`) a frozen reference copy; a LoRA policy
    (`model.lora`) trains its adapter alone and takes its base, adapter off, as the reference."""

    def __init__(self, model_cfg: ModelConfig, algo: AlgorithmConfig, ctx: DistContext,
                 emulate: LearnerEmulation | None = None) -> None:
        self.algo, self.ctx = algo, ctx
        self.emulate = emulate
        """Emulated step time (`trainer.emulate`, benchmarks on CPU): slept after each real step."""
        self.publish_dtype = _PUBLISH_DTYPES[model_cfg.publish_dtype]
        self.lora = model_cfg.lora
        """The adapter's config when the policy is a LoRA adapter on a frozen base (trainer/lora.py)."""
        model = model_cfg.build().float()
        self.liger = choose_liger(algo, ctx.device, str(model.config.model_type))
        """Whether Liger Kernel runs in the policy (trainer/fused.py), and why."""
        log.info("learner.fused_kernels", applied=self.liger.applied, reason=self.liger.reason)
        if self.liger.applied:
            apply_liger(model)
        if self.lora is not None:
            if ctx.distributed:
                raise TrainerError("model.lora: a LoRA policy trains in one process (FSDP of a peft model is "
                                   "not supported yet); run the trainer without torchrun")
            model = lora.wrap(model, self.lora)
        ref = copy.deepcopy(model).requires_grad_(False) if algo.kl_coef > 0 and self.lora is None else None
        if algo.activation_checkpointing:
            enable_checkpointing(model)
        self._selective = None if algo.activation_memory_gib is None else SelectiveCheckpointing(
            model, algo.activation_memory_gib, activation_dtype_bytes(ctx.device))
        if compiles(algo, ctx.device):
            log.info("learner.compiled", layers=compile_layers(model))
        self.model = ctx.shard(model)
        self.ref = ctx.shard(ref).eval() if ref is not None else None
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trained, lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay,
            # One fused kernel per update instead of a dozen list ops, each with its own temporaries
            # (2 % of a CPU step on bench/learner.py's 50 M model). Sharded (DTensor) parameters keep the
            # foreach path, which FSDP is tested with.
            fused=True if not ctx.distributed and trained and trained[0].device.type in _FUSED_DEVICES else None,
        )
        self.clip = ClipConfig(algo.clip_low, algo.clip_high, algo.tis_cap)
        self._shard_publisher: ShardPublisher | None = None
        self._snapshots = SnapshotRing()
        self.snapshot_wait_s = 0.0
        """Seconds optimizer updates have waited for a snapshot still being cast (cumulative)."""

    # -- operations led by rank 0 -------------------------------------------------------------

    def train_step(self, batch: StepBatch) -> StepStats:
        """One optimizer step on `batch` (rank 0 holds the whole batch; it is scattered)."""
        self.ctx.command("train")
        stats = self._train(self.ctx.scatter(batch.shard(self.ctx.world_size)))
        if self.emulate is not None:  # as a larger model on real GPUs would take (EMULATED)
            time.sleep(self.emulate.step_delay_s + self.emulate.token_delay_s * stats.tokens)
        return stats

    def published_state(self) -> dict[str, torch.Tensor]:
        """A snapshot of the weights as engines run them, taken now (see `begin_published_state`)."""
        return self.begin_published_state().result()

    def begin_published_state(self) -> Future[dict[str, torch.Tensor]]:
        """A snapshot of the weights as engines run them: publish dtype, every state-dict name (rank 0).

        Private copies that stay unchanged until another snapshot has been taken (the publisher keeps
        one while the next step trains, and as the parent of the next version: see snapshots.py). In
        one process the cast runs in the background, on the learner's device, while the next step's
        forward and backward run; that step's optimizer update waits for it (`fence`). Under FSDP the
        full state is gathered to rank 0's CPU first, a collective, so it is taken now."""
        self.ctx.command("state")
        if self.lora is not None:  # the adapter alone: the base is published once (`base_state`)
            return self._snapshots.begin(lora.adapter_state(self.model), self.publish_dtype)
        msd, _ = get_state(self.model, None, self.ctx, to_cpu=self.ctx.distributed)
        # Tied weights (lm_head = embeddings) are passed as they are: the hub stores them once.
        if self.ctx.distributed:
            done: Future[dict[str, torch.Tensor]] = Future()
            done.set_result(self._snapshots.take(msd, self.publish_dtype))
            return done
        return self._snapshots.begin(msd, self.publish_dtype)

    def base_state(self) -> dict[str, torch.Tensor]:
        """A LoRA policy's frozen base in the publish dtype, under its Hugging Face names: the version
        every adapter version applies to (a private copy)."""
        if self.lora is None:
            raise TrainerError("base_state: the policy has no adapter (model.lora is unset)")
        return {name: t.detach().to(self.publish_dtype, copy=True) for name, t in lora.base_state(self.model).items()}

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """fp32 model and optimizer state, unsharded (rank 0)."""
        self.ctx.command("checkpoint")
        msd, osd = get_state(self.model, self.optimizer, self.ctx)
        assert osd is not None
        return msd, osd

    def load_state(self, msd: dict[str, torch.Tensor], osd: dict[str, Any]) -> None:
        self._snapshots.fence()
        self.ctx.command("load")
        set_state(self.model, self.optimizer, msd, osd, self.ctx)

    def publish_sharded(self, publisher: ShardPublisher, version: int | None = None) -> PublishedVersion | None:
        """Every rank publishes the tensors it owns through its own `publisher` (set on followers
        with `attach_publisher`); rank 0 writes the manifest and returns the version."""
        self.ctx.command(("publish_sharded", version))
        return publish_sharded(publisher, self.model, self.ctx, self.publish_dtype, version)

    def attach_publisher(self, publisher: ShardPublisher) -> None:
        """Ranks > 0: the publisher `follow()` uses when rank 0 names a sharded publish."""
        self._shard_publisher = publisher

    def save_shards(self, path: str) -> None:
        """Every rank writes its shards of the model and optimizer under `path` (a checkpoint's
        temporary folder: `checkpoint.commit` makes it durable); nothing is gathered to rank 0."""
        self.ctx.command(("save_shards", path))
        save_shards(self.model, self.optimizer, path)

    def load_shards(self, path: str) -> None:
        """Every rank reads its own shards back from `path`."""
        self._snapshots.fence()
        self.ctx.command(("load_shards", path))
        load_shards(self.model, self.optimizer, path)

    def stop_followers(self) -> None:
        self.ctx.command("stop")

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 names until it says stop."""
        while True:
            cmd = self.ctx.command()
            if cmd == "stop":
                return
            if isinstance(cmd, tuple) and cmd[0] == "publish_sharded":
                if self._shard_publisher is None:
                    raise RuntimeError(f"rank {self.ctx.rank}: a sharded publish needs attach_publisher first")
                publish_sharded(self._shard_publisher, self.model, self.ctx, self.publish_dtype, cmd[1])
                continue
            if isinstance(cmd, tuple) and cmd[0] in ("save_shards", "load_shards"):
                (save_shards if cmd[0] == "save_shards" else load_shards)(self.model, self.optimizer, cmd[1])
                continue
            if cmd == "train":
                self._train(self.ctx.scatter(None))
            elif cmd == "state":
                get_state(self.model, None, self.ctx)
            elif cmd == "checkpoint":
                get_state(self.model, self.optimizer, self.ctx)
            elif cmd == "load":
                set_state(self.model, self.optimizer, {}, {}, self.ctx)
            else:
                raise RuntimeError(f"rank {self.ctx.rank}: unknown command {cmd!r} from rank 0")

    # -- the step, on every rank --------------------------------------------------------------

    def _train(self, shard: StepBatch) -> StepStats:
        """One step: a single update (ratio 1), or `ppo_epochs` passes of `mini_batches` updates each
        over shuffled parts of the step's samples, the ratio taken against the weights before the
        first update (the clip acts from the second update on)."""
        self.model.train()
        epochs, parts = self.algo.ppo_epochs, self.algo.mini_batches
        if epochs == 1 and parts == 1:
            per_rank = math.ceil(shard.total_seqs / self.ctx.world_size)
            sums, grad_norm = self._update(shard.samples, per_rank, shard.total_tokens, shard.total_seqs)
            return self._stats(sums, [grad_norm], passes=1)
        samples = self._with_old_logprobs(shard)
        # Same shuffles on every run of the same step (resume, the 2-rank equivalence); ranks differ.
        gen = torch.Generator().manual_seed(shard.version * 7919 + self.ctx.rank)
        upper = math.ceil(math.ceil(shard.total_seqs / self.ctx.world_size) / parts)
        sums, grad_norms = torch.zeros(_N_SUMS, dtype=torch.float64), []
        for _ in range(epochs):
            order = torch.randperm(len(samples), generator=gen).tolist()
            split = [order[i * len(order) // parts:(i + 1) * len(order) // parts] for i in range(parts)]
            local = torch.tensor([[len(ix), sum(samples[i].n_completion for i in ix)] for ix in split],
                                 dtype=torch.float64)
            totals = self.ctx.all_reduce_sum(local)  # each part's samples and tokens over every rank
            for ix, (seqs, tokens) in zip(split, totals.tolist(), strict=True):
                part_sums, grad_norm = self._update([samples[i] for i in ix], upper, int(tokens), int(seqs))
                sums += part_sums
                grad_norms.append(grad_norm)
        return self._stats(sums, grad_norms, passes=epochs)

    def _update(self, samples: list[TrainSample], per_rank_seqs: int, total_tokens: int,
                total_seqs: int) -> tuple[torch.Tensor, float]:
        """One optimizer update over `samples` (this rank's share; the totals are over every rank,
        `per_rank_seqs` bounds any rank's share so that every rank runs as many micro-batches)."""
        self.optimizer.zero_grad(set_to_none=True)
        micro = self.algo.micro_batch_samples
        n_micro = max(1, math.ceil(per_rank_seqs / micro))
        sums = torch.zeros(_N_SUMS, dtype=torch.float64)
        for i in range(n_micro):
            chunk = samples[i * micro:(i + 1) * micro]
            sums += self._micro_step(chunk or [_DUMMY], max(total_tokens, 1), max(total_seqs, 1), real=bool(chunk))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.algo.grad_clip)
        self.snapshot_wait_s += self._snapshots.fence()  # the last step's snapshot reads these weights
        self.optimizer.step()
        return sums, float(_full(grad_norm))

    def _stats(self, sums: torch.Tensor, grad_norms: list[float], passes: int) -> StepStats:
        sums = self.ctx.all_reduce_sum(sums)
        loss, kl, clipped, truncated, weight, tokens, approx_kl = sums.tolist()
        n, updates = max(tokens, 1.0), len(grad_norms)
        return StepStats(
            loss=loss / updates, kl=kl / n, clip_fraction=clipped / n, tis_truncated_fraction=truncated / n,
            tis_weight_mean=weight / n, grad_norm=sum(grad_norms) / updates, tokens=round(tokens / passes),
            approx_kl=approx_kl / n, updates=updates,
        )

    @torch.no_grad()
    def _with_old_logprobs(self, shard: StepBatch) -> list[TrainSample]:
        """The step's samples carrying their logprobs under the current weights (the PPO ratio's
        denominator for every update of the step); as many forward passes on every rank."""
        micro = self.algo.micro_batch_samples
        n_micro = max(1, math.ceil(math.ceil(shard.total_seqs / self.ctx.world_size) / micro))
        out: list[TrainSample] = []
        for i in range(n_micro):
            chunk = shard.samples[i * micro:(i + 1) * micro]
            mb = collate(chunk or [_DUMMY], self.ctx.device)
            with self._autocast():
                logp = self._logprobs(self.model, mb).float().cpu().numpy()
            for j, s in enumerate(chunk):
                start, end = s.prompt_len - 1, len(s.input_ids) - 1
                out.append(dataclasses.replace(s, old_logprobs=logp[j, start:end].copy()))
        return out

    def _micro_step(self, chunk: list[TrainSample], total_tokens: int, total_seqs: int, real: bool) -> torch.Tensor:
        mb = collate(chunk, self.ctx.device)
        if self._selective is not None:  # the fewest checkpointed layers that fit this micro-batch
            self._selective.plan(mb.input_ids.numel())
        with self._autocast():
            logp = self._logprobs(self.model, mb)
            logp_old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
            tok_loss, st = ppo_tis_token_loss(logp, logp_old, mb.behaviour_logprobs, mb.advantages, self.clip)
            kl = torch.zeros_like(logp)
            if self.algo.kl_coef > 0:
                with torch.no_grad(), self._reference() as ref:
                    logp_ref = self._logprobs(ref, mb)
                kl = kl_k3(logp, logp_ref)
                tok_loss = tok_loss + self.algo.kl_coef * kl
        loss = aggregate(tok_loss, mb.loss_mask, self.algo.aggregation, total_tokens=total_tokens,
                         total_seqs=total_seqs)
        # FSDP averages gradients over ranks; the step's loss is the sum of the ranks' shares.
        scale = float(self.ctx.world_size) if real else 0.0
        (loss * scale).backward()
        if not real:
            return torch.zeros(_N_SUMS, dtype=torch.float64)
        m = mb.loss_mask
        approx_kl = kl_k3(logp.detach(), logp_old) * m  # how far this update has moved from the old policy
        return torch.tensor([
            loss.item(), (kl * m).sum().item(), (st["clipped"] * m).sum().item(),
            (st["truncated"] * m).sum().item(), (st["tis_weight"] * m).sum().item(), m.sum().item(),
            approx_kl.sum().item(),
        ], dtype=torch.float64)

    def _logprobs(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """[B, T-1] logprobs of the targets at the scored positions (`loss_mask`), 0 elsewhere."""
        return causal_lm_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, mb.loss_mask > 0,
                                  self.algo.temperature, self.algo.logprob_chunk_tokens,
                                  liger_head_logprobs if self.liger.applied else None)

    @contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The KL penalty's reference policy: the frozen copy, or a LoRA policy's base (adapter off)."""
        if self.ref is not None:
            yield self.ref
            return
        with lora.base_policy(self.model) as base:
            yield base

    def _autocast(self) -> Any:
        # fp32 master weights; on CUDA the matmuls run in bf16, the loss maths in fp32.
        if self.ctx.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
