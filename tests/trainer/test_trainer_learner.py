"""The learner on the tiny model: a step moves probability towards the better sample; CPU and CUDA agree."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from slowdown import scaled

from fleetrl.broker import GroupRecord, Sample, floats, ids
from fleetrl.config import AlgorithmConfig, ModelConfig
from fleetrl.trainer import learner as learner_module
from fleetrl.trainer import losses
from fleetrl.trainer.batch import build_step_batch, collate
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.losses import token_logprobs

PROMPT = [1, 40, 41, 42, 61]
GOOD, BAD = [42, 41, 40, 2], [50, 51, 52, 2]


def _behaviour_group(model: torch.nn.Module) -> GroupRecord:
    """Two samples scored with the model's own logprobs (on-policy), rewards 1 and 0."""
    samples = []
    for completion, reward in ((GOOD, 1.0), (BAD, 0.0)):
        lp = _logprobs(model, completion).numpy()
        samples.append(Sample(ids(completion), floats(lp), np.zeros(len(completion), np.int32), reward, "stop"))
    return GroupRecord("g-1", "r", "reverse", 0, "a", "n", ids(PROMPT), samples)


@torch.no_grad()
def _logprobs(model: torch.nn.Module, completion: list[int]) -> torch.Tensor:
    x = torch.tensor([PROMPT + completion])
    logits = model(input_ids=x).logits[:, :-1]
    return token_logprobs(logits, x[:, 1:])[0, len(PROMPT) - 1:].cpu()


def test_a_step_moves_probability_to_the_rewarded_sample() -> None:
    torch.manual_seed(0)
    algo = AlgorithmConfig(lr=1e-3, micro_batch_samples=1)
    learner = Learner(ModelConfig(), algo, DistContext())
    group = _behaviour_group(learner.model)
    before_good, before_bad = _logprobs(learner.model, GOOD).sum(), _logprobs(learner.model, BAD).sum()
    stats = learner.train_step(build_step_batch([group], "grpo", 0))
    assert stats.tokens == 8 and stats.clip_fraction == 0.0 and stats.tis_truncated_fraction == 0.0
    assert stats.tis_weight_mean == pytest.approx(1.0, abs=1e-4)  # behaviour == current: weights of 1
    # Adam's first step moves shared weights too, so both may move one way; their gap must widen.
    gap_before = before_good - before_bad
    gap_after = _logprobs(learner.model, GOOD).sum() - _logprobs(learner.model, BAD).sum()
    assert gap_after > gap_before + 0.1


def test_published_state_has_every_name_in_the_publish_dtype() -> None:
    learner = Learner(ModelConfig(), AlgorithmConfig(), DistContext())
    state = learner.published_state()
    assert state.keys() == learner.model.state_dict().keys()
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert all(t.device.type == "cpu" for t in state.values())


def test_the_next_step_waits_for_a_snapshot_still_being_cast_before_it_changes_the_weights() -> None:
    """The snapshot of step N is cast while step N+1's forward and backward run; the update of step
    N+1 must not start before it is done, or the snapshot would mix both steps' weights."""
    learner = Learner(ModelConfig(), AlgorithmConfig(lr=1e-2, micro_batch_samples=1), DistContext())
    group = _behaviour_group(learner.model)
    before = {k: v.detach().to(torch.bfloat16) for k, v in learner.model.state_dict().items()}
    ring = learner._snapshots
    real_take, real_fence = ring.take, ring.fence
    cast_may_finish = threading.Event()

    def slow_take(state, dtype):  # type: ignore[no-untyped-def]
        # A cast slower than the forward and backward, however fast or slow the machine: it finishes
        # only once the update has been waiting on it for 0.3 s (30 s: the update never waited).
        cast_may_finish.wait(timeout=scaled(30))
        return real_take(state, dtype)

    def fence() -> float:
        if ring._pending is not None and not ring._pending.done():  # the update reached the cast
            threading.Timer(0.3, cast_may_finish.set).start()
        return real_fence()

    ring.take = slow_take  # type: ignore[method-assign]
    ring.fence = fence  # type: ignore[method-assign]
    snapshot = learner.begin_published_state()
    learner.train_step(build_step_batch([group], "grpo", 0))
    assert learner.snapshot_wait_s > 0.1  # the update waited for the cast (about 0.3 s: the timer starts first)
    got = snapshot.result(timeout=scaled(30))
    assert all(torch.equal(got[k].view(torch.int16), before[k].view(torch.int16)) for k in before)
    after = learner.model.state_dict()
    assert any(not torch.equal(after[k].to(torch.bfloat16), before[k]) for k in before)  # and the step moved them


