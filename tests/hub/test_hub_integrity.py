"""Refusals: flipped bytes, truncated frames, swapped manifests, wrong keys, unsigned manifests.

Each refusal names the store and key (and the tensor where one is at fault), and the caller's
state dict is left exactly as it was.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import pytest
import torch
from hub_helpers import same_bits, step, tiny_state

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, IntegrityError, SignatureError
from fleetrl.hub.manifest import dump_signed, manifest_text
from fleetrl.hub.signing import generate_ed25519


def published(config: FleetConfig) -> tuple[Hub, list[dict[str, torch.Tensor]]]:
    hub = Hub.from_config(config)
    states = [tiny_state(), step(tiny_state(), 1)]
    for s in states:
        hub.publish(s)
    return hub, states


def objects(hub: Hub) -> list[pathlib.Path]:
    root = pathlib.Path(hub.store.url.removeprefix("file://")) / hub.run / "objects"
    return sorted(root.iterdir())


def test_a_flipped_byte_anywhere_in_any_object_is_refused(dir_config: Callable[..., FleetConfig]) -> None:
    hub, states = published(dir_config())
    with hub:
        delta = hub.manifest(1).delta_objects()
        for path in objects(hub):
            good = path.read_bytes()
            for offset in (0, len(good) // 3, len(good) // 2, len(good) - 1):
                bad = bytearray(good)
                bad[offset] ^= 0x01
                path.write_bytes(bytes(bad))
                with pytest.raises(IntegrityError) as err:
                    hub.materialize(1)  # from the anchor: reads every object
                assert path.name in str(err.value) and hub.store.url in str(err.value)
                assert "tensor" in str(err.value)
                if path.name in delta:  # in place from version 0: reads the delta object only
                    into = {k: v.clone() for k, v in states[0].items()}
                    with pytest.raises(IntegrityError, match=path.name):
                        hub.materialize(1, into=into, have_version=0)
                    assert same_bits(into, states[0])  # nothing half-applied
            path.write_bytes(good)
        assert same_bits(hub.materialize(1), states[1])


def test_a_truncated_frame_is_refused(dir_config: Callable[..., FleetConfig]) -> None:
    hub, states = published(dir_config())
    with hub:
        delta = hub.manifest(1).delta_objects().pop()
        path = next(p for p in objects(hub) if p.name == delta)
        path.write_bytes(path.read_bytes()[:-7])
        into = {k: v.clone() for k, v in states[0].items()}
        with pytest.raises(IntegrityError, match=delta):
            hub.materialize(1, into=into, have_version=0)
        assert same_bits(into, states[0])


def test_a_swapped_manifest_is_refused(dir_config: Callable[..., FleetConfig]) -> None:
    hub, _ = published(dir_config())
    with hub:
        root = pathlib.Path(hub.store.url.removeprefix("file://")) / hub.run / "versions"
        (root / f"{1:012d}.json").write_bytes((root / f"{0:012d}.json").read_bytes())
        with pytest.raises(IntegrityError, match="swapped manifest"):
            hub.materialize(1)


def test_a_tampered_or_unsigned_manifest_is_refused(dir_config: Callable[..., FleetConfig]) -> None:
    hub, _ = published(dir_config())
    with hub:
        path = pathlib.Path(hub.store.url.removeprefix("file://")) / hub.run / "versions" / f"{1:012d}.json"
        doc = json.loads(manifest_text(path.read_bytes(), str(path)))
        doc["manifest"]["tensors"][1]["sha256"] = "0" * 64
        path.write_text(json.dumps(doc))
        with pytest.raises(SignatureError, match="does not verify"):
            Hub.from_config(hub.config).materialize(1)
        del doc["signature"]
        path.write_text(json.dumps(doc))
        with pytest.raises(SignatureError, match="unsigned"):
            Hub.from_config(hub.config).materialize(1)


def test_a_wrong_hmac_key_is_refused(dir_config: Callable[..., FleetConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    hub, _ = published(dir_config(signing={"scheme": "hmac-sha256"}))
    hub.close()
    monkeypatch.setenv("FLEETRL_HUB_KEY", "another key")
    with Hub.from_config(hub.config) as reader, pytest.raises(SignatureError) as err:
        reader.materialize(0)
    assert f"{0:012d}.json" in str(err.value) and "key" in str(err.value)


def test_ed25519_readers_verify_with_the_public_key_only(
        dir_config: Callable[..., FleetConfig], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    private, public = generate_ed25519()
    (tmp_path / "hub.pub").write_text(public)
    monkeypatch.setenv("FLEETRL_HUB_KEY", private)
    config = dir_config(signing={"scheme": "ed25519"})
    hub, states = published(config)
    hub.close()
    monkeypatch.delenv("FLEETRL_HUB_KEY")
    reader_cfg = config.model_copy(deep=True)
    reader_cfg.hub.signing.public_key_file = str(tmp_path / "hub.pub")
    with Hub.from_config(reader_cfg) as reader:
        assert same_bits(reader.materialize(1), states[1])
        with pytest.raises(SignatureError, match="no ed25519 signing key"):
            reader.publish(states[0])
    _, other = generate_ed25519()
    (tmp_path / "hub.pub").write_text(other)
    with Hub.from_config(reader_cfg) as reader, pytest.raises(SignatureError, match="expected key"):
        reader.materialize(1)


def test_a_caller_state_that_is_not_the_claimed_version_is_refused_untouched(
        dir_config: Callable[..., FleetConfig]) -> None:
    hub, states = published(dir_config())
    name = "model.layers.0.mlp.up_proj.weight"
    old, new = states[0][name].view(torch.int16).reshape(-1), states[1][name].view(torch.int16).reshape(-1)
    changed = int(torch.nonzero(old != new)[0])
    unchanged = int(torch.nonzero(old == new)[0])
    with hub:
        for where, verify_full in ((changed, False), (unchanged, True)):
            into = {k: v.clone() for k, v in states[0].items()}
            into["lm_head.weight"] = into["model.embed_tokens.weight"]
            into[name].view(torch.int16).view(-1)[where] += 1  # not version 0 any more
            before = {k: v.clone() for k, v in into.items()}
            with pytest.raises(IntegrityError, match=name):
                hub.materialize(1, into=into, have_version=0, verify_full=verify_full)
            assert same_bits(into, before)


def test_a_failing_part_puts_back_every_part_already_written(dir_config: Callable[..., FleetConfig]) -> None:
    """In place, parts are written as soon as they check out; one bad part restores all the others."""
    states = [tiny_state(hidden=256), step(tiny_state(hidden=256), 1)]  # 64 KiB frames: several parts
    name = "model.layers.0.mlp.up_proj.weight"
    with Hub.from_config(dir_config()) as hub:
        for s in states:
            hub.publish(s)
        assert len(hub.manifest(1).tensors[3].parts) > 1 and hub.manifest(1).tensors[3].name == name
        into = {k: v.clone() for k, v in states[0].items()}
        into["lm_head.weight"] = into["model.embed_tokens.weight"]
        old, new = into[name].view(torch.int16).view(-1), states[1][name].view(torch.int16).reshape(-1)
        old[int(torch.nonzero(old != new)[-1])] += 1  # one changed word of its last part: not version 0
        before = {k: v.clone() for k, v in into.items()}
        with pytest.raises(IntegrityError, match=name):
            hub.materialize(1, into=into, have_version=0)
        assert same_bits(into, before)  # the other parts of this tensor and the other tensors: put back
        into = {k: v.clone() for k, v in states[0].items()}
        assert same_bits(hub.materialize(1, into=into, have_version=0), states[1])


def test_overlapping_parts_in_a_signed_manifest_are_refused_untouched(dir_config: Callable[..., FleetConfig]) -> None:
    hub, states = published(dir_config())
    with hub:
        path = pathlib.Path(hub.store.url.removeprefix("file://")) / hub.run / "versions" / f"{1:012d}.json"
        manifest = hub.manifest(1)
        tensors = list(manifest.tensors)
        i = next(i for i, t in enumerate(tensors) if t.encoding == "delta")
        parts = [*tensors[i].parts, tensors[i].parts[0]]  # the same range twice: applied twice, undone twice
        tensors[i] = tensors[i].model_copy(update={"parts": parts})
        forged = manifest.model_copy(update={"tensors": tensors})
        path.write_bytes(dump_signed(forged, hub.keys()))  # signed with the real key: only the check stops it
        into = {k: v.clone() for k, v in states[0].items()}
        with Hub.from_config(hub.config) as reader, pytest.raises(IntegrityError, match="overlap"):
            reader.materialize(1, into=into, have_version=0)
        assert same_bits(into, states[0])
