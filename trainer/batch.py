"""From finished groups to the tensors of one optimizer step.

The collector hands the learner `groups_per_step` groups; here they become flat training samples
(prompt + completion ids, behaviour logprobs, per-token versions, one advantage each) plus the
totals every rank needs so that micro-batches and ranks add up to the loss of the whole step. The
result is plain numpy, so rank 0 can scatter it to the other ranks as picklable objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from fleetrl.broker import GroupRecord, Sample
from fleetrl.trainer.advantages import AdvantageKind, group_advantages


@dataclass(slots=True)
class TrainSample:
    """One sample: the model reads `input_ids` and is scored on the tokens after `prompt_len`."""

    input_ids: npt.NDArray[np.int64]
    prompt_len: int
    behaviour_logprobs: npt.NDArray[np.float32]
    """One per completion token."""
    versions: npt.NDArray[np.int32]
    """Policy version that produced each completion token."""
    advantage: float
    old_logprobs: npt.NDArray[np.float32] | None = None
    """One per completion token under the weights before the step's first update (set by the learner
    when it makes several updates per step; None: the current logprobs, detached, are the old ones)."""
    policy_mask: npt.NDArray[np.bool_] | None = None
    """One per completion token: False for tokens the environment wrote (tool results, observations),
    which stay in the context but out of the loss, the KL and the token counts. None: all the policy's."""

    @property
    def n_completion(self) -> int:
        """Completion tokens that enter the loss (the policy's)."""
        if self.policy_mask is not None:
            return int(self.policy_mask.sum())
        return len(self.input_ids) - self.prompt_len


@dataclass(slots=True)
class StepBatch:
    """The samples of one step (or one rank's share) and the step-wide totals."""

    samples: list[TrainSample]
    version: int
    """Learner version the step starts from; per-token lag is `version - versions`."""
    total_tokens: int
    """Completion tokens in the whole step, over every rank (token_mean denominator)."""
    total_seqs: int
    """Samples in the whole step, over every rank (seq_mean denominator)."""
    stats: dict[str, float] = field(default_factory=dict)

    def shard(self, world_size: int) -> list[StepBatch]:
        """Round-robin split: rank r gets samples r, r+w, ...; totals stay step-wide."""
        return [
            StepBatch(self.samples[r::world_size], self.version, self.total_tokens, self.total_seqs)
            for r in range(world_size)
        ]


def build_step_batch(groups: Sequence[GroupRecord], kind: AdvantageKind, version: int) -> StepBatch:
    """Advantages per group, then flat samples; samples with no completion tokens carry no loss."""
    samples: list[TrainSample] = []
    rewards_all: list[float] = []
    lags: list[int] = []
    for g in groups:
        rewards = torch.tensor([s.reward for s in g.samples], dtype=torch.float32)
        rewards_all.extend(rewards.tolist())
        adv = group_advantages(rewards, kind).tolist()
        group_prompt = np.asarray(g.prompt_ids, dtype=np.int64)
        for s, a in zip(g.samples, adv, strict=True):
            # One advantage per sample: an episode's turns, and an agent run's segments, share it.
            for prompt, lo, hi in _loss_contexts(s, group_prompt):
                sample = _train_sample(s, prompt, lo, hi, float(a))
                if sample is not None:
                    lags.append(version - int(sample.versions[sample.policy_mask].min() if sample.policy_mask
                                              is not None else sample.versions.min()))
                    samples.append(sample)
    batch = StepBatch(samples, version, sum(s.n_completion for s in samples), len(samples))
    batch.stats = {
        "reward_mean": float(np.mean(rewards_all)) if rewards_all else 0.0,
        "reward_std": float(np.std(rewards_all)) if rewards_all else 0.0,
        "groups": float(len(groups)),
        "samples": float(len(samples)),
        "tokens": float(batch.total_tokens),
        "lag_max": float(max(lags, default=0)),
        "lag_mean": float(np.mean(lags)) if lags else 0.0,
    }
    return batch


def _loss_contexts(s: Sample, group_prompt: npt.NDArray[np.int64]) -> list[tuple[npt.NDArray[np.int64], int, int]]:
    """(prompt, first, end) of each segment of context: one continuing the group's prompt, or those of an
    agent run's sample (`Sample.contexts`, each with its own prompt)."""
    n = len(s.completion_ids)
    if s.contexts is None:
        return [(group_prompt, 0, n)]
    starts = [at for at, _ in s.contexts] + [n]
    return [(np.asarray(p, dtype=np.int64), starts[k], starts[k + 1]) for k, (_, p) in enumerate(s.contexts)]


def _train_sample(s: Sample, prompt: npt.NDArray[np.int64], lo: int, hi: int, advantage: float) -> TrainSample | None:
    """Completion tokens lo..hi of `s` after `prompt`, or None when none of them enters the loss."""
    # With no prompt token nothing predicts the first completion token: it is not scored.
    skip = 1 if len(prompt) == 0 else 0
    lo += skip
    mask = s.policy_mask()[lo:hi] if s.segments is not None else None
    if hi <= lo or (mask is not None and not mask.any()):
        return None
    return TrainSample(
        input_ids=np.concatenate([prompt, np.asarray(s.completion_ids[lo - skip:hi], dtype=np.int64)]),
        prompt_len=max(len(prompt), 1),
        behaviour_logprobs=np.asarray(s.logprobs[lo:hi], dtype=np.float32),
        versions=np.asarray(s.versions[lo:hi], dtype=np.int32),
        advantage=advantage,
        policy_mask=mask,
    )


@dataclass(slots=True)
class MicroBatch:
    """Right-padded tensors of a few samples; position t predicts token t+1."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    """Aligned like `behaviour_logprobs`; None when the samples carry none."""


def collate(samples: Sequence[TrainSample], device: torch.device | str) -> MicroBatch:
    """Pad to the longest sample; targets, masks and logprobs are aligned to positions 0..L-2."""
    length = max(len(s.input_ids) for s in samples)
    n = len(samples)
    ids = torch.zeros((n, length), dtype=torch.long)
    attn = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length - 1), dtype=torch.float32)
    beh = torch.zeros((n, length - 1), dtype=torch.float32)
    with_old = all(s.old_logprobs is not None for s in samples)
    old = torch.zeros((n, length - 1), dtype=torch.float32) if with_old else None
    for i, s in enumerate(samples):
        L = len(s.input_ids)
        ids[i, :L] = torch.tensor(s.input_ids)
        attn[i, :L] = 1
        # Completion token j sits at position prompt_len + j and is predicted from the one before.
        start = s.prompt_len - 1
        mask[i, start:L - 1] = 1.0 if s.policy_mask is None else torch.from_numpy(s.policy_mask.astype("float32"))
        beh[i, start:L - 1] = torch.tensor(s.behaviour_logprobs)  # decoded arrays are read-only views
        if old is not None:
            old[i, start:L - 1] = torch.tensor(s.old_logprobs)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return MicroBatch(
        input_ids=ids.to(device), attention_mask=attn.to(device), targets=ids[:, 1:].to(device),
        loss_mask=mask.to(device), behaviour_logprobs=beh.to(device), advantages=adv.to(device),
        old_logprobs=old.to(device) if old is not None else None,
    )
