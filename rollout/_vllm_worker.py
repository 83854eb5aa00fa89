"""Runs inside vLLM's worker processes (`worker_extension_cls`): in-place weight reload.

vLLM mixes this class into its GPU worker, so `collective_rpc("fleetrl_load_weights", args=(path,))`
reaches every tensor-parallel rank. Each rank reads the safetensors file the engine wrote (Hugging
Face names, tied weights once) and hands it to the model's own `load_weights`, which shards and
casts as the model needs. Imported by vLLM by its qualified name; nothing here imports vllm.
"""

from __future__ import annotations

from typing import Any


class FleetrlWeightLoader:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def fleetrl_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(weights=list(tensors.items()))
        return len(tensors)
