"""`bench/pipeline.py --cost`: an on-demand fleet against a hybrid one at the same dollars per hour.

RLBoost's comparison (harvesting preemptible capacity for rollout: 28-49 % better cost efficiency
than on-demand only) on the real code path. Both fleets run the whole system as processes, as
`bench/pipeline.py` does (one tansu broker per region, MQTT, the trainer, one region agent per node
supervising its rollout worker), in `algorithm.mode: async`, with prices in their fleet.yaml, and
they run at the same time, each on its own brokers, so both meet the same machine load:

* on demand: `--od-nodes` nodes at `--price` dollars a node-hour: `--base-nodes` in region r0, the
  rest in r1;
* hybrid: the same `--base-nodes` on-demand nodes in r0, and in r1 as many spot nodes at
  `(1 - --discount) x --price` as the on-demand fleet's budget buys (rounded down: the hybrid never
  spends more per hour). Each spot node is preempted `--spot-preempt-every` seconds after it started
  (the first with a random phase): a notice through its agent's notice file (the real notice and
  handover path: it hands its unfinished groups over as partials, goes offline and exits 0), and a
  replacement node (a new name, as an auto-scaling group's new instance) starts at the notice, as
  EC2 capacity rebalancing (`capacity_rebalance = true` in infra/terraform) launches one when a spot
  node is at risk. Both are paid while both run.

The dollars are the trainer's own measure (`trainer/cost.py`): node-seconds between each node's
heartbeats times its pool's price, read from `step.done`'s `cost_usd_*` totals over the measured
window (from the first step `warm_s` after the start, past the first spot nodes' common start, to the
end of the last). Each run ends with `fleetrl audit` (every dispatched group trained once, stale,
dead-lettered or still in flight). `--rebalance-lead S` starts each replacement S seconds before its
notice instead (a rebalance recommendation before the interruption). `--cost-grid` measures a table
of discount x spot life instead of the seeds.

    cost_efficiency             hybrid groups trained per dollar / on-demand groups per dollar
    throughput_ratio_equal_budget  hybrid groups/s / on-demand groups/s (hybrid budget <= on-demand's)
    waste_share                 the hybrid's tokens sampled that no trained group holds, over its tokens
                                sampled (preempted work regenerated, duplicates, stale groups; the
                                tokens in flight at the window's two ends cancel out)
    paid_idle_share             the hybrid's paid node-seconds with no engine up (replacements loading)
    start_to_first_group_s      median seconds from a replacement's spawn to its first finished group; each
                                fleet's line also gives the phases before it (agent up, engine built,
                                consumer joined, first weights, loop)

EMULATED, and said so in the output: GPU speed (a sleep after each decoding step of the real torch
engine), completion lengths (a long tail by prompt), the link delay home <-> region, and the prices
(data in fleet.yaml; only their ratio matters).
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import random
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

import yaml
from fleet_run import FLEETRL, Fleet, Run, RunResult, event_ts, events, fleet_config

from fleetrl import devstack
from fleetrl.demo.books import run_audit


@dataclass(frozen=True)
class CostPlan:
    """The two fleets and the spot market."""

    price: float = 2.0
    """On-demand US dollars per node-hour (EMULATED data; only ratios matter)."""
    discount: float = 0.65
    """Spot's discount off the on-demand price."""
    od_nodes: int = 3
    """Nodes of the on-demand fleet."""
    base_nodes: int = 1
    """On-demand nodes of the hybrid fleet (region r0); the rest of the budget buys spot nodes (r1)."""
    spot_preempt_every_s: float = 60.0
    """A spot node's life: it is preempted this long after it started (0: never)."""
    warm_s: float = 60.0
    """The measured window opens at the first step this long after the trainer started (both fleets)."""
    session_timeout_s: float = 2.0
    """`rollout.group_session_timeout_s` of both fleets (tansu holds every join for half of it)."""
    rebalance_lead_s: float = 0.0
    """The replacement starts this long before the notice (EC2's rebalance recommendation, which capacity
    rebalancing acts on, may come before the interruption notice); 0: at the notice."""

    @property
    def spot_nodes(self) -> int:
        """Spot nodes the on-demand fleet's budget buys beside the base (rounded down)."""
        spot_price = (1.0 - self.discount) * self.price
        return math.floor((self.od_nodes - self.base_nodes) * self.price / spot_price + 1e-9)

    def usd_per_hour(self, kind: str) -> float:
        if kind == "on_demand":
            return self.od_nodes * self.price
        return self.base_nodes * self.price + self.spot_nodes * (1.0 - self.discount) * self.price


