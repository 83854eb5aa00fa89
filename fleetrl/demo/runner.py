"""`fleetrl demo`: the whole pipeline on this machine, with nothing to set up (DESIGN.md §8).

    fleetrl demo --config examples/fleet.demo.yaml [--steps N] [--workdir DIR]

It starts, each as its own process with its log under `<workdir>/logs/`:

    tansu (one per region, on the port of regions[].kafka)    the regions' Kafka clusters
    an MQTT broker (mosquitto if installed, else amqtt)        the control plane, on mqtt.url's port
    fleetrl trainer                                            dispatch, learn, publish versions
    fleetrl replicator --region R   (one per region)           copy versions into the region stores
    fleetrl agent --region R --node N   (one per regions[].nodes entry)

after creating the run's topics on every cluster. The work directory (default `.fleetrl/demo` next
to the config) is wiped at the start: every run starts from fresh stores and checkpoints, and the
config the children read (`<workdir>/fleet.yaml`) points every store and the checkpoints there.
Progress is read from the children's JSON log events (`fleetrl.demo.view`). Faults come from
`fleetrl.demo.chaos`, hostile records from the fuzzer fed by `fleetrl.demo.fuzz_feed`, and a run
bounded by its work rather than `--steps` ends through `fleetrl.demo.ending`. When the trainer has
done its steps and exited, the demo lets the replicas catch up, stops the agents and replicators,
runs `fleetrl audit`, stops the brokers and prints a summary (also written to
`<workdir>/summary.json`). Any child that dies makes the demo print its log tail, stop everything
else and exit 1; Ctrl-C and SIGTERM stop everything too. Every stop is by PID and bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.live import Live

from fleetrl import devstack
from fleetrl.cli_args import ArgumentRefused
from fleetrl.config import FleetConfig, SecretField, StoreConfig
from fleetrl.demo.books import DeadLetterTally, run_audit, verify_stores
from fleetrl.demo.chaos import Chaos, FaultLog, FaultPlan
from fleetrl.demo.ending import RunEnd
from fleetrl.demo.fuzz_feed import FuzzFeed
from fleetrl.demo.procs import (
    Child,
    ChildFailed,
    DemoError,
    Ports,
    check_free,
    child_env,
    default_workdir,
    effective_config,
    fleetrl_child,
    fresh_workdir,
    kill_strays,
    loopback_ports,
    signing_keys,
    stop_all,
    with_tracking,
    write_config,
)
from fleetrl.demo.relay import Relay, RelayHub
from fleetrl.demo.supervision import START_LIMIT, OnFailure
from fleetrl.demo.view import LogTail, Progress, RegionView, live_display

_POLL_S = 0.5
_STALL_S = 300.0  # default of --stall-timeout: no optimizer step for this long, something is wrong: stop
_CATCH_UP_S = 10.0  # after the last step, how long replicas may take to reach the final version
_SERVER_READY_S = 20.0
_S3_KEYS = {"AWS_ACCESS_KEY_ID": "fleetrl", "AWS_SECRET_ACCESS_KEY": "fleetrl", "AWS_DEFAULT_REGION": "us-east-1"}


class _Terminated(BaseException):
    """SIGTERM to the demo: unwinds like Ctrl-C, so that everything it started is stopped."""


def run_demo(args: argparse.Namespace, config: FleetConfig) -> int:
    # Off a terminal (a pipe, a CI log) rich would wrap at 80 columns: keep each step on one line.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    demo = Demo(args, config, console)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return demo.run()
    except DemoError as exc:
        print(f"fleetrl demo: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated):
        print("fleetrl demo: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


class Demo:
    def __init__(self, args: argparse.Namespace, config: FleetConfig, console: Console) -> None:
        self.args, self.config, self.console = args, config, console
        self.source = str(args.config)
        self.steps = args.steps or config.algorithm.max_steps
        self.servers: list[Child] = []
        self.children: list[Child] = []
        self.trainer: Child | None = None
        self.exit_codes: dict[str, int | None] = {}
        self.tails: list[tuple[LogTail, tuple[str, str] | None]] = []
        self.plan = FaultPlan.from_args(args)
        self.relays = RelayHub()
        self.agents: dict[str, tuple[str, str]] = {}
        """Agent child name -> (region, node)."""
        self.fuzzer: Child | None = None
        self.feed: FuzzFeed | None = None
        self.moto_port: int | None = None
        self.on_failure = OnFailure()
        """Restart=on-failure of the trainer, agents and replicators (fleetrl/demo/supervision.py)."""

    def run(self) -> int:
        t0 = time.monotonic()
        ports = loopback_ports(self.config, self.source)
        for i, region in enumerate(self.config.regions):
            if not region.nodes:
                raise DemoError(f"{self.source}: regions[{i}] ({region.name}) lists no nodes; the demo starts "
                                f"one agent per regions[].nodes entry")
        names = {r.name for r in self.config.regions}
        for p in self.plan.partitions:
            if p.region not in names:
                raise ArgumentRefused("--partition", f"{p.region!r} not in {self.source} "
                                                     f"(regions: {', '.join(sorted(names))})")
        check_free(ports, self.source)
        config_path = pathlib.Path(self.args.config)
        default = default_workdir(config_path)
        self.workdir = fresh_workdir(pathlib.Path(self.args.workdir) if self.args.workdir else default, default)
        self.out = pathlib.Path(getattr(self.args, "out", None) or self.workdir).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.config = with_tracking(effective_config(self.config, self.workdir), self.args, self.out)
        self.dead_letters = DeadLetterTally(self.config)
        trainer_keys = signing_keys(self.config)
        self.progress = Progress(self.steps, {r.name: RegionView() for r in self.config.regions})
        self.faults = FaultLog(t0, self.workdir / "faults.jsonl")
        self.progress.faults = self.faults.faults
        with self._everything_stopped_at_exit():
            s3 = _S3_KEYS if self._needs_s3() else {}
            self.env = child_env(s3)
            crashes = self.workdir / "crashes"
            self.trainer_env = child_env({**trainer_keys, **s3, **self.plan.crash_env("trainer", crashes)})
            self.replicator_env = child_env({**s3, **self.plan.crash_env("replicator", crashes)})
            self.agent_env = child_env({**s3, **self.plan.crash_env("worker", crashes)})  # its workers inherit it
            self._start(ports, self.env)
            assert self.trainer is not None
            self.chaos = Chaos(self.plan, self, self.faults, self.progress.on_fault)
            self.end = RunEnd(self.plan, getattr(self.args, "duration", None), self.faults.started, self.chaos,
                              self.trainer, self.feed)
            self._watch_until_trainer_done()
            if not self.chaos.stopped:
                self.chaos.stop()
            fuzz = self.feed.drain(self._check_alive) if self.feed is not None else {}
            self._catch_up()
            self.exit_codes = {self.trainer.name: self.trainer.returncode(), **self._stop_children()}
            self.console.print("auditing: reading every region's prompts, trajectories and dead letters ...")
            audit = run_audit(self.config_path, self.workdir, self.env)
            self.console.print("verifying every version in every store ...")
            stores = verify_stores(self.config_path, self.workdir, self.env)
            dead = asyncio.run(self.dead_letters.update())
            self._stop_servers()
            wall_s = time.monotonic() - t0
            summary = self._summary(audit, wall_s, dead, fuzz, stores)
        self._report(summary)
        return 0 if audit.get("ok") and summary["stores_ok"] else 1

    def _needs_s3(self) -> bool:
        return self.plan.durable or bool(self.plan.partitions)

    # -- start ----------------------------------------------------------------------------------

    def _start(self, ports: Ports, env: dict[str, str]) -> None:
        logs = self.workdir / "logs"
        self.console.print(f"fleetrl demo: {self.steps} steps; workdir {self.workdir} (logs in {logs})")
        if self._needs_s3():
            self._start_moto()
        partitioned = bool(self.plan.partitions)
        for region, port in ports.kafka.items():
            # Under --partition the region's clients (and the trainer) reach tansu through a relay on
            # the config's port, which tansu advertises; tansu itself listens on a free port behind it.
            listen = devstack.free_port() if partitioned else port
            storage, s3env = "memory://tansu/", {}
            if self.plan.durable:
                storage, s3env = f"s3://tansu-{region}/", devstack.tansu_s3_env(self._moto_url())
            self._start_server(devstack.tansu(listen, storage, s3env, advertised_port=port), f"tansu-{region}")
            if partitioned:
                self.relays.add(Relay(f"{region}/kafka", listen, home_pids=self._home_pids, port=port))
        m = self.config.mqtt
        password = SecretField("mqtt.password", m, "password").value() if m.username else None
        # With mqtt.username set, the broker accepts that user and password only, as a fleet's would.
        mqtt = devstack.mqtt_broker(ports.mqtt, workdir=self.workdir,
                                    users={m.username: password or ""} if m.username else None)
        self._start_server(mqtt, mqtt.name)
        asyncio.run(self._create_topics())
        self.config_path = write_config(self.config, self.workdir / "fleet.yaml")
        self.region_configs = {r.name: self._region_config(r.name, ports.mqtt) for r in self.config.regions}
        c = self.config
        for r in c.regions:
            self._spawn(fleetrl_child(f"replicator-{r.name}", ["replicator", "--region", r.name],
                                      self.region_configs[r.name], self.workdir, self.replicator_env,
                                      c.hub.lease_ttl_s + 5))
        self.trainer = self._spawn(fleetrl_child("trainer", ["trainer", "--steps", str(self.steps)], self.config_path,
                                                 self.workdir, self.trainer_env, c.trainer.drain_timeout_s + 10))
        (self.workdir / "notices").mkdir(exist_ok=True)
        for r in c.regions:
            for n in r.nodes:
                self.start_agent(r.name, n.name)
        if self.plan.fuzzing:
            argv = [sys.executable, "-m", "fleetrl.demo.fuzz", "--config", str(self.config_path),
                    "--seed", str(self.plan.seed)]
            self.fuzzer = self._spawn(Child("fuzzer", argv, logs / "fuzzer.log", env, 15.0, stdin_pipe=True))
            self.feed = FuzzFeed(self.plan, self.fuzzer, self.dead_letters, self.steps)

    def start_agent(self, region: str, node: str) -> Child:
        """One agent (a node) of `region`, with its own notice file (the preemption notice source)."""
        c = self.config
        child = fleetrl_child(f"agent-{region}-{node}", ["agent", "--region", region, "--node", node,
                                                         "--notice-file", str(self.notice_file(region, node))],
                              self.region_configs[region], self.workdir, self.agent_env,
                              1.5 * c.rollout.handover_timeout_s + 10)
        self.agents[child.name] = (region, node)
        return self._spawn(child, agent=(region, node))

    def generating(self, agent: Child) -> bool:
        """Whether the agent's worker has loaded its weights (its `worker.started`) and holds groups it
        is generating (admitted, neither finished nor handed over): a notice now has work to hand over."""
        region, node = self.agents[agent.name]
        view = self.progress.regions[region]
        return node in view.generating and bool(view.holding.get(node))

    def notice_file(self, region: str, node: str) -> pathlib.Path:
        return self.workdir / "notices" / f"{region}-{node}"

    def agent_of(self, child: Child) -> tuple[str, str]:
        return self.agents[child.name]

    def _home_pids(self) -> list[int]:
        return [self.trainer.pid] if self.trainer is not None and self.trainer.returncode() is None else []

    def _start_moto(self) -> None:
        spec = devstack.moto_s3()
        self._start_server(spec, "moto")
        self.moto_port = spec.port
        import boto3

        s3 = boto3.client("s3", endpoint_url=self._moto_url(), aws_access_key_id="fleetrl",
                          aws_secret_access_key="fleetrl", region_name="us-east-1")
        for bucket in ["fleetrl-home", *(f"tansu-{r.name}" for r in self.config.regions)]:
            s3.create_bucket(Bucket=bucket)
        if self.plan.partitions:  # the home store behind a relay per region: its link home can be cut
            self.config.hub.home_store = StoreConfig(url=f"s3://fleetrl-home/{self.config.run}",
                                                     endpoint_url=self._moto_url(), region_name="us-east-1")

    def _moto_url(self, port: int | None = None) -> str:
        return f"http://127.0.0.1:{port or self.moto_port}"

    def _region_config(self, region: str, mqtt_port: int) -> pathlib.Path:
        """The config a region's processes read: under --partition their MQTT and home store go
        through relays of the region (its links home)."""
        if not self.plan.partitions:
            return self.config_path
        c = self.config.model_copy(deep=True)
        mqtt = self.relays.add(Relay(f"{region}/mqtt", mqtt_port))
        c.mqtt.url = f"mqtt://127.0.0.1:{mqtt.port}"
        assert self.moto_port is not None
        store = self.relays.add(Relay(f"{region}/store", self.moto_port))
        c.hub.home_store = c.hub.home_store.model_copy(update={"endpoint_url": self._moto_url(store.port)})
        return write_config(c, self.workdir / f"fleet-{region}.yaml")

    def _start_server(self, spec: devstack.ServerProcess, name: str) -> None:
        """Start a dev-stack server as a `Child` (so it, too, dies with the demo) and wait for its port."""
        server = Child(name, spec.argv, self.workdir / "logs" / f"{name}.log", {**os.environ, **spec.env},
                       stop_timeout_s=5.0)
        self.servers.append(server.start())
        assert server.proc is not None
        try:
            devstack.wait_for_port(spec.port, _SERVER_READY_S, server.proc)
        except devstack.DevStackError as exc:
            raise DemoError(f"{name} did not start: {exc}; last lines of {server.log_path}:\n{server.tail()}") from None
        self._record_pids()
        self.console.print(f"  started {name:<22} pid {server.pid:<8} 127.0.0.1:{spec.port}")

    async def _create_topics(self) -> None:
        from fleetrl.broker import ensure_topics

        for r in self.config.regions:
            await ensure_topics(self.config, r.name)

    def _spawn(self, child: Child, agent: tuple[str, str] | None = None) -> Child:
        self.children.append(child.start())
        self.tails.append((LogTail(child.log_path), agent))
        self._record_pids()
        self.console.print(f"  started {child.name:<22} pid {child.pid:<8} log {child.log_path.name}")
        return child

    def pids(self) -> dict[str, int]:
        return {c.name: c.pid for c in [*self.servers, *self.children]}

    def _record_pids(self) -> None:
        """Kept current from the first start on: whoever cleans up after a crashed demo finds them all."""
        tmp = self.workdir / "pids.json.tmp"  # replaced whole: a reader never sees it half written
        tmp.write_text(json.dumps(self.pids(), indent=2))
        tmp.replace(self.workdir / "pids.json")

    # -- watch ----------------------------------------------------------------------------------

    def restarted(self, child: Child) -> None:
        """Chaos restarted `child` (same command, same log)."""
        self._record_pids()

    def _watch_until_trainer_done(self) -> None:
        assert self.trainer is not None
        last_step, last_change = 0, time.monotonic()
        stall_s = float(getattr(self.args, "stall_timeout", _STALL_S))  # --stall-timeout
        with live_display(self.console, self.progress) as live:
            while True:
                self._read_logs(live)
                if self.progress.step >= self.steps and not self.chaos.stopped:
                    self.chaos.stop()  # the last step is done: let the trainer drain and exit in peace
                self.end.tick()
                self.chaos.tick()
                self._restart_failed()
                if self.feed is not None:
                    self.feed.order(self.progress)
                rc = self.trainer.returncode()
                if rc is not None and not self._down_on_purpose(self.trainer):
                    self._read_logs(live)
                    if rc == 0:
                        return
                    self._supervise(self.trainer)
                self._check_alive()
                if self.progress.step != last_step:
                    last_step, last_change = self.progress.step, time.monotonic()
                elif time.monotonic() - last_change > stall_s:
                    raise DemoError(f"no optimizer step for {stall_s:.0f} s (--stall-timeout; at step {last_step}); "
                                    f"see the logs in {self.workdir / 'logs'}")
                time.sleep(_POLL_S)

    def _read_logs(self, live: Live | None) -> None:
        for tail, agent in self.tails:
            for event in tail.events():
                line = self.progress.feed(event, agent)
                if line is not None and live is None:
                    self.console.print(line)
        for line in self.progress.pop_lines():
            if live is None:
                self.console.print(line)
        if live is not None:
            live.update(self.progress.table())

    def _check_alive(self) -> None:
        for child in self.children:
            if (child is not self.trainer and child.returncode() is not None and not self._down_on_purpose(child)
                    and child is not self.fuzzer):
                if child.returncode() == 0:
                    raise ChildFailed.of(child)  # a daemon that leaves on its own while the run goes on
                self._supervise(child)
        for server in self.servers:
            if server.returncode() is not None and not self.chaos.expected_down(server):
                raise ChildFailed.of(server)

    def _down_on_purpose(self, child: Child) -> bool:
        return self.chaos.expected_down(child) or self.on_failure.waiting(child)

    def _supervise(self, child: Child) -> None:
        """`child` exited non-zero by itself: restart it as its unit's Restart=on-failure would, or raise
        once it has failed too often in a row (supervision.START_LIMIT)."""
        restart = self.on_failure.failed(child)
        if restart is None:
            raise ChildFailed.of(child)
        self.console.print(f"  {child.name} (pid {child.pid}) exited with code {child.returncode()}: restarting it "
                           f"in {restart.delay_s:.0f} s (failure {restart.failure} of {START_LIMIT} in a row), "
                           f"as its unit's Restart=on-failure would; log {child.log_path}")

    def _restart_failed(self) -> None:
        for child in self.on_failure.due():
            child.restart()
            self.restarted(child)
            self.console.print(f"  restarted {child.name:<20} pid {child.pid}")

    def _catch_up(self) -> None:
        """Give the replicators a moment to copy the final version (bounded). A replicator restarted near
        the end (a kill, a crash point) copies nothing until its dead predecessor's lease expires, so
        the bound covers one lease lifetime too."""
        deadline = time.monotonic() + _CATCH_UP_S + self.config.hub.lease_ttl_s
        while len(self.progress.holding_latest()) < len(self.progress.regions) and time.monotonic() < deadline:
            self.chaos.tick()  # stopped: only restarts (a replicator may crash at a point while catching up)
            self._check_alive()
            time.sleep(0.2)
            self._feed_quietly()

    def _feed_quietly(self) -> None:
        for tail, agent in self.tails:
            for event in tail.events():
                self.progress.feed(event, agent)

    # -- stop, audit, summary -------------------------------------------------------------------

    def _stop_children(self) -> dict[str, int | None]:
        codes = stop_all([c for c in self.children if c.returncode() is None])
        self._feed_quietly()
        return codes

    def _stop_servers(self) -> None:
        stop_all([s for s in self.servers if s.returncode() is None])

    @contextmanager
    def _everything_stopped_at_exit(self) -> Iterator[None]:
        """Whatever happens (a failure, Ctrl-C, SIGTERM), stop every process the demo started."""
        try:
            yield
        finally:
            # Cleanup is bounded; a second Ctrl-C must not cut it short and leave processes behind.
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                live = [c for c in self.children if c.returncode() is None]
                if live:
                    self.console.print(f"stopping {len(live)} processes ...")
                    stop_all(live)
                self._stop_servers()
                self.relays.close()
                strays = kill_strays(self.workdir)
                if strays:
                    self.console.print(f"killed {len(strays)} leftover processes: {', '.join(strays)}")
            finally:
                signal.signal(signal.SIGINT, previous)

    def _summary(self, audit: dict[str, Any], wall_s: float, dead: dict[str, Any],
                 fuzz: dict[str, Any], stores: list[dict[str, Any]]) -> dict[str, Any]:
        from fleetrl.demo.summary import export_command, summarize

        return summarize(self.progress, audit, wall_s, self.pids(), self.exit_codes, self.workdir,
                         faults=self.faults.faults, dead_letters=dead, fuzz=fuzz, out=self.out,
                         plan=dataclasses.asdict(self.plan), stores=stores,
                         export=export_command(self.config_path, stores, self.config.hub.home_store.scheme == "s3"))

    def _report(self, summary: dict[str, Any]) -> None:
        """The run's files (summary.json, metrics.jsonl, reward.png), then the table on screen."""
        from fleetrl.demo.summary import render, write_artefacts

        write_artefacts(summary, self.progress, self.faults.faults, self.workdir, self.out)
        self.console.print(render(summary))
