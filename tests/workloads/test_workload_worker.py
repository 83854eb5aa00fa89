"""The rollout worker on a local Hugging Face folder (Qwen2, bf16 shards) with chat rows and TRL-style rewards,
against real tansu: it renders each chat prompt with the tokenizer's chat template (the ids the group
carries are `apply_chat_template`'s), and a reward that raises, overruns its timeout, returns NaN or the
wrong number of rewards dead-letters its group with reason `reward_error` while the others go through.

`reward.timeout_s` is generous (an ordinary reward call never reaches it) and the slow reward blocks until
the test lets it go, after the worker dead-lettered its group: it overruns the timeout however fast the
machine, and the others never race it however slow."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
import torch
import yaml
from slowdown import scaled

from fleetrl.broker import GroupRecord, Producer, PromptRecord, Sampling, ensure_topics, read_dead_letters
from fleetrl.config import FleetConfig, parse_config
from fleetrl.hub import Hub
from fleetrl.rollout.worker import RolloutWorker

pytestmark = pytest.mark.integration
REGION = "r1"
HERE = pathlib.Path(__file__).parent
MODES = ["ok", "raise", "nan", "slow", "short", "ok", "long"]


def _config(run_id: str, bootstrap: str, store: pathlib.Path, model: pathlib.Path) -> FleetConfig:
    data: dict[str, Any] = {
        "run": run_id,
        "model": {"path": str(model)},
        "algorithm": {"n_samples": 3, "max_new_tokens": 6},
        "dataset": {"task": "keywords", "max_prompt_tokens": 64},  # a label: prompts from the test
        "reward": {"functions": [{"fn": "reward_fns:picky"}, {"fn": "reward_fns:keyword_reward", "weight": 0.5}],
                   "python_path": [str(HERE)], "timeout_s": 5.0},
        "hub": {"home_store": store.as_uri(), "threads": 2, "poll_interval_s": 0.1},
        "kafka": {"partitions": {"prompts": 2, "partials": 1, "trajectories": 2, "dead_letter": 1}},
        "rollout": {"weight_fallback_poll_s": 0.2, "idle_poll_s": 0.1, "handover_timeout_s": 15.0,
                    "stats_interval_s": 0.5},
        "regions": [{"name": REGION, "kafka": bootstrap, "store": store.as_uri(),
                     "engine": {"kind": "torch", "max_batch": 16, "dtype": "bfloat16"}}],
    }
    return parse_config(yaml.safe_dump(data), source="workload-test.yaml", env={})


def _publish_folder(config: FleetConfig) -> None:
    state = {k: v.to(torch.bfloat16) for k, v in config.model.build().state_dict().items()}
    with Hub.from_config(config) as hub:
        hub.publish(state)


def _prompt(config: FleetConfig, i: int, mode: str) -> PromptRecord:
    text = f"Say the word red. ({i})" if mode != "long" else "red " * 100  # 64 tokens fit the short ones only
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    return PromptRecord(group_id=f"{config.run}-g{i}", run=config.run, task="keywords", n_samples=3,
                        sampling=Sampling(max_new_tokens=6), messages=messages,
                        columns={"mode": mode, "keyword": "red"})


async def test_chat_rows_render_with_the_template_and_failing_rewards_dead_letter(
        run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path, qwen2_folder: pathlib.Path) -> None:
    import reward_fns
    from fleet_testkit import read_stream
    from transformers import AutoTokenizer

    reward_fns.RELEASE_SLOW.clear()
    config = _config(run_id, tansu_bootstrap, tmp_path / "store", qwen2_folder)
    _publish_folder(config)
    await ensure_topics(config, REGION)
    sent = [_prompt(config, i, mode) for i, mode in enumerate(MODES)]
    async with Producer(config, REGION, "test-dispatcher") as producer:
        for r in sent:
            await producer.send("prompts", r.group_id, r)
    worker, stop = RolloutWorker(config, REGION, "n1"), asyncio.Event()
    assert sorted(worker.engine.eos_ids) == [0, 2]  # both EOS ids of the generation config
    task = asyncio.create_task(worker.run(stop))
    try:
        async with asyncio.timeout(scaled(120)):
            while worker.groups_done + sum(worker.dead_lettered.values()) < len(MODES):
                assert not task.done(), "the worker stopped"
                await asyncio.sleep(0.1)
    finally:
        reward_fns.RELEASE_SLOW.set()  # the slow call's thread returns (its group was dead-lettered)
        stop.set()
        await asyncio.wait_for(task, timeout=scaled(30))
    # max_prompt_tokens counts the rendered prompt: the long one never reaches the engine
    assert worker.groups_done == 2 and worker.dead_lettered == {"reward_error": 4, "tokens_bound": 1}
    stats = worker.stats()["rewards"]
    assert stats["reward_fns:picky"]["errors"] == 4 and stats["reward_fns:picky"]["groups"] == 2

    out = [d.record for d in await read_stream(config, REGION, "trajectories", 2, timeout_s=20)]
    tok = AutoTokenizer.from_pretrained(str(qwen2_folder), local_files_only=True)
    by_id = {p.group_id: p for p in sent}
    for g in out:
        assert isinstance(g, GroupRecord)
        expected = tok.apply_chat_template(by_id[g.group_id].messages, add_generation_prompt=True, return_dict=False)
        assert g.prompt_ids.tolist() == expected  # the trainer learns the exact ids the engine saw
        for s in g.samples:  # picky gives 1.0, keyword_reward 0 or 1 at weight 0.5
            assert s.reward in (1.0, 1.5)
        assert g.reward_parts is not None and g.reward_parts["reward_fns:picky"] == 1.0
        said = [2 * (s.reward - 1.0) for s in g.samples]  # keyword_reward's own value, 0 or 1
        assert g.reward_parts["reward_fns:keyword_reward"] == pytest.approx(sum(said) / len(said))
    assert sorted(g.group_id for g in out) == [f"{run_id}-g0", f"{run_id}-g5"]

    letters = await read_dead_letters(config, REGION)
    reasons = {d.key.decode() if d.key else "": (d.reason, d.message) for d in letters}
    assert {r for r, _ in reasons.values()} == {"reward_error", "tokens_bound"}
    assert "dataset.max_prompt_tokens" in reasons[f"{run_id}-g6"][1]
    assert "ValueError: cannot score 3 completions" in reasons[f"{run_id}-g1"][1]
    assert "not finite" in reasons[f"{run_id}-g2"][1]
    assert "TimeoutError" in reasons[f"{run_id}-g3"][1]
    assert "returned 1 rewards for 3 completions" in reasons[f"{run_id}-g4"][1]
