"""Publish and materialize over directory stores: chains, anchors, in-place updates, ties, gc."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch
from hub_helpers import same_bits, step, tiny_state
from safetensors.torch import load_file
from slowdown import scaled

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, HubError, VersionConflict


def publish_chain(hub: Hub, n: int, frac: float = 0.03, hidden: int = 64) -> list[dict[str, torch.Tensor]]:
    states = [tiny_state(hidden=hidden)]
    for i in range(1, n):
        states.append(step(states[-1], seed=i, frac=frac))
    for i, state in enumerate(states):
        assert hub.publish(state).version == i
    return states


def test_twenty_versions_with_anchor_interval_five_materialize_exactly(
        dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config(anchor_interval=5)) as hub:
        states = publish_chain(hub, 20)
        assert [hub.manifest(v).anchor for v in range(20)] == [v - v % 5 for v in range(20)]
        for v in range(20):
            assert same_bits(hub.materialize(v), states[v]), v
        assert hub.latest() == 19


def test_in_place_update_follows_the_chain_and_skips_dense_anchors(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config(anchor_interval=5)) as hub:
        states = publish_chain(hub, 12)
        into = {k: v.clone() for k, v in states[3].items()}
        into["lm_head.weight"] = into["model.embed_tokens.weight"]
        ptr = into["model.layers.0.mlp.up_proj.weight"].data_ptr()
        for v in range(12):
            hub.manifest(v)  # cached from here on: the byte counts below are objects only
        steps, from_caller = hub.reader.plan(7, 3)
        assert from_caller and [(s.version, s.dense) for s in steps] == [(v, False) for v in range(4, 8)]
        before = hub.store.stats.get_bytes
        out = hub.materialize(7, into=into, have_version=3)  # crosses the anchor at 5 via its delta
        delta_bytes = hub.store.stats.get_bytes - before
        assert out is into and same_bits(into, states[7])
        assert into["model.layers.0.mlp.up_proj.weight"].data_ptr() == ptr  # updated in place
        before = hub.store.stats.get_bytes
        fresh = hub.materialize(7)
        assert same_bits(fresh, states[7])
        assert delta_bytes < hub.store.stats.get_bytes - before
        # More than K behind: starts from the newest anchor, still exact.
        stale = {k: v.clone() for k, v in states[0].items()}
        assert same_bits(hub.materialize(11, into=stale, have_version=0), states[11])


def test_tied_weights_stored_once_and_handed_out_shared(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config()) as hub:
        hub.publish(tiny_state())
        entries = {t.name: t for t in hub.manifest(0).tensors}
        assert entries["lm_head.weight"].encoding == "tied"
        assert entries["lm_head.weight"].tied_to == "model.embed_tokens.weight"
        out = hub.materialize(0)
        assert out["lm_head.weight"] is out["model.embed_tokens.weight"]


def test_unchanged_tensors_are_same_and_cost_nothing(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config()) as hub:
        state = tiny_state()
        hub.publish(state)
        nxt = dict(state)
        nxt["model.norm.weight"] = (state["model.norm.weight"].view(torch.int16) + 1).view(torch.bfloat16)
        pv = hub.publish(nxt)
        encodings = {t.name: t.encoding for t in hub.manifest(1).tensors}
        assert encodings["model.norm.weight"] == "delta"
        assert encodings["model.layers.0.mlp.up_proj.weight"] == "same"
        assert pv.bytes_written < 8000
        assert same_bits(hub.materialize(1), nxt)


def test_dtypes_and_odd_shapes_round_trip(dir_config: Callable[..., FleetConfig]) -> None:
    state = {
        "f32": torch.randn(3, 5), "f16": torch.randn(7).half(),
        "i8": torch.randint(-128, 127, (4, 4), dtype=torch.int8),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "nan": torch.tensor([float("nan"), -0.0, 1e-40]),
    }
    with Hub.from_config(dir_config()) as hub:
        hub.publish(state)
        nxt = {k: v.clone() for k, v in state.items()}
        nxt["f32"][1, 2] = -0.0
        nxt["i8"][0, 0] = 5
        hub.publish(nxt)
        assert same_bits(hub.materialize(1), nxt)
        assert same_bits(hub.materialize(0), state)


def test_safetensors_output_matches(dir_config: Callable[..., FleetConfig], tmp_path: pathlib.Path) -> None:
    with Hub.from_config(dir_config()) as hub:
        states = publish_chain(hub, 3)
        path = hub.materialize_to_safetensors(2, tmp_path / "v2.safetensors")
        loaded = load_file(str(path))
        assert "lm_head.weight" not in loaded  # tied: saved once, as Hugging Face does
        loaded["lm_head.weight"] = loaded["model.embed_tokens.weight"]
        assert same_bits(loaded, states[2])


def test_publishing_over_an_existing_manifest_is_a_conflict(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config()) as hub:
        hub.publish(tiny_state(1))
        hub.store.create(f"{hub.run}/versions/{1:012d}.json", b"{}")  # someone else's version 1
        with pytest.raises(VersionConflict, match="version 1"):
            hub.publish(tiny_state(2))
        assert hub.latest() == 0


def test_wait_for_version_is_bounded(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config(poll_interval_s=0.05)) as hub:
        hub.publish(tiny_state())
        assert hub.wait_for_version(0, timeout_s=scaled(1)) == 0
        with pytest.raises(HubError) as err:
            hub.wait_for_version(3, timeout_s=0.2)
        assert err.value.retriable


def test_gc_keeps_the_window_and_the_chains_it_needs(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config(anchor_interval=5, retention_versions=4, gc_grace_s=0)) as hub:
        states = publish_chain(hub, 14)
        report = hub.gc()
        # Window 10..13 starts at anchor 10: 0..9 go, and with them every object only they used.
        assert report.deleted_versions == list(range(10))
        assert hub.versions() == [10, 11, 12, 13]
        assert report.deleted_objects and report.freed_bytes > 0
        for v in (10, 13):
            assert same_bits(hub.materialize(v), states[v])
        assert hub.gc().deleted_objects == []


def test_gc_keeps_a_version_an_unfinished_evaluation_pinned(dir_config: Callable[..., FleetConfig]) -> None:
    """An evaluation pinned version 7 (DESIGN.md §12): retention keeps it and the chain from its anchor 5,
    however old, until the pin is released; then the window alone decides."""
    with Hub.from_config(dir_config(anchor_interval=5, retention_versions=4, gc_grace_s=0)) as hub:
        states = publish_chain(hub, 14)
        hub.pin(7)
        assert hub.pinned() == [7]
        report = hub.gc()
        assert report.deleted_versions == list(range(5))
        assert same_bits(hub.materialize(7), states[7])
        hub.pin(7, pinned=False)
        assert hub.pinned() == [] and hub.gc().deleted_versions == list(range(5, 10))
        assert hub.versions() == [10, 11, 12, 13]


def _changed(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    return torch.nonzero(a.reshape(-1).view(torch.int16) != b.reshape(-1).view(torch.int16)).flatten().tolist()


def test_changes_name_exactly_the_changed_elements_and_update_in_place(
        dir_config: Callable[..., FleetConfig]) -> None:
    _check_changes(dir_config, hidden=64)


def test_changes_of_tensors_stored_in_several_parts_are_joined_in_order(
        dir_config: Callable[..., FleetConfig]) -> None:
    """At hidden 256 the larger tensors span several 64 KiB parts: their changes are recorded per part and
    joined per tensor (on the reader's threads, hub/inplace.py)."""
    _check_changes(dir_config, hidden=256, joined=True)


def _check_changes(dir_config: Callable[..., FleetConfig], hidden: int, joined: bool = False) -> None:
    with Hub.from_config(dir_config(anchor_interval=5)) as hub:
        states = publish_chain(hub, 9, hidden=hidden)
        parts = {t.name: len(t.parts) for t in hub.manifest(4).tensors}
        assert (sum(n > 1 for n in parts.values()) >= 2) == joined, parts  # two or more to join side by side
        into = {k: v.clone() for k, v in states[3].items()}
        into["lm_head.weight"] = into["model.embed_tokens.weight"]
        ptrs = {k: v.data_ptr() for k, v in into.items()}
        for have, version in ((3, 4), (4, 7)):  # one step (the kernel path), then three across the anchor at 5
            found = hub.changes(version, into, have)
            assert found is not None and same_bits(into, states[version])
            assert {k: v.data_ptr() for k, v in into.items()} == ptrs
            for name, (positions, values) in found.items():
                assert positions.dtype.name == "int64"
                union = sorted({p for v in range(have + 1, version + 1)
                                for p in _changed(states[v - 1][name], states[v][name])})
                assert positions.tolist() == union, name
                # The new values, of their own memory (the next version changes `into` in place).
                expected = states[version][name].reshape(-1)[torch.from_numpy(positions)]
                assert same_bits({name: values}, {name: expected}), name
                assert values.untyped_storage().data_ptr() != into[name].untyped_storage().data_ptr()
            assert found["lm_head.weight"] is found["model.embed_tokens.weight"]
        # More than an anchor interval behind: no chain in place; the caller materializes.
        stale = {k: v.clone() for k, v in states[0].items()}
        assert hub.changes(8, stale, 0) is None and same_bits(stale, states[0])


def test_changes_from_a_state_that_is_not_the_claimed_version_write_nothing(
        dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config()) as hub:
        states = publish_chain(hub, 3)
        wrong = {k: v.clone() for k, v in states[0].items()}  # claims to hold version 1
        before = {k: v.clone() for k, v in wrong.items()}
        with pytest.raises(HubError, match="digest"):
            hub.changes(2, wrong, 1)
        assert same_bits(wrong, before)