COST_FLEET = Fleet(slowdowns=(0.8, 0.8), tail_p=0.15, short_tokens=4, max_new_tokens=8, groups_per_step=8,
                   n_samples=4, max_staleness=6, steps=10, preempt_every_s=0.0, link_delay_s=0.05)
"""Both regions the same GPUs: 0.8 s a decoding step (EMULATED), so a node is bound by that sleep and
not by the CPU its tiny model needs on 2 shared cores (at 0.3 s the same three nodes ran 7.5 or 11.6
groups/s as the machine's load moved). 8 groups x 4 samples a step; the admission window, (1 + 6 + 1
ahead) x 8 = 64 groups, covers every node's 4 groups in flight, and a long group (8 tokens, 6.4 s)
comes back within the staleness bound at the hybrid's step rate."""
GROUPS_IN_FLIGHT = 4
MAX_BATCH = 16


@dataclass
class CostResult:
    kind: str
    run: RunResult
    usd: float
    """Dollars spent over the measured window (trainer/cost.py)."""
    usd_by_capacity: dict[str, float]
    tokens_sampled: int
    node_s: float
    serving_s: float
    groups_resent: int
    tokens_regenerated: int
    spot_preemptions: int
    audit_ok: bool
    audit: dict[str, Any] = field(default_factory=dict)
    start: dict[str, float] = field(default_factory=dict)
    """Median seconds from a replacement node's spawn to each phase of its start (`START_PHASES`)."""

    @property
    def groups_per_usd(self) -> float:
        return self.run.groups / self.usd if self.usd > 0 else float("nan")

    @property
    def waste_share(self) -> float:
        return max(0.0, 1.0 - self.run.tokens_trained / self.tokens_sampled) if self.tokens_sampled else float("nan")

    @property
    def paid_idle_share(self) -> float:
        # Never below 0: serving and paid seconds are summed apart, so "all serving" can round to -0.000.
        return max(0.0, 1.0 - self.serving_s / self.node_s) if self.node_s else float("nan")


