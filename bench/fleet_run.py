"""One fleet run of the real system, as the pipeline benches start it: the pieces `bench/pipeline.py`
and `bench/cost_fleet.py` both build on.

`Fleet` describes a fleet (regions' throttles, completion lengths, steps, preemptions); `fleet_config`
turns it into a fleet.yaml; `Run` starts its processes (one tansu broker per region, MQTT, the trainer,
one region agent per node, each with its notice file), watches and preempts them, stops them by their
ids, and reads the run's figures from the daemons' JSON logs into a `RunResult` (the measured window:
from the end of the warm-up steps to the end of the last). This module prints nothing and parses no
command line; the benches that import it do (docs/pipeline.md, docs/cost.md).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import yaml

from fleetrl import devstack
from fleetrl.demo.view import LogTail
from fleetrl.trainer.round_trips import PHASES

FLEETRL = [sys.executable, "-m", "fleetrl.cli"]


@dataclass(frozen=True)
class Fleet:
    """One fleet description; both modes run on it."""

    slowdowns: tuple[float, ...] = (0.0, 0.03)
    """Per region: seconds added to each decoding step (region 0 is the fast one)."""
    nodes: int = 1
    """Nodes per region."""
    tail_p: float = 0.15
    short_tokens: int = 4
    max_new_tokens: int = 48
    groups_per_step: int = 4
    n_samples: int = 4
    max_staleness: int = 2
    steps: int = 12
    preempt_every_s: float = 20.0
    """Seconds between preemption notices to a random node that is up (0: none)."""
    link_delay_s: float = 0.05
    """One-way delay between home and every region (seconds)."""
    length_aware: bool = True
    """`rollout.length_aware`: the engine admits long-predicted samples first, the trainer places by
    predicted work."""
    prompts: int = 12
    """Distinct prompts, cycled (epochs), so each comes back and its history predicts its length."""
    workload: str = "reverse"
    """`reverse`: one completion per sample. `tools`: episodes of `bench/tool_env.py` (3 model turns, tool
    calls of 0.05 s, 10 % of them 1 s: EMULATED latencies)."""
    weight_transfer_s: float = 0.0
    """Added to every worker's pull of each new version (`engine.emulate.weight_transfer_s`: its WAN copy)."""
    learner_token_s: float = 0.0
    """Added to every learner step per trained token (`trainer.emulate.token_delay_s`: 0 trains at the
    tiny model's own CPU speed)."""
    window_s: float = 0.0
    """Train on until the measured window (from the end of the warm-up steps) has lasted this long and
    holds at least `steps - warm_steps` steps, then stop the trainer (0: exactly `steps` steps). The full
    run sets it to five preemption intervals, so both modes meet several preemptions."""

    @property
    def warm_steps(self) -> int:
        """Steps before the measured window: async fills its pipeline (1 + max_staleness steps of
        work) by then, so the window starts and ends with a full pipeline and counts no head start."""
        return self.max_staleness + 2


@dataclass
class RunResult:
    mode: str
    wall_s: float
    steps: int
    groups: int
    rewards: list[float]
    lag_mean: float
    lag_max: float
    trainer_busy_s: float
    tokens_sampled: int
    tokens_trained: int
    busy_s: dict[str, float] = field(default_factory=dict)
    uptime_s: dict[str, float] = field(default_factory=dict)
    preemptions: int = 0
    """Preemption notices inside the measured window."""
    preemptions_total: int = 0
    """Preemption notices over the whole run (warm-up included)."""
    tokens_handed_over: int = 0
    handover_timeouts: int = 0
    tokens_moved: int = 0
    """Tokens of partials the trainer moved from a gone region to another (kept, not regenerated)."""
    warm_steps: int = 0
    """Steps before the measured window."""
    groups_restarted: int = 0
    """Groups dispatched again from scratch (a gone region's, or partials too stale to move): their
    sampled tokens are regenerated."""
    admission_cap: int = 0
    """Groups admitted and not yet trained, at most: `(1 + max_staleness) x groups_per_step`."""
    round_trip: dict[str, float] = field(default_factory=dict)
    """A group's round trip by phase (`to_worker`, `wait`, `generate`, `back`: trainer/round_trips.py),
    seconds: the mean over the window's steps of each step's mean."""

    @property
    def step_s(self) -> float:
        """Mean wall time of a step in the window."""
        return self.wall_s / max(1, self.steps - self.warm_steps)

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_sampled / self.wall_s

    def engine_idle(self, region: str | None = None) -> float:
        regions = [region] if region else list(self.uptime_s)
        up = sum(self.uptime_s[r] for r in regions)
        return 1.0 - sum(self.busy_s[r] for r in regions) / up if up else 1.0

    @property
    def trainer_idle(self) -> float:
        return 1.0 - self.trainer_busy_s / self.wall_s

    def reward(self, steps: int | None = None) -> float:
        """Mean reward of the 3 steps ending at step `steps` (default: the last)."""
        end = len(self.rewards) if steps is None else steps
        return statistics.fmean(self.rewards[max(0, end - 3):end])



