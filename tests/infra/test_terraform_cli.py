"""Terraform itself on infra/terraform: fmt, init + validate against the provider schema, and a
mocked `terraform test` apply of the two-regions environment whose state the other checks read."""

from __future__ import annotations

import base64
import gzip
import json
import pathlib
from typing import Any

import pytest
import yaml
from tf_support import TF_ROOT, Terraform, resources

from fleetrl.config import parse_config

PROVIDER_FREE = ["modules/fleet-config", "modules/node-bootstrap", "modules/kafka-acls"]
AWS_DIRS = [
    "modules/s3-store",
    "modules/generated-secret",
    "modules/rollout-region",
    "modules/home-region",
    "environments/two-regions",
]


def test_every_terraform_dir_is_covered() -> None:
    dirs = {str(p.parent.relative_to(TF_ROOT)) for p in TF_ROOT.glob("*/*/versions.tf")}
    assert dirs == set(PROVIDER_FREE + AWS_DIRS)


def test_fmt_check(terraform: Terraform) -> None:
    proc = terraform.run("fmt", "-check", "-recursive", "-diff", "-no-color", cwd=TF_ROOT, check=False)
    assert proc.returncode == 0, f"run `infra/terraform/bin/terraform fmt -recursive infra/terraform`:\n{proc.stdout}"


def assert_validates(terraform: Terraform, path: pathlib.Path, plugin_dir: pathlib.Path | None) -> None:
    terraform.init(path, plugin_dir)
    result = json.loads(terraform.run("validate", "-json", cwd=path, check=False).stdout)
    assert result["valid"], [d.get("summary", "") + ": " + d.get("detail", "") for d in result["diagnostics"]]


@pytest.mark.parametrize("rel", PROVIDER_FREE)
def test_validate_provider_free(terraform: Terraform, tf_copy: pathlib.Path, rel: str) -> None:
    assert_validates(terraform, tf_copy / rel, None)


@pytest.mark.parametrize("rel", AWS_DIRS)
def test_validate_against_aws_schema(terraform: Terraform, tf_copy: pathlib.Path,
                                     plugin_dir: pathlib.Path, rel: str) -> None:
    assert_validates(terraform, tf_copy / rel, plugin_dir)


def test_mocked_apply_runs_pass(mock_apply: dict[str, Any]) -> None:
    runs = {e["test_run"]["run"]: e["test_run"].get("status") for e in mock_apply["events"]
            if e.get("type") == "test_run" and e["test_run"].get("progress") == "complete"}
    assert runs == {"renders_fleet_yaml": "pass", "refuses_home_as_region_name": "pass",
                    "refuses_world_open_cidr": "pass", "refuses_duplicate_region_names": "pass"}


def _cloud_config(b64gzip: str) -> dict[str, Any]:
    text = gzip.decompress(base64.b64decode(b64gzip)).decode()
    assert text.startswith("#cloud-config\n")
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


def _files(cloud: dict[str, Any]) -> dict[str, str]:
    return {f["path"]: f["content"] for f in cloud["write_files"]}


def test_provisioned_fleet_yaml_validates(mock_apply: dict[str, Any]) -> None:
    fleet_yaml = mock_apply["state"]["outputs"]["fleet_yaml"]["value"]
    config = parse_config(fleet_yaml, source="terraform output fleet_yaml", env={})
    assert [r.name for r in config.regions] == ["us-west-2", "eu-west-1"]
    assert config.regions[0].kafka.bootstrap.endswith(":9096")
    assert config.regions[0].kafka.sasl_mechanism == "SCRAM-SHA-512"
    assert config.regions[0].link_costs == {"home": 2.0, "eu-west-1": 8.0}
    assert config.hub.home_store.url.startswith("s3://") and config.hub.home_store.region_name
    assert config.mqtt.url == "mqtt://10.0.1.10:1883"
    assert config.algorithm.lr == pytest.approx(1e-6)
    assert config.trainer.checkpoint_dir == "/var/lib/fleetrl/checkpoints"


