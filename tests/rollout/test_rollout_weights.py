"""WeightSync over a directory store: along a delta chain an engine gets only what changed (positions and
values to the torch engine, the changed tensors to one that cannot scatter), never a clone of the state."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from rollout_testkit import HUB_KEY, fleet_dict, make_config
from safetensors.torch import load_file

from fleetrl.config import ModelConfig
from fleetrl.hub import Hub
from fleetrl.rollout.engine import TensorChanges
from fleetrl.rollout.torch_engine import TorchEngine
from fleetrl.rollout.vllm_engine import VllmEngine
from fleetrl.rollout.weights import WeightSync

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)


def _versions(n: int, frac: float = 0.02) -> list[dict[str, torch.Tensor]]:
    """The tiny model's bf16 state, then versions each moving `frac` of every matrix's elements by an ulp.

    Vectors (norms, biases) stay: the hub stores tensors of equal bytes once (the model's norms start
    as ones), and a version that un-ties them is materialized whole, not applied as changes."""
    base = {k: v.to(torch.bfloat16) for k, v in ModelConfig().build().state_dict().items()}
    out = [base]
    g = torch.Generator().manual_seed(1)
    for _ in range(1, n):
        new = {}
        for name, t in out[-1].items():
            if name == "lm_head.weight":
                continue
            if t.dim() < 2:
                new[name] = t.clone()
                continue
            bits = t.view(torch.int16)
            moved = torch.rand(bits.shape, generator=g) < frac
            new[name] = torch.where(moved, bits + 1, bits).view(torch.bfloat16)
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
        out.append(new)
    return out


def _assert_engine_holds(engine: TorchEngine, state: Mapping[str, torch.Tensor]) -> None:
    live = engine.model.state_dict()
    for name, t in state.items():
        torch.testing.assert_close(live[name], t.to(live[name].dtype), atol=0, rtol=0, msg=name)


async def test_a_delta_reaches_the_torch_engine_as_positions_and_values(tmp_path: pathlib.Path, run_id: str) -> None:
    config = make_config(fleet_dict(run_id, "127.0.0.1:9", tmp_path / "store"))
    states = _versions(4)
    engine = TorchEngine(ModelConfig().build(), max_batch=2, static=True, graphs="record")
    with Hub.from_config(config) as hub:
        for s in states[:2]:
            hub.publish(s)
        sync = WeightSync(hub, engine, fallback_poll_s=60.0)
        assert await sync.refresh(0)
        assert [u.kind for u in engine._staged] == ["all"]
        engine.step()
        _assert_engine_holds(engine, states[0])
        storage = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
        assert await sync.refresh(1)
        [update] = engine._staged
        kind, changes, version = update.kind, update.tensors, update.version
        assert kind == "changes" and version == 1
        assert set(changes) == {name for name, t in states[1].items() if t.dim() == 2}
        for name, change in changes.items():
            assert isinstance(change, TensorChanges)
            moved = torch.nonzero(states[0][name].reshape(-1).view(torch.int16)
                                  != states[1][name].reshape(-1).view(torch.int16)).flatten()
            assert change.positions.tolist() == moved.tolist()
            assert torch.equal(change.values.view(torch.int16), states[1][name].reshape(-1)[moved].view(torch.int16))
        for s in states[2:]:
            hub.publish(s)
        assert await sync.refresh(2) and await sync.refresh(3)  # two changes staged before the engine steps
        assert [u.version for u in engine._staged] == [1, 2, 3]
        engine.step()
        assert engine.version == 3 and not engine._staged
        _assert_engine_holds(engine, states[3])
        assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == storage


class _Recorder:
    """Stands in for vLLM's LLMEngine where only `collective_rpc` is reached (vLLM cannot run here: this
    checks the file FleetRL hands the workers, not vLLM's loading)."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, torch.Tensor]] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...]) -> None:
        assert method == "fleetrl_load_weights"
        self.loaded.append(load_file(args[0]))


async def test_an_engine_that_cannot_scatter_gets_only_the_tensors_a_delta_changed(
        tmp_path: pathlib.Path, run_id: str) -> None:
    config = make_config(fleet_dict(run_id, "127.0.0.1:9", tmp_path / "store"))
    states = _versions(2)  # version 1 leaves the vectors as they were
    rpc = _Recorder()
    engine = VllmEngine(rpc, eos_ids=[2], max_context=512)
    try:
        with Hub.from_config(config) as hub:
            for s in states:
                hub.publish(s)
            sync = WeightSync(hub, engine, fallback_poll_s=60.0)
            assert await sync.refresh(0) and await sync.refresh(1)
            assert [u.kind for u in engine._staged] == ["all", "part"]
            engine._apply_staged()
        full, part = rpc.loaded
        assert set(part) == {name for name, t in full.items() if t.dim() == 2}
        for name, t in part.items():
            assert torch.equal(t.view(torch.int16), states[1][name].view(torch.int16)), name
    finally:
        engine.close()
