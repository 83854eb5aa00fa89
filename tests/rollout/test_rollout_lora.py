"""The torch engine serving LoRA adapter versions: merged and unmerged compute what peft computes, a
merge is bit for bit the same whatever versions came before, the switch holds between two decoding
steps, an adapter of another base (or one that does not fit) is refused, and `WeightSync` reads the
base once and only the adapter chain after it."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import torch

from fleetrl.broker import Sampling
from fleetrl.config import FleetConfig, LoraAdapterConfig, ModelConfig
from fleetrl.hub import AdapterInfo, Hub, open_store
from fleetrl.rollout import EngineError
from fleetrl.rollout.adapters import LoraWeights
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.sampling import behaviour_logprobs
from fleetrl.rollout.torch_engine import TorchEngine
from fleetrl.rollout.weights import WeightSync
from fleetrl.trainer import lora

torch.set_num_threads(1)
MODES = ["merged", "unmerged"]
INFO = AdapterInfo(base=0, r=4, lora_alpha=8)
PROMPT = [1, 40, 41, 42, 61, 50]


def _peft(seed: int) -> Any:
    """The tiny model with a trained-looking adapter (B non-zero), seeded."""
    model = lora.wrap(ModelConfig().build(), LoraAdapterConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad), key=lambda x: x[0]):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _adapter(version: int, seed: int, base: int = 0) -> LoraWeights:
    tensors = {k: v.detach().clone() for k, v in lora.adapter_state(_peft(seed)).items()}
    return LoraWeights(version, AdapterInfo(base=base, r=4, lora_alpha=8), tensors)


def _base() -> dict[str, torch.Tensor]:
    return ModelConfig().build().state_dict()


def _engine(mode: str, dtype: str = "float32") -> TorchEngine:
    return TorchEngine(ModelConfig(tiny={"seed": 5}).build(), max_batch=8, lora_mode=mode, dtype=dtype)


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([PROMPT])).logits


@pytest.mark.parametrize("mode", MODES)
def test_the_engine_computes_what_peft_computes(mode: str) -> None:
    engine = _engine(mode)  # built from another seed: every weight comes from the staged base
    engine.stage_adapter(_adapter(1, seed=1), base=_base())
    samples = engine.generate(GroupRequest("g", PROMPT, Sampling(max_new_tokens=8), n_samples=3, seed=2))
    assert engine.version == 1 and engine.base_version == 0
    reference = _peft(1)
    torch.testing.assert_close(_logits(engine.model), _logits(reference), atol=2e-6, rtol=0)
    for s in samples:
        x = torch.tensor([PROMPT + s.completion_ids.tolist()])
        with torch.no_grad():
            logits = reference(input_ids=x).logits[0, len(PROMPT) - 1:-1]
        fresh = behaviour_logprobs(logits, torch.from_numpy(s.completion_ids.astype(np.int64)), 1.0)
        np.testing.assert_allclose(s.logprobs, fresh.numpy(), atol=1e-4, rtol=0)
        assert (s.versions == 1).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_merge_is_bit_for_bit_the_same_whatever_versions_came_before(dtype: str) -> None:
    hopping, fresh = _engine("merged", dtype), _engine("merged", dtype)
    hopping.stage_adapter(_adapter(1, seed=1), base=_base())
    hopping.step()
    for version, seed in ((2, 2), (3, 3), (4, 1)):
        hopping.stage_adapter(_adapter(version, seed=seed))
        hopping.step()
    fresh.stage_adapter(_adapter(4, seed=1), base=_base())
    fresh.step()
    merged, expected = hopping.model.state_dict(), fresh.model.state_dict()
    assert all(torch.equal(merged[n], t) for n, t in expected.items())
    # ... and it is W0 + scale * B @ A, summed in fp32 and rounded once into the engine's dtype.
    pairs = _adapter(4, seed=1).pairs()
    name = "model.layers.1.mlp.down_proj"
    a, b = pairs[name]
    w0 = _base()[f"{name}.weight"].to(getattr(torch, dtype))
    want = (w0.float() + (b.float() @ a.float()) * INFO.scaling).to(getattr(torch, dtype))
    assert torch.equal(merged[f"{name}.weight"], want)
    # Back to the base alone (full weights after adapters): every target weight as loaded.
    hopping.stage_weights({k: v.to(getattr(torch, dtype)) for k, v in _base().items()}, version=5)
    hopping.step()
    assert hopping.base_version is None
    assert all(torch.equal(hopping.model.state_dict()[n], t.to(getattr(torch, dtype))) for n, t in _base().items())


@pytest.mark.parametrize("mode", MODES)
def test_an_in_flight_switch_of_adapters_happens_exactly_at_the_step(mode: str) -> None:
    engine = _engine(mode)
    engine.stage_adapter(_adapter(1, seed=1), base=_base())
    sampling = Sampling(max_new_tokens=12)
    engine.submit(GroupRequest("g", PROMPT, sampling, n_samples=3, seed=4))
    for _ in range(5):
        assert engine.step() == []
    engine.stage_adapter(_adapter(2, seed=2))
    done = []
    for _ in range(50):
        done = engine.step()
        if done:
            break
    assert done
    for s in done[0].samples:  # (a sample may stop early, at its EOS)
        assert len(s.versions) > 5
        np.testing.assert_array_equal(s.versions, [1] * 5 + [2] * (len(s.versions) - 5))
    torch.testing.assert_close(_logits(engine.model), _logits(_peft(2)), atol=2e-6, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_an_adapter_of_another_base_or_that_does_not_fit_is_refused(mode: str) -> None:
    engine = _engine(mode)
    with pytest.raises(EngineError, match="applies to base version 0; the engine holds no base"):
        engine.stage_adapter(_adapter(1, seed=1))
    engine.stage_adapter(_adapter(1, seed=1), base=_base())
    engine.step()
    with pytest.raises(EngineError, match="applies to base version 3; the engine holds base version 0"):
        engine.stage_adapter(_adapter(2, seed=2, base=3))
    before = _logits(engine.model)
    good = _adapter(2, seed=2)
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    for tensors, fault in (({**good.tensors, name: torch.zeros(3, 4)}, "model.layers.0.mlp.up_proj"),
                           ({k: v for k, v in good.tensors.items() if k != name}, "only one of lora_A, lora_B"),
                           ({**good.tensors, "base_model.model.model.norm.lora_A.weight": torch.zeros(4, 64),
                             "base_model.model.model.norm.lora_B.weight": torch.zeros(64, 4)}, "not a linear layer")):
        engine.stage_adapter(LoraWeights(2, INFO, tensors))
        with pytest.raises(EngineError, match=fault):
            engine.step()
        assert engine.version == 1 and torch.equal(_logits(engine.model), before)  # nothing half applied


def _hub_config(tmp: pathlib.Path) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "lora", "hub": {"home_store": str(tmp / "home"), "threads": 1, "anchor_interval": 8,
                               "signing": {"scheme": "hmac-sha256", "key": "k" * 32}},
        "regions": [{"name": "r1", "kafka": "127.0.0.1:9", "store": str(tmp / "home")}],
    })


@pytest.mark.parametrize("mode", MODES)
async def test_weight_sync_reads_the_base_once_then_only_adapters(mode: str, tmp_path: pathlib.Path) -> None:
    config = _hub_config(tmp_path)
    with Hub.from_config(config) as trainer:
        trainer.publish({k: v.to(torch.bfloat16) for k, v in _base().items()})
        for version in (1, 2, 3):
            tensors = _adapter(version, seed=version).tensors
            trainer.publish({k: v.to(torch.bfloat16) for k, v in tensors.items()}, adapter=INFO)
        base_bytes = sum(trainer.manifest(0).objects.values())
    view = {n: open_store(n, c) for n, c in config.stores().items()}
    engine = _engine(mode)
    with Hub(config, store="r1", stores=view) as node:
        sync = WeightSync(node, engine, fallback_poll_s=600)
        assert await sync.refresh(1) and engine.staged_version == 1
        engine.step()
        assert engine.base_version == 0 and view["r1"].stats.object_bytes > base_bytes
        read = view["r1"].stats.object_bytes
        assert await sync.refresh(3)
        engine.step()
        assert view["r1"].stats.object_bytes - read < base_bytes / 2  # two adapter versions, no base
    published = _peft(3)
    with torch.no_grad():  # the engine runs the adapter as published (bf16), on the base as published
        for p in (p for _, p in published.named_parameters()):
            p.copy_(p.to(torch.bfloat16).float())
    torch.testing.assert_close(_logits(engine.model), _logits(published), atol=2e-6, rtol=0)
