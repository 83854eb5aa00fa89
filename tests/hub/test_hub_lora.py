"""LoRA adapter versions in the hub: the base published once, every later version the adapter alone
(its own chain of deltas and anchors), its manifest naming the base; readers refuse an adapter of a
base they do not hold; signing, retention and replication (directories and moto's S3) as for any
version."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import pytest
import torch
from hub_helpers import same_bits, three_stores, tiny_state

from fleetrl.config import FleetConfig
from fleetrl.hub import AdapterInfo, BaseMismatch, Hub, HubError, Replicator, SignatureError, open_store
from fleetrl.hub.manifest import manifest_text
from fleetrl.hub.stores import ObjectStore

MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj")


def adapter_state(seed: int = 0, r: int = 4, hidden: int = 64) -> dict[str, torch.Tensor]:
    """A bf16 LoRA adapter of `tiny_state`'s linear layers under peft's names (B non-zero: trained)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, width in zip(MODULES, (hidden, 2 * hidden), strict=True):
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, hidden, generator=g) * 0.05
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(width, r, generator=g) * 1e-3
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def adapter_step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next adapter version: every element of B moves by one ulp, 3 % of A's (as Adam moves them)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone()
        mask = torch.rand(bits.shape, generator=g) < (1.0 if name.endswith("lora_B.weight") else 0.03)
        sign = torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
        out[name] = torch.where(mask, bits + sign, bits).view(torch.bfloat16)
    return out


def info(base: int, r: int = 4) -> AdapterInfo:
    return AdapterInfo(base=base, r=r, lora_alpha=8)


def publish_lora(hub: Hub, n: int) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """Base (version 0) and adapter versions 1..n; returns the base version and the adapters by version."""
    base = hub.publish(tiny_state()).version
    adapters: list[dict[str, torch.Tensor]] = [{}]
    state = adapter_state()
    for v in range(1, n + 1):
        assert hub.publish(state, adapter=info(base)).version == v
        adapters.append(state)
        state = adapter_step(state, v)
    return base, adapters


def test_adapter_versions_chain_on_their_base(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config(anchor_interval=3)) as hub:
        base, adapters = publish_lora(hub, 7)
        m = {v: hub.manifest(v) for v in range(8)}
        assert m[0].adapter is None and m[0].is_anchor
        # The first adapter is an anchor of its own chain: nothing of the base is a parent of it.
        assert m[1].adapter == info(0) and m[1].is_anchor and m[1].parent == 0
        assert all(t.delta is None and t.encoding == "anchor" for t in m[1].tensors)
        assert [v for v in range(1, 8) if m[v].is_anchor] == [1, 4, 7]  # anchor_interval 3, counted from 1
        assert all(m[v].base == 0 and m[v].anchor == (1 if v < 4 else 4 if v < 7 else 7) for v in range(1, 8))
        assert {t.encoding for t in m[2].tensors} == {"delta"}
        assert {t.name for t in m[5].tensors} == set(adapters[1])
        state: dict[str, torch.Tensor] | None = None
        have = None
        for v in range(1, 8):  # in place along the adapter chain, as a rollout node reads it
            got, state = hub.materialize_adapter(v, base, into=state, have_version=have)
            assert got == info(0) and same_bits(state, adapters[v])
            have = v
        assert same_bits(hub.materialize(0), tiny_state())  # the base, whole, as any version
        # A delta of the adapter is far below the adapter itself.
        assert sum(m[5].objects.values()) < sum(m[4].objects.values()) / 2


