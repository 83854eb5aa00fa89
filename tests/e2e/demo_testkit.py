"""What the e2e tests of `fleetrl demo` share: the shipped demo config on free ports, and the
clean-up of whatever a demo run left alive (by the PIDs it recorded)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
from typing import Any

import yaml

from fleetrl.devstack import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def demo_config(tmp_path: pathlib.Path) -> tuple[dict[str, Any], pathlib.Path]:
    """`examples/fleet.demo.yaml` with its brokers on free ports (and unchanged otherwise), written to
    `tmp_path/fleet.yaml`; the caller may change the returned document and write it again."""
    doc = yaml.safe_load((ROOT / "examples" / "fleet.demo.yaml").read_text())
    for region in doc["regions"]:
        region["kafka"] = f"127.0.0.1:{free_port()}"
    doc["mqtt"]["url"] = f"mqtt://127.0.0.1:{free_port()}"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return doc, path


def kill_leftovers(work: pathlib.Path) -> None:
    """SIGKILL every process the demo in `work` recorded (pids.json) that is still alive."""
    pids_file = work / "pids.json"
    if pids_file.exists():
        for pid in json.loads(pids_file.read_text()).values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
