"""A rollout node cannot publish a version any reader accepts (Ed25519, the default scheme).

A node holds the hub's public key, its MQTT and Kafka passwords and its S3 keys. The test signs a
version with every one of them (as an HMAC key, and as the seed of an Ed25519 key claiming the
trainer's key id), writes it where the trainer would, and checks that each reader refuses it: a
node's reader, the region's replicator and the trainer's own reader.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hub_helpers import HUB_KEY, step, tiny_state

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, SignatureError
from fleetrl.hub import manifest as mf
from fleetrl.hub.errors import ObjectNotFound
from fleetrl.hub.replicator import Replicator
from fleetrl.hub.signing import Keys, load_keys

NODE_SECRETS = {"mqtt": "node-mqtt-password-1", "kafka": "node-kafka-password-2",
                "s3_key_id": "AKIANODEKEY000000003", "s3_secret": "node-s3-secret-key-4"}


def _node_config(trainer: FleetConfig, public_hex: str) -> FleetConfig:
    """What a rollout node's fleet.yaml holds: the public key and the node's own credentials."""
    node = trainer.model_copy(deep=True)
    node.hub.signing.key_env = None
    node.hub.signing.public_key = public_hex
    node.mqtt.username, node.mqtt.password = "node", NODE_SECRETS["mqtt"]  # type: ignore[assignment]
    region = node.regions[0]
    region.kafka.sasl_username, region.kafka.sasl_password = "node", NODE_SECRETS["kafka"]  # type: ignore[assignment]
    region.store.access_key_id = NODE_SECRETS["s3_key_id"]  # type: ignore[assignment]
    region.store.secret_access_key = NODE_SECRETS["s3_secret"]  # type: ignore[assignment]
    return node


def _forgers(public_hex: str, genuine_key_id: str) -> Iterator[tuple[str, Keys]]:
    """Every signing key a node could make from what it holds."""
    materials = {"public key (hex)": public_hex.encode(), "public key (raw)": bytes.fromhex(public_hex),
                 **{name: value.encode() for name, value in NODE_SECRETS.items()}}
    for name, material in materials.items():
        key_id = hashlib.sha256(material).hexdigest()[:16]
        yield f"HMAC with the {name}", Keys("hmac-sha256", key_id, material, material)
        yield f"HMAC with the {name}, claiming the trainer's key id", Keys("hmac-sha256", genuine_key_id, material,
                                                                            material)
        seed = material if len(material) == 32 else hashlib.sha256(material).digest()
        private = Ed25519PrivateKey.from_private_bytes(seed)
        yield f"Ed25519 seeded with the {name}", Keys("ed25519", genuine_key_id, private, private.public_key())


@pytest.fixture
def fleet(dir_config: Callable[..., FleetConfig], tmp_path: pathlib.Path,
          monkeypatch: pytest.MonkeyPatch) -> tuple[FleetConfig, FleetConfig, Keys]:
    """(trainer config, node config, trainer keys) with versions 0 and 1 published by the trainer."""
    trainer = dir_config()
    assert trainer.hub.signing.scheme == "ed25519"  # the default
    keys = load_keys(trainer.hub.signing)
    with Hub.from_config(trainer) as hub:
        hub.publish(tiny_state())
        hub.publish(step(tiny_state(), 1))
    monkeypatch.delenv("FLEETRL_HUB_KEY")
    public_hex = keys.verify_key.public_bytes_raw().hex()
    return trainer, _node_config(trainer, public_hex), keys


def test_a_node_cannot_sign_at_all(fleet: tuple[FleetConfig, FleetConfig, Keys]) -> None:
    _, node, _ = fleet
    with Hub.from_config(node) as hub, pytest.raises(SignatureError, match="no ed25519 signing key"):
        hub.publish(step(tiny_state(), 2))


def test_a_version_signed_with_anything_a_node_holds_is_refused_by_every_reader(
        fleet: tuple[FleetConfig, FleetConfig, Keys], monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, node, keys = fleet
    region = node.regions[0].name
    with Hub.from_config(node) as reader:
        genuine = reader.manifest(1)
    forged_body: dict[str, Any] = {**genuine.model_dump(), "version": 2, "parent": 1}
    forged = mf.Manifest.model_validate(forged_body)
    tried: list[str] = []
    for name, forger in _forgers(node.hub.signing.public_key or "", keys.key_id):
        with Hub.from_config(node) as hub:
            hub.store.put(mf.version_key(node.run, 2), mf.dump_signed(forged, forger))
        monkeypatch.delenv("FLEETRL_HUB_KEY", raising=False)
        with Hub.from_config(node) as node_reader, pytest.raises(SignatureError):
            node_reader.materialize(2)
        replicator = Replicator(node, region)
        try:
            with pytest.raises(ObjectNotFound, match=r"signature|signed with"):
                replicator.copy_version(2)
        finally:
            replicator.close()
        monkeypatch.setenv("FLEETRL_HUB_KEY", HUB_KEY)
        with Hub.from_config(trainer) as trainer_reader, pytest.raises(SignatureError):
            trainer_reader.materialize(2)
        tried.append(name)
    assert len(tried) == 3 * (2 + len(NODE_SECRETS)), tried