def test_every_node_boots_with_that_fleet_yaml(mock_apply: dict[str, Any]) -> None:
    state = mock_apply["state"]
    fleet_yaml = state["outputs"]["fleet_yaml"]["value"]
    config = parse_config(fleet_yaml, env={})
    templates = [r for r in resources(state["root_module"]) if r["type"] == "aws_launch_template"]
    trainers = [r for r in resources(state["root_module"]) if r["address"] == "module.home.aws_instance.trainer"]
    assert len(templates) == 2 and len(trainers) == 1
    for lt in templates:
        files = _files(_cloud_config(lt["values"]["user_data"]))
        assert files["/etc/fleetrl/fleet.yaml"] == fleet_yaml
        region = "us-west-2" if "region_a" in lt["address"] else "eu-west-1"
        # The packaged units (fleetrl units install) run the region named in node.env: the agent with
        # --region ${FLEETRL_REGION}, the replicator as the instance fleetrl-replicator@<region>.
        assert files["/etc/fleetrl/node.env"] == f"FLEETRL_REGION={region}\n"
        assert "fleetrl' units install --dest /etc/systemd/system" in files["/usr/local/lib/fleetrl/install.sh"]
        cloud = _cloud_config(lt["values"]["user_data"])
        assert cloud["runcmd"][-1][-2:] == ["fleetrl-agent.service", f"fleetrl-replicator@{region}.service"]
        drop_in = files["/etc/systemd/system/fleetrl-agent.service.d/10-node-bootstrap.conf"]
        assert "TimeoutStopSec=110" in drop_in and "Requires=fleetrl-secrets.service" in drop_in
        secrets = json.loads(files["/etc/fleetrl/secrets.json"])
        # Every *_env the node's config names is filled at boot, and nothing holds a value. With Ed25519
        # (the default) a node gets the public key file and never the signing key.
        assert config.hub.signing.scheme == "ed25519" and config.hub.signing.public_key_file in secrets["files"]
        needed = {config.mqtt.password_env, config.region(region).kafka.sasl_password_env}
        assert needed == set(secrets["env"]) and config.hub.signing.key_env not in secrets["env"]
        assert all(set(src) == {"arn", "json_key"} for src in secrets["env"].values())
    files = _files(_cloud_config(trainers[0]["values"]["user_data_base64"]))
    assert files["/etc/fleetrl/fleet.yaml"] == fleet_yaml
    # The trainer runs the packaged fleetrl-trainer.service; Terraform adds a drop-in only.
    assert "/etc/systemd/system/fleetrl-trainer.service" not in files
    drop_in = files["/etc/systemd/system/fleetrl-trainer.service.d/10-node-bootstrap.conf"]
    assert "TimeoutStopSec=120" in drop_in and f"ReadWritePaths={config.trainer.checkpoint_dir}" in drop_in
    assert _cloud_config(trainers[0]["values"]["user_data_base64"])["runcmd"][-1][-1] == "fleetrl-trainer.service"
    env_names = set(json.loads(files["/etc/fleetrl/secrets.json"])["env"])
    assert {r.kafka.sasl_password_env for r in config.regions} | {config.hub.signing.key_env} <= env_names


def test_security_groups_open_only_design_ports(mock_apply: dict[str, Any]) -> None:
    rules = [r["values"] for r in resources(mock_apply["state"]["root_module"])
             if r["type"] in ("aws_vpc_security_group_ingress_rule", "aws_vpc_security_group_egress_rule")]
    ports = {(v["from_port"], v["to_port"]) for v in rules}
    assert ports <= {(443, 443), (80, 80), (1883, 1883), (8883, 8883), (9096, 9096), (9092, 9096),
                     (9400, 9400), (9401, 9401)}
    world = [v for v in rules if v.get("cidr_ipv4") == "0.0.0.0/0"]
    assert {(v["from_port"]) for v in world} <= {80, 443}, "only package/API egress may reach the internet"


def test_mosquitto_cloud_config(mock_apply: dict[str, Any]) -> None:
    address = "module.home.aws_instance.mqtt[0]"
    (mqtt,) = [r for r in resources(mock_apply["state"]["root_module"]) if r["address"] == address]
    cloud = _cloud_config(mqtt["values"]["user_data_base64"])
    files = _files(cloud)
    conf = files["/etc/mosquitto/conf.d/fleetrl.conf"]
    assert "listener 1883" in conf and "allow_anonymous false" in conf
    assert "mosquitto_passwd -b /etc/mosquitto/fleetrl.passwd 'fleetrl' \"$MQTT_PASSWORD\"" in \
        files["/usr/local/lib/fleetrl/mqtt-auth.sh"]
    spec = json.loads(files["/etc/fleetrl/secrets.json"])
    assert spec["env"]["MQTT_PASSWORD"]["json_key"] == "password"
    assert "mosquitto" in cloud["packages"]


def test_each_region_renders_its_kafka_acls(mock_apply: dict[str, Any]) -> None:
    state = mock_apply["state"]
    config = parse_config(state["outputs"]["fleet_yaml"]["value"], env={})
    commands = state["outputs"]["kafka_acl_commands"]["value"]
    assert set(commands) == {r.name for r in config.regions}
    for region in config.regions:
        # one SCRAM user per region (the default): every role's grants go to it
        user = f"User:{region.kafka.sasl_username}"
        assert commands[region.name] and all(f"--allow-principal {user} " in c for c in commands[region.name])
        assert any(f"--topic fleetrl.{config.run}.trajectories " in c for c in commands[region.name])
    # enforcement is opt-in (kafka.enforce_acls) until the ACLs are applied
    msk = [r["values"] for r in resources(state["root_module"]) if r["type"] == "aws_msk_configuration"]
    assert len(msk) == 2 and all("allow.everyone.if.no.acl.found=true\n" in v["server_properties"] for v in msk)
