"""The data and control planes: record schemas and codecs, Kafka clients, topic tooling, MQTT.

Public surface; other packages import only these names.
"""

from fleetrl.broker.codec import decode_record, encode_record, expand_versions, rle_versions
from fleetrl.broker.consumer import Consumer, Delivery
from fleetrl.broker.control import (
    ControlCommand,
    EngineState,
    EngineStatus,
    Heartbeat,
    PolicyAnnouncement,
    ReplicaAnnouncement,
)
from fleetrl.broker.deadletter import DeadLetter
from fleetrl.broker.dlq import read_dead_letters, replay_dead_letters
from fleetrl.broker.errors import (
    BrokerError,
    ControlPlaneError,
    KafkaError,
    RecordError,
    RecordTooLarge,
    TopicError,
)
from fleetrl.broker.lag import PartitionLag, end_offsets, group_lag
from fleetrl.broker.logread import RawRecord, read_log, read_log_from
from fleetrl.broker.mqtt import ControlPlane
from fleetrl.broker.naming import (
    SCHEMA_HEADER,
    STREAMS,
    Stream,
    control_topic,
    node_topic,
    policy_topic,
    replica_topic,
    rollout_group,
    topic_name,
    trainer_group,
    trainer_handover_group,
)
from fleetrl.broker.producer import Producer
from fleetrl.broker.records import (
    FINISH_REASONS,
    SCHEMA_GROUP,
    SCHEMA_PARTIAL,
    SCHEMA_PROMPT,
    SCHEMA_PROMPT_V2,
    GroupRecord,
    HandedOverBy,
    PartialRecord,
    PartialSample,
    PromptRecord,
    Record,
    RecordLimits,
    Sample,
    Sampling,
    Timings,
    check_record,
    floats,
    ids,
)
from fleetrl.broker.topics import TopicChange, TopicSpec, ensure_topics, topic_specs

__all__ = [
    "FINISH_REASONS",
    "SCHEMA_GROUP",
    "SCHEMA_HEADER",
    "SCHEMA_PARTIAL",
    "SCHEMA_PROMPT",
    "SCHEMA_PROMPT_V2",
    "STREAMS",
    "BrokerError",
    "Consumer",
    "ControlCommand",
    "ControlPlane",
    "ControlPlaneError",
    "DeadLetter",
    "Delivery",
    "EngineState",
    "EngineStatus",
    "GroupRecord",
    "HandedOverBy",
    "Heartbeat",
    "KafkaError",
    "PartialRecord",
    "PartialSample",
    "PartitionLag",
    "PolicyAnnouncement",
    "Producer",
    "PromptRecord",
    "RawRecord",
    "Record",
    "RecordError",
    "RecordLimits",
    "RecordTooLarge",
    "ReplicaAnnouncement",
    "Sample",
    "Sampling",
    "Stream",
    "Timings",
    "TopicChange",
    "TopicError",
    "TopicSpec",
    "check_record",
    "control_topic",
    "decode_record",
    "encode_record",
    "end_offsets",
    "ensure_topics",
    "expand_versions",
    "floats",
    "group_lag",
    "ids",
    "node_topic",
    "policy_topic",
    "read_dead_letters",
    "read_log",
    "read_log_from",
    "replay_dead_letters",
    "replica_topic",
    "rle_versions",
    "rollout_group",
    "topic_name",
    "topic_specs",
    "trainer_group",
    "trainer_handover_group",
]
