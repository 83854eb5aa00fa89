"""Config of the transports FleetRL runs over: object stores, the hub, Kafka, MQTT.

These describe endpoints and wire behaviour; the other section modules hold the run itself (model,
algorithm, regions, trainer) and `fleet.py` composes them all.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fleetrl.config.base import MIB, Model
from fleetrl.config.secrets import Secret


class StoreConfig(Model):
    """An object store holding hub objects: a local directory or an S3-API bucket."""

    url: str
    """`file:///abs/dir` or `s3://bucket/prefix`. A bare path is taken as a directory."""
    endpoint_url: str | None = None
    """S3 endpoint for non-AWS stores (MinIO, R2, moto). None means AWS's own endpoint."""
    region_name: str | None = None
    """S3 region (AWS_DEFAULT_REGION applies when unset)."""
    access_key_id: Secret | None = None
    """S3 access key id; with none of its sources set, boto3's own chain applies (instance role, AWS_*)."""
    access_key_id_env: str | None = None
    """Environment variable holding the access key id."""
    access_key_id_file: str | None = None
    """File holding the access key id (systemd credential, Kubernetes secret)."""
    secret_access_key: Secret | None = None
    """S3 secret access key (prefer `secret_access_key_file` or `_env`); shown as `**********`."""
    secret_access_key_env: str | None = None
    """Environment variable holding the secret access key."""
    secret_access_key_file: str | None = None
    """File holding the secret access key (systemd credential, Kubernetes secret)."""

    @model_validator(mode="before")
    @classmethod
    def _from_url(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        if url.startswith("s3://"):
            if len(url[5:].split("/", 1)[0]) < 3:
                raise ValueError(f"S3 bucket name in {url!r} must have at least 3 characters")
            return url
        if url.startswith("file://"):
            return url
        if url.startswith("/") or url.startswith("."):
            return url  # resolved against the config file's folder by the loader
        raise ValueError(f"store URL {url!r} must start with file://, s3:// or be a path")

    @property
    def scheme(self) -> Literal["file", "s3"]:
        return "s3" if self.url.startswith("s3://") else "file"


class SigningConfig(Model):
    """How manifests are signed and verified.

    Ed25519 is the default: only the trainer holds the private key; rollout nodes and replicators
    get the public key alone and so cannot publish a version any reader accepts. HMAC-SHA256 shares
    one key between signers and readers: choose it explicitly, and only where every reader is trusted
    to publish (a single-tenant setup).
    """

    scheme: Literal["ed25519", "hmac-sha256"] = "ed25519"
    """Ed25519 (only the trainer can sign), or HMAC-SHA256 with a shared secret (every reader can sign)."""
    key: Secret | None = None
    """The signing key itself (Ed25519 private key as PEM or 64 hex digits, or the HMAC secret). Prefer
    `key_file` or `key_env`; shown as `**********` everywhere."""
    key_env: str | None = "FLEETRL_HUB_KEY"
    """Environment variable holding the signing key; readers of an Ed25519 hub leave it unset."""
    key_file: str | None = None
    """File holding the signing key (a systemd credential `$CREDENTIALS_DIRECTORY/...` or a mounted
    Kubernetes secret); read when set, before `key_env`."""
    public_key: str | None = None
    """Ed25519 only: the public key readers verify with (PEM or 64 hex digits); not a secret."""
    public_key_file: str | None = None
    """Ed25519 only: file holding the public key readers verify with (used when `public_key` is unset)."""

class HubConfig(Model):
    """The tensor hub (DESIGN.md §5)."""

    home_store: StoreConfig = Field(default_factory=lambda: StoreConfig(url="./.fleetrl/home"))
    """Source of truth for every version."""
    anchor_interval: int = Field(8, ge=1)
    """A dense anchor every K versions bounds delta chains to K."""
    retention_versions: int = Field(64, ge=1)
    """gc keeps the newest N versions (and every object their chains need)."""
    frame_bytes: int = Field(4 * MIB, ge=64 * 1024)
    """Target uncompressed size of one zstd frame: the unit of parallel decode and ranged GET."""
    zstd_level: int = Field(3, ge=1, le=22)
    """zstd level of objects (3 is a good speed/size balance for deltas)."""
    threads: int = Field(4, ge=1)
    """Threads for hashing, compression and decode."""
    signing: SigningConfig = Field(default_factory=SigningConfig)
    """How manifests are signed; unsigned or mis-signed versions are refused."""
    lease_ttl_s: float = Field(30.0, gt=0)
    """Replicator lease lifetime; the holder renews it at a third of that."""
    poll_interval_s: float = Field(1.0, gt=0)
    """How often replicators and readers look at `latest`."""
    replicator_metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port (/metrics, /healthz) of the region replicators (0 picks a free port; None disables)."""
    gc_grace_s: float = Field(3600.0, ge=0)
    """gc leaves unreferenced objects younger than this alone: a publisher may be uploading them."""


class MqttConfig(Model):
    """The control plane (DESIGN.md §4)."""

    url: str = "mqtt://127.0.0.1:1883"
    """`mqtt://host:port` or `mqtts://host:port`."""
    username: str | None = None
    """MQTT user name; None connects anonymously."""
    password: Secret | None = None
    """MQTT password (prefer `password_file` or `password_env`); shown as `**********`."""
    password_env: str | None = None
    """Environment variable holding the password."""
    password_file: str | None = None
    """File holding the password (systemd credential, Kubernetes secret); read before `password_env`."""
    ca_file: str | None = None
    """CA bundle for mqtts:// (system CAs when unset)."""
    keepalive_s: int = Field(10, ge=1)
    """MQTT keepalive; the broker fires a node's last will after ~1.5x this."""
    heartbeat_interval_s: float = Field(5.0, gt=0)
    """How often nodes publish their retained heartbeat."""
    reconnect_max_s: float = Field(10.0, gt=0)
    """Cap of the exponential reconnect backoff."""

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        if not re.match(r"^mqtts?://[^:/]+(:\d+)?/?$", url):
            raise ValueError(f"MQTT URL {url!r} must look like mqtt://host:port")
        return url


class TopicPartitions(Model):
    prompts: int = Field(32, ge=1)
    """Partitions of `prompts` (bounds rollout consumers per region)."""
    partials: int = Field(32, ge=1)
    """Partitions of `partials`."""
    trajectories: int = Field(32, ge=1)
    """Partitions of `trajectories`."""
    dead_letter: int = Field(4, ge=1)
    """Partitions of `dead-letter`."""


class KafkaConfig(Model):
    """Settings shared by every region cluster (DESIGN.md §3)."""

    partitions: TopicPartitions = Field(default_factory=TopicPartitions)
    """Partition count of each topic."""
    replication_factor: int = Field(1, ge=1)
    """Replicas of each topic (3 on production clusters)."""
    max_message_bytes: int = Field(16 * MIB, ge=1024 * 1024)
    """`max.message.bytes` of the data topics; producers and consumers are sized to match."""
    compression: Literal["zstd", "gzip", "none"] = "zstd"
    """Kafka-level compression of produced batches (zstd needs cramjam)."""
    idempotent_producer: bool = False
    """Off by default: tansu lacks InitProducerId, and receivers dedup by group_id anyway."""
    request_timeout_s: float = Field(30.0, gt=0)
    """Timeout of one Kafka request."""
    fetch_max_wait_ms: int = Field(100, ge=1, le=10_000)
    """How long a consumer's fetch waits on the broker for data before it answers empty; a record that
    lands meanwhile may wait for the end of it (tansu, a worker's two topics), so this is latency per
    hop. `bench/fetch_wait.py`: p50 223 ms at the client default 500, 24 ms at 100, 13 ms at 50."""
    partition_assignment: Literal["rendezvous", "sticky", "round_robin"] = "rendezvous"
    """How a consumer group spreads partitions over its members. A region of preemptible nodes changes
    members every few seconds, and a partition that moves re-delivers its uncommitted prompts to the new
    owner. `rendezvous` (broker/assignor.py) moves few partitions beyond those a member joining or
    leaving must move (3 of 32 on average) and joins with the same metadata every time; `sticky`
    (aiokafka's) moves the fewest but sends each member's last assignment with every join, and tansu
    starts a new generation whenever a member of a formed group joins with changed metadata, which kept
    churning groups rebalancing for minutes; `round_robin` (aiokafka's default) reshuffles nearly every
    partition on each change. Every member of a group must use the same: tansu cannot negotiate between
    two (InconsistentGroupProtocol), so changing it on a running fleet means restarting its rollout
    workers together."""
    retries: int = Field(5, ge=0)
    """Bounded retries of retriable errors, exponential backoff."""
    retry_backoff_s: float = Field(0.2, gt=0)
    """First retry delay; doubles each retry."""
    retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=60_000)
    """`retention.ms` of the run's topics."""


class KafkaClusterConfig(Model):
    """How to reach one region's Kafka cluster."""

    bootstrap: str
    """`host:port[,host:port...]`."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How clients talk to the brokers (MSK with SCRAM uses SASL_SSL)."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    """SASL mechanism when security_protocol is SASL_*."""
    sasl_username: str | None = None
    """SASL user name."""
    sasl_password: Secret | None = None
    """SASL password (prefer `sasl_password_file` or `sasl_password_env`); shown as `**********`."""
    sasl_password_env: str | None = None
    """Environment variable holding the SASL password."""
    sasl_password_file: str | None = None
    """File holding the SASL password (systemd credential, Kubernetes secret); read before the variable."""
    ca_file: str | None = None
    """CA bundle for SSL (system CAs when unset)."""

    @model_validator(mode="before")
    @classmethod
    def _from_str(cls, data: Any) -> Any:
        return {"bootstrap": data} if isinstance(data, str) else data

    @field_validator("bootstrap")
    @classmethod
    def _check_bootstrap(cls, value: str) -> str:
        for part in value.split(","):
            if not re.match(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$", part.strip()):
                raise ValueError(f"bootstrap entry {part!r} must be host:port")
        return value
