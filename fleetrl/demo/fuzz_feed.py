"""The demo's side of the fuzzing producer: how many hostile records it is told to send, and when.

The fuzzer (`fleetrl.demo.fuzz`) is a child process that sends as many hostile records as each line
on its stdin asks and logs `fuzz.sent` / `fuzz.done`. `FuzzFeed` holds the other end of that pipe:
`order` keeps it at `--fuzz-rate` of the valid records (or orders `--fuzz-records` in all),
`all_read` says whether every one of a `--fuzz-records` run's records is in a dead-letter topic
(what ends such a run, `fleetrl.demo.ending`), and `drain` closes the orders at the end and waits,
bounded, until the consumers have dead-lettered what it sent: the summary's `fuzz` figures. The
runner calls `order` from its watch loop; `stopped` ends the orders once the run is ending.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fleetrl.demo.books import DeadLetterTally
from fleetrl.demo.chaos import FaultPlan
from fleetrl.demo.procs import Child, ChildFailed
from fleetrl.demo.view import LogTail, Progress

_FUZZ_DRAIN_S = 30.0  # after the fuzzer's last batch, how long its records may take to be dead-lettered
_TALLY_EVERY_S = 2.0  # --fuzz-records: how often the dead-letter topics are read while the last ones are read


class FuzzFeed:
    """The orders to one running fuzzer (`fuzzer`, started with a stdin pipe) and what came of them."""

    def __init__(self, plan: FaultPlan, fuzzer: Child, dead_letters: DeadLetterTally, steps: int) -> None:
        self.plan, self.fuzzer, self.dead_letters, self.steps = plan, fuzzer, dead_letters, steps
        self.ordered = 0
        self.sent = 0
        """Records the fuzzer says it has sent (its last `fuzz.sent`)."""
        self.stopped = False
        """No more orders: the run is ending (`fleetrl.demo.ending`)."""
        self._log = LogTail(fuzzer.log_path)
        self._next_tally = 0.0

    def order(self, progress: Progress) -> None:
        """Keep the fuzzer at `fuzz_rate` of the records in prompts and trajectories (two valid records,
        a prompt and its group, per finished group).

        With --fuzz-records N it orders N in all (at once without a rate), and the run lasts until they
        are all dead-lettered (`all_read`). Without, it stops a third of the way through the run,
        so that the consumers still read (and dead-letter) all it sent: a worker reads prompts only into
        a free slot, and near the end its slots hold groups waiting for a version the trainer will not
        publish; the trainer reads a hostile trajectory only on its way to a group it still needs, and
        with half the run left a big last batch could still sit behind the last one it needed."""
        if self.fuzzer.proc is None or self.fuzzer.proc.stdin is None or self.stopped:
            return
        records, rate = self.plan.fuzz_records, self.plan.fuzz_rate
        if not records and progress.step >= max(1, self.steps // 3):
            return
        valid = 2 * sum(r.groups_done for r in progress.regions.values())
        paced = int(valid * rate / (1.0 - rate)) if rate else records
        due = (min(paced, records) if records else paced) - self.ordered
        if due > 0:
            try:
                self.fuzzer.proc.stdin.write(f"{due}\n".encode())
                self.fuzzer.proc.stdin.flush()
            except BrokenPipeError:
                raise ChildFailed.of(self.fuzzer) from None
            self.ordered += due

    def all_read(self, now: float) -> bool:
        """--fuzz-records: the fuzzer sent them all and each is in a dead-letter topic (the topics are
        read every `_TALLY_EVERY_S`, and only once all are sent)."""
        for event in self._log.events():
            if event.get("event") == "fuzz.sent":
                self.sent = int(event["total"])
        if self.sent < self.plan.fuzz_records or now < self._next_tally:
            return False
        self._next_tally = now + _TALLY_EVERY_S
        return bool(asyncio.run(self.dead_letters.update())["fuzz"] >= self.plan.fuzz_records)

    def drain(self, check_alive: Callable[[], None]) -> dict[str, Any]:
        """Close the fuzzer's orders (it exits after its last batch) and wait, bounded, until the
        consumers have dead-lettered what it sent (`check_alive` raises if another child died)."""
        if self.fuzzer.proc is None:
            return {}
        if self.fuzzer.proc.stdin is not None:
            self.fuzzer.proc.stdin.close()
        rc = self.fuzzer.wait_or_kill(time.monotonic() + 60)
        done = [e for e in LogTail(self.fuzzer.log_path).events() if e.get("event") == "fuzz.done"]
        if rc != 0 or not done:
            raise ChildFailed.of(self.fuzzer)
        sent = int(done[-1]["total"])
        deadline = time.monotonic() + _FUZZ_DRAIN_S
        while time.monotonic() < deadline:
            check_alive()
            if asyncio.run(self.dead_letters.update())["fuzz"] >= sent:
                break
            time.sleep(1.0)
        return {"sent": sent, "kinds": done[-1]["kinds"], "rate": self.plan.fuzz_rate}
