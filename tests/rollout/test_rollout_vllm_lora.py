"""The vLLM engine serving LoRA adapter versions: one `LoRARequest` per version, the switch between two
steps, the logprobs of the adapted policy.

Skipped here and in CI: it needs vLLM and a CUDA GPU, and this machine has neither (vLLM's wheel is
also far over what the lent GPU machines can carry, ../shared/FACTS.md). What runs here instead: the
adapter's peft folder, loaded by `PeftModel.from_pretrained` (tests/workloads/test_workload_lora_export.py),
and the torch engine's serving of adapters (test_rollout_lora.py).
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import torch

from fleetrl.broker import Sampling
from fleetrl.config import LoraAdapterConfig, ModelConfig, VllmEngineConfig
from fleetrl.hub import AdapterInfo
from fleetrl.rollout.adapters import LoraWeights
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.sampling import behaviour_logprobs
from fleetrl.trainer import lora

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm", reason="vLLM cannot run here: no vllm wheel and no CUDA GPU on this machine")
if not torch.cuda.is_available():
    pytest.skip("vLLM cannot run here: it needs a CUDA GPU", allow_module_level=True)

CFG = LoraAdapterConfig(r=8, lora_alpha=16, target_modules="all-linear")


def _adapter(version: int, seed: int) -> tuple[LoraWeights, Any]:
    model = lora.wrap(ModelConfig().build(), CFG)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad), key=lambda x: x[0]):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    tensors = {k: v.to(torch.bfloat16) for k, v in lora.adapter_state(model).items()}
    return LoraWeights(version, AdapterInfo(base=0, r=CFG.r, lora_alpha=CFG.lora_alpha), tensors), model.eval()


def test_vllm_serves_each_adapter_version_as_a_lora_request(tmp_path: pathlib.Path) -> None:
    from fleetrl.rollout.vllm_engine import VllmEngine

    ModelConfig().build().save_pretrained(tmp_path)
    engine = VllmEngine.from_config(ModelConfig(path=str(tmp_path), lora=CFG),
                                    VllmEngineConfig(gpu_memory_utilization=0.3, enforce_eager=True))
    first, reference = _adapter(1, seed=1)
    base = {k: v.to(torch.bfloat16) for k, v in ModelConfig().build().state_dict().items()}
    engine.stage_adapter(first, base=base)
    sampling = Sampling(temperature=0.8, top_p=1.0, max_new_tokens=12)
    samples = engine.generate(GroupRequest("g", [1, 40, 41, 42], sampling, n_samples=4, seed=1))
    assert engine.llm.list_loras() == {2}  # version 1's LoRARequest id
    for s in samples:
        x = torch.tensor([[1, 40, 41, 42, *s.completion_ids.tolist()]])
        with torch.no_grad():
            logits = reference(input_ids=x).logits[0, 3:-1]
        fresh = behaviour_logprobs(logits, torch.from_numpy(s.completion_ids.astype(np.int64)), 0.8)
        np.testing.assert_allclose(s.logprobs, fresh.numpy(), atol=0.05)  # bf16 engine vs fp32 forward
    engine.submit(GroupRequest("h", [1, 40, 41, 42], sampling, n_samples=2, seed=2))
    engine.step()
    engine.stage_adapter(_adapter(2, seed=2)[0])
    done = []
    for _ in range(100):
        done += engine.step()
        if done:
            break
    assert engine.llm.list_loras() == {3}  # version 2 loaded, version 1 removed
    for s in done[0].samples:
        assert s.versions[0] == 1 and (s.versions[1:] == 2).all()
    engine.close()
