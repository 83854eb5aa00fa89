"""What the e2e tests of `fleetrl demo` share: the shipped configs on free ports (with the examples'
inputs built as the README says), a bounded demo run, and the clean-up of whatever a demo run left
alive (by the PIDs it recorded)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import yaml
from slowdown import scaled

from fleetrl.devstack import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 4
DEMO_TIMEOUT_S = 240
"""`run_demo`'s default bound, on the reference machine: `run_demo` scales it (and every other bound it
is given) by the machine's slowdown (tests/slowdown.py). Like every `*_TIMEOUT_S` of the e2e tests, it is
the reference figure, since pytest's timeout marks built from them are scaled by tests/conftest.py."""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def demo_config(tmp_path: pathlib.Path) -> tuple[dict[str, Any], pathlib.Path]:
    """`examples/fleet.demo.yaml` with its brokers on free ports (and unchanged otherwise), written to
    `tmp_path/fleet.yaml`; the caller may change the returned document and write it again."""
    doc = yaml.safe_load((ROOT / "examples" / "fleet.demo.yaml").read_text())
    for region in doc["regions"]:
        region["kafka"] = f"127.0.0.1:{free_port()}"
    doc["mqtt"]["url"] = f"mqtt://127.0.0.1:{free_port()}"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return doc, path


def example_config(tmp_path: pathlib.Path, example: str, *rows: str) -> tuple[dict[str, Any], pathlib.Path]:
    """`examples/fleet.<example>.yaml` on free ports, reading the inputs that `python -m
    fleetrl.demo.hf_inputs <dir> [--rows ...]` builds (as the README says) into `tmp_path/<example>`; the
    caller may change the returned document and write it again to the returned path."""
    inputs = tmp_path / example
    subprocess.run([sys.executable, "-m", "fleetrl.demo.hf_inputs", str(inputs), *rows], check=True,
                   env=_env(), capture_output=True, timeout=scaled(120))
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"fleet.{example}.yaml").read_text())
    doc["model"]["path"] = str(inputs / "model")
    doc["dataset"]["path"] = str(inputs / "prompts.jsonl")
    doc["mqtt"]["url"] = f"mqtt://127.0.0.1:{free_port()}"
    for region in doc["regions"]:
        region["kafka"] = f"127.0.0.1:{free_port()}"
    path = tmp_path / f"fleet.{example}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return doc, path


def ctrl_c_reaches_it() -> None:
    """`preexec_fn` of a demo the test stops with SIGINT: a suite started in the background (`make test
    &`, nohup) hands its children SIGINT ignored, as POSIX shells do for background jobs, and the demo
    would then never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("FLEETRL_HUB_KEY", None)
    return env


def kill_leftovers(work: pathlib.Path) -> None:
    """SIGKILL every process the demo in `work` recorded (pids.json) that is still alive."""
    pids_file = work / "pids.json"
    if pids_file.exists():
        for pid in json.loads(pids_file.read_text()).values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


STALL = ["--stall-timeout", f"{scaled(300):g}"]
"""`fleetrl demo`'s hang detector (no optimizer step for 300 s), scaled: every demo a test runs passes it."""

UNBOUNDED_STEPS = 1_000_000
"""`--steps` of a run bounded by `--duration` (or by its work, `--fuzz-records`) instead: more than any
such run reaches."""