class CostRun(Run):
    """One fleet's processes: `kind` on_demand or hybrid; spot nodes preempted and replaced."""

    def __init__(self, fleet: Fleet, plan: CostPlan, kind: str, seed: int, root: pathlib.Path) -> None:
        super().__init__(fleet, "async", seed, root)
        self.plan, self.kind = plan, kind
        self.rng = random.Random(seed * 7919 + 1)
        self.spot_due: dict[str, float] = {}
        """Live spot node -> when it is preempted (monotonic)."""
        self.leaving: list[subprocess.Popen[bytes]] = []
        self.replaced: set[str] = set()
        """Spot nodes whose replacement has started."""
        self.started_at = time.time()
        self._stopping = False
        self.warm_s = plan.warm_s
        """Seconds from the start before the measured window may open (the same for both fleets)."""
        self._spot_made = 0
        self.replacement_logs: list[pathlib.Path] = []

    def warm_steps(self, done: list[float]) -> int:
        """The window opens at the first step `warm_s` after the trainer started (and after the pipeline
        warm-up steps): the first spot nodes all start at once, a transient the steady state has not."""
        late = [i + 1 for i, t in enumerate(done) if t >= self.started_at + self.warm_s]
        return max(self.fleet.warm_steps, late[0] if late else len(done))

    def _layout(self) -> list[tuple[str, str, str]]:
        """(region, node, capacity) of the fleet's first nodes."""
        p = self.plan
        if self.kind == "on_demand":
            return [("r0", f"b{j}", "on_demand") for j in range(p.base_nodes)] + \
                   [("r1", f"o{j}", "on_demand") for j in range(p.od_nodes - p.base_nodes)]
        return [("r0", f"b{j}", "on_demand") for j in range(p.base_nodes)] + \
               [("r1", f"s{j}-0", "spot") for j in range(p.spot_nodes)]

    def _config(self, ports: dict[str, int]) -> dict[str, Any]:
        config = fleet_config(self.fleet, "async", self.seed, self.root, ports)
        config["kafka"]["partitions"] = {"prompts": 16, "partials": 16, "trajectories": 16, "dead_letter": 1}
        # The default heartbeat (5 s), not the pipeline bench's 1 s: on 2 loaded cores 1-s beats came late
        # enough for the trainer to find the spot region silent and re-send its groups, and amqtt fired
        # last wills for agents that were alive.
        config["mqtt"]["heartbeat_interval_s"] = 5
        config["rollout"]["max_groups_in_flight"] = GROUPS_IN_FLIGHT
        config["rollout"]["group_session_timeout_s"] = self.plan.session_timeout_s
        layout = self._layout()
        spot_price = round((1.0 - self.plan.discount) * self.plan.price, 6)
        for region in config["regions"]:
            region["engine"]["max_batch"] = MAX_BATCH
            # Each worker reading its whole region's trajectories is N^2 work on one machine's 2 cores,
            # which a region of real nodes spreads over N hosts: off in both fleets.
            region["engine"]["speculative"] = {"region_history": False}
            region["nodes"] = [{"name": n} for r, n, _ in layout if r == region["name"]]
            if region["name"] == "r1" and self.kind == "hybrid":
                region.update(capacity="spot", price=spot_price)
            else:
                region.update(capacity="on_demand", price=self.plan.price)
        return config

    def start(self) -> None:
        ports = {"mqtt": devstack.free_port()}
        self.servers.append(devstack.mqtt_broker(ports["mqtt"], self.root))
        for i in range(2):
            ports[f"r{i}"] = devstack.free_port()
            self.servers.append(devstack.tansu(ports[f"r{i}"]))
        for server in self.servers:
            server.start()
        self.config = self._config(ports)
        self.config_path = self.root / "fleet.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        subprocess.run([*FLEETRL, "topics", "create", "--config", str(self.config_path)], check=True,
                       capture_output=True, timeout=60)
        self.trainer_log = self.logs / "trainer.log"
        from fleetrl.demo.view import LogTail
        self._trainer_tail = LogTail(self.trainer_log)
        self.trainer = self._spawn(["trainer", "--config", str(self.config_path)], self.trainer_log)
        self.started_at = time.time()
        now = time.monotonic()
        for region, node, capacity in self._layout():
            self._start_agent(region, node)
            if capacity == "spot" and self.plan.spot_preempt_every_s:
                self.spot_due[node] = now + self.rng.uniform(0.0, self.plan.spot_preempt_every_s)
                self._spot_made += 1

    def _preempt_due(self) -> None:
        """A notice to each spot node whose life is over; its replacement (a new name) starts at the
        notice, or `rebalance_lead_s` before it."""
        now = time.monotonic()
        for node, due in list(self.spot_due.items()):
            if node not in self.replaced and now >= due - self.plan.rebalance_lead_s:
                self._spot_made += 1
                fresh = f"{node.split('-')[0]}-{self._spot_made}"
                self._start_agent("r1", fresh)
                self.replacement_logs.append(self.agent_logs[-1][1])
                self.spot_due[fresh] = now + self.plan.spot_preempt_every_s
                self.replaced.add(node)
            if now < due:
                continue
            del self.spot_due[node]
            notice = self.root / f"notice-r1-{node}-{self.generation[('r1', node)]}"
            notice.write_text("bench/pipeline.py --cost: spot interruption\n")
            self.preempted_at.append(time.time())
            self.leaving.append(self.agents.pop(("r1", node)))

    def tick(self) -> bool:
        """One round of watching the run: preempt what is due, stop the trainer once the window is long
        enough; False once the trainer has exited (0), an error if anything died."""
        if self.trainer.poll() is not None:
            if self.trainer.returncode != 0:
                raise RuntimeError(f"{self.kind} trainer exited {self.trainer.returncode}; see {self.trainer_log}")
            return False
        for key, proc in list(self.agents.items()):
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"{self.kind} agent {key} died with {proc.returncode}; see {self.logs}")
        for proc in list(self.leaving):
            if proc.poll() is not None:
                if proc.returncode != 0:
                    raise RuntimeError(f"a preempted {self.kind} agent exited {proc.returncode}; see {self.logs}")
                self.leaving.remove(proc)
        self._preempt_due()
        if self.fleet.window_s and not self._stopping and self._window_long_enough():
            self._stopping = True  # the trainer drains (publish, checkpoint) and exits 0
            self.trainer.send_signal(signal.SIGTERM)
        return True

    def stop(self) -> None:
        self.agents.update({("gone", str(i)): p for i, p in enumerate(self.leaving)})
        super().stop()

    def cost_result(self, audit: dict[str, Any]) -> CostResult:
        run = self.result()
        steps = [e for e in events(self.trainer_log) if e["event"] == "step.done"]
        first, last = steps[self.warm_steps([event_ts(e) for e in steps]) - 1], steps[-1]

        def grew(key: str) -> float:
            return float(last.get(key) or 0.0) - float(first.get(key) or 0.0)

        return CostResult(
            kind=self.kind, run=run, usd=grew("cost_usd_total"),
            usd_by_capacity={c: grew(f"cost_usd_{c}") for c in ("on_demand", "spot")},
            tokens_sampled=int(grew("tokens_sampled_total")), node_s=grew("node_s_total"),
            serving_s=grew("serving_s_total"), groups_resent=int(grew("groups_resent_total")),
            tokens_regenerated=int(grew("tokens_regenerated_total")), spot_preemptions=run.preemptions,
            audit_ok=bool(audit.get("ok")), audit=audit, start=start_phases(self.replacement_logs))


