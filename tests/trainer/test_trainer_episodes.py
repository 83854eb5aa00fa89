"""Episodes in the learner: environment tokens stay in the context but out of the loss, the KL and
the token counts; the advantage is one per episode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleetrl.broker import GroupRecord, Sample, floats, ids, segments_of
from fleetrl.config import AlgorithmConfig, ModelConfig
from fleetrl.trainer import learner as learner_module
from fleetrl.trainer import losses
from fleetrl.trainer.batch import build_step_batch, collate
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner

PROMPT = [1, 40, 41, 42, 61]
# turn 1 (policy) | tool result (environment) | turn 2 (policy)
SOURCES = [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]
GOOD = [42, 41, 2, 70, 71, 72, 73, 40, 41, 2]
BAD = [50, 51, 2, 70, 71, 72, 73, 52, 53, 2]
ENV = np.asarray(SOURCES) == 1


def _group(env_logprob: float = 0.0) -> GroupRecord:
    samples = []
    for completion, reward in ((GOOD, 1.0), (BAD, 0.0)):
        lp = np.where(ENV, env_logprob, -1.0)
        versions = np.where(ENV, -1, 0)
        samples.append(Sample(ids(completion), floats(lp), ids(versions), reward, "stop",
                              segments=segments_of(SOURCES)))
    return GroupRecord("g-1", "r", "tools", 0, "a", "n", ids(PROMPT), samples)


def test_collate_masks_environment_tokens_and_counts_only_the_policy_s() -> None:
    batch = build_step_batch([_group()], "grpo", 0)
    assert batch.total_tokens == 2 * 6  # 6 policy tokens per episode, the 4 environment ones do not count
    assert [s.advantage for s in batch.samples] == pytest.approx([0.7071, -0.7071], abs=1e-3)  # one per episode
    mb = collate(batch.samples, "cpu")
    start = len(PROMPT) - 1  # position predicting the first completion token
    assert mb.loss_mask[0, start:].tolist() == [0.0 if e else 1.0 for e in ENV]
    assert mb.loss_mask[0, :start].sum() == 0
    assert mb.input_ids[0].tolist() == PROMPT + GOOD  # the environment's ids stay in the context


def test_spy_on_the_loss_sees_environment_tokens_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    learner = Learner(ModelConfig(), AlgorithmConfig(lr=1e-3, micro_batch_samples=2, kl_coef=0.1), DistContext())
    seen: list[torch.Tensor] = []

    def spy(tok_loss: torch.Tensor, mask: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(mask.clone())
        return losses.aggregate(tok_loss, mask, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(learner_module, "aggregate", spy)
    stats = learner.train_step(build_step_batch([_group()], "grpo", 0))
    assert len(seen) == 1 and seen[0].sum().item() == 12
    assert stats.tokens == 12  # the step's token count is the policy's


def _train(env_logprob: float) -> tuple[dict[str, torch.Tensor], learner_module.StepStats]:
    torch.manual_seed(0)
    algo = AlgorithmConfig(lr=1e-2, micro_batch_samples=1, kl_coef=0.1, ppo_epochs=2, mini_batches=2)
    learner = Learner(ModelConfig(), algo, DistContext())
    batch = build_step_batch([_group()], "grpo", 0)
    for s in batch.samples:  # what no record may carry: logprobs on environment tokens
        s.behaviour_logprobs = np.where(ENV, env_logprob, s.behaviour_logprobs).astype(np.float32)
    stats = learner.train_step(batch)
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}, stats


def test_environment_token_logprobs_change_nothing() -> None:
    weights_a, stats_a = _train(0.0)
    weights_b, stats_b = _train(-7.5)
    assert stats_a.loss == stats_b.loss and stats_a.kl == stats_b.kl and stats_a.tokens == stats_b.tokens
    assert stats_a.clip_fraction == stats_b.clip_fraction and stats_a.tis_weight_mean == stats_b.tis_weight_mean
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    # ...while the policy's logprobs do change the step (the test could fail).
    torch.manual_seed(0)
    learner = Learner(ModelConfig(), AlgorithmConfig(lr=1e-2, micro_batch_samples=1, kl_coef=0.1, ppo_epochs=2,
                                                     mini_batches=2), DistContext())
    batch = build_step_batch([_group()], "grpo", 0)
    for s in batch.samples:
        s.behaviour_logprobs = np.where(ENV, 0.0, -7.5).astype(np.float32)
    assert learner.train_step(batch).tis_weight_mean != stats_a.tis_weight_mean
