"""Preemption watchers: how a region agent learns that its node must go (DESIGN.md §1, §8).

A watcher is anything with `async wait() -> Notice` that returns once the node has to leave, and
`close()`. The agent races every watcher it holds; the first notice makes it hand over its unfinished
groups (`fleetrl.partial/1`), publish `offline` and exit 0. Two implementations live here:

* `SignalWatcher`: SIGTERM / SIGINT, what systemd, Kubernetes and an operator send (reason `sigterm`);
* `NoticeFileWatcher`: a file that appears at a configured path (reason `preempted`). A sidecar, a
  cron job or a cloud metadata poller writes it on a spot interruption notice.

The cloud metadata pollers (AWS instance-action, GCP preempted, Azure Scheduled Events) implement the
same protocol in `fleetrl.regions.cloud_notices`.
"""

from __future__ import annotations

import asyncio
import pathlib
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

_NOTICE_BYTES = 200  # how much of a notice file is quoted in logs


@dataclass(frozen=True, slots=True)
class Notice:
    """Why the node must go: `reason` becomes the worker's handover reason; `window_s` is the seconds
    the node has left when the notice says so (None: the agent's own handover bound applies)."""

    reason: Literal["sigterm", "preempted"]
    detail: str
    window_s: float | None = None


class PreemptionWatcher(Protocol):
    """Returns from `wait()` when this node must leave; `close()` releases what it holds."""

    async def wait(self) -> Notice: ...

    def close(self) -> None: ...


class SignalWatcher:
    """SIGTERM and SIGINT (by default) on the running loop: an orderly stop."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = tuple(signals)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._got: asyncio.Future[signal.Signals] | None = None

    def install(self) -> None:
        """Take the signals now (idempotent): a signal during start-up must not kill the process."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._got = self._loop.create_future()
        for sig in self.signals:
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._got is not None and not self._got.done():
            self._got.set_result(sig)

    async def wait(self) -> Notice:
        self.install()
        assert self._got is not None
        sig = await self._got
        return Notice("sigterm", sig.name)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for sig in self.signals:
                self._loop.remove_signal_handler(sig)
        self._loop = None


class NoticeFileWatcher:
    """A preemption notice: the file at `path` exists (polled every `poll_s`); `window_s` is the time
    the node is told it has once the file appears (None: the agent's own handover bound)."""

    def __init__(self, path: str | pathlib.Path, poll_s: float = 1.0, window_s: float | None = None) -> None:
        self.path = pathlib.Path(path)
        self.poll_s = poll_s
        self.window_s = window_s

    async def wait(self) -> Notice:
        while not self.path.exists():
            await asyncio.sleep(self.poll_s)
        try:
            text = self.path.read_text(errors="replace")[:_NOTICE_BYTES].strip()
        except OSError as exc:  # it appeared: that alone is the notice
            text = f"unreadable: {exc.strerror}"
        return Notice("preempted", f"notice file {self.path}" + (f": {text}" if text else ""), self.window_s)

    def close(self) -> None:
        pass
