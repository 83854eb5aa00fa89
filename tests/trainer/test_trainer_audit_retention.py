"""`fleetrl audit` after Kafka retention removed the records below the checkpoint's settled watermark.

tansu 0.6 cannot delete records: DeleteRecords closes the connection (memory storage), and
`retention.ms` / `segment.ms` on a topic remove nothing (checked here, 2026-11-25). So retention is
emulated: a second tansu receives the run's `prompts` partition by partition at the same offsets,
where each record below the watermark is replaced by a prompt of a group no checkpoint knows. An
audit that read any of them would report it lost; the one reading from the watermark must pass and
say where it started. The same topics read from the beginning fail, so the replacement is a real trap.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pathlib
import subprocess
import sys
from collections.abc import Callable

import pytest
import yaml
from aiokafka import AIOKafkaProducer
from slowdown import scaled
from trainer_groups import answer_prompts

from fleetrl import devstack
from fleetrl.broker import SCHEMA_HEADER, PromptRecord, Sampling, encode_record, ensure_topics, read_log, topic_name
from fleetrl.config import FleetConfig
from fleetrl.trainer.audit import read_topics, reconcile, watermarks_of
from fleetrl.trainer.checkpoint import latest
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.service import Trainer

pytestmark = pytest.mark.integration
REGION = "local-a"
STEPS = 6


def reverse_prompts() -> itertools.cycle[tuple[str, str, str]]:
    return itertools.cycle([("reverse", "abc=", "cba"), ("reverse", "dab=", "bad")])


async def _train(config: FleetConfig) -> None:
    await ensure_topics(config, REGION)
    trainer = Trainer(config, reverse_prompts, Learner(config.model, config.algorithm, DistContext()))
    train = asyncio.create_task(trainer.run(max_steps=STEPS))
    side = asyncio.create_task(answer_prompts(config, REGION, train.done, []))
    await asyncio.wait_for(train, scaled(240))
    await asyncio.wait_for(side, scaled(30))


async def _replicate_with_trap(config: FleetConfig, replica: FleetConfig, marks: dict[int, int]) -> int:
    """Copy `prompts` to the replica at the same offsets, records below the watermark replaced."""
    await ensure_topics(replica, REGION)
    topic = topic_name(config.run, "prompts")
    producer = AIOKafkaProducer(bootstrap_servers=replica.region(REGION).kafka.bootstrap)
    await producer.start()
    trapped = 0
    try:
        for r in sorted(await read_log(config, REGION, topic), key=lambda r: (r.partition, r.offset)):
            value, headers = r.value, r.headers
            if r.offset < marks.get(r.partition, 0):
                trap = PromptRecord(group_id=f"{config.run}-gone-{r.partition}-{r.offset}", run=config.run,
                                    task="reverse", n_samples=2, sampling=Sampling(), prompt="x")
                value, headers = encode_record(trap), [(SCHEMA_HEADER, trap.schema.encode())]
                trapped += 1
            meta = await producer.send_and_wait(topic, value, key=r.key, partition=r.partition, headers=headers)
            assert meta.offset == r.offset
    finally:
        await producer.stop()
    return trapped


def _audit_cli(config_file: pathlib.Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetrl.cli", "audit", "--config", str(config_file), *extra],
                          capture_output=True, text=True, timeout=scaled(120), check=False)


async def test_audit_passes_and_reports_the_watermark_after_older_records_are_gone(
        make_fleet: Callable[..., FleetConfig], tmp_path: pathlib.Path) -> None:
    data = make_fleet().model_dump(mode="json", exclude_unset=True)
    data["trainer"]["ledger_detail_groups"] = 2  # fold early: a few steps cover what a long run shows
    config = FleetConfig.model_validate(data)
    await _train(config)
    ckpt = latest(config.trainer.checkpoint_dir, config.run)
    assert ckpt is not None
    marks = watermarks_of(ckpt.state)[REGION]
    assert sum(marks.values()) > 0, marks

    with devstack.tansu() as broker:
        data["regions"][0]["kafka"] = f"127.0.0.1:{broker.port}"
        replica = FleetConfig.model_validate(data)
        trapped = await _replicate_with_trap(config, replica, marks)
        assert trapped == sum(marks.values())
        # Read from the beginning, the trap is sprung: every replaced record is read, a prompt of a group
        # the trainer never issued.
        full = reconcile(await read_topics(replica), ckpt.state, config.run)
        assert full.foreign_prompts == trapped
        config_file = tmp_path / "replica.yaml"
        config_file.write_text(yaml.safe_dump(data))
        as_json = await asyncio.to_thread(_audit_cli, config_file, "--json")
        human = await asyncio.to_thread(_audit_cli, config_file)

    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    report = json.loads(as_json.stdout)
    print(f"audit past retention: watermarks={report['watermarks']} skipped={report['skipped_below_watermark']} "
          f"trained={report['trained']} folded={report['settled_folded']}")
    assert report["ok"] and not report["lost"] and not report["trained_twice"]
    assert report["foreign_prompts"] == 0  # read from the watermarks on, no trap record is read
    assert report["watermarks"] == {REGION: {str(p): o for p, o in marks.items()}}
    assert report["skipped_below_watermark"] == trapped
    assert report["trained"] == STEPS * config.algorithm.groups_per_step and report["settled_folded"] > 0
    assert human.returncode == 0, human.stdout + human.stderr
    assert "proved from the settled watermark on" in human.stdout and human.stdout.strip().endswith("ok")
    assert f"{trapped} prompt record(s) below it not read" in human.stdout