START_PHASES = (("agent up", "agent.started"), ("worker spawned", "agent.worker_started"),
                ("engine built", "worker.engine_built"), ("consumer joined", "consumer.assigned"),
                ("first weights", "weights.staged"), ("loop", "worker.started"), ("first group", "worker.group_done"))
"""A node's start, phase by phase: the first event of each kind in its agent's log (the worker's are relayed
there), from the bench's spawn of the agent process."""


def start_phases(logs: list[pathlib.Path]) -> dict[str, float]:
    """Median seconds from a node's spawn to each phase's first event, over the nodes that reached the
    last phase (the replacements' start, with everything that shares the machine's cores)."""
    seen: dict[str, list[float]] = {name: [] for name, _ in START_PHASES}
    for log in logs:
        evs = events(log)
        spawned = next((event_ts(e) for e in evs if e.get("event") == "bench.agent_spawned"), None)
        first = {}
        for e in evs:
            first.setdefault(e.get("event"), event_ts(e))
        if spawned is None or START_PHASES[-1][1] not in first:
            continue
        for name, event in START_PHASES:
            if event in first:
                seen[name].append(first[event] - spawned)
    return {name: statistics.median(v) for name, v in seen.items() if v}


def run_pair(fleet: Fleet, plan: CostPlan, seed: int, timeout_s: float) -> tuple[CostResult, CostResult]:
    """The on-demand and the hybrid fleet at the same time, each on its own brokers: both meet the same
    machine load (2 shared cores: a run after the other met another load and another throughput), and
    their ratio is measured in one run. Each ends with `fleetrl audit` while its brokers run."""
    keep = os.environ.get("FLEETRL_BENCH_KEEP")
    with contextlib.ExitStack() as stack:
        runs = []
        for kind in ("on_demand", "hybrid"):
            root = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"fleetrl-cost-{kind}-",
                                                                                dir=keep)))
            if keep:
                root = pathlib.Path(keep) / f"cost-{kind}-{seed}-{int(time.time())}"
            runs.append(CostRun(fleet, plan, kind, seed, root))
        try:
            for run in runs:
                run.start()
            deadline = time.monotonic() + timeout_s
            while [run.tick() for run in runs] != [False, False]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the runs did not finish within {timeout_s:.0f} s; see {runs[0].root.parent}")
                time.sleep(0.2)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            audits = [run_audit(run.config_path, run.root, env) for run in runs]
        finally:
            for run in runs:
                run.stop()
        od, hybrid = (run.cost_result(audit) for run, audit in zip(runs, audits, strict=True))
        return od, hybrid


