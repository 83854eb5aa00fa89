"""`fleetrl demo --config examples/fleet.lora.yaml` as it ships (on free ports): nothing to build first,
the base published once and every version after it an adapter, the reward rises, the books balance,
every store verifies, and the last version leaves through `fleetrl hub export` as a peft adapter folder
that `PeftModel.from_pretrained` loads onto the exported base, and merged as a full folder."""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Any

import pytest
import torch
import yaml
from demo_testkit import ROOT, STALL, alive, free_port
from slowdown import scaled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 16
DEMO_TIMEOUT_S = 300  # bound of the run (about 25 s on 2 idle cores); the reference figure, scaled in `_fleetrl`


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("FLEETRL_HUB_KEY", None)  # the demo brings its own
    return env


def _fleetrl(*args: str, timeout_s: float = DEMO_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetrl.cli", *args], capture_output=True, text=True,
                          env=_env(), timeout=scaled(timeout_s), check=False)


def test_the_lora_example_learns_and_its_adapter_loads_with_peft(tmp_path: pathlib.Path,
                                                                 workdir: pathlib.Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "fleet.lora.yaml").read_text())
    for region in doc["regions"]:
        region["kafka"] = f"127.0.0.1:{free_port()}"
    doc["mqtt"]["url"] = f"mqtt://127.0.0.1:{free_port()}"
    config = tmp_path / "fleet.lora.yaml"
    config.write_text(yaml.safe_dump(doc))

    run = _fleetrl("demo", "--config", str(config), *STALL, "--workdir", str(workdir), "--steps", str(STEPS))
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    summary: dict[str, Any] = json.loads((workdir / "summary.json").read_text())
    assert summary["audit"]["ok"], summary["audit"]
    assert summary["final_version"] == STEPS + 1  # the base (0), the first adapter (1), one per step
    assert all(region["replica_version"] == STEPS + 1 for region in summary["regions"].values())
    rewards = summary["rewards"]
    assert statistics.fmean(rewards[-3:]) > statistics.fmean(rewards[:3]) + 0.1, rewards
    pids: dict[str, int] = json.loads((workdir / "pids.json").read_text())
    assert [name for name, pid in pids.items() if alive(pid)] == []

    fleet = workdir / "fleet.yaml"
    # (readers verify with the public key the demo wrote into its fleet.yaml)
    assert _fleetrl("hub", "export", "--config", str(fleet), "--version", "latest", "--out",
                                str(tmp_path / "adapter")).returncode == 0
    stamp = json.loads((tmp_path / "adapter" / "fleetrl_export.json").read_text())
    assert stamp["kind"] == "peft_adapter" and stamp["base_version"] == 0 and stamp["version"] == STEPS + 1
    assert _fleetrl("hub", "export", "--config", str(fleet), "--version", "0", "--out",
                    str(tmp_path / "base")).returncode == 0
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), local_files_only=True).float()
    policy = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert _fleetrl("hub", "export", "--config", str(fleet), "--version", "latest", "--out",
                    str(tmp_path / "merged"), "--merged").returncode == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True).eval()
    x = torch.tensor([[1, 68, 69, 70, 32]])  # "abc=" in the char tokenizer, after bos
    with torch.no_grad():
        adapted = policy(input_ids=x).logits
        with policy.disable_adapter():
            plain = policy(input_ids=x).logits
        torch.testing.assert_close(merged(input_ids=x).logits.float(), adapted, atol=0.15, rtol=0)
    assert (adapted - plain).abs().max() > 0.1  # the adapter moved the policy away from its base
