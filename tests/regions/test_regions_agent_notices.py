"""A cloud's preemption notice, served by a local server speaking its protocol, ends an agent process:
it hands its unfinished groups over as partials, goes `offline` and exits 0 inside the notice window,
and another node finishes those groups keeping every token already generated."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from fleet_testkit import produce_prompts as produce
from fleet_testkit import read_stream, reverse_prompts
from metadata_servers import AwsImds, AzureImds, GcpMetadata, MetadataServer
from regions_testkit import (
    HUB_KEY,
    REGION,
    announce,
    fleet_dict,
    make_config,
    publish_tiny,
    read_partials,
    setup_topics,
    start_agent,
    wait_for_beat,
)
from slowdown import scaled

from fleetrl.broker import ControlPlane, GroupRecord
from fleetrl.rollout import RolloutWorker

pytestmark = pytest.mark.integration
LONG = 400  # a random-init model rarely emits EOS: generation is long enough to interrupt


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
    torch.set_num_threads(1)


@pytest.fixture
def agents() -> Iterator[list[Any]]:
    procs: list[Any] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=scaled(10))


@contextlib.contextmanager
def _server(source: str) -> Iterator[MetadataServer]:
    server: MetadataServer = {"aws": AwsImds, "gcp": GcpMetadata, "azure": AzureImds}[source]()
    with server:
        yield server


async def _finish_elsewhere(config: Any, n_groups: int, timeout_s: float) -> None:
    """Run a worker until it finished `n_groups` groups (within `timeout_s`, the reference machine's
    figure, scaled)."""
    worker = RolloutWorker(config, REGION, "finisher")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        async with asyncio.timeout(scaled(timeout_s)):
            while worker.groups_done < n_groups:
                assert not task.done(), task.exception()
                await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, scaled(30))


@pytest.mark.parametrize("source", ["aws", "gcp", "azure"])
async def test_cloud_notice_hands_over_goes_offline_and_exits_0_inside_the_window(
    source: str, run_id: str, tansu_bootstrap: str, mqtt_server: Any, tmp_path: pathlib.Path, agents: list[Any],
) -> None:
    with _server(source) as server:
        data = fleet_dict(run_id, tansu_bootstrap, mqtt_server.port, tmp_path / "store")
        data["algorithm"].update(max_new_tokens=LONG, n_samples=8)
        data["model"] = {"tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}}
        data["regions"][0]["preemption"] = {"source": source, "base_url": server.url, "poll_s": 0.2}
        config = make_config(data)
        window_s = config.region(REGION).preemption.notice_window_s
        publish_tiny(config)
        await setup_topics(config)
        proc, log_path = start_agent(data, tmp_path, "n1")
        agents.append(proc)
        async with ControlPlane(config, f"{run_id}-watcher") as cp:
            await announce(config, cp, 0)
            await wait_for_beat(cp, "n1", lambda b: b.state == "up" and b.version == 0, timeout_s=90)
            # 4 groups x 8 samples through a batch of 8: rounds of up to 400 decoding steps each.
            sent = reverse_prompts(config, REGION, 4, n_samples=8, max_new_tokens=LONG, seed=5)
            await produce(config, REGION, sent)
            await wait_for_beat(cp, "n1", lambda b: b.in_flight > 0, timeout_s=60)
            noticed = time.monotonic()
            event_id = server.preempt()
            rc = await asyncio.to_thread(proc.wait, window_s + 10)
            took_s = time.monotonic() - noticed
            assert rc == 0, log_path.read_text()[-3000:]
            assert took_s < window_s, f"left after {took_s:.1f} s, window {window_s} s"
            await wait_for_beat(cp, "n1", lambda b: b.state == "offline", timeout_s=5)
        if source == "azure":
            assert server.acks == [event_id]  # approved, so the platform may proceed early
        if source == "aws":
            assert server.token_puts >= 1 and server.unauthorized == 0  # IMDSv2: every read carried a token

    handed = await read_partials(config, 4, timeout_s=20)
    assert handed, f"no partials; the agent's log ends:\n{log_path.read_text()[-6000:]}"
    assert all(p.handed_over_by.reason == "preempted" and p.handed_over_by.node == "n1" for p in handed)
    assert sum(len(s.completion_ids) for p in handed for s in p.samples) > 0
    if source != "aws":
        return  # what follows a notice is the same code for every source: one finishing run proves it (20 s)
    await _finish_elsewhere(config, len(handed), timeout_s=120)
    out = [d.record for d in await read_stream(config, REGION, "trajectories", 4, timeout_s=20, distinct=True)]
    final = {g.group_id: g for g in out if isinstance(g, GroupRecord)}
    assert sorted(final) == sorted(r.group_id for r in sent)  # none lost
    for p in handed:
        g = final[p.group_id]
        for before, after in zip(p.samples, g.samples, strict=True):
            n = len(before.completion_ids)  # the finisher kept every token and logprob generated here
            np.testing.assert_array_equal(after.completion_ids[:n], before.completion_ids)
            np.testing.assert_array_equal(after.logprobs[:n], before.logprobs)