def show(r: CostResult, plan: CostPlan) -> None:
    nominal = plan.usd_per_hour(r.kind)
    split = ", ".join(f"{c} ${v:.4f}" for c, v in r.usd_by_capacity.items() if v)
    print(f"  {r.kind:9s}: {r.run.groups} groups in {r.run.wall_s:.1f} s = {r.run.groups_per_s:.3f} groups/s; "
          f"${r.usd:.4f} measured ({split}; nominal ${nominal:.2f}/h -> "
          f"${nominal * r.run.wall_s / 3600:.4f} over the window) = {r.groups_per_usd:.0f} groups/$, "
          f"${1000 * r.usd / max(r.run.groups, 1):.4f} per 1,000 groups; {r.spot_preemptions} spot preemptions "
          f"in the window; tokens sampled {r.tokens_sampled}, trained {r.run.tokens_trained} (waste "
          f"{r.waste_share:.3f}); paid node-s {r.node_s:.0f}, with no engine up {r.paid_idle_share:.3f}; groups "
          f"re-sent {r.groups_resent}, tokens regenerated (known) {r.tokens_regenerated}; tokens handed over "
          f"{r.run.tokens_handed_over}, moved {r.run.tokens_moved}; reward (last 3 of {r.run.steps}) "
          f"{r.run.reward():.3f}; audit {'ok' if r.audit_ok else 'FAILED: ' + str(r.audit.get('problems'))}",
          flush=True)
    if r.start:
        print("    a replacement's start (median s from its spawn): "
              + ", ".join(f"{name} {s:.1f}" for name, s in r.start.items()), flush=True)


def compare(fleet: Fleet, plan: CostPlan, seeds: int, timeout_s: float) -> dict[str, float]:
    """Both fleets per seed, side by side in one run."""
    pairs: list[tuple[CostResult, CostResult]] = []
    for seed in range(seeds):
        print(f"seed {seed} ({_load()}):", flush=True)
        od, hybrid = run_pair(fleet, plan, seed, timeout_s)
        show(od, plan)
        show(hybrid, plan)
        print(f"  cost_efficiency {hybrid.groups_per_usd / od.groups_per_usd:.3f}, throughput ratio "
              f"{hybrid.run.groups_per_s / od.run.groups_per_s:.3f} (load after: {_load()})", flush=True)
        pairs.append((od, hybrid))
    eff = [h.groups_per_usd / o.groups_per_usd for o, h in pairs]
    equal = [min(o.run.steps, h.run.steps) for o, h in pairs]
    rewards = [(o.run.reward(n), h.run.reward(n)) for (o, h), n in zip(pairs, equal, strict=True)]
    return {
        "cost_efficiency": statistics.fmean(eff),
        "throughput_ratio_equal_budget": statistics.fmean(h.run.groups_per_s / o.run.groups_per_s for o, h in pairs),
        "waste_share": statistics.fmean(h.waste_share for _, h in pairs),
        "waste_share_on_demand": statistics.fmean(o.waste_share for o, _ in pairs),
        "paid_idle_share": statistics.fmean(h.paid_idle_share for _, h in pairs),
        "cost_efficiency_min": min(eff), "cost_efficiency_max": max(eff),
        "usd_per_1000_groups_on_demand": statistics.fmean(1000 * o.usd / o.run.groups for o, _ in pairs),
        "usd_per_1000_groups_hybrid": statistics.fmean(1000 * h.usd / h.run.groups for _, h in pairs),
        "reward_delta": statistics.fmean(h - o for o, h in rewards),
        "reward_spread_on_demand": max(o for o, _ in rewards) - min(o for o, _ in rewards),
        "spot_preemptions": statistics.fmean(h.spot_preemptions for _, h in pairs),
        "start_to_first_group_s": statistics.fmean(h.start.get("first group", float("nan")) for _, h in pairs),
        "spot_nodes": float(plan.spot_nodes),
        "audit_ok": float(all(o.audit_ok and h.audit_ok for o, h in pairs)),
    }


