"""fleet.yaml and node cloud-init rendered by real Terraform (provider-free modules, no mirror
needed) from sample module outputs, then validated by fleetrl.config: a template that drifts from
the config models fails here."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import hcl2
import pytest
import yaml
from tf_support import TF_ROOT, Terraform

from fleetrl.config import AwsSpotPriceConfig, ConfigError, TorchEngineConfig, VllmEngineConfig, parse_config

HCL_OPTS = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False)

HOME_HMAC = {
    "store_url": "s3://fleetrl-r1-home-abc/hub", "store_region": "us-east-1",
    "mqtt_url": "mqtt://10.0.1.10:1883", "mqtt_username": "fleetrl", "mqtt_password_env": "FLEETRL_MQTT_PASSWORD",
    "mqtt_ca_file": None, "signing_scheme": "hmac-sha256", "signing_key_env": "FLEETRL_HUB_KEY",
    "signing_public_key_file": None,
}
HOME_ED25519 = {**HOME_HMAC, "mqtt_url": "mqtts://emqx.fleetrl.internal:8883", "mqtt_ca_file": "/etc/fleetrl/ca.pem",
                "signing_scheme": "ed25519", "signing_public_key_file": "/etc/fleetrl/hub.pub"}
MSK_REGION = {
    "name": "us-west-2", "kafka_bootstrap": "b-1.x.kafka.us-west-2.amazonaws.com:9096,b-2.x:9096",
    "kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512", "kafka_sasl_username": "fleetrl",
    "kafka_password_env": "FLEETRL_KAFKA_PASSWORD_US_WEST_2", "store_url": "s3://fleetrl-us-west-2-abc/hub",
    "store_region": "us-west-2", "link_costs": {"home": 2, "eu-west-1": 8}, "nodes": [], "weight": 1,
    "engine": {"kind": "vllm", "gpu_memory_utilization": 0.85},
    # A mixed-instances group: an on-demand base at a fixed price, spot priced from EC2's history.
    "capacity": "spot", "transfer_usd_per_gb": 0.02, "preemption": {"source": "aws"},
    "prices": {"on_demand": 3.4, "spot": None,
               "spot_history": {"region_name": "us-west-2", "instance_types": ["g6e.xlarge", "g5.2xlarge"],
                                "availability_zones": []}},
}
EXTERNAL_REGION = {
    "name": "eu-west-1", "kafka_bootstrap": "redpanda-0.internal:9092", "kafka_security_protocol": "PLAINTEXT",
    "kafka_sasl_mechanism": None, "kafka_sasl_username": None, "kafka_password_env": None,
    "store_url": "s3://fleetrl-eu-west-1-abc/hub", "store_region": "eu-west-1", "link_costs": {"home": 5},
    "nodes": ["euw1-a"], "weight": 0.5, "engine": {"kind": "torch", "device": "cuda", "max_batch": 64},
}


def _harness(tmp_path: pathlib.Path, module_args: dict[str, Any], module: str = "fleet-config") -> pathlib.Path:
    """A root module that calls one provider-free module with JSON-encoded arguments."""
    (tmp_path / "main.tf.json").write_text(json.dumps({
        "module": {"m": {"source": str(TF_ROOT / "modules" / module), **module_args}},
        "output": {name: {"value": f"${{module.m.{name}}}"} for name in _outputs(module)},
    }))
    return tmp_path


def _outputs(module: str) -> list[str]:
    with open(TF_ROOT / "modules" / module / "outputs.tf") as f:
        return [next(iter(o)) for o in hcl2.load(f, serialization_options=HCL_OPTS).get("output", [])]


def _render(terraform: Terraform, tmp_path: pathlib.Path, **args: Any) -> str:
    outputs = terraform.apply_outputs(_harness(tmp_path, {"run": "r1", **args}))
    return str(outputs["fleet_yaml"])


def test_msk_region_with_hmac_signing(terraform: Terraform, tmp_path: pathlib.Path) -> None:
    text = _render(terraform, tmp_path, home=HOME_HMAC, regions=[MSK_REGION, {**EXTERNAL_REGION}],
                   algorithm={"lr": 1e-6, "groups_per_step": 64}, hub={"anchor_interval": 16},
                   kafka={"replication_factor": 3}, trainer={"device": "cuda"})
    config = parse_config(text, env={})
    usw2 = config.region("us-west-2")
    assert usw2.kafka.security_protocol == "SASL_SSL"
    assert usw2.kafka.sasl_password_env == "FLEETRL_KAFKA_PASSWORD_US_WEST_2"
    assert isinstance(usw2.engine, VllmEngineConfig) and usw2.engine.gpu_memory_utilization == 0.85
    assert usw2.store.region_name == "us-west-2" and usw2.nodes == []
    assert config.hub.signing.scheme == "hmac-sha256" and config.hub.signing.public_key_file is None
    assert config.hub.anchor_interval == 16 and config.kafka.replication_factor == 3
    assert config.algorithm.lr == pytest.approx(1e-6) and config.algorithm.groups_per_step == 64
    assert config.trainer.metrics_port == 9400 and config.rollout.metrics_port == 9401
    assert config.mqtt.password_env == "FLEETRL_MQTT_PASSWORD"
    # Each pool's capacity type and price (docs/cost.md); the nodes learn theirs from the instance metadata.
    assert usw2.capacity == "spot" and usw2.price is None and usw2.transfer_usd_per_gb == 0.02
    assert usw2.price_of("on_demand") == 3.4
    spot = usw2.price_of("spot")
    assert isinstance(spot, AwsSpotPriceConfig)
    assert (spot.region_name, spot.instance_types) == ("us-west-2", ["g6e.xlarge", "g5.2xlarge"])
    assert usw2.preemption.source == "aws"
    euw1 = config.region("eu-west-1")  # no pools given: on demand, unpriced, SIGTERM only
    assert (euw1.capacity, euw1.pools, euw1.price, euw1.preemption.source) == ("on_demand", [], None, "none")


def test_external_kafka_and_ed25519(terraform: Terraform, tmp_path: pathlib.Path) -> None:
    text = _render(terraform, tmp_path, home=HOME_ED25519, regions=[EXTERNAL_REGION])
    config = parse_config(text, env={})
    euw1 = config.region("eu-west-1")
    assert euw1.kafka.security_protocol == "PLAINTEXT" and euw1.kafka.sasl_mechanism is None
    assert isinstance(euw1.engine, TorchEngineConfig) and euw1.engine.max_batch == 64
    assert [n.name for n in euw1.nodes] == ["euw1-a"] and euw1.weight == 0.5
    assert config.hub.signing.public_key_file == "/etc/fleetrl/hub.pub"
    assert config.mqtt.url.startswith("mqtts://") and config.mqtt.ca_file == "/etc/fleetrl/ca.pem"


def test_unknown_setting_fails_config_validation(terraform: Terraform, tmp_path: pathlib.Path) -> None:
    # Pass-through sections are checked by the config models, not by Terraform: a typo must surface.
    region = {**MSK_REGION, "link_costs": {"home": 1}}
    text = _render(terraform, tmp_path, home=HOME_HMAC, regions=[region], algorithm={"groups_per_stp": 4})
    with pytest.raises(ConfigError, match="groups_per_stp"):
        parse_config(text, env={})


def test_reserved_region_name_refused_by_terraform(terraform: Terraform, tmp_path: pathlib.Path) -> None:
    harness = _harness(tmp_path, {"run": "r1", "home": HOME_HMAC, "regions": [{**MSK_REGION, "name": "home"}]})
    terraform.init(harness)
    proc = terraform.run("plan", "-no-color", "-input=false", cwd=harness, check=False)
    assert proc.returncode != 0 and 'must not be "home"' in proc.stderr


def _named_blocks(module: str, file: str, kind: str) -> dict[str, Any]:
    with open(TF_ROOT / "modules" / module / file) as f:
        blocks = hcl2.load(f, serialization_options=HCL_OPTS)[kind]
    return {next(iter(b)): next(iter(b.values())) for b in blocks}


def _module_var_attrs(module: str, var: str) -> set[str]:
    variables = _named_blocks(module, "variables.tf", "variable")
    # python-hcl2 gives the type as one expression string: take every `name =` in it, at any depth.
    return set(re.findall(r"(\w+) = ", str(variables[var]["type"])))


def _output_keys(module: str, output: str) -> set[str]:
    return set(_named_blocks(module, "outputs.tf", "output")[output]["value"])


def test_region_modules_match_fleet_config_inputs() -> None:
    # Terraform drops object attributes a type does not name: check both sides name the same ones.
    region_attrs = _module_var_attrs("fleet-config", "regions")
    engine_attrs = {"kind", "device", "max_batch", "threads", "dtype", "gpu_memory_utilization",
                    "tensor_parallel_size", "max_num_seqs", "enforce_eager"}
    price_attrs = {"on_demand", "spot", "spot_history", "region_name", "instance_types", "availability_zones"}
    nested = engine_attrs | price_attrs
    assert _output_keys("rollout-region", "fleet_region") == region_attrs - nested
    assert _output_keys("home-region", "fleet_home") == _module_var_attrs("fleet-config", "home")
    assert set(MSK_REGION) == region_attrs - nested
    prices = MSK_REGION["prices"]
    assert set(prices) | set(prices["spot_history"]) == price_attrs
    assert set(HOME_HMAC) == _module_var_attrs("fleet-config", "home")
    assert engine_attrs <= region_attrs
    assert engine_attrs <= set(TorchEngineConfig.model_fields) | set(VllmEngineConfig.model_fields)
    assert engine_attrs == _module_var_attrs("rollout-region", "engine")


def test_trainer_node_cloud_config(terraform: Terraform, tmp_path: pathlib.Path) -> None:
    """The trainer node runs the packaged fleetrl-trainer.service; Terraform renders no unit text,
    only a drop-in (after the secrets, its stop timeout, the checkpoint volume writable)."""
    from fleetrl.regions.units import unit_text

    args = {
        "fleet_yaml": "run: r1\n", "fleetrl_package": "fleetrl[gpu]==0.1.0", "trainer": {"stop_timeout_s": 150},
        "secret_env": {"FLEETRL_HUB_KEY": {"arn": "arn:aws:secretsmanager:us-east-1:000000000000:secret:k"}},
        "state_dirs": ["/data/checkpoints"],
        "mounts": [{"device": "/dev/disk/by-id/nvme-x", "path": "/data/checkpoints"}],
    }
    outputs = terraform.apply_outputs(_harness(tmp_path, args, module="node-bootstrap"))
    cloud = yaml.safe_load(outputs["cloud_config"])
    files = {f["path"]: f["content"] for f in cloud["write_files"]}
    assert files["/etc/fleetrl/fleet.yaml"] == "run: r1\n" and "/etc/fleetrl/node.env" not in files
    assert "/etc/systemd/system/fleetrl-trainer.service" not in files  # it comes from the package
    assert [p for p in files if p.endswith(".service")] == [
        "/etc/systemd/system/fleetrl-secrets.service", "/etc/systemd/system/fleetrl-gpu-devices.service"]
    drop_in = files["/etc/systemd/system/fleetrl-trainer.service.d/10-node-bootstrap.conf"]
    assert "Requires=fleetrl-secrets.service" in drop_in and "TimeoutStopSec=150" in drop_in
    assert "ReadWritePaths=/data/checkpoints" in drop_in
    install = files["/usr/local/lib/fleetrl/install.sh"]
    assert "pip' install --quiet 'fleetrl[gpu]==0.1.0'" in install and "mkfs.ext4" in install
    assert install.index("pip' install") < install.index("'/opt/fleetrl/venv/bin/fleetrl' units install --dest ")
    assert json.loads(files["/etc/fleetrl/secrets.json"])["env"]["FLEETRL_HUB_KEY"]["json_key"] is None
    enabled = ["fleetrl-secrets.service", "fleetrl-gpu-devices.service", "fleetrl-trainer.service"]
    assert cloud["runcmd"][-1] == ["systemctl", "enable", "--now", *enabled] and outputs["enabled_units"] == enabled
    # What the packaged unit runs, and the GPU readiness unit runs before it.
    trainer = unit_text("fleetrl-trainer.service")
    assert "ExecStartPre=/opt/fleetrl/venv/bin/fleetrl topics create --config /etc/fleetrl/fleet.yaml" in trainer
    assert "EnvironmentFile=-/run/fleetrl/env\n" in trainer
    assert "Before=fleetrl-agent.service fleetrl-trainer.service" in files[
        "/etc/systemd/system/fleetrl-gpu-devices.service"]


def test_rollout_node_runs_the_packaged_units(terraform: Terraform, tmp_path: pathlib.Path) -> None:
    """With `region`, the units come from the package (`fleetrl units install`); Terraform writes only
    node.env and drop-ins, and the packaged units read what those hold."""
    from fleetrl.regions.units import unit_text

    args = {"fleet_yaml": "run: r1\n", "fleetrl_package": "fleetrl==0.1.0", "region": "eu-west-1",
            "agent_stop_timeout_s": 100}
    outputs = terraform.apply_outputs(_harness(tmp_path, args, module="node-bootstrap"))
    cloud = yaml.safe_load(outputs["cloud_config"])
    files = {f["path"]: f["content"] for f in cloud["write_files"]}
    assert [p for p in files if p.endswith(".service")] == [  # no daemon unit rendered here
        "/etc/systemd/system/fleetrl-secrets.service", "/etc/systemd/system/fleetrl-gpu-devices.service"]
    assert files["/etc/fleetrl/node.env"] == "FLEETRL_REGION=eu-west-1\n"
    install = files["/usr/local/lib/fleetrl/install.sh"]
    assert install.index("pip' install") < install.index(
        "'/opt/fleetrl/venv/bin/fleetrl' units install --dest /etc/systemd/system --prefix '/opt/fleetrl/venv'")
    assert "install -d -m 0700 /etc/fleetrl/credentials" in install  # the units' LoadCredential= folder
    agent_drop_in = files["/etc/systemd/system/fleetrl-agent.service.d/10-node-bootstrap.conf"]
    assert "After=fleetrl-secrets.service" in agent_drop_in and "TimeoutStopSec=100" in agent_drop_in
    assert "After=fleetrl-secrets.service" in files[
        "/etc/systemd/system/fleetrl-replicator@.service.d/10-node-bootstrap.conf"]
    enabled = ["fleetrl-secrets.service", "fleetrl-gpu-devices.service", "fleetrl-agent.service",
               "fleetrl-replicator@eu-west-1.service"]
    assert cloud["runcmd"][-1] == ["systemctl", "enable", "--now", *enabled]
    assert outputs["enabled_units"] == enabled
    assert set(outputs["drop_ins"]) == {"fleetrl-agent.service", "fleetrl-replicator@.service"}
    # What the package's agent unit reads: node.env for the region, /run/fleetrl/env (written by
    # fleetrl-secrets.service) for FLEETRL_NODE and the secrets.
    agent = unit_text("fleetrl-agent.service")
    assert "EnvironmentFile=/etc/fleetrl/node.env\n" in agent and "EnvironmentFile=-/run/fleetrl/env\n" in agent
    assert "--region ${FLEETRL_REGION} --node ${FLEETRL_NODE}" in agent


@pytest.mark.parametrize(("extra", "message"), [
    ({}, "Give a region"),
    ({"region": "eu-west-1", "trainer": {}}, "not both"),
    ({"trainer": {"stop_timeout_s": 1}}, "trainer.stop_timeout_s must be within"),
    ({"region": "EU"}, "region must be a FleetRL name"),
])
def test_node_bootstrap_refuses(terraform: Terraform, tmp_path: pathlib.Path, extra: dict[str, Any],
                                message: str) -> None:
    args = {"fleet_yaml": "run: r1\n", "fleetrl_package": "fleetrl==0.1.0", **extra}
    with pytest.raises(Exception, match=message):
        terraform.apply_outputs(_harness(tmp_path, args, module="node-bootstrap"))
