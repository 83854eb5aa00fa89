"""Your model, your data, your reward, end to end on real brokers: a locally built Llama and Qwen2 folder
(bf16, sharded) trains for a few steps on chat rows from a JSONL dataset scored by a TRL-style reward,
and the last version leaves through `fleetrl hub export` as a folder that `from_pretrained` loads with
logits bit-exact to the hub's materialized version."""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import pytest
import torch
import yaml
from slowdown import scaled

from fleetrl.broker import ensure_topics
from fleetrl.cli import main
from fleetrl.config import FleetConfig, load_config
from fleetrl.demo.hf_inputs import write_prompts
from fleetrl.hub import Hub
from fleetrl.rollout.worker import RolloutWorker
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.service import Trainer
from fleetrl.trainer_cli import prompt_source
from fleetrl.workload import check_workload

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REGION = "local-a"
STEPS = 3
HERE = pathlib.Path(__file__).parent


def _config_file(run: str, bootstrap: str, mqtt_port: int, tmp: pathlib.Path, model: pathlib.Path) -> pathlib.Path:
    store = (tmp / "store").as_uri()
    data: dict[str, Any] = {
        "run": run,
        "model": {"path": str(model), "publish_dtype": "bfloat16"},
        "algorithm": {"groups_per_step": 4, "n_samples": 4, "max_staleness": 1, "lr": 1e-3, "max_new_tokens": 6},
        "dataset": {"task": "keywords", "path": str(write_prompts(tmp / "prompts.jsonl", n=64)),
                    "system_prompt": "Be brief.", "shuffle": True},
        "reward": {"functions": [{"fn": "reward_fns:keyword_reward"}, {"fn": "reward_fns:length_reward",
                                                                        "weight": 0.01}],
                   "python_path": [str(HERE)]},
        "hub": {"home_store": store, "threads": 2, "poll_interval_s": 0.1},
        "mqtt": {"url": f"mqtt://127.0.0.1:{mqtt_port}"},
        "kafka": {"partitions": {"prompts": 2, "partials": 1, "trajectories": 2, "dead_letter": 1}},
        "rollout": {"weight_fallback_poll_s": 0.1, "max_groups_in_flight": 4},
        "trainer": {"checkpoint_dir": str(tmp / "ckpt"), "checkpoint_every": 5},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store, "nodes": [{"name": "node-1"}],
                     "engine": {"kind": "torch", "max_batch": 16, "dtype": "bfloat16"}}],
    }
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def _train(config: FleetConfig) -> list[float]:
    await ensure_topics(config, REGION)
    trainer = Trainer(config, prompt_source(config), Learner(config.model, config.algorithm, DistContext()))
    stop_trainer, stop_worker = asyncio.Event(), asyncio.Event()
    train = asyncio.create_task(trainer.run(max_steps=STEPS, stop=stop_trainer))
    worker = asyncio.create_task(RolloutWorker(config, REGION, "node-1").run(stop_worker))
    try:
        async with asyncio.timeout(scaled(300)):
            while not train.done():
                if worker.done():
                    worker.result()
                await asyncio.sleep(0.2)
        train.result()
    finally:
        stop_worker.set()
        await asyncio.wait_for(worker, scaled(60))
    return trainer.result.rewards


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
async def test_local_folder_trains_on_chat_rows_and_exports_bit_exact(
        run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path, arch: str,
        request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder: pathlib.Path = request.getfixturevalue(f"{arch}_folder")
    assert len(list(folder.glob("model-*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    path = _config_file(run_id, tansu_bootstrap, mqtt_server.port, tmp_path, folder)
    config = load_config(path)
    check_workload(config, str(path))
    rewards = await _train(config)
    assert len(rewards) == STEPS and all(r == r for r in rewards), rewards

    out = tmp_path / "export"
    assert main(["hub", "export", "--config", str(path), "--version", "latest", "--out", str(out),
                 "--max-shard-size", "100KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with its index
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    messages = [{"role": "user", "content": "Say the word red."}]
    ids = torch.tensor([tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)])
    assert ids[0].tolist() == AutoTokenizer.from_pretrained(str(folder), local_files_only=True).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False)

    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert exported.dtype == torch.bfloat16 and type(exported).__name__.lower().startswith(arch)
    with Hub.from_config(config) as hub:
        version = hub.latest()
        assert version is not None and version >= STEPS
        state = hub.materialize(version)
    weights = exported.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in state.items())  # every tensor, bit for bit
    # The hub's version run by the same code path as any bf16 checkpoint (the base folder's model, its
    # weights replaced): the same logits, bit for bit.
    base = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    base_logits = _logits(base, ids)
    base.load_state_dict(state, strict=False)
    assert torch.equal(_logits(exported, ids), _logits(base, ids))
    assert not torch.equal(_logits(exported, ids), base_logits)  # and it is the trained model, not the base
