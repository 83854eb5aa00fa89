"""Fixtures of the workload tests: local Hugging Face model folders built on the spot (no download)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from fleetrl.demo.hf_inputs import build_model_folder

HUB_KEY = "6680e5459cd0040518f9d6b4ec6f916984f5a12f538b6eea69e195dc1a06cc09"  # Ed25519 private key (hex)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Qwen2 architecture, bf16, three safetensors shards with an index, BPE tokenizer, ChatML template."""
    return build_model_folder(tmp_path_factory.mktemp("qwen2") / "model", arch="qwen2")


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Llama architecture (untied embeddings), bf16, sharded."""
    return build_model_folder(tmp_path_factory.mktemp("llama") / "model", arch="llama")


@pytest.fixture(scope="session")
def agent_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Qwen2 with the tool-calling chat template (Hermes `<tool_call>`), as `examples/fleet.agent.yaml` builds."""
    return build_model_folder(tmp_path_factory.mktemp("agent") / "model", arch="qwen2", agent=True)
