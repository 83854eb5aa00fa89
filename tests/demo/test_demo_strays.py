"""`fleetrl demo` leaves nothing behind: after stopping what it started, it kills every other process whose
command line names its work directory (`fleetrl.demo.procs.kill_strays`): a worker whose agent was killed
is nobody's child any more, and one that hangs at exit would outlive the demo."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import psutil
from slowdown import scaled

from fleetrl.demo.procs import kill_strays


def _sleeper(arg: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(300)", arg],
                            start_new_session=True)


def test_only_processes_naming_the_work_directory_are_killed(tmp_path: pathlib.Path) -> None:
    work, other = tmp_path / "work", tmp_path / "work2"
    stray, by_name, neighbour = _sleeper(str(work / "fleet.yaml")), _sleeper(f"--workdir={work}"), \
        _sleeper(str(other / "fleet.yaml"))
    try:
        for p in (stray, by_name, neighbour):  # each has started (its command line is readable)
            psutil.Process(p.pid).cmdline()
        killed = kill_strays(work)
        assert stray.wait(timeout=scaled(10)) == -9 and by_name.wait(timeout=scaled(10)) == -9
        assert any(f"({stray.pid})" in k for k in killed) and len(killed) == 2, killed
        assert neighbour.poll() is None  # a demo in `work2` is not this one's
    finally:
        for p in (stray, by_name, neighbour):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=scaled(10))
