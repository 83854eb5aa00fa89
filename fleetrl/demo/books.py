"""The demo's books: `fleetrl audit` run as an operator runs it, and the tally of dead letters.

`DeadLetterTally` reads every region's dead-letter topic on from where its last count stopped, so
that waiting for a fuzzer's records to be dead-lettered (a count a second) and the final count read
each record once, not the whole topic each time (a flood holds 160,000 of them).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections import Counter
from typing import Any

from fleetrl.broker import DeadLetter, read_log_from, topic_name
from fleetrl.config import FleetConfig
from fleetrl.demo.fuzz import KEY_PREFIX
from fleetrl.demo.procs import DemoError

# The audit's reads fail on their own when a broker stops answering; this only bounds a hung process. A long
# durable run's logs come back from object storage one batch at a time, which takes minutes.
_AUDIT_TIMEOUT_S = 900.0


def run_audit(config_path: pathlib.Path, workdir: pathlib.Path, env: dict[str, str]) -> dict[str, Any]:
    """`fleetrl audit --json` as a process (its log in `workdir/logs/audit.log`); its report."""
    report: dict[str, Any] = _json_of("audit", ["audit", "--json"], config_path, workdir, env)
    return report


def verify_stores(config_path: pathlib.Path, workdir: pathlib.Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """`fleetrl hub verify --all --store all` as a process: per store, whether its versions are gapless,
    `latest` names the newest and every version verifies (its log in `workdir/logs/verify.log`)."""
    reports: list[dict[str, Any]] = _json_of("verify", ["hub", "verify", "--all", "--store", "all"], config_path,
                                             workdir, env)
    return reports


def _json_of(name: str, args: list[str], config_path: pathlib.Path, workdir: pathlib.Path,
             env: dict[str, str]) -> Any:
    """Run `fleetrl ARGS` (bounded; its log in `workdir/logs/NAME.log`) and parse the JSON it prints."""
    argv = [sys.executable, "-m", "fleetrl.cli", *args, "--config", str(config_path), "--log-json"]
    log_path = workdir / "logs" / f"{name}.log"
    what = f"fleetrl {' '.join(args[:2])}"
    with open(log_path, "wb") as log:
        try:
            out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=log, timeout=_AUDIT_TIMEOUT_S, env=env,
                                 check=False)
        except subprocess.TimeoutExpired:
            raise DemoError(f"{what} took over {_AUDIT_TIMEOUT_S:.0f} s; see {log_path}") from None
    try:
        return json.loads(out.stdout)
    except ValueError:
        raise DemoError(f"{what} exited {out.returncode} without a report; see {log_path}") from None


class DeadLetterTally:
    """Every region's dead-letter topic: how many, why, and how many came from the fuzzer."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self._next: dict[str, dict[int, int]] = {}
        """Region -> partition -> the offset the next count reads from."""
        self._reasons: Counter[str] = Counter()
        self._fuzz_keys: set[bytes] = set()
        self._fuzz_records = 0

    async def update(self) -> dict[str, Any]:
        """Read what arrived since the last call (fails if a broker stops answering); the counts so far."""
        topic = topic_name(self.config.run, "dead-letter")
        for r in self.config.regions:
            positions = self._next.setdefault(r.name, {})
            raws, _ = await read_log_from(self.config, r.name, topic, positions,
                                          client_id=f"{self.config.run}-demo-dlq")
            for raw in raws:
                positions[raw.partition] = raw.offset + 1
                dl = DeadLetter.from_record(raw.partition, raw.offset, raw.key, raw.value, raw.headers)
                self._reasons[dl.reason] += 1
                if (raw.key or b"").startswith(KEY_PREFIX.encode()) and dl.reason != "unknown":
                    self._fuzz_keys.add(raw.key or b"")
                    self._fuzz_records += 1
        # A hostile record is counted once: a worker killed after dead-lettering it and before committing
        # reads it again and dead-letters it a second time (`fuzz_repeats`).
        return {"total": sum(self._reasons.values()), "fuzz": len(self._fuzz_keys),
                "fuzz_repeats": self._fuzz_records - len(self._fuzz_keys),
                "reasons": dict(sorted(self._reasons.items()))}
