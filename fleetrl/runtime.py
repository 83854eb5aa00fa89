"""Running a daemon's asyncio main so that leaving it is bounded.

`asyncio.run` ends by cancelling the tasks still alive and waiting for them, then waiting for the
default executor's threads, both without a bound: one task that ignores its cancel (a library
swallowing it in an acknowledgement wait, see `fleetrl.broker.mqtt`) or one `to_thread` call stuck
in a system call keeps a daemon that has already said `agent.stopped` alive forever. Under systemd
such a process is neither working nor restarted: the node sits idle. The soak run saw it once in 119
preempted agents.

`run_daemon(main, name)` runs `main` like `asyncio.run`, then gives leftover tasks `grace_s` to
finish their cancel and the executor's threads as long again, logs whatever is still there
(`daemon.tasks_ignored_cancel` with each task's await chain, `daemon.threads_left` with the thread
names) so that the cause can be fixed, and then leaves the process with `os._exit` (status 0 after a
clean return, 1 after an error, printed first) rather than wait for them; only then does nothing
after `run_daemon` run, so a daemon's main must have finished its work (logs, files) before it returns.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from fleetrl.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")
GRACE_S = 10.0


DAEMONS = ("agent", "trainer", "replicator")
"""The `fleetrl` sub-commands that run as daemons (the rollout worker is `python -m fleetrl.rollout`)."""


def no_progress_bars() -> None:
    """No tqdm progress bar in this process: call it before anything imports tqdm (which reads `TQDM_*` at
    import). A daemon's output is JSON log lines, where a bar is noise; and a bar left open is finalized at
    the interpreter's exit, where tqdm's `__del__` takes its multiprocessing lock: a rollout worker whose
    agent was killed handed over, returned from `run_daemon`, and then hung in that acquire for good (seen
    twice in one demo run, 480 MB each). A disabled bar never takes the lock when it closes. Values the
    environment already sets are kept."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def run_daemon(main: Coroutine[Any, Any, T], name: str, grace_s: float = GRACE_S) -> T:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        result = loop.run_until_complete(main)
    except BaseException as exc:
        _leave(loop, name, grace_s, status=1, error=exc)
        raise
    _leave(loop, name, grace_s, status=0)
    return result


def _leave(loop: asyncio.AbstractEventLoop, name: str, grace_s: float, status: int,
           error: BaseException | None = None) -> None:
    """Close the loop within `grace_s` (twice: tasks, then threads); `os._exit(status)` if anything is stuck."""
    stuck = False
    try:
        pending = loop.run_until_complete(cancel_all([t for t in asyncio.all_tasks(loop) if not t.done()], grace_s))
        if pending:
            stuck = True
            log.error("daemon.tasks_ignored_cancel", daemon=name, grace_s=grace_s,
                      tasks=[describe_task(t) for t in pending])
        if not stuck:
            loop.run_until_complete(_bounded(loop.shutdown_asyncgens(), grace_s))
    finally:
        asyncio.set_event_loop(None)
        loop.close()  # shuts the default executor down without waiting for its threads
    deadline = time.monotonic() + grace_s
    for thread in _blocking_threads():
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    threads = _blocking_threads()
    if threads:
        stuck = True
        log.error("daemon.threads_left", daemon=name, grace_s=grace_s, threads=[t.name for t in threads])
    if stuck:
        if error is not None:  # the caller would have printed it: say it before leaving
            print(f"fleetrl {name}: fatal: {type(error).__name__}: {error}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


async def cancel_all(tasks: list[asyncio.Task[Any]], timeout_s: float) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait up to `timeout_s` for them to end; returns those still running (tasks
    that ignore their cancel: name them with `describe_task` and leave them behind)."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return set()
    _, stuck = await asyncio.wait(tasks, timeout=timeout_s)
    return stuck


async def _bounded(coro: Coroutine[Any, Any, None], timeout_s: float) -> None:
    try:
        await asyncio.wait_for(coro, timeout_s)
    except TimeoutError:
        log.warning("daemon.asyncgens_not_closed", timeout_s=timeout_s)


def _blocking_threads() -> list[threading.Thread]:
    """Threads the interpreter would wait for at exit (non-daemon, alive, not this one)."""
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and t.is_alive() and not t.daemon]


def describe_task(task: asyncio.Task[Any]) -> str:
    """A task's name and where it waits: each coroutine of its await chain as file:line function."""
    chain: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None and len(chain) < 32:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            chain.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return f"{task.get_name()}: {' <- '.join(chain) or '?'}"
