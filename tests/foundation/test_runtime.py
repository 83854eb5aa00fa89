"""run_daemon: a daemon whose main returned leaves within its grace, whatever it left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from slowdown import scaled

STUCK = textwrap.dedent("""
    import asyncio, threading, sys
    from fleetrl.log import configure
    from fleetrl.runtime import run_daemon

    configure(json=True)
    release = threading.Event()

    async def deaf() -> None:  # swallows every cancel, as a library acknowledgement wait can
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    async def main() -> str:
        asyncio.get_running_loop().create_task(deaf(), name="deaf")
        asyncio.get_running_loop().run_in_executor(None, release.wait)  # a thread stuck in a call
        await asyncio.sleep(0.1)
        if sys.argv[1] == "fail":
            raise RuntimeError("the broker is gone")
        return "done"

    print(run_daemon(main(), "test", grace_s=0.5), flush=True)
""")

CLEAN = textwrap.dedent("""
    import asyncio
    from fleetrl.runtime import run_daemon

    async def main() -> int:
        await asyncio.to_thread(sum, [1, 2])
        asyncio.get_running_loop().create_task(asyncio.sleep(3600))  # cancelled, and goes
        return 7

    print(run_daemon(main(), "test", grace_s=5), flush=True)
""")


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=scaled(60),
                          check=False)


@pytest.mark.parametrize(("mode", "status"), [("ok", 0), ("fail", 1)])
def test_a_daemon_with_a_deaf_task_and_a_stuck_thread_still_leaves(mode: str, status: int) -> None:
    out = _run(STUCK, mode)  # asyncio.run would wait for both forever (the 60 s timeout, scaled, would fail it)
    assert out.returncode == status, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("{")]
    events = {e["event"]: e for e in map(json.loads, lines)}
    assert any(t.startswith("deaf: ") and "deaf" in t.split(": ", 1)[1]
               for t in events["daemon.tasks_ignored_cancel"]["tasks"])
    assert events["daemon.threads_left"]["threads"]
    if mode == "ok":
        assert out.stdout == ""  # it left from inside run_daemon: nothing after it ran
    else:
        assert "fleetrl test: fatal: RuntimeError: the broker is gone" in out.stderr


def test_a_daemon_that_leaves_nothing_stuck_returns_its_result_and_logs_nothing() -> None:
    out = _run(CLEAN)
    assert out.returncode == 0 and out.stdout.strip() == "7"
    assert "daemon." not in out.stderr


DAEMON_ARGV = [["-m", "fleetrl.rollout", "--config", "/nonexistent.yaml", "--region", "r", "--node", "n"],
               ["-m", "fleetrl.cli", "replicator", "--config", "/nonexistent.yaml", "--region", "r"]]


@pytest.mark.parametrize("argv", DAEMON_ARGV)
def test_a_daemon_s_process_makes_no_progress_bar(argv: list[str]) -> None:
    """A daemon's bars are disabled before tqdm is imported: in a daemon's JSON log a bar is noise, and a bar
    finalized at exit takes tqdm's multiprocessing lock (a worker hung in it for good after its agent was
    killed). The daemon is started with a config it cannot read (it exits at once); what it set up before is
    read back by running its entry point in a child with `sys.argv` and a hook that reports tqdm's default."""
    probe = textwrap.dedent(f"""
        import atexit, os, runpy, sys
        def report():
            import tqdm
            print("disable:", tqdm.tqdm(range(1)).disable, os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"), flush=True)
        atexit.register(report)
        sys.argv = {[a for a in argv[1:]]!r}
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=scaled(60),
                         check=False, env=env)
    assert "disable: True 1" in out.stdout, (out.stdout, out.stderr[-2000:])
