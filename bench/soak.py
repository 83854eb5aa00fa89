"""Soak: the chaos demo for a given time, every kind of fault at once, then the books are checked.

Runs `fleetrl demo` (the real processes: tansu per region on durable S3 storage (moto), MQTT, the
trainer, replicators, agents and their workers) on the shipped demo config (on free ports) with

    --durable --kill-every K --preempt-every 10 --partition local-b:20:20 --fuzz-rate F

for `--minutes` (the trainer is stopped with SIGTERM at the end: it drains and checkpoints), then
reads the demo's summary.json. Not a speed benchmark: it proves that under faults nothing is lost,
nothing is trained twice, every hostile record is dead-lettered and learning goes on. The baseline is
the run's own start: reward_end is compared with reward_start of the same run. The last line:

    result: faults=N lost=0 trained_twice=0 fuzzed=... dead_lettered=... groups=... reward_start=...
            reward_end=... ledger_bytes=... stores_ok=1

(`ledger_bytes`: the newest checkpoint's state.msgpack, which holds the collector's ledger.)

    .venv/bin/python bench/soak.py [--quick] [--minutes M] [--kill-every K] [--fuzz-rate F] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
from typing import Any

import yaml

from fleetrl.devstack import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
# After --duration: the trainer drains and checkpoints, replicas catch up, the audit reads every topic
# (bounded by the demo at 15 minutes), the servers stop.
_AFTER_RUN_S = 1200.0


def _config(tmp: pathlib.Path) -> pathlib.Path:
    doc = yaml.safe_load((ROOT / "examples" / "fleet.demo.yaml").read_text())
    for region in doc["regions"]:
        region["kafka"] = f"127.0.0.1:{free_port()}"
    doc["mqtt"]["url"] = f"mqtt://127.0.0.1:{free_port()}"
    doc["algorithm"]["max_steps"] = 1_000_000  # --duration ends the run
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run(minutes: float, fuzz_rate: float, out: pathlib.Path, seed: int, kill_every_s: float = 15.0) -> dict[str, Any]:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fleetrl-soak-"))
    config = _config(tmp)
    argv = [sys.executable, "-m", "fleetrl.cli", "demo", "--config", str(config), "--workdir", str(tmp / "work"),
            "--out", str(out), "--duration", str(minutes * 60), "--durable", "--kill-every", f"{kill_every_s:g}",
            "--preempt-every", "10", "--partition", "local-b:20:20", "--fuzz-rate", str(fuzz_rate),
            "--seed", str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    print(f"soak: {minutes:g} min of {' '.join(argv[3:])}", flush=True)
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=minutes * 60 + _AFTER_RUN_S)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        raise SystemExit("soak: the demo overran its time; see the logs in " + str(tmp / "work" / "logs")) from None
    if not (out / "summary.json").exists():
        raise SystemExit(f"soak: the demo failed (exit {rc}) before writing its summary; see the logs in "
                         f"{tmp / 'work' / 'logs'}")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["_rc"] = rc
    return summary


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT the demo's session (its own bounded clean-up), then SIGKILL whatever is left of it."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _ledger_bytes(summary: dict[str, Any]) -> int:
    ckpt = summary["fleetrl_audit"].get("checkpoint")
    state = pathlib.Path(ckpt) / "state.msgpack" if ckpt else None
    return state.stat().st_size if state is not None and state.exists() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="two minutes")
    parser.add_argument("--fuzz-rate", type=float, default=0.2)
    parser.add_argument("--kill-every", type=float, default=15.0, help="seconds between SIGKILLs (default 15)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="where summary.json, metrics.jsonl and reward.png go")
    args = parser.parse_args()
    minutes = 2.0 if args.quick else args.minutes
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="fleetrl-soak-out-")).resolve()
    s = run(minutes, args.fuzz_rate, out, args.seed, args.kill_every)
    a = s["audit"]
    faults = [f for f in s["faults"] if f["kind"] in ("kill", "preempt", "partition")]
    kinds: dict[str, int] = {}
    for f in faults:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    print(f"soak: demo exit {s['_rc']}; {s['steps']} steps in {s['wall_s']:.0f} s; faults {kinds}; "
          f"audit {'ok' if a['ok'] else 'FAILED ' + '; '.join(a['problems'])}; artefacts in {out}")
    print(f"result: faults={len(faults)} lost={a['lost']} trained_twice={a['trained_twice']} "
          f"fuzzed={s['fuzz'].get('sent', 0)} dead_lettered={s['dead_letters'].get('total', 0)} "
          f"groups={a['trained']} reward_start={s['reward']['start']} reward_end={s['reward']['end']} "
          f"ledger_bytes={_ledger_bytes(s)} stores_ok={int(bool(s.get('stores_ok')))}")
    return 0 if s["_rc"] == 0 and a["ok"] and s.get("stores_ok") else 1


if __name__ == "__main__":
    sys.exit(main())
