"""The vLLM engine on a GPU: same interface, recorded logprobs, in-place reload. Skipped without vllm/CUDA."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from fleetrl.broker import Sampling
from fleetrl.config import ModelConfig, VllmEngineConfig
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.sampling import behaviour_logprobs

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny Qwen2 saved as a local Hugging Face checkpoint (vLLM loads folders, not objects)."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    ModelConfig().build().save_pretrained(path)
    return path


def test_vllm_engine_records_logprobs_and_reloads_weights(checkpoint: pathlib.Path) -> None:
    from fleetrl.rollout.vllm_engine import VllmEngine

    model_cfg = ModelConfig(path=str(checkpoint))
    engine = VllmEngine.from_config(model_cfg, VllmEngineConfig(gpu_memory_utilization=0.3, enforce_eager=True))
    sampling = Sampling(temperature=0.8, top_p=1.0, max_new_tokens=12)
    samples = engine.generate(GroupRequest("g", [1, 40, 41, 42], sampling, n_samples=4, seed=1))
    model = ModelConfig().build()
    for s in samples:
        x = torch.tensor([[1, 40, 41, 42, *s.completion_ids.tolist()]])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0, 3:-1]
        fresh = behaviour_logprobs(logits, torch.from_numpy(s.completion_ids.astype(np.int64)), 0.8)
        np.testing.assert_allclose(s.logprobs, fresh.numpy(), atol=0.05)  # bf16 engine vs fp32 forward
    new = ModelConfig(tiny={"seed": 1}).build().state_dict()
    engine.submit(GroupRequest("h", [1, 40, 41, 42], sampling, n_samples=2, seed=2))
    engine.step()
    engine.stage_weights({k: v.to(torch.bfloat16) for k, v in new.items()}, version=3)
    done = []
    for _ in range(100):
        done += engine.step()
        if done:
            break
    for s in done[0].samples:
        assert s.versions[0] == 0 and (s.versions[1:] == 3).all()
    # A delta's part: only the tensors it changed (the final norm here) go to the workers' load_weights.
    engine.stage_weights({"model.norm.weight": (new["model.norm.weight"] * 2).to(torch.bfloat16)}, version=4,
                         complete=False)
    later = engine.generate(GroupRequest("k", [1, 40, 41, 42], sampling, n_samples=2, seed=3))
    assert all((s.versions == 4).all() for s in later)
    engine.close()
