"""A LoRA run's versions leave through `fleetrl hub export`: as a peft adapter folder that
`PeftModel.from_pretrained` loads onto the base version's folder, and with `--merged` as a full Hugging
Face folder whose weights are bit for bit what the torch engine serves merged."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch
import yaml

from fleetrl.cli import main
from fleetrl.config import LoraAdapterConfig, ModelConfig, load_config
from fleetrl.hub import Hub
from fleetrl.rollout.torch_engine import TorchEngine
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.publisher import WeightPublisher

PROMPT = torch.tensor([[1, 40, 41, 42, 61, 50, 51]])


def _config_file(tmp: pathlib.Path) -> pathlib.Path:
    doc: dict[str, Any] = {
        "run": "lora-export",
        "model": {"lora": {"r": 4, "lora_alpha": 16, "target_modules": "all-linear"}},
        "hub": {"home_store": (tmp / "home").as_uri(), "threads": 1},
        "regions": [{"name": "r1", "kafka": "127.0.0.1:9", "store": (tmp / "r1").as_uri()}],
    }
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def _publish_trained_adapter(path: pathlib.Path) -> tuple[int, dict[str, torch.Tensor]]:
    """Base and one adapter version of a learner whose adapter moved away from zero; returns the
    adapter's version and the tensors as published."""
    from fleetrl.trainer.metrics import TrainerMetrics

    config = load_config(path)
    learner = Learner(config.model, config.algorithm, DistContext())
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    assert config.model.lora is not None
    with Hub.from_config(config) as hub:
        publisher = WeightPublisher(hub, None, TrainerMetrics())
        await publisher.ensure_base(learner.base_state, config.model.lora)
        state = learner.published_state()
        pv = await publisher.publish(state)
    return pv.version, state


async def test_an_adapter_version_exports_as_a_peft_folder_and_merged(tmp_path: pathlib.Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = _config_file(tmp_path)
    version, adapter = await _publish_trained_adapter(path)
    assert main(["hub", "export", "--config", str(path), "--version", "latest", "--out", str(tmp_path / "ad")]) == 0
    folder = tmp_path / "ad"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                        "adapter_model.safetensors", "fleetrl_export.json"]
    stamp = json.loads((folder / "fleetrl_export.json").read_text())
    assert stamp == {"run": "lora-export", "version": version, "kind": "peft_adapter", "base_version": 0}
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["peft_type"]) == (4, 16, "LORA")

    # The base version, exported as any version of full weights, with the adapter folder on top.
    assert main(["hub", "export", "--config", str(path), "--version", "0", "--out", str(tmp_path / "base")]) == 0
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), local_files_only=True).float()
    loaded = PeftModel.from_pretrained(base, str(folder)).eval()
    got = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert got.keys() == adapter.keys() and all(torch.equal(got[k], v.float()) for k, v in adapter.items())

    assert main(["hub", "export", "--config", str(path), "--version", str(version), "--out",
                 str(tmp_path / "merged"), "--merged"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True).eval()
    assert json.loads((tmp_path / "merged" / "fleetrl_export.json").read_text())["kind"] == "merged"
    engine = TorchEngine(ModelConfig().build(), dtype="bfloat16", lora_mode="merged")
    from fleetrl.hub import AdapterInfo
    from fleetrl.rollout.adapters import LoraWeights

    with Hub.from_config(load_config(path)) as hub:
        info, tensors = hub.materialize_adapter(version, 0)
        engine.stage_adapter(LoraWeights(version, info, tensors), base=hub.materialize(0))
    engine.step()
    assert isinstance(info, AdapterInfo) and merged.dtype == torch.bfloat16
    served = engine.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in merged.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=PROMPT).logits.float(), loaded(input_ids=PROMPT).logits,
                                   atol=0.1, rtol=0)  # bf16 weights against the fp32 adapter on the bf16 base


def test_export_of_a_full_version_still_writes_a_model_folder(tmp_path: pathlib.Path) -> None:
    config = load_config(_config_file(tmp_path)).model_copy(update={"model": ModelConfig()})
    from fleetrl.hub.export import export_version

    with Hub.from_config(config) as hub:
        hub.publish({k: v.to(torch.bfloat16) for k, v in ModelConfig().build().state_dict().items()})
        summary = export_version(hub, config, 0, tmp_path / "out", merged=True)
    assert summary["kind"] == "model" and (tmp_path / "out" / "config.json").is_file()
    with pytest.raises(Exception, match="already exists"), Hub.from_config(config) as hub:
        export_version(hub, config, 0, tmp_path / "out")


def test_lora_config_names_its_fields_as_peft_does() -> None:
    cfg = LoraAdapterConfig()
    from peft import LoraConfig

    peft_defaults = LoraConfig()
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules) == (
        peft_defaults.r, peft_defaults.lora_alpha, peft_defaults.lora_dropout, peft_defaults.target_modules)
    with pytest.raises(ValueError, match="target_modules is an empty list"):
        LoraAdapterConfig(target_modules=[])
    with pytest.raises(ValueError, match="alpha"):
        LoraAdapterConfig.model_validate({"alpha": 16})  # peft's name is lora_alpha: a typo names itself