def fleet_config(fleet: Fleet, mode: str, seed: int, root: pathlib.Path, ports: dict[str, int]) -> dict[str, Any]:
    store = str(root / "store")
    algo: dict[str, Any] = {"mode": mode, "groups_per_step": fleet.groups_per_step, "n_samples": fleet.n_samples,
                            "lr": 1e-2, "max_new_tokens": fleet.max_new_tokens,
                            "max_steps": fleet.steps if not fleet.window_s else 100_000}
    if mode == "async":
        algo["max_staleness"] = fleet.max_staleness
    dataset: dict[str, Any] = {"task": "reverse", "seed": seed}
    if fleet.workload == "reverse":
        dataset.update(path=str(prompt_file(fleet, seed, root)), columns={"reference": "reference"}, epochs=1000)
    if fleet.workload == "tools":
        dataset["env"] = {"name": "tool_env:LatencyEnv", "python_path": [str(pathlib.Path(__file__).parent)],
                          "max_turns": 3, "max_episode_tokens": 3 * fleet.max_new_tokens + 32,
                          "config": {"max_turns": 3, "latency_s": 0.05, "tail_latency_s": 1.0, "tail_p": 0.1}}
    return {
        "run": f"pipe-{mode}-{seed}",
        "model": {"tiny": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "seed": seed}},
        "algorithm": algo,
        "dataset": dataset,
        "hub": {"home_store": store, "threads": 1, "poll_interval_s": 0.1, "anchor_interval": 32},
        "mqtt": {"url": f"mqtt://127.0.0.1:{ports['mqtt']}", "heartbeat_interval_s": 1},
        "kafka": {"partitions": {"prompts": 2, "partials": 2, "trajectories": 2, "dead_letter": 1}},
        "trainer": {"checkpoint_dir": str(root / "ckpt"), "checkpoint_every": 1000, "throughput_window_s": 10,
                    **({"emulate": {"token_delay_s": fleet.learner_token_s}} if fleet.learner_token_s else {})},
        "rollout": {"handover_timeout_s": 10, "max_groups_in_flight": 8, "stats_interval_s": 2,
                    "weight_fallback_poll_s": 5, "length_aware": fleet.length_aware},
        "agent": {"progress_interval_s": 1, "restart_backoff_s": 0.5},
        "regions": [
            {"name": f"r{i}", "kafka": f"127.0.0.1:{ports[f'r{i}']}", "store": store,
             "emulate_link_delay_s": fleet.link_delay_s,
             "nodes": [{"name": f"n{j}"} for j in range(fleet.nodes)],
             "engine": {"kind": "torch", "max_batch": 32,
                        "emulate": {"step_delay_s": delay, "tail_p": fleet.tail_p, "tail_by_prompt": True,
                                    "short_tokens": fleet.short_tokens,
                                    "weight_transfer_s": fleet.weight_transfer_s}}}
            for i, delay in enumerate(fleet.slowdowns)
        ],
    }


def prompt_file(fleet: Fleet, seed: int, root: pathlib.Path) -> pathlib.Path:
    """`fleet.prompts` reverse-task prompts as a JSONL dataset, read in order `epochs` times: prompts come
    back as in RL epochs (whether a prompt's samples are long is a property of the prompt, EMULATED)."""
    from fleetrl.rollout import get_task

    path = root / "prompts.jsonl"
    task = get_task("reverse").prompts(seed)
    rows = [next(task) for _ in range(fleet.prompts)]
    path.write_text("".join(json.dumps({"prompt": r.prompt, "reference": r.reference}) + "\n" for r in rows))
    return path


