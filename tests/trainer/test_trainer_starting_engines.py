"""A node serves once one of its engines is up (`Heartbeat.serving`), and only then counts for the
region credits (trainer/credits.py).

An agent beats `up` as soon as it runs, while its engines load the model for tens of seconds
(`starting`): work sent there waits for them, a stall after every preemption. The heartbeats go
through the trainer's own feed (`Trainer._heartbeats`) from the control plane's retained view of the
nodes (a `ControlPlane` never connected: the view is what its MQTT reader fills). A heartbeat
without engine statuses (an older agent) keeps its meaning: `up` serves. The handover's side is in
test_trainer_handover.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fleetrl.broker import ControlPlane, Heartbeat
from fleetrl.config import FleetConfig
from fleetrl.trainer.dist import DistContext
from fleetrl.trainer.learner import Learner
from fleetrl.trainer.service import Trainer


def beat(now: float, *engines: tuple[str, float], state: str = "up", tokens_per_s: float = 0.0) -> Heartbeat:
    """A node's heartbeat as its agent sends it: each engine's (state, busy tokens/s), the node's
    capacity their sum. No engines: a heartbeat without engine statuses, as an older agent sends."""
    fields: dict[str, Any] = {"state": state, "ts": now, "tokens_per_s": tokens_per_s}
    if engines:
        fields["engines"] = [{"index": i, "state": s, "busy_tokens_per_s": b} for i, (s, b) in enumerate(engines)]
        fields["busy_tokens_per_s"] = sum(b for _, b in engines)
    return Heartbeat.model_validate(fields)


def trainer(mode: str, regions: tuple[str, ...]) -> tuple[Trainer, dict[tuple[str, str], Heartbeat]]:
    """A trainer that is never run, and the retained heartbeats its loop reads."""
    config = FleetConfig.model_validate({
        "run": "starting", "algorithm": {"mode": mode, "groups_per_step": 4, "n_samples": 2, "max_new_tokens": 8},
        "model": {"tiny": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}},
        "trainer": {"throughput_window_s": 60.0},
        "regions": [{"name": r, "kafka": "127.0.0.1:9", "store": f"/tmp/{r}"} for r in regions],
    })

    def prompts() -> Iterator[tuple[str, str, str]]:
        return iter([])

    t = Trainer(config, prompts, Learner(config.model, config.algorithm, DistContext()), use_mqtt=False)
    t.announcer = ControlPlane(config, "starting-trainer")
    return t, t.announcer.nodes


def test_a_node_serves_once_one_of_its_engines_is_up() -> None:
    assert not beat(0.0, ("starting", 0.0), ("starting", 0.0)).serving
    assert not beat(0.0, ("restarting", 0.0), ("crashloop", 0.0)).serving
    assert beat(0.0, ("starting", 0.0), ("up", 0.0)).serving
    assert not beat(0.0, ("up", 50.0), state="draining").serving
    # no engine statuses (an older agent, a node without supervisors): `up` serves, as before
    assert beat(0.0).serving and Heartbeat(state="up", engines=2).serving
    assert Heartbeat.model_validate_json(b'{"state": "up", "tokens_per_s": 3.0}').serving
    assert not beat(0.0, state="offline").serving
    # a reading of the heartbeat, not a field of it: the wire format is what DESIGN.md section 4 fixes
    assert "serving" not in json.loads(beat(0.0, ("up", 1.0)).to_json())


def test_a_node_whose_engines_all_start_adds_no_capacity_until_one_is_up() -> None:
    t, nodes = trainer("sync", ("a", "b", "c"))
    nodes[("a", "n1")] = beat(1.0, ("up", 300.0))
    nodes[("b", "n1")] = beat(1.0, ("starting", 0.0), ("starting", 0.0))  # loading the model
    nodes[("c", "n1")] = beat(1.0)  # an older agent: up, not measured yet, borrows the mean
    t._heartbeats(1.0)
    assert t.credits.capacities(1.0) == {"a": 300.0, "b": 0.0, "c": 300.0}
    assert {t.credits.pick({}, 1.0), t.credits.pick({"a": 1, "c": 1}, 1.0)} <= {"a", "c"}
    # one of b's engines is up, not measured yet: the node borrows the mean of the measured ones
    nodes[("b", "n1")] = beat(2.0, ("starting", 0.0), ("up", 0.0))
    t._heartbeats(2.0)
    assert t.credits.capacities(2.0) == {"a": 300.0, "b": 300.0, "c": 300.0}
    nodes[("b", "n1")] = beat(3.0, ("up", 100.0), ("up", 100.0))
    t._heartbeats(3.0)
    assert t.credits.capacities(3.0) == {"a": 300.0, "b": 200.0, "c": 250.0}  # the mean moved


def test_a_region_whose_nodes_all_start_gets_no_work_until_an_engine_is_up() -> None:
    t, nodes = trainer("async", ("a", "b"))
    cr = t.credits
    for r in ("a", "b"):
        cr.on_dispatch(r, 0.0)
    for s in range(1, 60):  # both returned a group a second
        cr.on_arrival("a", float(s))
        cr.on_arrival("b", float(s))
    # b was preempted and moved its work away; its replacement node beats `up` while its engine loads
    nodes[("a", "n1")] = beat(60.0, ("up", 50.0), tokens_per_s=40.0)
    nodes[("b", "n1")] = beat(60.0, ("stopped", 0.0), state="offline")
    nodes[("b", "n2")] = beat(60.0, ("starting", 0.0))
    t._heartbeats(60.0)
    assert cr.rates(60.0)["b"] == 0.0  # what it returned came from the node that is gone
    assert cr.pick({"a": 5, "b": 0}, 60.0) == "a"  # not probed: nothing there can take the group
    # its engine is up: an idle region with a serving node gets a group to show its rate
    nodes[("b", "n2")] = beat(61.0, ("up", 0.0))
    t._heartbeats(61.0)
    assert cr.rates(61.0)["b"] > 0.0
    assert cr.pick({"a": 5, "b": 0}, 61.0) == "b"
    # an older agent's `up` without engine statuses counts as it always did
    nodes[("b", "n2")] = beat(62.0)
    t._heartbeats(62.0)
    assert cr.pick({"a": 5, "b": 0}, 62.0) == "b"
