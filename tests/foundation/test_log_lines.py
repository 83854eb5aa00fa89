"""Daemon logs are JSON lines: every event is exactly one whole line, even with threads logging at once.

The replicator daemon logs from its MQTT thread and its main thread; a log shipper (and the tests that
read a daemon's stderr) split the stream on newlines, so two events on one line lose both.
"""

from __future__ import annotations

import json
import subprocess
import sys

THREADS, EVENTS = 8, 1500

_SCRIPT = f"""
import threading
from fleetrl.log import configure, get_logger
configure(json=True)
log = get_logger("test.lines")
start = threading.Barrier({THREADS})
def run(t):
    start.wait()
    for i in range({EVENTS}):
        log.info("line.written", thread=t, n=i, pad="x" * (i % 97))
threads = [threading.Thread(target=run, args=(t,)) for t in range({THREADS})]
for th in threads: th.start()
for th in threads: th.join()
"""


def test_events_logged_from_many_threads_at_once_are_one_json_object_per_line() -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    lines = proc.stderr.splitlines()
    events = [json.loads(line) for line in lines]  # a line holding two events fails here ("Extra data")
    assert len(events) == THREADS * EVENTS
    seen = {(e["thread"], e["n"]) for e in events}
    assert len(seen) == THREADS * EVENTS, "every event once"
