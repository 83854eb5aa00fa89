"""`fleetrl demo`'s fault schedule (no servers): whom `--preempt-every` and `--kill-every` may hit.

A schedule that also notices nodes still loading keeps hitting the newest ones on a slow machine: on
CI's 2 cores every replacement was preempted before its worker took work, and a region never produced.
Likewise a trainer killed again before it trained a step proves nothing, and passing its turn to
another kind hits that kind twice as often.
"""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Iterator

import pytest
from slowdown import scaled

from fleetrl.demo.chaos import RECOVER_S, Chaos, FaultLog, FaultPlan
from fleetrl.demo.procs import Child
from fleetrl.demo.view import Progress, RegionView


class Fleet:
    """The part of the demo's runner that preemption uses: its agents (real sleeping processes), their
    notice files, and the progress view fed from their logs."""

    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir, self.children, self.agents, self.servers = workdir, [], {}, []
        self.progress = Progress(4, {"a": RegionView(), "b": RegionView()})
        (workdir / "notices").mkdir()

    def start(self, name: str) -> Child:
        # a lifetime that outlasts any test here (they kill their children by pid)
        child = Child(name, [sys.executable, "-c", f"import time; time.sleep({scaled(30)})"],
                      self.workdir / f"{name}.log", {}).start()
        self.children.append(child)
        return child

    def start_agent(self, region: str, node: str) -> Child:
        child = self.start(f"agent-{region}-{node}")
        self.agents[child.name] = (region, node)
        return child

    def restarted(self, child: Child) -> None:
        pass

    def agent_of(self, child: Child) -> tuple[str, str]:
        return self.agents[child.name]

    def notice_file(self, region: str, node: str) -> pathlib.Path:
        return self.workdir / "notices" / f"{region}-{node}"

    def generating(self, agent: Child) -> bool:
        region, node = self.agents[agent.name]
        view = self.progress.regions[region]
        return node in view.generating and bool(view.holding.get(node))


