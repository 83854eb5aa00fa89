"""Any process can publish a delta: a publisher with nothing in memory reads the store's newest version.

Five `fleetrl hub publish` processes in a row write one anchor and four deltas, as many bytes as one
long-lived publisher, and every version pulls back bit for bit. A newest version that does not
verify is no parent: the next version is an anchor and says why. A version whose manifest landed
but whose `latest` pointer did not (a publisher killed in between) is built on, not collided with.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import yaml
from hub_helpers import hub_env, same_bits, step, tiny_state
from safetensors.torch import load_file, save_file
from slowdown import scaled

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, VersionConflict

FLEETRL = [sys.executable, "-m", "fleetrl.cli"]


def _chain(n: int, untie: bool = False) -> list[dict[str, torch.Tensor]]:
    """Versions of a small model; `untie` drops lm_head (saved once, as Hugging Face files hold it)."""
    states = [tiny_state(hidden=256)]
    for i in range(1, n):
        states.append(step(states[-1], seed=i))
    return [{k: v for k, v in s.items() if k != "lm_head.weight"} for s in states] if untie else states


def _cli(config: FleetConfig, tmp_path: pathlib.Path) -> list[str]:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return ["--config", str(path)]


@pytest.mark.slow
def test_five_cli_processes_publish_deltas_as_small_as_one_process(
        dir_config: Callable[..., FleetConfig], tmp_path: pathlib.Path) -> None:
    states = _chain(5, untie=True)
    config = dir_config(anchor_interval=8)
    cfg = _cli(config, tmp_path)
    cli_bytes, reasons = [], []
    for i, state in enumerate(states):
        file = tmp_path / f"v{i}.safetensors"
        save_file(state, str(file))
        done = subprocess.run([*FLEETRL, "hub", "publish", str(file), *cfg], env=hub_env(), capture_output=True,
                              timeout=scaled(120), check=False)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        out = json.loads(done.stdout)
        assert out["version"] == i
        cli_bytes.append(out["bytes_written"])
        reasons.append(out["anchor_reason"])
    assert reasons == ["first version", None, None, None, None]

    one = make_other_store(config, tmp_path)
    with Hub.from_config(one) as hub:
        one_bytes = [hub.publish(s).bytes_written for s in states]
    assert cli_bytes[0] == pytest.approx(one_bytes[0], rel=0.05)
    for v in range(1, 5):  # deltas: a few KB against the ~100 KB anchor
        assert cli_bytes[v] == pytest.approx(one_bytes[v], rel=0.05), (cli_bytes, one_bytes)
        assert cli_bytes[v] < cli_bytes[0] / 5

    with Hub.from_config(config) as hub:
        for v, state in enumerate(states):
            assert hub.manifest(v).anchor == 0
            assert same_bits(hub.materialize(v), state), v
    done = subprocess.run([*FLEETRL, "hub", "pull", "latest", str(tmp_path / "out.safetensors"), *cfg],
                          env=hub_env(), capture_output=True, timeout=scaled(120), check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert same_bits(load_file(str(tmp_path / "out.safetensors")), states[4])


def make_other_store(config: FleetConfig, tmp_path: pathlib.Path) -> FleetConfig:
    doc = config.model_dump(mode="json")
    doc["hub"]["home_store"] = {"url": (tmp_path / "one-process").as_uri()}
    return FleetConfig.model_validate(doc)


def test_a_newest_version_that_fails_verification_makes_an_anchor_that_says_why(
        dir_config: Callable[..., FleetConfig], tmp_path: pathlib.Path) -> None:
    states = _chain(3)
    config = dir_config()
    with Hub.from_config(config) as hub:
        hub.publish(states[0])
        hub.publish(states[1])
    for obj in (tmp_path / "home").rglob("objects/*"):  # damage every object: version 1 cannot be rebuilt
        obj.write_bytes(obj.read_bytes()[:-3] + b"xyz")
    with Hub.from_config(config) as hub:
        pv = hub.publish(states[2])
        assert pv.version == 2 and pv.anchor == 2
        assert pv.anchor_reason is not None and "newest version 1 cannot be a parent" in pv.anchor_reason
        assert "IntegrityError" in pv.anchor_reason
        assert hub.manifest(2).parent == 1
        assert all(t.delta is None for t in hub.manifest(2).tensors)  # no delta from a parent it could not read
        assert same_bits(hub.materialize(2), states[2])


def test_a_shape_change_makes_an_anchor_naming_the_tensor(dir_config: Callable[..., FleetConfig]) -> None:
    config = dir_config()
    with Hub.from_config(config) as hub:
        hub.publish(tiny_state())
    wider = tiny_state(hidden=96)
    with Hub.from_config(config) as hub:
        pv = hub.publish(wider)
        assert pv.anchor == 1 and pv.anchor_reason is not None and "model.embed_tokens.weight" in pv.anchor_reason
        assert same_bits(hub.materialize(1), wider)


def test_a_manifest_without_its_latest_pointer_is_built_on(dir_config: Callable[..., FleetConfig]) -> None:
    """A publisher killed after creating manifest 2 but before moving `latest` (still at 1)."""
    states = _chain(4)
    config = dir_config()
    with Hub.from_config(config) as hub:
        for s in states[:2]:
            hub.publish(s)
        pointer = hub.store.get(f"{hub.run}/latest")
        hub.publish(states[2])
        hub.store.put(f"{hub.run}/latest", pointer)
        hub.store.delete(f"{hub.run}/holders/{2:012d}/home")
        assert hub.latest() == 1
    with Hub.from_config(config) as hub:
        # what a restarted trainer compares its checkpoint with: the pointer says 1, the store holds 2
        assert (hub.latest(), hub.newest()) == (1, 2)
        adopted = hub.published(2)
        assert adopted.version == 2 and adopted.manifest_key.endswith(f"{2:012d}.json")
        assert adopted.sha256 == hashlib.sha256(hub.store.get(adopted.manifest_key)).hexdigest()
        assert hub.holds(states[2], 2) and not hub.holds(states[1], 2) and not hub.holds(states[3], 2)
        assert not hub.holds({k: v for k, v in states[2].items() if k != "lm_head.weight"}, 2)
        with pytest.raises(VersionConflict, match=r"asked to publish version 2 but the next version .* is 3"):
            hub.publish(states[3], version=2)
        pv = hub.publish(states[3], version=3)
        assert pv.version == 3 and pv.anchor_reason is None and hub.manifest(3).parent == 2
        assert hub.holders(2) == ["home"]
        assert same_bits(hub.materialize(3), states[3])
