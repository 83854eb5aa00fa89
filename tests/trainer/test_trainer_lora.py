"""A LoRA policy in the learner (`model.lora`): peft wraps the tiny model, the base stays frozen (bf16
when configured), only the adapter has optimizer state, the KL reference is the base with the adapter
off, checkpoints hold the adapter and its optimizer state and resume exactly; the publisher puts the
base in the store once and every version after it is the adapter."""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np
import pytest
import torch

from fleetrl.broker import GroupRecord, Sample, floats, ids
from fleetrl.config import AlgorithmConfig, FleetConfig, LoraAdapterConfig, ModelConfig
from fleetrl.hub import Hub
from fleetrl.trainer import TrainerError, checkpoint
from fleetrl.trainer.batch import build_step_batch
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.metrics import TrainerMetrics
from fleetrl.trainer.publisher import WeightPublisher

PROMPT = [1, 40, 41, 42, 61]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora(**kwargs: object) -> ModelConfig:
    return ModelConfig(lora=LoraAdapterConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **kwargs}))


def _group(step: int) -> GroupRecord:
    """Four samples with spread rewards (their behaviour logprobs made up: the TIS weight caps them)."""
    rng = np.random.default_rng(step)
    samples = []
    for i in range(4):
        completion = rng.integers(3, 120, size=5).tolist()
        lp = -rng.random(len(completion)).astype(np.float32) - 0.5
        samples.append(Sample(ids(completion), floats(lp), np.zeros(len(completion), np.int32), float(i), "stop"))
    return GroupRecord(f"g-{step}", "r", "reverse", 0, "a", "n", ids(PROMPT), samples)


def _train(learner: Learner, steps: range) -> None:
    for s in steps:
        learner.train_step(build_step_batch([_group(s)], "grpo", s))


def _adapter(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}


def test_the_base_is_frozen_and_only_the_adapter_has_optimizer_state() -> None:
    learner = Learner(_lora(base_dtype="bfloat16"), AlgorithmConfig(lr=1e-2), DistContext())
    trainable = {n: p for n, p in learner.model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in learner.model.named_parameters() if not p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == set(LINEAR)  # every linear layer, not the head
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}
    assert {b.dtype for n, b in learner.model.named_buffers() if n.endswith("inv_freq")} == {torch.float32}
    before = {n: p.detach().clone() for n, p in frozen.items()}
    _train(learner, range(2))
    assert all(torch.equal(p, before[n]) for n, p in frozen.items())
    state = learner.optimizer.state
    assert len(state) == len(trainable) and all(id(p) in {id(q) for q in trainable.values()}
                                                for p in (p for g in learner.optimizer.param_groups
                                                          for p in g["params"]))


def test_the_kl_reference_is_the_base_with_the_adapter_off_and_no_copy() -> None:
    learner = Learner(_lora(), AlgorithmConfig(lr=1e-2, kl_coef=0.1), DistContext())
    assert learner.ref is None
    _train(learner, range(3))  # the adapter moved: the policy is no longer the base
    x = torch.tensor([[*PROMPT, 50, 51, 52]])
    base = ModelConfig().build().eval()
    with torch.no_grad():
        with learner._reference() as ref:
            ref_logits = ref(input_ids=x).logits
        policy_logits = learner.model(input_ids=x).logits
        assert torch.allclose(ref_logits, base(input_ids=x).logits, atol=1e-6)
        assert not torch.allclose(policy_logits, ref_logits, atol=1e-4)
    stats = learner.train_step(build_step_batch([_group(9)], "grpo", 9))
    assert stats.kl > 0


def test_published_state_is_the_adapter_and_base_state_the_base_under_hf_names() -> None:
    learner = Learner(_lora(), AlgorithmConfig(), DistContext())
    adapter = learner.published_state()
    assert adapter and all(n.startswith("base_model.model.model.layers.") and n.endswith(
        (".lora_A.weight", ".lora_B.weight")) for n in adapter)
    assert {t.dtype for t in adapter.values()} == {torch.bfloat16}
    base = learner.base_state()
    built = ModelConfig().build().state_dict()
    assert base.keys() == built.keys()
    assert all(torch.equal(base[n], t.to(torch.bfloat16)) for n, t in built.items())
    with pytest.raises(TrainerError, match="no adapter"):
        Learner(ModelConfig(), AlgorithmConfig(), DistContext()).base_state()


