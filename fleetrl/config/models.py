"""The pydantic models of `fleet.yaml` (DESIGN.md §7), under the name they had before they were split.

Each section lives in its own module (policy, algorithm, dataset, reward, engine, rollout, agent,
region, trainer, transport, pricing, preemption) and `fleet.py` composes them; `fleetrl.config` is the
public surface. This module re-exports them for code that imports `fleetrl.config.models`; nothing in
the config package imports it.
"""

from __future__ import annotations

from fleetrl.config.agent import AgentConfig
from fleetrl.config.algorithm import AlgorithmConfig
from fleetrl.config.base import MIB, NAME_RE, Model, ReferenceProblem
from fleetrl.config.dataset import DatasetColumns, DatasetConfig, EnvConfig
from fleetrl.config.engine import (
    EngineConfig,
    EngineEmulation,
    SpeculativeConfig,
    TorchEngineConfig,
    VllmEngineConfig,
)
from fleetrl.config.fleet import FleetConfig
from fleetrl.config.policy import LoraAdapterConfig, ModelConfig
from fleetrl.config.preemption import NoPreemptionConfig, PreemptionConfig
from fleetrl.config.pricing import Capacity, NodePoolConfig, PlacementConfig, PriceConfig
from fleetrl.config.region import NodeConfig, RegionConfig
from fleetrl.config.reward import RewardConfig, RewardFunctionConfig
from fleetrl.config.rollout import RolloutConfig
from fleetrl.config.tiny_model import TinyModelConfig
from fleetrl.config.trainer import LearnerEmulation, TrainerConfig
from fleetrl.config.transport import (
    HubConfig,
    KafkaClusterConfig,
    KafkaConfig,
    MqttConfig,
    SigningConfig,
    StoreConfig,
    TopicPartitions,
)

__all__ = [
    "MIB",
    "NAME_RE",
    "AgentConfig",
    "AlgorithmConfig",
    "Capacity",
    "DatasetColumns",
    "DatasetConfig",
    "EngineConfig",
    "EngineEmulation",
    "EnvConfig",
    "FleetConfig",
    "HubConfig",
    "KafkaClusterConfig",
    "KafkaConfig",
    "LearnerEmulation",
    "LoraAdapterConfig",
    "Model",
    "ModelConfig",
    "MqttConfig",
    "NoPreemptionConfig",
    "NodeConfig",
    "NodePoolConfig",
    "PlacementConfig",
    "PreemptionConfig",
    "PriceConfig",
    "ReferenceProblem",
    "RegionConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "SigningConfig",
    "SpeculativeConfig",
    "StoreConfig",
    "TinyModelConfig",
    "TopicPartitions",
    "TorchEngineConfig",
    "TrainerConfig",
    "VllmEngineConfig",
]
