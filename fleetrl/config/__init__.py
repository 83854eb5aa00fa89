"""Configuration of a FleetRL run: the models of `fleet.yaml` and their loader (DESIGN.md §7)."""

from fleetrl.config.agent import AgentConfig
from fleetrl.config.algorithm import AlgorithmConfig
from fleetrl.config.dataset import DatasetColumns, DatasetConfig, EnvConfig
from fleetrl.config.engine import (
    EngineConfig,
    EngineEmulation,
    SpeculativeConfig,
    TorchEngineConfig,
    VllmEngineConfig,
)
from fleetrl.config.errors import ConfigError, SecretError
from fleetrl.config.eval import GREEDY_TEMPERATURE, EvalConfig, EvalSetConfig
from fleetrl.config.fleet import FleetConfig
from fleetrl.config.loader import apply_env_overrides, load_config, parse_config
from fleetrl.config.policy import LoraAdapterConfig, ModelConfig
from fleetrl.config.preemption import PreemptionConfig
from fleetrl.config.pricing import (
    AwsSpotPriceConfig,
    Capacity,
    FilePriceConfig,
    NodePoolConfig,
    PlacementConfig,
    PriceConfig,
)
from fleetrl.config.region import NodeConfig, RegionConfig
from fleetrl.config.reward import RewardConfig, RewardFunctionConfig
from fleetrl.config.rollout import RolloutConfig
from fleetrl.config.secrets import Secret, SecretField, register_all, secret_fields
from fleetrl.config.tiny_model import TinyModelConfig
from fleetrl.config.tracking import TrackingConfig
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
    "GREEDY_TEMPERATURE",
    "AgentConfig",
    "AlgorithmConfig",
    "AwsSpotPriceConfig",
    "Capacity",
    "ConfigError",
    "DatasetColumns",
    "DatasetConfig",
    "EngineConfig",
    "EngineEmulation",
    "EnvConfig",
    "EvalConfig",
    "EvalSetConfig",
    "FilePriceConfig",
    "FleetConfig",
    "HubConfig",
    "KafkaClusterConfig",
    "KafkaConfig",
    "LearnerEmulation",
    "LoraAdapterConfig",
    "ModelConfig",
    "MqttConfig",
    "NodeConfig",
    "NodePoolConfig",
    "PlacementConfig",
    "PreemptionConfig",
    "PriceConfig",
    "RegionConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "Secret",
    "SecretError",
    "SecretField",
    "SigningConfig",
    "SpeculativeConfig",
    "StoreConfig",
    "TinyModelConfig",
    "TopicPartitions",
    "TorchEngineConfig",
    "TrackingConfig",
    "TrainerConfig",
    "VllmEngineConfig",
    "apply_env_overrides",
    "load_config",
    "parse_config",
    "register_all",
    "secret_fields",
]