def grid(fleet: Fleet, plan: CostPlan, timeout_s: float) -> dict[str, float]:
    """A markdown table of cost_efficiency: spot discount x a spot node's life (one seed per cell, both
    fleets in one run). Each cell measures over 1.5 lives (at least 120 s; `--quick`: the fleet's window)
    after the same warm-up."""
    discounts, lives = (0.3, 0.5, 0.65), (0.0, 180.0, 60.0)
    print("| spot discount \\ spot node preempted | " + " | ".join(
        f"every {s:g} s" if s else "never" for s in lives) + " |")
    print("|---|---|---|---|", flush=True)
    found: dict[str, float] = {}
    for discount in discounts:
        cells = []
        for life in lives:
            cell = replace(plan, discount=discount, spot_preempt_every_s=life)
            window = fleet.window_s if fleet.window_s < 60 else max(120.0, 1.5 * life)
            out = compare(replace(fleet, window_s=window), cell, 1, timeout_s + 2 * window)
            cells.append(f"{out['cost_efficiency']:.2f} ({cell.spot_nodes} spot; waste {out['waste_share']:.2f}, "
                         f"paid idle {out['paid_idle_share']:.2f}{'' if out['audit_ok'] else '; AUDIT FAILED'})")
            found[f"cost_efficiency_d{discount * 100:.0f}_life{life:g}"] = out["cost_efficiency"]
            found["audit_ok"] = min(found.get("audit_ok", 1.0), out["audit_ok"])
        print(f"| {discount:.0%} | " + " | ".join(cells) + " |", flush=True)
    return found


def _load() -> str:
    return "load " + " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])


def describe(fleet: Fleet, plan: CostPlan) -> str:
    return (f"cost fleets: on demand {plan.od_nodes} node(s) (r0 {plan.base_nodes}, r1 "
            f"{plan.od_nodes - plan.base_nodes}) "
            f"at ${plan.price:g}/node-hour = ${plan.usd_per_hour('on_demand'):.2f}/h; hybrid {plan.base_nodes} "
            f"on-demand (r0) + {plan.spot_nodes} spot (r1) at {plan.discount:.0%} off = "
            f"${plan.usd_per_hour('hybrid'):.2f}/h; a spot node preempted "
            + (f"{plan.spot_preempt_every_s:g} s after it starts (notice file -> handover -> offline; the "
               "replacement starts " + (f"{plan.rebalance_lead_s:g} s before the notice" if plan.rebalance_lead_s
                                        else "at the notice") + ")" if plan.spot_preempt_every_s else "never")
            + f". EMULATED: GPU speed ({fleet.slowdowns[0]:g} s sleep per decoding step of the real torch engine), "
            f"completion lengths ({fleet.tail_p:.0%} of prompts run to {fleet.max_new_tokens} tokens, the rest stop "
            f"within {fleet.short_tokens}), link delay {fleet.link_delay_s:g} s each way, prices (data). "
            f"{fleet.groups_per_step} groups x {fleet.n_samples} samples a step, async max_staleness "
            f"{fleet.max_staleness}, {GROUPS_IN_FLIGHT} groups in flight per worker; each run measured over "
            f"{fleet.window_s:g} s from its first step {plan.warm_s:g} s after the start "
            f"(and after {fleet.warm_steps} warm-up steps), at least {fleet.steps} steps.")


def main(args: Any) -> None:
    """`bench/pipeline.py --cost` (its arguments)."""
    life = args.spot_preempt_every
    plan = CostPlan(price=args.price, discount=args.discount, od_nodes=args.od_nodes, base_nodes=args.base_nodes,
                    spot_preempt_every_s=life, rebalance_lead_s=args.rebalance_lead,
                    session_timeout_s=args.session_timeout,
                    warm_s=20.0 if args.quick else max(life, 30.0))
    if plan.spot_nodes < 1:
        raise SystemExit(f"the budget of {plan.od_nodes - plan.base_nodes} on-demand node(s) buys no spot node at "
                         f"{plan.discount:.0%} off: raise --od-nodes or --discount")
    window = 25.0 if args.quick else 3 * (plan.spot_preempt_every_s or 60.0)
    fleet = replace(COST_FLEET, steps=args.steps or (8 if args.quick else 20), window_s=window)
    print(describe(fleet, plan), flush=True)
    timeout_s = 300.0 + 2 * window
    if args.cost_grid:  # the grid alone (its default cell is the 65 % / 60 s one: --seeds runs that)
        print("result: " + " ".join(f"{k}={v:.3f}" for k, v in grid(fleet, plan, timeout_s).items()))
        return
    out = compare(fleet, plan, args.seeds, timeout_s)
    print("result: " + " ".join(f"{k}={v:.3f}" for k, v in out.items()))
