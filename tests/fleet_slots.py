"""The suite's fleet slots: a test that starts whole fleets holds one slot per fleet while it runs.

N lock files in one folder shared by every pytest-xdist worker (`FLEETRL_TEST_FLEET_SLOTS_DIR`, made by
the controlling process), N = `slowdown.fleet_slots()`. A slot is an `flock` on one file: released when
the holder closes it or its process dies. tests/conftest.py takes them around each fleet test.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO

SLOTS_ENV = "FLEETRL_TEST_FLEET_SLOTS_DIR"


def _try_lock(f: IO[str]) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def hold(wanted: int, total: int, bound_s: float, warn: Callable[[str], None],
         folder: pathlib.Path | None = None, poll_s: float = 0.2) -> Iterator[int]:
    """Hold `wanted` of the `total` slots (at most all of them) while the block runs; yields how many.

    One slot: any free one. Several: slot 0, then 1, ... in that order, each held while waiting for the
    next, so that two holders wanting several can never each hold a part the other waits for (a holder
    wanting a single slot never waits while it holds one). After `bound_s` without them the block runs
    anyway, with `warn` told how many were missing: a bound only a hung holder reaches."""
    folder = folder or pathlib.Path(os.environ.get(SLOTS_ENV) or tempfile.gettempdir())
    wanted = max(1, min(wanted, total))
    files = [open(folder / f"slot-{i}", "a+") for i in range(total)]  # noqa: SIM115
    try:
        deadline = time.monotonic() + bound_s
        held = 0
        while held < wanted and time.monotonic() < deadline:
            if wanted == 1:
                held = int(any(_try_lock(f) for f in files))
            elif _try_lock(files[held]):
                held += 1
                continue
            if held < wanted:
                time.sleep(poll_s)
        if held < wanted:
            warn(f"{wanted - held} of {wanted} fleet slot(s) not free after {bound_s:.0f} s: running without them")
        yield held
    finally:
        for f in files:
            f.close()  # closing releases the lock
