"""`fleetrl agent` refuses a bad identity with one line and exit 2; the preemption watchers fire."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal

import pytest
import yaml
from slowdown import scaled

from fleetrl.cli import main
from fleetrl.regions import NoticeFileWatcher, SignalWatcher


@pytest.fixture
def config_file(tmp_path: pathlib.Path) -> pathlib.Path:
    doc = {"run": "t-agent", "regions": [{"name": "west", "kafka": "127.0.0.1:9", "store": str(tmp_path / "w"),
                                          "nodes": [{"name": "node-1"}]}]}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(("region", "node", "named"), [("east", "node-1", "'east'"), ("west", "Node_1", "'Node_1'")])
def test_bad_identity_exits_2_with_one_line(config_file: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                            region: str, node: str, named: str) -> None:
    rc = main(["agent", "--config", str(config_file), "--region", region, "--node", node])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and named in err and err.startswith("fleetrl agent:")


async def test_notice_file_watcher_fires_when_the_file_appears(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "notice"
    watcher = NoticeFileWatcher(path, poll_s=0.02)
    waiting = asyncio.create_task(watcher.wait())
    await asyncio.sleep(0.1)
    assert not waiting.done()
    path.write_text("spot instance-action terminate 2026-11-22T10:00:00Z")
    notice = await asyncio.wait_for(waiting, scaled(5))
    assert notice.reason == "preempted" and "terminate" in notice.detail and str(path) in notice.detail


async def test_signal_watcher_turns_sigterm_into_a_notice() -> None:
    watcher = SignalWatcher(signals=(signal.SIGUSR1,))
    waiting = asyncio.create_task(watcher.wait())
    await asyncio.sleep(0)  # installed before the signal comes
    os.kill(os.getpid(), signal.SIGUSR1)
    notice = await asyncio.wait_for(waiting, scaled(5))
    watcher.close()
    assert notice.reason == "sigterm" and notice.detail == "SIGUSR1"