def test_a_version_of_full_weights_is_written_as_before_adapters(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config()) as hub:
        publish_lora(hub, 1)
        root = pathlib.Path(hub.store.url.removeprefix("file://")) / hub.run / "versions"
        full = json.loads(manifest_text((root / f"{0:012d}.json").read_bytes(), "v0"))["manifest"]
        adapter = json.loads(manifest_text((root / f"{1:012d}.json").read_bytes(), "v1"))["manifest"]
    assert "adapter" not in full  # readers that predate adapters read it as they did
    assert adapter["adapter"] == {"base": 0, "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "peft_type": "LORA"}


def test_readers_refuse_an_adapter_of_a_base_they_do_not_hold(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config()) as hub:
        publish_lora(hub, 2)
        with pytest.raises(BaseMismatch, match="adapter of base version 0; this reader holds no base"):
            hub.materialize_adapter(2, None)
        with pytest.raises(BaseMismatch, match="this reader holds base version 5"):
            hub.materialize_adapter(2, 5)
        with pytest.raises(HubError, match="version 0 is full weights, not an adapter"):
            hub.materialize_adapter(0, None)
        with pytest.raises(HubError, match="base version 9: the base is not readable"):
            hub.publish(adapter_state(), adapter=info(9))
        with pytest.raises(HubError, match="that version is itself an adapter"):
            hub.publish(adapter_state(), adapter=info(2))
        assert hub.latest() == 2  # nothing was published by the refused calls


def test_a_new_publisher_continues_the_adapter_chain_without_reading_the_base(
        dir_config: Callable[..., FleetConfig]) -> None:
    config = dir_config(anchor_interval=8)
    with Hub.from_config(config) as hub:
        _, adapters = publish_lora(hub, 2)
        base_bytes = sum(hub.manifest(0).objects.values())
    view = {n: open_store(n, c) for n, c in config.stores().items()}
    with Hub(config, stores=view) as fresh:  # a restarted trainer: nothing in memory
        pv = fresh.publish(adapter_step(adapters[2], 9), adapter=info(0))
        assert pv.version == 3 and pv.anchor_reason is None  # a delta against adapter version 2
        assert view["home"].stats.object_bytes < base_bytes  # it read version 2's chain, never the base
        # Full weights after adapters start a chain of their own.
        pv = fresh.publish(tiny_state(1))
        assert pv.anchor == 4 and pv.anchor_reason is not None and "after adapter version 3" in pv.anchor_reason


def test_gc_keeps_the_base_of_every_retained_adapter_version(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config(anchor_interval=3, retention_versions=2, gc_grace_s=0)) as hub:
        _, adapters = publish_lora(hub, 9)
        report = hub.gc()
        # Window 8..9 starts at adapter anchor 7; its base, version 0, stays however old.
        assert report.kept_versions == [0, 7, 8, 9] and report.deleted_versions == list(range(1, 7))
        assert hub.versions() == [0, 7, 8, 9] and hub.holders(0) == ["home"]
        assert same_bits(hub.materialize(0), tiny_state())
        assert same_bits(hub.materialize_adapter(9, 0)[1], adapters[9])
        assert hub.gc().deleted_objects == []


def test_a_tampered_adapter_manifest_is_refused(dir_config: Callable[..., FleetConfig]) -> None:
    with Hub.from_config(dir_config()) as hub:
        publish_lora(hub, 2)
        hub.publish(tiny_state(2))  # version 3: another base a forger would point the adapter at
        path = pathlib.Path(hub.store.url.removeprefix("file://")) / hub.run / "versions" / f"{2:012d}.json"
        doc = json.loads(manifest_text(path.read_bytes(), str(path)))
        doc["manifest"]["adapter"]["base"] = 3
        path.write_text(json.dumps(doc))
        with Hub.from_config(hub.config) as reader, pytest.raises(SignatureError, match="does not verify"):
            reader.materialize_adapter(2, 3)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_adapter_versions_replicate_once_per_region_and_a_late_region_fetches_the_base(
        kind: str, run_id: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> None:
    config = three_stores(kind, run_id, tmp_path, request, anchor_interval=3)

    def clients() -> dict[str, ObjectStore]:
        return {n: open_store(n, c) for n, c in config.stores().items()}

    with Hub.from_config(config) as trainer:
        base, adapters = publish_lora(trainer, 3)
    near_view = clients()
    assert Replicator(config, "near", stores=near_view).replicate_once() == [0, 1, 2, 3]
    with Hub.from_config(config) as trainer:  # `far` joins later
        state = adapters[3]
        for v in range(4, 9):
            state = adapter_step(state, v)
            trainer.publish(state, adapter=info(base))
            adapters.append(state)
        newest_anchor = trainer.manifest(8).anchor
    # More than an anchor interval behind, `near` copies every version in order (it never jumps past one).
    assert Replicator(config, "near", stores=near_view).replicate_once() == [4, 5, 6, 7, 8]
    far_view = clients()
    # The adapter chain's newest anchor and what follows it, and first the base that chain applies to.
    assert Replicator(config, "far", stores=far_view).replicate_once() == [0, *range(newest_anchor, 9)]
    assert far_view["home"].stats.object_gets == 0  # all of it from `near`, the nearer holder
    with Hub(config, store="far", stores=clients()) as node:
        assert node.holders(0) == ["far"] and node.latest() == 8
        assert same_bits(node.materialize(0), tiny_state())
        assert same_bits(node.materialize_adapter(8, 0)[1], adapters[8])
        check = node.verify_store()  # the base, then the chain from its anchor: whole, not a gap
        assert check.ok and check.gaps == [] and check.versions == [0, *range(newest_anchor, 9)], check
    again = Replicator(config, "far", stores=clients())
    assert again.replicate_once() == [] and again._holes == []  # nor a hole to fill for the next replicator
    with Hub.from_config(config) as home:  # peer references name every holder, the base's too
        assert home.holders(0) == ["far", "home", "near"] and home.holders(8) == ["far", "home", "near"]
