"""Where the suite's time goes, per test file: a pytest plugin and the report it feeds.

    make test-profile                       # the whole suite as `make test` runs it, profiled
    python tests/suite_profile.py table DIR [--load "1.2 0.9 0.7"]
    python tests/suite_profile.py ids BEFORE.txt AFTER.txt

The plugin (`-p suite_profile`, with tests/ on PYTHONPATH) adds up, per test file, the wall time of
its tests (setup, call and teardown), the CPU time of the pytest process (`RUSAGE_SELF`) and of the
child processes it waited for (`RUSAGE_CHILDREN`: brokers, demo runs, CLI processes), and writes one
JSON file per process (`files-<xdist worker>.json`) into `$SUITE_PROFILE_DIR`. Under xdist the wall
times of files on different workers overlap, so the wall column sums to more than the run took; CPU
is CPU either way. A server shared by a worker (tests/conftest.py) is charged to the file whose test
stopped it (the worker's last), since its CPU is counted when it is reaped.

`table` merges the JSON files into a Markdown table, heaviest CPU first. `ids` compares two lists of
collected test ids (`pytest --collect-only -q`, one id a line): their counts, and what is only in one.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import resource
import sys
import time
from collections.abc import Generator
from typing import Any

import pytest

_files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
"""Test file -> [wall s, CPU self s, CPU children s, tests]."""


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    t0, (self0, kids0) = time.monotonic(), _cpu()
    yield
    self1, kids1 = _cpu()
    row = _files[item.nodeid.split("::")[0]]
    row[0] += time.monotonic() - t0
    row[1] += self1 - self0
    row[2] += kids1 - kids0
    row[3] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = pathlib.Path(os.environ.get("SUITE_PROFILE_DIR", ".suite-profile"))
    folder.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if _files:  # the xdist controller runs no test
        rows = {f: {"wall": w, "cpu_self": s, "cpu_children": c, "tests": int(n)} for f, (w, s, c, n) in _files.items()}
        (folder / f"files-{worker}.json").write_text(json.dumps(rows, indent=1))


def merge(folder: pathlib.Path) -> dict[str, dict[str, float]]:
    """The per-file rows of every `files-*.json` in `folder`, added up (a file split across workers)."""
    total: dict[str, dict[str, float]] = {}
    for path in sorted(folder.glob("files*.json")):
        for name, row in json.loads(path.read_text()).items():
            into = total.setdefault(name, {"wall": 0.0, "cpu_self": 0.0, "cpu_children": 0.0, "tests": 0})
            for key in into:
                into[key] += row[key]
    return total


def table(rows: dict[str, dict[str, Any]]) -> str:
    """A Markdown table, heaviest CPU first, with a total row."""
    lines = ["| file | tests | wall s | CPU self s | CPU children s | CPU / wall |", "|---|---:|---:|---:|---:|---:|"]
    order = sorted(rows.items(), key=lambda kv: -(kv[1]["cpu_self"] + kv[1]["cpu_children"]))
    for name, r in [*order, ("**total**", {k: sum(x[k] for x in rows.values()) for k in
                                           ("wall", "cpu_self", "cpu_children", "tests")})]:
        cpu = r["cpu_self"] + r["cpu_children"]
        lines.append(f"| {name} | {int(r['tests'])} | {r['wall']:.0f} | {r['cpu_self']:.0f} | {r['cpu_children']:.0f} "
                     f"| {cpu / r['wall'] if r['wall'] else 0:.2f} |")
    return "\n".join(lines)


def compare_ids(before: pathlib.Path, after: pathlib.Path) -> str:
    """Counts of two collected-id lists and the ids only one of them has."""
    old = {line.strip() for line in before.read_text().splitlines() if "::" in line}
    new = {line.strip() for line in after.read_text().splitlines() if "::" in line}
    out = [f"before: {len(old)} ids ({before})", f"after:  {len(new)} ids ({after})",
           f"in both: {len(old & new)}; only before: {len(old - new)}; only after: {len(new - old)}"]
    out += [f"  only before: {i}" for i in sorted(old - new)]
    out += [f"  only after:  {i}" for i in sorted(new - old)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/suite_profile.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("table", help="the per-file table of a profiled run")
    t.add_argument("folder", type=pathlib.Path)
    t.add_argument("--load", default=None, help="the machine's load (uptime) to print beside it")
    i = sub.add_parser("ids", help="compare two lists of collected test ids")
    i.add_argument("before", type=pathlib.Path)
    i.add_argument("after", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.command == "table":
        rows = merge(args.folder)
        if not rows:
            print(f"no files-*.json in {args.folder}", file=sys.stderr)
            return 1
        print(table(rows))
        if args.load:
            print(f"\nload average (uptime): {args.load}")
    else:
        print(compare_ids(args.before, args.after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
