"""The headline number: asynchronous training against the synchronous baseline on the same fleet.

Runs the real system twice per seed on one fleet description, `algorithm.mode: sync` then `async`:
one tansu broker per region, an MQTT broker, the trainer, and one region agent per node (each
supervising its rollout worker process), all as processes started with the `fleetrl` CLI. Both runs
have the same groups per step. Sync spreads each step's groups over the regions by their measured
capacity (trainer/credits.py), as a synchronous trainer over the same workers would: the baseline
does not starve its own fast region. The fleet is heterogeneous and unreliable, as the papers'
settings are:

* regions with different per-token speeds: `regions[].engine.emulate.step_delay_s` sleeps after
  every decoding step of the real torch engine (a throttle: THIS IS EMULATED, and said so below);
* a long-tailed completion-length distribution: the samples of `engine.emulate.tail_p` of the
  prompts run to `max_new_tokens`, the others stop after 1..`short_tokens` tokens (emulated lengths
  of the real engine, `tail_by_prompt`; the tiny random model has no length distribution of its
  own); `--prompts` distinct prompts are cycled as epochs, so each comes back;
* length-aware scheduling (`rollout.length_aware`, on by default) against off: each run pair is
  repeated with it off, and the sync step's wall time and the async throughput printed side by side;
* preemptions: every `--preempt-every` seconds a random live node gets a notice through its agent's
  `--notice-file` (the agent hands its groups over as partials and exits 0), and a replacement node
  starts, as a spot fleet does (only nodes whose worker is up are preempted);
* a link delay between home and every region: `regions[].emulate_link_delay_s` holds each prompt
  that long in the trainer before it is produced to the region's Kafka, and each trajectory that long
  after the trainer fetched it (a throttle in the trainer's transport: EMULATED, and said so below).
  Weights are not delayed: the regions' stores are the home store (one directory) and the policy
  announcement goes over loopback MQTT.

Throughput is measured from the end of step `max_staleness + 2` to the end of the last: start-up
(brokers, processes, Kafka group joins) counts in neither run, and the async run's window starts
and ends with a full pipeline, so work it generated ahead before the window is no head start. The
full run trains on until that window covers five preemption intervals (`--window-intervals`), so
where one preemption falls no longer decides the ratio; `--quick` trains exactly `--steps` steps.

`--profile production` keeps every process and sets the throttles in the proportions of a 7B policy
on H100s (decode time per token, a long-tailed length law, training time emulated in the learner,
WAN round trip, weight transfer per version), each number with its source (`--help`, and
docs/pipeline.md).

Printed per run: the window's length and the preemptions inside it, groups trained per second,
tokens sampled per second, engine-idle fraction per region (1 - time in engine steps / worker
uptime, over the measured window), trainer-idle fraction (1 - time stepping and publishing /
window), mean and max staleness of the trained groups; at preemptions, the tokens workers handed
over and the trainer moved to another region (kept, not regenerated), the groups restarted from
scratch and the handovers that ran out of time (their tokens are regenerated); tokens sampled and
trained, and the mean reward of the last 3 steps (the reward comparison takes both runs at the
smaller step count: equal samples); a group's round trip in phases (to the worker, waiting there for
its weights, generating, back to the trainer: the trainer's per-step means, trainer/round_trips.py).
The last line:

    result: throughput_ratio=... reward_delta=... engine_idle_async=... engine_idle_sync=...
            engine_idle_sync_r0=... engine_idle_async_r0=... window_s_sync=... preemptions_sync=...
            rt_to_worker_async=... rt_wait_async=... rt_generate_async=... rt_back_async=... ...
            sync_step_s_la_on=... sync_step_s_la_off=... async_groups_s_la_on=... async_groups_s_la_off=...

    .venv/bin/python bench/pipeline.py [--quick] [--seeds N] [--profile defaults|production]
                                       [--grid tail|preempt] [--workload tools]
    .venv/bin/python bench/pipeline.py --cost [--quick] [--seeds N] [--cost-grid] [--discount 0.65]
                                       [--spot-preempt-every 60] [--od-nodes 3] [--base-nodes 1]

`--cost` runs an on-demand fleet against a hybrid one at the same dollars per hour instead
(bench/cost_fleet.py; results: docs/cost.md).

`FLEETRL_BENCH_KEEP=DIR` keeps every run's config and logs under DIR. Results: docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from fleetrl import devstack
from fleetrl.demo.view import LogTail
from fleetrl.hub.signing import generate_ed25519
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


PRODUCTION_SCALE = {"tokens": 256, "time": 128}
"""`--profile production`: one bench token stands for 256 real tokens and one bench second for 128 real
seconds, so every proportion below holds while a run fits in minutes on 2 CPU cores."""

PRODUCTION_SOURCES = """\
production profile: a 7B policy (Qwen2.5-7B, 7.62 B parameters) trained with GRPO in the shape of DAPO's
runs, scaled by 1/256 in tokens and 1/128 in time (a bench token is 256 real tokens, a bench second 128
real seconds); each number, its source, and what it becomes here:
  * decode: 20 ms per decoding step of a 7B engine on one H100 at ~100 concurrent sequences, i.e. ~5,000
    tokens/s, as Red Hat's MLPerf Inference v5.1 result measured (Llama-3.1-8B, vLLM, one H100: 5,103
    tokens/s Server, 5,777 Offline; redhat.com/en/blog/efficient-and-reproducible-llm-inference-red-hat-
    mlperf-inference-v51-results); the slow region an A100, 2x slower (Lambda's vLLM benchmark, "H100 ~2x
    better throughput and lower latency than A100": github.com/LambdaLabsML/vllm-benchmark) -> step delay
    0.040 s (H100 region) and 0.080 s (A100 region) per bench token;
  * tokens per sample: DAPO's budget, 16,384 tokens (+4,096 soft overlong; 512 prompts x 16 samples a
    step: Yu et al. 2025, arXiv:2503.14476); a 10 % tail runs to the budget, the rest stop uniformly within
    4,096 (mean ~3,500: an ASSUMPTION, not a measurement) -> max_new_tokens 64, short_tokens 16, tail 10 %;
  * training: 8N FLOPs per token (6N forward + backward, Kaplan et al. 2020, arXiv:2001.08361, plus 2N to
    recompute the old log-probs) over a DAPO step's 8,192 x ~3,700 tokens on 64 H100s (989 TFLOP/s dense
    bf16, NVIDIA H100 datasheet) at 40 % MFU (ASSUMPTION) = 72 s a step -> 0.0025 s per trained bench token
    (a bench step's ~225 tokens: 0.56 s), slept in the learner after its real step;
  * WAN: 150 ms round trip home <-> region (issue 25's figure; a cross-continent inter-region RTT, e.g.
    cloudping.co's AWS matrix) -> 0.0006 s one way, through the trainer's link-delay throttle;
  * weights: 15.2 GB of bf16 per version dense; ~220 MB as a delta (the README's hub figure, 2.9 MB a
    version for a 100.7 M-parameter Qwen2 at lr 1e-6 by bench/hub_delta.py, scaled by parameters), ~0.2 s
    over a 10 Gbit/s inter-region link (bandwidth an ASSUMPTION) plus the replicator's round trips: ~0.5 s
    -> 0.004 s added to each worker's pull of each version.
  Not scaled (the bench's own floor, far above these proportions): Kafka fetch waits, the trainer's 0.2 s
  poll, the tiny model's CPU decode step (~5 ms) and learner step, and a replacement node's 10-30 s start."""

PROFILES: dict[str, dict[str, Any]] = {
    "defaults": {"slowdowns": (0.0, 0.03), "tail_p": 0.15, "short_tokens": 4, "max_new_tokens": 48,
                 "link_delay_s": 0.05},
    "production": {"slowdowns": (0.040, 0.080), "tail_p": 0.10, "short_tokens": 16, "max_new_tokens": 64,
                   "link_delay_s": 0.0006, "weight_transfer_s": 0.004, "learner_token_s": 0.0025},
}
"""Throttle settings per `--profile` (production: see PRODUCTION_SOURCES)."""


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
        self._steps_done += [_ts(e) for e in self._trainer_tail.events() if e.get("event") == "step.done"]
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
        warm = self.warm_steps([_ts(e) for e in steps])
        if len(steps) <= warm:
            raise RuntimeError(f"{self.mode} run trained {len(steps)} step(s), not more than the {warm} "
                               f"warm-up steps; see {self.trainer_log}")
        t0, t1 = _ts(steps[warm - 1]), _ts(steps[-1])
        window = steps[warm:]
        busy: dict[str, float] = defaultdict(float)
        uptime: dict[str, float] = defaultdict(float)
        sampled = handed = timeouts = 0
        for region, log in self.agent_logs:
            evs = events(log)
            samples = [e for e in evs if e.get("event") in ("worker.stats", "worker.stopped")
                       and "engine_busy_s" in e and t0 <= _ts(e) <= t1 + 1.0]
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


def _ts(event: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def run_once(fleet: Fleet, mode: str, seed: int, timeout_s: float) -> RunResult:
    keep = os.environ.get("FLEETRL_BENCH_KEEP")  # a folder: keep each run's logs there
    with tempfile.TemporaryDirectory(prefix=f"fleetrl-pipe-{mode}-", dir=keep) as tmp:
        root = pathlib.Path(tmp)
        if keep:
            root = pathlib.Path(keep) / f"{mode}-{seed}-{int(time.time())}"
        run = Run(fleet, mode, seed, root)
        try:
            run.start()
            run.wait_trainer(timeout_s)
        finally:
            run.stop()
        return run.result()


def show(r: RunResult) -> None:
    regions = " ".join(f"{reg}={r.engine_idle(reg):.2f}" for reg in sorted(r.uptime_s))
    print(f"  {r.mode:5s}: window {r.wall_s:.1f} s ({r.steps} steps in all), {r.preemptions} preemption(s) inside "
          f"it ({r.preemptions_total} in the run); {r.groups} groups = {r.groups_per_s:.3f} groups/s, "
          f"{r.tokens_per_s:.1f} tokens/s; engine idle {r.engine_idle():.2f} ({regions}); trainer idle "
          f"{r.trainer_idle:.2f}; staleness mean {r.lag_mean:.2f} max {r.lag_max:.0f}; at preemptions: "
          f"tokens handed over {r.tokens_handed_over}, moved to another region {r.tokens_moved} "
          f"(kept), groups restarted from scratch {r.groups_restarted} and handovers timed out "
          f"{r.handover_timeouts} (their tokens regenerated); tokens sampled {r.tokens_sampled}, trained "
          f"{r.tokens_trained}; reward (last 3 of {r.steps} steps) {r.reward():.3f}", flush=True)
    if r.round_trip:
        print(f"  {r.mode:5s}: a group's round trip (mean): "
              + ", ".join(f"{ph} {r.round_trip[ph]:.3f} s" for ph in PHASES if ph in r.round_trip)
              + f" = {sum(r.round_trip.values()):.3f} s; admitted to trained {r.admission_cap / r.groups_per_s:.3f} s "
              f"at most ({r.admission_cap} groups admitted and untrained at {r.groups_per_s:.2f} groups/s, "
              "Little's law)", flush=True)


def compare(fleet: Fleet, seeds: int, timeout_s: float, length_aware_off: bool = True) -> dict[str, float]:
    """sync vs async per seed (length-aware on, the default); with `length_aware_off`, both again with
    `rollout.length_aware: false`, side by side."""
    pairs, off_pairs = [], []
    for seed in range(seeds):
        print(f"seed {seed}:", flush=True)
        sync = run_once(fleet, "sync", seed, timeout_s)
        show(sync)
        asyn = run_once(fleet, "async", seed, timeout_s)
        show(asyn)
        pairs.append((sync, asyn))
        if length_aware_off:
            off = replace(fleet, length_aware=False)
            print("  length-aware scheduling off:", flush=True)
            off_pairs.append((run_once(off, "sync", seed, timeout_s), run_once(off, "async", seed, timeout_s)))
            for r in off_pairs[-1]:
                show(r)
            print(f"  length-aware on | off: sync step {sync.step_s:.2f} s | {off_pairs[-1][0].step_s:.2f} s; "
                  f"async {asyn.groups_per_s:.3f} | {off_pairs[-1][1].groups_per_s:.3f} groups/s", flush=True)
    ratios = [a.groups_per_s / s.groups_per_s for s, a in pairs]
    # Equal samples: with `window_s` the runs train different step counts; compare at the shorter one.
    equal = [min(s.steps, a.steps) for s, a in pairs]
    rewards = [(s.reward(n), a.reward(n)) for (s, a), n in zip(pairs, equal, strict=True)]
    out = {
        "throughput_ratio": statistics.fmean(ratios),
        "throughput_ratio_median": statistics.median(ratios),
        "throughput_ratio_min": min(ratios), "throughput_ratio_max": max(ratios),
        "reward_delta": statistics.fmean(a - s for s, a in rewards),
        "reward_sync_spread": max(s for s, _ in rewards) - min(s for s, _ in rewards),
        "engine_idle_async": statistics.fmean(a.engine_idle() for _, a in pairs),
        "engine_idle_sync": statistics.fmean(s.engine_idle() for s, _ in pairs),
        "trainer_idle_async": statistics.fmean(a.trainer_idle for _, a in pairs),
        "trainer_idle_sync": statistics.fmean(s.trainer_idle for s, _ in pairs),
        "staleness_async": statistics.fmean(a.lag_mean for _, a in pairs),
    }
    for region in sorted({r for s, a in pairs for r in (*s.uptime_s, *a.uptime_s)}):
        for mode, i in (("sync", 0), ("async", 1)):
            runs = [pair[i] for pair in pairs if region in pair[i].uptime_s]
            if runs:
                out[f"engine_idle_{mode}_{region}"] = statistics.fmean(r.engine_idle(region) for r in runs)
    for mode, i in (("sync", 0), ("async", 1)):
        out[f"window_s_{mode}"] = statistics.fmean(pair[i].wall_s for pair in pairs)
        out[f"preemptions_{mode}"] = statistics.fmean(pair[i].preemptions for pair in pairs)
        for ph in PHASES:
            got = [pair[i].round_trip[ph] for pair in pairs if ph in pair[i].round_trip]
            if got:
                out[f"rt_{ph}_{mode}"] = statistics.fmean(got)
    if off_pairs:
        out.update({
            "sync_step_s_la_on": statistics.fmean(s.step_s for s, _ in pairs),
            "sync_step_s_la_off": statistics.fmean(s.step_s for s, _ in off_pairs),
            "async_groups_s_la_on": statistics.fmean(a.groups_per_s for _, a in pairs),
            "async_groups_s_la_off": statistics.fmean(a.groups_per_s for _, a in off_pairs),
        })
    return out


def grid(axis: str, base: dict[str, Any], fleet: Fleet, timeout_s: float) -> None:
    """Print a markdown table of throughput_ratio: slow-region step delay x (tail share | preemption)."""
    columns: list[float] = [0.0, 0.15, 0.3] if axis == "tail" else [0.0, 30.0, 15.0]
    head = [f"{c:.0%}" for c in columns] if axis == "tail" else [f"every {c:g} s" if c else "none" for c in columns]
    name = "tail share" if axis == "tail" else "preemption"
    print(f"| slow-region step delay \\ {name} | " + " | ".join(head) + " |")
    print("|---|---|---|---|", flush=True)
    for slow in (0.0, 0.03, 0.08):
        cells = []
        for c in columns:
            over = {"tail_p": c} if axis == "tail" else {"preempt_every_s": c}
            cell = Fleet(**{**base, "slowdowns": (fleet.slowdowns[0], slow), "tail_p": fleet.tail_p, **over})
            cells.append(f"{compare(cell, 1, timeout_s, length_aware_off=False)['throughput_ratio']:.2f}")
        print(f"| {slow:g} s | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short fleet run (under two minutes on 2 cores)")
    parser.add_argument("--seeds", type=int, default=1, help="repeat with this many seeds and report the spread")
    parser.add_argument("--grid", choices=["tail", "preempt"], default=None,
                        help="a table first: the ratio as the slow region's step delay grows against the tail "
                             "share or against the preemption rate (3 x 3 cells, one seed each)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="defaults",
                        help="the throttles: `defaults` (the figures of docs/pipeline.md so far) or `production`, "
                             "proportioned as a 7B policy on H100s; its sources: "
                             + PRODUCTION_SOURCES.replace("%", "%%"))
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default: 20, --quick 10); the full run goes on until its window "
                             "also covers --window-intervals preemption intervals")
    parser.add_argument("--window-intervals", type=float, default=None,
                        help="measure each run over at least this many preemption intervals (default 5; "
                             "--quick 0: exactly --steps steps)")
    parser.add_argument("--slowdown", type=float, default=None,
                        help="step delay of the slow region (s; default: the profile's, 0.03 at the defaults)")
    parser.add_argument("--tail-p", type=float, default=None,
                        help="share of samples that run to max_new_tokens (default: the profile's, 0.15)")
    parser.add_argument("--preempt-every", type=float, default=None,
                        help="seconds between preemptions (0: none; default 20, --quick 15)")
    parser.add_argument("--link-delay", type=float, default=None,
                        help="one-way home-region link delay (s; default: the profile's, 0.05)")
    parser.add_argument("--no-length-aware-off", action="store_true",
                        help="skip the runs with length-aware scheduling off (half the time; --quick skips "
                             "them unless --length-aware-off)")
    parser.add_argument("--length-aware-off", action="store_true",
                        help="also with --quick: repeat each pair with length-aware scheduling off")
    parser.add_argument("--workload", choices=["reverse", "tools"], default="reverse",
                        help="tools: multi-turn episodes whose tool calls have a long latency tail (EMULATED)")
    cost = parser.add_argument_group("cost", "--cost: an on-demand fleet against a hybrid (on-demand base + spot) "
                                             "at the same dollars per hour (bench/cost_fleet.py, docs/cost.md)")
    cost.add_argument("--cost", action="store_true", help="run the cost comparison instead of sync vs async")
    cost.add_argument("--cost-grid", action="store_true",
                      help="with --cost, instead of the seeds: a table of cost_efficiency over spot discount x "
                           "spot node life (3 x 3 cells, one seed each; the on-demand run once)")
    cost.add_argument("--discount", type=float, default=0.65, help="spot's discount off on-demand (default 0.65)")
    cost.add_argument("--spot-preempt-every", type=float, default=60.0,
                      help="seconds a spot node lives before its preemption notice (0: never; default 60)")
    cost.add_argument("--od-nodes", type=int, default=3, help="nodes of the on-demand fleet (default 3)")
    cost.add_argument("--base-nodes", type=int, default=1,
                      help="on-demand nodes of the hybrid; the rest of the budget buys spot nodes (default 1)")
    cost.add_argument("--price", type=float, default=2.0, help="on-demand dollars per node-hour (default 2.0)")
    cost.add_argument("--session-timeout", type=float, default=2.0,
                      help="rollout.group_session_timeout_s of both fleets (default 2; tansu holds every join for "
                           "half of it, and the spot region's group changes members every few seconds)")
    cost.add_argument("--rebalance-lead", type=float, default=0.0,
                      help="start a spot node's replacement this many seconds before its notice (EC2 capacity "
                           "rebalancing on a rebalance recommendation; default 0: at the notice)")
    args = parser.parse_args()
    # A hang-up or TERM ends the bench through its `finally`s, so every process it started is stopped.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    os.environ.setdefault("FLEETRL_HUB_KEY", generate_ed25519()[0])
    if args.cost:
        import cost_fleet

        cost_fleet.main(args)
        return
    steps = args.steps or (10 if args.quick else 20)
    preempt = args.preempt_every if args.preempt_every is not None else (15.0 if args.quick else 20.0)
    intervals = args.window_intervals if args.window_intervals is not None else (0.0 if args.quick else 5.0)
    profile = dict(PROFILES[args.profile])
    if args.slowdown is not None:
        profile["slowdowns"] = (profile["slowdowns"][0], args.slowdown)
    for key, value in (("tail_p", args.tail_p), ("link_delay_s", args.link_delay)):
        if value is not None:
            profile[key] = value
    base: dict[str, Any] = {**profile, "steps": steps, "preempt_every_s": preempt, "workload": args.workload,
                            "window_s": intervals * preempt}
    fleet = Fleet(**base)
    if args.profile == "production":
        print(PRODUCTION_SOURCES, flush=True)
    print(f"fleet ({args.profile}): {len(fleet.slowdowns)} regions x {fleet.nodes} node(s); per-step delay per region "
          f"{list(fleet.slowdowns)} s (EMULATED: a sleep after each decoding step of the real torch engine); "
          f"completion lengths EMULATED: the samples of {fleet.tail_p:.0%} of the prompts run to max_new_tokens="
          f"{fleet.max_new_tokens}, the rest stop after 1-{fleet.short_tokens} tokens; {fleet.prompts} prompts cycled; "
          f"preemption every {fleet.preempt_every_s:g} s with replacement; "
          f"link delay home<->region {fleet.link_delay_s:g} s each way (EMULATED in the trainer's Kafka clients); "
          f"weight transfer {fleet.weight_transfer_s:g} s per version and worker, learner {fleet.learner_token_s:g} s "
          f"per trained token (EMULATED; 0: none); {fleet.groups_per_step} groups x {fleet.n_samples} samples per "
          f"step, {fleet.steps} steps per run"
          + (f" and on until the measured window lasts {fleet.window_s:g} s ({intervals:g} preemption intervals)"
             if fleet.window_s else "")
          + f"; sync spreads each step by region capacity; async max_staleness {fleet.max_staleness}; "
          f"workload {fleet.workload}"
          + (" (episodes of 3 model turns; tool calls 0.05 s, 10% 1 s: EMULATED)" if fleet.workload == "tools" else ""),
          flush=True)
    timeout_s = 300.0 if args.quick else 600.0 + 2 * fleet.window_s  # bounds: start-up on a busy machine
    if args.grid:
        grid(args.grid, base, fleet, timeout_s)
    off = args.length_aware_off or not (args.quick or args.no_length_aware_off)  # --quick: two runs, not four
    out = compare(fleet, args.seeds, timeout_s, length_aware_off=off)
    print("result: " + " ".join(f"{k}={v:.3f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
