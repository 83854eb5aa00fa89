"""Checkpoints are atomic folders; the newest complete one wins; a half-written one is ignored."""

from __future__ import annotations

import pathlib

import pytest
import torch

from fleetrl.trainer import CheckpointError
from fleetrl.trainer import checkpoint as ck


def _state(step: int, run: str = "r") -> dict[str, object]:
    return {"run": run, "step": step, "version": step, "collector": {}, "dispatcher": {}, "offsets": {}}


def test_save_latest_prune_and_ignore_partial(tmp_path: pathlib.Path) -> None:
    model = {"w": torch.arange(4.0)}
    for step in (1, 2, 3):
        ck.save(tmp_path, _state(step), model, {"state": {}, "param_groups": []}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002", "step-000000003"]
    # a SIGKILL in the middle of writing step 4 leaves only a .tmp folder: it does not count
    partial = tmp_path / "step-000000004.tmp"
    partial.mkdir()
    (partial / ck.STATE_FILE).write_bytes(b"\x00garbage")
    latest = ck.latest(tmp_path, "r")
    assert latest is not None and latest.step == 3
    weights, opt = latest.weights()
    assert torch.equal(weights["w"], model["w"]) and opt["param_groups"] == []
    # the next save of step 4 replaces the leftover
    ck.save(tmp_path, _state(4), model, {}, keep=2)
    latest = ck.latest(tmp_path, "r")
    assert latest is not None and latest.step == 4
    with pytest.raises(CheckpointError, match="exists already"):
        ck.save(tmp_path, _state(4), model, {}, keep=2)


def test_wrong_run_and_damage_are_named(tmp_path: pathlib.Path) -> None:
    assert ck.latest(tmp_path / "nothing-here", "r") is None
    ck.save(tmp_path, _state(1, run="other"), {}, {}, keep=1)
    with pytest.raises(CheckpointError, match="belongs to run 'other'"):
        ck.latest(tmp_path, "r")
    (tmp_path / "step-000000001" / ck.STATE_FILE).write_bytes(b"not msgpack at all \xc1")
    with pytest.raises(CheckpointError, match="step-000000001"):
        ck.latest(tmp_path, "other")


def test_amending_the_newest_checkpoint_replaces_its_state_and_keeps_its_weights(tmp_path: pathlib.Path) -> None:
    """What a draining trainer took in after its last step's checkpoint (evaluations, docs/eval.md) goes into
    that checkpoint's state; the weights stay, and a leftover of a killed amend is not read."""
    model = {"w": torch.arange(4.0)}
    ck.save(tmp_path, _state(3), model, {}, keep=2)
    ck.amend_state(tmp_path, 3, {**_state(3), "eval": {"evals": [], "orphans": 2}})
    latest = ck.latest(tmp_path, "r")
    assert latest is not None and latest.step == 3 and latest.state["eval"] == {"evals": [], "orphans": 2}
    assert torch.equal(latest.weights()[0]["w"], model["w"])
    (latest.path / f"{ck.STATE_FILE}.tmp").write_bytes(b"\x00garbage")  # killed mid-amend: the old state holds
    again = ck.latest(tmp_path, "r")
    assert again is not None and again.state["eval"]["orphans"] == 2
    with pytest.raises(CheckpointError, match="cannot amend"):
        ck.amend_state(tmp_path, 9, _state(9))  # no such checkpoint