def test_a_lora_learner_under_torchrun_is_refused_before_any_collective() -> None:
    with pytest.raises(TrainerError, match="trains in one process"):
        Learner(_lora(), AlgorithmConfig(), DistContext(rank=0, world_size=2))


def test_target_modules_the_model_lacks_or_the_engines_cannot_serve_are_named() -> None:
    with pytest.raises(TrainerError, match=r"model\.lora"):
        Learner(_lora(target_modules=["no_such_proj"]), AlgorithmConfig(), DistContext())
    with pytest.raises(TrainerError, match=r"model\.lora\.target_modules: 'lm_head' is the output head"):
        Learner(_lora(target_modules=["q_proj", "lm_head"]), AlgorithmConfig(), DistContext())


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_and_resumes_exactly(tmp_path: pathlib.Path) -> None:
    algo = AlgorithmConfig(lr=1e-2)
    straight = Learner(_lora(), algo, DistContext())
    _train(straight, range(4))

    first = Learner(_lora(), algo, DistContext())
    _train(first, range(2))
    folder = checkpoint.begin(tmp_path, 2)
    first.save_shards(str(folder / checkpoint.WEIGHTS_DIR))
    saved = checkpoint.commit(tmp_path, folder, {"run": "r", "step": 2, "version": 2}, keep=2)
    model, optimizer = checkpoint.latest(tmp_path, "r").weights()  # type: ignore[union-attr]
    assert model.keys() == _adapter(first).keys()  # the adapter only: no base tensor in the checkpoint
    assert len(optimizer["state"]) == len(model)

    resumed = Learner(_lora(seed=7), algo, DistContext())  # another initial adapter: the checkpoint wins
    resumed.load_shards(str(saved / checkpoint.WEIGHTS_DIR))
    assert all(torch.equal(t, _adapter(first)[n]) for n, t in _adapter(resumed).items())
    _train(resumed, range(2, 4))
    assert all(torch.equal(t, _adapter(straight)[n]) for n, t in _adapter(resumed).items())


def _hub_config(tmp: pathlib.Path) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "lora", "hub": {"home_store": str(tmp / "home"), "threads": 1, "anchor_interval": 4,
                               "signing": {"scheme": "hmac-sha256", "key": "k" * 32}},
        "regions": [{"name": "r1", "kafka": "127.0.0.1:9", "store": str(tmp / "r1")}],
    })


async def test_the_base_is_published_once_and_every_version_after_it_is_the_adapter() -> None:
    learner = Learner(_lora(), AlgorithmConfig(lr=1e-2), DistContext())
    cfg = learner.lora
    assert cfg is not None
    with tempfile.TemporaryDirectory() as tmp, Hub.from_config(_hub_config(pathlib.Path(tmp))) as hub:
        publisher = WeightPublisher(hub, None, TrainerMetrics())
        assert await publisher.ensure_base(learner.base_state, cfg) == 0
        assert (await publisher.publish(learner.published_state())).version == 1
        _train(learner, range(2))
        assert (await publisher.publish(learner.published_state())).version == 2
        assert hub.manifest(2).base == 0 and {t.encoding for t in hub.manifest(2).tensors} <= {"delta", "same"}
        # A restarted trainer finds the base through the newest adapter and publishes no second one.
        again = WeightPublisher(Hub.from_config(hub.config), None, TrainerMetrics())
        assert await again.ensure_base(learner.base_state, cfg) == 0
        assert again.holds(learner.published_state(), 2) and not again.holds(learner.published_state(), 1)
        # Another base (another model) is published as a version of its own.
        other = Learner(ModelConfig(tiny={"seed": 3}, lora=cfg), AlgorithmConfig(), DistContext())
        assert await again.ensure_base(other.base_state, cfg) == 3
        assert hub.versions() == [0, 1, 2, 3] and hub.manifest(3).adapter is None