def run_demo(config: pathlib.Path, work: pathlib.Path, *chaos: str, steps: int | None = STEPS,
             timeout_s: float = DEMO_TIMEOUT_S, duration_s: float | None = None) -> dict[str, Any]:
    """Run the demo to its end (bounded); returns summary.json after asserting exit 0.

    With `duration_s` the run lasts that long (`--duration`: faults all along, then the trainer is
    stopped and drains) instead of `steps` steps, however fast the fleet trains: a test whose faults
    must land while the fleet trains cannot be outrun by a faster pipeline. With `steps=None` the run
    ends when its chaos options say it has done its work (`--fuzz-records`). Either way its step count
    is then `summary["steps"]`.

    `timeout_s` is a hang bound written for the reference machine: it is scaled here by the machine's
    slowdown, and so are the bounds of the clean-up after it. `duration_s` is not (it is the run's
    length, the test's own choice)."""
    env = _env()
    timeout_s = scaled(timeout_s)
    out_dir = work.parent / "out"
    bound = ["--steps", str(steps if steps is not None and duration_s is None else UNBOUNDED_STEPS)]
    if duration_s is not None:
        bound += ["--duration", str(duration_s)]
    proc = subprocess.Popen([sys.executable, "-m", "fleetrl.cli", "demo", "--config", str(config), *STALL, "--workdir",
                             str(work), "--out", str(out_dir), *bound, *chaos],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, preexec_fn=ctrl_c_reaches_it)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the demo's own bounded cleanup
        try:
            out, _ = proc.communicate(timeout=scaled(60))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the demo and whatever it left
            out, _ = proc.communicate(timeout=scaled(10))
        raise AssertionError(f"demo ran over {timeout_s:.0f} s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-6000:]
    summary: dict[str, Any] = json.loads((out_dir / "summary.json").read_text())
    assert (out_dir / "reward.png").stat().st_size > 10_000
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    done = steps if steps is not None and duration_s is None else summary["steps"]
    assert [r["step"] for r in rows] == list(range(1, done + 1))
    assert_tracked(config, out_dir / "tracking", done)
    summary["_output"], summary["_rows"] = out, rows
    return summary


def assert_tracked(config: pathlib.Path, folder: pathlib.Path, steps: int) -> list[dict[str, Any]]:
    """The trainer's own metrics.jsonl, and TensorBoard's event files where the config asks for them, hold
    every step exactly once, whatever was killed and restarted (trainer/tracking/session.py)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    scalars = [r for r in rows if "table" not in r]
    assert [r["step"] for r in scalars if any(k.startswith("train/") for k in r)] == list(range(1, steps + 1))
    # an evaluation's figures: at the step that published its version, once per set (never redone twice)
    evals = [(k, r["step"]) for r in scalars for k in r if k.startswith("eval/") and k.endswith("/pass@1")]
    assert len(evals) == len(set(evals)), evals
    assert all(any(k.startswith(("train/", "eval/")) for k in r) for r in scalars), scalars
    if "tensorboard" in (yaml.safe_load(config.read_text()).get("tracking") or {}).get("report_to", []):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (run,) = (folder / "tensorboard").iterdir()  # one run, continued by every restarted trainer
        acc = EventAccumulator(str(run))
        acc.Reload()
        for tag in ("train/reward_mean", "train/loss", "train/entropy", "train/tokens_per_s"):
            assert [e.step for e in acc.Scalars(tag)] == list(range(1, steps + 1)), tag
        for tag in {k for k, _ in evals}:
            assert sorted(e.step for e in acc.Scalars(tag)) == sorted(s for k, s in evals if k == tag), tag
    return rows


def assert_accounted(summary: dict[str, Any], steps: int | None = STEPS) -> None:
    """The books balance over the run's steps (`steps`; None: however many a `--duration` run made)."""
    steps = summary["steps"] if steps is None else steps
    a = summary["audit"]
    assert a["ok"] and a["lost"] == 0 and a["trained_twice"] == 0, summary["fleetrl_audit"]
    assert summary["steps"] == steps and len(summary["rewards"]) == steps
    assert a["trained"] == steps * 8  # groups_per_step of the demo config, each trained once
    assert summary["still_running"] == []


def assert_evals_balanced(summary: dict[str, Any]) -> None:
    """The shipped config's held-out evaluations (`eval:` in examples/fleet.demo.yaml) all finished, their
    books balance (every eval prompt dispatched returned once, none lost), and `summary.json` has a row of
    figures per evaluated version."""
    books = summary["audit"]["eval"]
    assert books["scheduled"] >= 1 and books["complete"] == books["scheduled"] and books["unfinished"] == [], books
    assert books["lost"] == [] and books["in_flight"] == 0 and books["dispatched"] == books["returned"] > 0, books
    rows = summary["eval"]
    assert len({(r["set"], r["version"]) for r in rows}) >= books["complete"], rows
    for r in rows:
        assert r["set"] == "reverse-held-out" and r["prompts"] == 16 and r["samples"] == 16 * r["k"] == 64, r
        assert 0.0 <= r["pass@1"] <= r["pass@4"] <= 1.0 and 0.0 <= r["reward_mean"] <= 1.0, r
        assert 1 <= r["length_mean"] <= 6 and sum(r["regions"].values()) == 16, r


def assert_learned(summary: dict[str, Any], steps: int, label: str) -> None:
    """The audit is ok and the mean reward of the last 10 steps is above that of the first 10."""
    assert summary["audit"]["ok"] and summary["audit"]["problems"] == [], summary["audit"]
    rewards = summary["rewards"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"{label}: {len(rewards)} steps, reward first 10 {first:.3f} -> last 10 {last:.3f}")
    assert len(rewards) == steps and last > first, rewards


def kills_of(summary: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [f for f in summary["faults"]
            if f["kind"] == "kill" and (f["target"] == kind or f["target"].startswith(f"{kind}-"))]
