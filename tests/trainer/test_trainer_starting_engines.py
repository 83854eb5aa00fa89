"""A node serves once one of its engines is up (`Heartbeat.serving`, broker/control.py).

An agent beats `up` as soon as it runs, while its engines load the model for tens of seconds
(`starting`): work sent there waits for them, a stall after every preemption. A heartbeat without
engine statuses (an older agent) keeps its meaning: `up` serves.
"""

from __future__ import annotations

import json
from typing import Any

from fleetrl.broker import Heartbeat


def beat(now: float, *engines: tuple[str, float], state: str = "up", tokens_per_s: float = 0.0) -> Heartbeat:
    """A node's heartbeat as its agent sends it: each engine's (state, busy tokens/s), the node's
    capacity their sum. No engines: a heartbeat without engine statuses, as an older agent sends."""
    fields: dict[str, Any] = {"state": state, "ts": now, "tokens_per_s": tokens_per_s}
    if engines:
        fields["engines"] = [{"index": i, "state": s, "busy_tokens_per_s": b} for i, (s, b) in enumerate(engines)]
        fields["busy_tokens_per_s"] = sum(b for _, b in engines)
    return Heartbeat.model_validate(fields)


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