def events(path: pathlib.Path) -> list[dict[str, Any]]:
    """JSON log events of a daemon's log (a worker's are relayed in its agent's log)."""
    return list(LogTail(path).events())


class Run:
    """The processes of one run: brokers, trainer, agents (replaced after preemption)."""

    def __init__(self, fleet: Fleet, mode: str, seed: int, root: pathlib.Path) -> None:
        self.fleet, self.mode, self.seed, self.root = fleet, mode, seed, root
        self.rng = random.Random(seed)
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.servers: list[devstack.ServerProcess] = []
        self.agents: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self.generation: dict[tuple[str, str], int] = defaultdict(int)
        self.agent_logs: list[tuple[str, pathlib.Path]] = []
        self.preempted_at: list[float] = []
        """Wall-clock time of each preemption notice."""
        self._steps_done: list[float] = []
        """Wall-clock time of each `step.done` the trainer logged, read as it runs (`window_s`)."""

    def start(self) -> None:
        ports = {"mqtt": devstack.free_port()}
        self.servers.append(devstack.mqtt_broker(ports["mqtt"], self.root))
        for i in range(len(self.fleet.slowdowns)):
            ports[f"r{i}"] = devstack.free_port()
            self.servers.append(devstack.tansu(ports[f"r{i}"]))
        for server in self.servers:  # listed before started: stop() ends one that a signal interrupted
            server.start()
        self.config = fleet_config(self.fleet, self.mode, self.seed, self.root, ports)
        self.config_path = self.root / "fleet.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        subprocess.run([*FLEETRL, "topics", "create", "--config", str(self.config_path)], check=True,
                       capture_output=True, timeout=60)
        self.trainer_log = self.logs / "trainer.log"
        self._trainer_tail = LogTail(self.trainer_log)
        self.trainer = self._spawn(["trainer", "--config", str(self.config_path)], self.trainer_log)
        for region in self.config["regions"]:
            for node in region["nodes"]:
                self._start_agent(region["name"], node["name"])

    def _spawn(self, argv: list[str], log: pathlib.Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen([*FLEETRL, *argv, "--log-json"], stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})

    def _start_agent(self, region: str, node: str) -> None:
        key = (region, node)
        self.generation[key] += 1
        notice = self.root / f"notice-{region}-{node}-{self.generation[key]}"
        log = self.logs / f"agent-{region}-{node}-{self.generation[key]}.log"
        self.agent_logs.append((region, log))
        stamp = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
        log.write_text(json.dumps({"event": "bench.agent_spawned", "timestamp": stamp}) + "\n")  # start phases
        self.agents[key] = self._spawn(["agent", "--config", str(self.config_path), "--region", region, "--node",
                                        node, "--notice-file", str(notice)], log)

    def preempt_one(self) -> None:
        """A notice to a random live node; its replacement starts once it has gone."""
        live = [k for k, p in self.agents.items() if p.poll() is None and self._worker_up(k)]
        if not live:
            return
        region, node = self.rng.choice(live)
        notice = self.root / f"notice-{region}-{node}-{self.generation[(region, node)]}"
        notice.write_text("bench/pipeline.py: spot preemption\n")
        self.preempted_at.append(time.time())
        proc = self.agents[(region, node)]
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._start_agent(region, node)

    def _worker_up(self, key: tuple[str, str]) -> bool:
        log = self.logs / f"agent-{key[0]}-{key[1]}-{self.generation[key]}.log"
        return log.exists() and '"worker.started"' in log.read_text(errors="replace")

    def warm_steps(self, done: list[float]) -> int:
        """Steps before the measured window (`done`: each step's end, wall clock)."""
        return self.fleet.warm_steps

    def _window_long_enough(self) -> bool:
        self._steps_done += [event_ts(e) for e in self._trainer_tail.events() if e.get("event") == "step.done"]
        done = self._steps_done
        warm = self.warm_steps(done)
        return len(done) >= max(self.fleet.steps, warm + 1) and done[-1] - done[warm - 1] >= self.fleet.window_s

    def wait_trainer(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._stopping = False
        next_preempt = time.monotonic() + self.fleet.preempt_every_s if self.fleet.preempt_every_s else None
        while self.trainer.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.mode} run did not finish within {timeout_s:.0f} s; see {self.trainer_log}")
            for key, proc in list(self.agents.items()):
                if proc.poll() not in (None, 0):
                    raise RuntimeError(f"agent {key} died with {proc.returncode}; see {self.logs}")
            if next_preempt is not None and time.monotonic() >= next_preempt:
                self.preempt_one()
                next_preempt = time.monotonic() + self.fleet.preempt_every_s
            if self.fleet.window_s and self._window_long_enough() and not self._stopping:
                self._stopping = True  # the trainer drains (publish, checkpoint) and exits 0
                self.trainer.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        if self.trainer.returncode != 0:
            raise RuntimeError(f"trainer exited {self.trainer.returncode}; see {self.trainer_log}")

    def stop(self) -> None:
        """Stop every process this run started, by its id: agents (TERM: they hand over), trainer,
        then the servers, whatever failed before."""
        procs = [*self.agents.values(), *([self.trainer] if hasattr(self, "trainer") else [])]
        try:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            for server in self.servers:
                server.stop()

    def result(self) -> RunResult:
        """The run's figures over the window from the end of its warm-up steps to the end of its last."""
        trainer = events(self.trainer_log)
        steps = [e for e in trainer if e["event"] == "step.done"]
        warm = self.warm_steps([event_ts(e) for e in steps])
        if len(steps) <= warm:
            raise RuntimeError(f"{self.mode} run trained {len(steps)} step(s), not more than the {warm} "
                               f"warm-up steps; see {self.trainer_log}")
        t0, t1 = event_ts(steps[warm - 1]), event_ts(steps[-1])
        window = steps[warm:]
        busy: dict[str, float] = defaultdict(float)
        uptime: dict[str, float] = defaultdict(float)
        sampled = handed = timeouts = 0
        for region, log in self.agent_logs:
            evs = events(log)
            samples = [e for e in evs if e.get("event") in ("worker.stats", "worker.stopped")
                       and "engine_busy_s" in e and t0 <= event_ts(e) <= t1 + 1.0]
            if len(samples) >= 2:  # cumulative counters: their growth inside the window
                busy[region] += float(samples[-1]["engine_busy_s"]) - float(samples[0]["engine_busy_s"])
                uptime[region] += float(samples[-1]["uptime_s"]) - float(samples[0]["uptime_s"])
                sampled += int(samples[-1]["tokens_sampled"]) - int(samples[0]["tokens_sampled"])
            handed += sum(int(e.get("tokens", 0)) for e in evs
                          if e.get("event") == "worker.handed_over" and e.get("reason") == "preempted")
            timeouts += sum(1 for e in evs if e.get("event") == "worker.handover_timeout")
        return RunResult(
            mode=self.mode, wall_s=t1 - t0, steps=len(steps), groups=sum(int(e["groups"]) for e in window),
            rewards=[float(e["reward_mean"]) for e in steps],
            lag_mean=statistics.fmean(float(e["lag_mean"]) for e in steps),
            lag_max=max(float(e["lag_max"]) for e in steps),
            trainer_busy_s=sum(float(e["seconds"]) for e in window),
            tokens_sampled=sampled, tokens_trained=sum(int(e["tokens"]) for e in window),
            busy_s=dict(busy), uptime_s=dict(uptime), preemptions=sum(t0 <= t <= t1 for t in self.preempted_at),
            preemptions_total=len(self.preempted_at),
            tokens_handed_over=handed, handover_timeouts=timeouts,
            tokens_moved=sum(int(e.get("tokens", 0)) for e in trainer if e["event"] == "handover.partial_moved"),
            groups_restarted=sum(1 for e in trainer if e["event"] in ("dispatch.redispatched", "handover.too_stale")),
            warm_steps=warm,
            admission_cap=(1 + (self.fleet.max_staleness if self.mode == "async" else 0)) * self.fleet.groups_per_step,
            round_trip={ph: statistics.fmean(float(e[f"rt_{ph}"]) for e in window if f"rt_{ph}" in e)
                        for ph in PHASES if any(f"rt_{ph}" in e for e in window)},
        )


def event_ts(event: dict[str, Any]) -> float:
    """A JSON log event's wall-clock time (its ISO `timestamp`), in seconds since the epoch."""
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
