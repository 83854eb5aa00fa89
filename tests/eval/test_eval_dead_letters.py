"""The eval dead letters a worker writes, followed on real tansu (`trainer/eval_dead.py`)."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib

import pytest
from eval_fleet_testkit import REGION, fleet_dict, make_config
from fleet_testkit import reverse_prompts
from slowdown import scaled

from fleetrl.broker import EvalTag, Producer, RecordError, encode_record, ensure_topics
from fleetrl.trainer.eval_book import eval_group_id
from fleetrl.trainer.eval_dead import EvalDeadLetters

pytestmark = pytest.mark.integration


async def test_eval_dead_letters_are_found_with_their_attempt_and_reason(
        run_id: str, tansu_bootstrap: str, tmp_path: pathlib.Path) -> None:
    config = make_config(fleet_dict(run_id, tansu_bootstrap, tmp_path / "store", 1, []))
    await ensure_topics(config, REGION)
    base = reverse_prompts(config, REGION, 3, n_samples=2, max_new_tokens=8)
    evals = [dataclasses.replace(p, group_id=eval_group_id(run_id, "held", 4, i), min_version=4, attempt=i,
                                 eval=EvalTag("held", 4)) for i, p in enumerate(base[:2])]
    found: list[tuple[str, int, str]] = []
    async with EvalDeadLetters(config, f"{run_id}-dead", window=0) as dead, \
            Producer(config, REGION, f"{run_id}-worker") as producer:
        await dead.start()
        for record, reason in ((evals[0], "reward_error"), (base[2], "reward_error"),
                               (evals[1], "eval_version_gone")):
            await producer.dead_letter(record.group_id.encode(), encode_record(record),
                                       RecordError(reason, "test", field="reward", group_id=record.group_id),
                                       f"fleetrl.{run_id}.prompts", 0, 0)
        await producer.dead_letter(b"x-eval-junk", b"not msgpack", RecordError("malformed", "junk"),
                                   f"fleetrl.{run_id}.prompts", 0, 1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(30)
        for _ in range(1000):  # bounded in count and time
            await dead.poll(lambda gid, attempt, reason: found.append((gid, attempt, reason)))
            if len(found) >= 2 or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
    assert sorted(found) == [(evals[0].group_id, 0, "reward_error"), (evals[1].group_id, 1, "eval_version_gone")]