@pytest.fixture
def fleet(tmp_path: pathlib.Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    f.start_agent("a", "node-1")
    f.start_agent("b", "node-1")
    yield f
    for c in f.children:
        if c.proc is not None:
            c.proc.kill()
            c.proc.wait(timeout=scaled(10))
        if c._log is not None:
            c._log.close()


def test_only_a_node_whose_worker_generates_is_preempted(fleet: Fleet, tmp_path: pathlib.Path) -> None:
    chaos = Chaos(FaultPlan(preempt_every_s=1.0), fleet, FaultLog(time.monotonic(), tmp_path / "faults.jsonl"))
    chaos._preempt_one()  # neither worker is up yet: nothing to notice
    assert chaos.log.faults == [] and not list((tmp_path / "notices").iterdir())

    fleet.progress.feed({"event": "worker.started"}, ("b", "node-1"))
    chaos._preempt_one()  # b's worker is up but holds no group: a notice would have nothing to hand over
    assert chaos.log.faults == []
    fleet.progress.feed({"event": "worker.admitted", "group_id": "g1"}, ("b", "node-1"))
    fleet.progress.feed({"event": "worker.started"}, ("a", "node-1"))
    fleet.progress.feed({"event": "worker.admitted", "group_id": "g2"}, ("a", "node-1"))
    fleet.progress.feed({"event": "worker.group_done", "group_id": "g2"}, ("a", "node-1"))  # a holds none
    for _ in range(3):  # only b's node holds a group; its replacement is not up, so nothing else is noticed
        chaos._preempt_one()
    assert [(f.kind, f.target) for f in chaos.log.faults] == [("preempt", "agent-b-node-1"),
                                                               ("replace", "agent-b-node-1-r1")]
    assert (tmp_path / "notices" / "b-node-1").exists()

    fleet.progress.feed({"event": "worker.started"}, ("b", "node-1-r1"))
    fleet.progress.feed({"event": "worker.admitted", "group_id": "g3"}, ("b", "node-1-r1"))
    fleet.progress.feed({"event": "worker.admitted", "group_id": "g4"}, ("b", "node-1-r1"))
    fleet.progress.feed({"event": "worker.handed_over", "group_id": "g3"}, ("b", "node-1-r1"))
    fleet.progress.feed({"event": "worker.released", "group_ids": ["g4"]}, ("b", "node-1-r1"))
    chaos._preempt_one()  # its groups were handed over or released to another member: it holds none
    assert chaos.log.faults[-2].target == "agent-b-node-1"
    fleet.progress.feed({"event": "worker.admitted", "group_id": "g5"}, ("b", "node-1-r1"))
    chaos._preempt_one()
    assert chaos.log.faults[-2].target == "agent-b-node-1-r1"  # the replacement, once it generates


def test_kills_and_notices_wait_for_a_step_after_the_last_fault(fleet: Fleet, tmp_path: pathlib.Path) -> None:
    """`tick` injects nothing before the fleet's first step, nor before a step after the last kill,
    restart or notice: however slow the machine, the fleet trains between two faults."""
    fleet.start("replicator-a")
    plan = FaultPlan(kill_every_s=0.001, preempt_every_s=0.001, kill_only=("replicator",))
    chaos = Chaos(plan, fleet, FaultLog(time.monotonic(), tmp_path / "faults.jsonl"))
    fleet.progress.feed({"event": "worker.started"}, ("a", "node-1"))
    fleet.progress.feed({"event": "worker.admitted", "group_id": "g1"}, ("a", "node-1"))
    time.sleep(0.01)
    chaos.tick()  # both are due, but the fleet has not trained yet
    assert chaos.log.faults == [] and not chaos.caught_up()
    fleet.progress.feed({"event": "step.done", "step": 1, "version": 1, "reward_mean": 0.1})
    time.sleep(0.01)
    chaos.tick()  # a kill and a notice are both due: one fault a tick, the kill (due first)
    assert [f.kind for f in chaos.log.faults] == ["kill"]
    assert not chaos.caught_up()
    chaos._restart_due(time.monotonic() + 5)  # the replicator comes back: still no step since
    for _ in range(3):
        time.sleep(0.01)
        chaos.tick()
    assert [f.kind for f in chaos.log.faults] == ["kill", "restart"]
    fleet.progress.feed({"event": "step.done", "step": 2, "version": 2, "reward_mean": 0.1})
    chaos.restarted_at = dict.fromkeys(chaos.restarted_at, time.monotonic() - RECOVER_S - 1)
    time.sleep(0.01)
    chaos.tick()  # a step after the restart: the notice, due longer than the next kill, goes first
    assert [f.kind for f in chaos.log.faults] == ["kill", "restart", "preempt", "replace"]
    fleet.progress.feed({"event": "step.done", "step": 3, "version": 3, "reward_mean": 0.1})
    time.sleep(0.01)
    chaos.tick()  # then the replicator is killed again
    assert [f.kind for f in chaos.log.faults][-1] == "kill"


def test_kinds_take_turns_and_a_trainer_is_spared_until_it_checkpoints(fleet: Fleet, tmp_path: pathlib.Path) -> None:
    fleet.start("trainer")
    fleet.start("replicator-a")
    plan = FaultPlan(kill_every_s=1.0, kill_only=("trainer", "agent", "replicator"))
    chaos = Chaos(plan, fleet, FaultLog(time.monotonic(), tmp_path / "faults.jsonl"))

    def kills() -> list[str]:
        return [f.target.split("-")[0] for f in chaos.log.faults if f.kind == "kill"]

    chaos._kill_one()  # the trainer's turn before the run's first step: it is still starting, nobody dies
    assert kills() == []
    fleet.progress.feed({"event": "step.done", "step": 1, "version": 1, "reward_mean": 0.1})
    chaos.kill_turn = 0
    chaos._kill_one()  # a step, but no checkpoint yet: a kill now would only make the trainer redo it
    assert kills() == []
    fleet.progress.feed({"event": "checkpoint.saved", "step": 1})
    chaos.kill_turn = 0
    for _ in range(3):
        chaos._kill_one()
    assert kills() == ["trainer", "agent", "replicator"]
    chaos._restart_due(time.monotonic() + 5)  # RestartSec passed: all three come back
    restarts = {f.target.split("-")[0] for f in chaos.log.faults if f.kind == "restart"}
    assert restarts == {"trainer", "agent", "replicator"}

    chaos._kill_one()  # the trainer's turn, but it has just restarted: nobody is killed in its place
    assert kills() == ["trainer", "agent", "replicator"]
    long_ago = time.monotonic() - RECOVER_S - 1
    chaos.restarted_at = dict.fromkeys(chaos.restarted_at, long_ago)
    fleet.progress.last_checkpoint_at = long_ago - 1  # the run's first checkpoint came before that restart
    chaos.kill_turn = 0
    chaos._kill_one()  # RECOVER_S passed, but the restarted trainer has not checkpointed
    assert kills() == ["trainer", "agent", "replicator"]
    fleet.progress.feed({"event": "step.done", "step": 2, "version": 2, "reward_mean": 0.1})
    chaos.kill_turn = 0
    chaos._kill_one()  # a step alone is not enough: a kill now would take it back
    assert kills() == ["trainer", "agent", "replicator"]
    fleet.progress.feed({"event": "checkpoint.saved", "step": 1})
    chaos._kill_one()  # the agent's turn now; the trainer has checkpointed, so its next turn kills it
    chaos._kill_one()
    chaos._kill_one()
    assert kills() == ["trainer", "agent", "replicator", "agent", "replicator", "trainer"]


def test_until_faults_ends_at_the_first_step_after_every_kind_was_killed_and_came_back(
        fleet: Fleet, tmp_path: pathlib.Path) -> None:
    """`--until-faults`: while a kind asked for is still unkilled mid-flight (after the fleet's first
    step) the run goes on; once each was, chaos stops injecting and the run may end, but only after a
    step of the trainer that follows the last restart (a step before it proves nothing about the
    recovery)."""
    fleet.start("trainer")
    plan = FaultPlan(kill_every_s=1.0, kill_only=("trainer", "agent"), until_faults=True)
    chaos = Chaos(plan, fleet, FaultLog(time.monotonic(), tmp_path / "faults.jsonl"))
    chaos._kill_one()  # the trainer's turn, before the fleet's first step: spared
    assert [f for f in chaos.log.faults if f.kind == "kill"] == []
    fleet.progress.feed({"event": "step.done", "step": 1, "version": 1, "reward_mean": 0.1})
    fleet.progress.feed({"event": "checkpoint.saved", "step": 1})
    chaos._kill_one()  # an agent, mid-flight
    assert not chaos.all_happened()
    chaos._kill_one()  # the trainer, mid-flight
    assert chaos.all_happened() and not chaos.recovered()  # not stopped yet, both still down
    chaos.stop()  # what the runner does once all happened: restarts what is down at once
    assert {f.target.split("-")[0] for f in chaos.log.faults if f.kind == "restart"} == {"trainer", "agent"}
    assert not chaos.recovered()  # the only step came before the restarts
    fleet.progress.feed({"event": "step.done", "step": 2, "version": 2, "reward_mean": 0.1})
    assert chaos.recovered()


def test_recover_sets_how_long_a_restarted_process_and_trainer_are_spared(fleet: Fleet, tmp_path: pathlib.Path) -> None:
    """`--recover S` (a slower machine needs longer): S s for any restarted process, and a restarted trainer
    that never checkpoints is spared 6 x S s, not the default's 120 s."""
    fleet.start("trainer")
    plan = FaultPlan(kill_every_s=1.0, kill_only=("trainer", "agent"), recover_s=50.0)
    chaos = Chaos(plan, fleet, FaultLog(time.monotonic(), tmp_path / "faults.jsonl"))
    fleet.progress.feed({"event": "step.done", "step": 1, "version": 1, "reward_mean": 0.1})
    fleet.progress.feed({"event": "checkpoint.saved", "step": 1})
    now = time.monotonic()
    chaos.restarted_at = {"trainer": now - 40.0, "agent-a-node-1": now - 40.0}
    fleet.progress.last_checkpoint_at = now - 41.0  # the run's first checkpoint, before those restarts
    assert not chaos._recovered("agent-a-node-1", now)  # 40 s < 50 s (the default 20 s would have passed)
    assert chaos._recovered("agent-a-node-1", now + 11.0)
    assert not chaos._recovered("trainer", now + 200.0)  # no checkpoint, and 240 s < 6 x 50 s
    assert chaos._recovered("trainer", now + 261.0)


def test_until_faults_also_waits_for_the_evaluations_scheduled_so_far(fleet: Fleet, tmp_path: pathlib.Path) -> None:
    """Every fault happened and was recovered from, but an evaluation is still out: the run goes on (its
    books must balance at the end, under the faults) until its `eval.done`."""
    from fleetrl.demo.ending import RunEnd

    trainer = fleet.start("trainer")
    plan = FaultPlan(kill_every_s=1.0, kill_only=("agent",), until_faults=True)
    chaos = Chaos(plan, fleet, FaultLog(time.monotonic(), tmp_path / "faults.jsonl"))
    end = RunEnd(plan, None, time.monotonic(), chaos, trainer, None)
    fleet.progress.feed({"event": "eval.scheduled", "set": "held", "version": 0, "step": 0, "prompts": 4})
    fleet.progress.feed({"event": "step.done", "step": 1, "version": 1, "reward_mean": 0.1})
    fleet.progress.feed({"event": "checkpoint.saved", "step": 1})
    chaos._kill_one()  # an agent, mid-flight
    assert end._run_over(time.monotonic()) is None  # all happened: chaos stops and restarts the agent
    assert chaos.stopped
    fleet.progress.feed({"event": "step.done", "step": 2, "version": 2, "reward_mean": 0.1})
    assert chaos.recovered()
    assert end._run_over(time.monotonic()) is None  # recovered, but the evaluation of version 0 is out
    fleet.progress.feed({"event": "eval.done", "set": "held", "version": 0, "step": 0, "pass@1": 0.5})
    assert end._run_over(time.monotonic()) == 0.0
