"""The whole run (`fleet.yaml`): `FleetConfig` composes every section and checks what one section
alone cannot (region and node names unique, link costs naming known stores).

Every field of every section is documented right under it; docs/config.md is generated from these
models (`python -m fleetrl.config.reference`) and a test checks that it is current. Models forbid
unknown keys so that a typo names itself.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from fleetrl.config.agent import AgentConfig
from fleetrl.config.algorithm import AlgorithmConfig
from fleetrl.config.base import NAME_RE, Model, ReferenceProblem
from fleetrl.config.dataset import DatasetConfig
from fleetrl.config.eval import EvalConfig, check_eval
from fleetrl.config.policy import ModelConfig
from fleetrl.config.region import RegionConfig
from fleetrl.config.reward import RewardConfig
from fleetrl.config.rollout import RolloutConfig
from fleetrl.config.tracking import TrackingConfig
from fleetrl.config.trainer import TrainerConfig
from fleetrl.config.transport import HubConfig, KafkaConfig, MqttConfig, StoreConfig


class FleetConfig(Model):
    """The whole run: one `fleet.yaml`."""

    run: str = Field(pattern=NAME_RE)
    """Run id: part of every topic, MQTT path and store key."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    hub: HubConfig = Field(default_factory=HubConfig)
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation on the fleet (docs/eval.md); none unless `eval.sets` is given."""
    regions: list[RegionConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> FleetConfig:
        names = [r.name for r in self.regions]
        stores = {"home", *names}
        for i, region in enumerate(self.regions):
            if names.index(region.name) != i:
                raise ReferenceProblem(("regions", i, "name"), f"region {region.name!r} is defined twice")
            unknown = set(region.link_costs) - stores
            if unknown:
                raise ReferenceProblem(
                    ("regions", i, "link_costs"),
                    f"unknown store(s) {sorted(unknown)}; known: {sorted(stores)}",
                )
            nodes = [n.name for n in region.nodes]
            for j, node in enumerate(nodes):
                if nodes.index(node) != j:
                    raise ReferenceProblem(("regions", i, "nodes", j), f"node {node!r} is defined twice")
        check_eval(self.eval, self.dataset, self.model)
        return self

    def region(self, name: str) -> RegionConfig:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"no region {name!r} in config; regions: {[r.name for r in self.regions]}")

    def stores(self) -> dict[str, StoreConfig]:
        """Every store by name: `home` and one per region."""
        return {"home": self.hub.home_store, **{r.name: r.store for r in self.regions}}