def test_collate_aligns_completion_tokens_with_their_predictors() -> None:
    group = GroupRecord("g", "r", "reverse", 0, "a", "n", ids([1, 7]), [
        Sample(ids([8, 9, 2]), floats([-0.1, -0.2, -0.3]), np.zeros(3, np.int32), 1.0, "stop")])
    mb = collate(build_step_batch([group], "grpo_no_std", 0).samples, "cpu")
    # input 1 7 8 9 2: position 1 (token 7) predicts 8, position 2 predicts 9, position 3 predicts 2
    assert mb.targets.tolist() == [[7, 8, 9, 2]]
    assert mb.loss_mask.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    assert mb.behaviour_logprobs[0, 1:].tolist() == pytest.approx([-0.1, -0.2, -0.3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_step_matches_cpu_step() -> None:
    """One loop for both devices: on CUDA (bf16 autocast, fp32 masters) the step's loss is the CPU one."""
    algo = AlgorithmConfig(lr=1e-3)
    cpu = Learner(ModelConfig(), algo, DistContext())
    gpu = Learner(ModelConfig(), algo, DistContext(device=torch.device("cuda")))
    group = _behaviour_group(cpu.model)
    s_cpu = cpu.train_step(build_step_batch([group], "grpo", 0))
    s_gpu = gpu.train_step(build_step_batch([group], "grpo", 0))
    assert s_gpu.loss == pytest.approx(s_cpu.loss, rel=0.05, abs=1e-3)
    assert next(gpu.model.parameters()).dtype == torch.float32


def test_one_update_per_step_keeps_ratio_one_and_reports_no_drift() -> None:
    torch.manual_seed(0)
    learner = Learner(ModelConfig(), AlgorithmConfig(lr=1e-1, micro_batch_samples=1), DistContext())
    stats = learner.train_step(build_step_batch([_behaviour_group(learner.model)], "grpo", 0))
    assert stats.updates == 1 and stats.clip_fraction == 0.0 and stats.approx_kl == 0.0


def test_several_updates_take_the_ratio_against_the_step_start_and_clip(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    algo = AlgorithmConfig(lr=5e-2, micro_batch_samples=1, ppo_epochs=3, mini_batches=2)
    learner = Learner(ModelConfig(), algo, DistContext())
    group = _behaviour_group(learner.model)
    start = {tuple(c): _logprobs(learner.model, c) for c in (GOOD, BAD)}
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def spy(logp: torch.Tensor, logp_old: torch.Tensor, *rest: object) -> object:
        seen.append((logp.detach().clone(), logp_old.clone(), rest[1]))  # type: ignore[arg-type]
        return losses.ppo_tis_token_loss(logp, logp_old, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(learner_module, "ppo_tis_token_loss", spy)
    before_gap = start[tuple(GOOD)].sum() - start[tuple(BAD)].sum()
    stats = learner.train_step(build_step_batch([group], "grpo", 0))
    assert stats.updates == 6 and len(seen) == 6  # 3 passes x 2 mini-batches of one sample each
    n = len(PROMPT) - 1
    for _, old, adv in seen:  # every update's ratio is against the logprobs before the first one
        completion = GOOD if adv.item() > 0 else BAD
        assert torch.allclose(old[0, n:], start[tuple(completion)], atol=1e-5)
    # The weights moved between updates (later logp differ from the old ones) and the clip acted.
    assert any(not torch.allclose(logp[0, n:], old[0, n:], atol=1e-3) for logp, old, _ in seen[2:])
    assert stats.clip_fraction > 0 and stats.approx_kl > 0 and stats.tokens == 8
    gap_after = _logprobs(learner.model, GOOD).sum() - _logprobs(learner.model, BAD).sum()
    assert gap_after > before_gap + 0.1
