"""`terraform apply` and `destroy` of environments/two-regions against emulated AWS APIs.

moto's server mode (real HTTP) stands in for AWS: every aliased provider of a scratch copy of the
environment is pointed at it by an override file (docs/provisioning.md shows the same recipe for
users). The run applies the whole environment with Kafka in `external` mode and detailed monitoring
off (moto has neither MSK's CreateConfiguration nor MonitorInstances), loads the rendered
fleet.yaml with `fleetrl config check`, plans again (only moto's known omissions may show as
changes: MOTO_OMISSIONS), destroys, and checks that nothing is left in state or in moto. The MSK
path (the default) is planned here against moto too, and applied by the mocked `terraform test`
(test_terraform_cli.py). Each terraform command writes the provider's debug log into the test's folder, and
moto its access log; a failed command names the requests the AWS SDK sent again (the log's `retrying request`
lines and moto's request recorder), the sign of the race that `serial_moto.py` removes.

2.5-5 min on 2 shared cores (138-152 s in three runs alone, ~1.5 min of CPU; 164-256 s in 13 runs beside two busy
loops; 235-301 s in four earlier runs while other work shared the cores): a plan of the MSK variant
8-60 s; apply 70-110 s, of which the provider waits 55 s for the buckets' lifecycle rules to settle;
the second plan 11-32 s; destroy 48-138 s, mostly 10 s polls of instances and volumes one after
another. Each terraform command is bounded by STEP_TIMEOUT_S, the test by its timeout mark.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from slowdown import scaled
from tf_support import Terraform, copy_tree

from fleetrl import devstack

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ALIASES = {"home": "us-east-1", "region_a": "us-west-2", "region_b": "eu-west-1"}
CIDRS = {"home": "10.0.0.0/16", "region_a": "10.1.0.0/16", "region_b": "10.2.0.0/16"}
# Every service the modules call (kafka: MSK, unused in external mode but configured like the rest).
SERVICES = ("autoscaling", "ec2", "iam", "kafka", "kms", "logs", "s3", "secretsmanager", "sts")
STEP_TIMEOUT_S = 420  # each terraform command (Terraform.run scales it); the test's own bound is its timeout mark
# What moto does not return (or returns differently), so that a second plan wants to set it again:
# (resource type, attribute path without list indexes) -> why. A changed attribute at or under one
# of these paths is moto's; anything else a second plan changes is a fault of ours.
MOTO_OMISSIONS = {
    ("aws_autoscaling_group", "mixed_instances_policy"):
        "moto drops a group's MixedInstancesPolicy on an UpdateAutoScalingGroup that does not repeat it (the "
        "provider's after the create), so DescribeAutoScalingGroups returns none; moto launches from the "
        "policy's template anyway, every instance on demand",
    ("aws_autoscaling_group", "capacity_reservation_specification.capacity_reservation_preference"):
        "moto returns no CapacityReservationSpecification; the provider plans its default, \"\"",
    ("aws_launch_template", "tag_specifications"):
        "moto adds the template's own tags as a `launch-template` tag specification of its data",
    ("aws_vpc_security_group_egress_rule", "referenced_security_group_id"):
        "moto returns a referenced group as <account>/sg-..., the form AWS keeps for another account's",
    ("aws_vpc_security_group_egress_rule", "description"):
        "moto returns no description for a rule that references a security group",
    ("aws_vpc_security_group_ingress_rule", "referenced_security_group_id"):
        "moto returns a referenced group as <account>/sg-..., the form AWS keeps for another account's",
    ("aws_vpc_security_group_ingress_rule", "description"):
        "moto returns no description for a rule that references a security group",
}


# region_a's nodes as a mixed-instances group (docs/cost.md): one on-demand node, spot above it.
MIXED = {"on_demand_base_capacity": 1, "on_demand_percentage_above_base_capacity": 0,
         "spot_allocation_strategy": "capacity-optimized", "spot_max_price": "2.5", "on_demand_price": 3.4}


def _provider_override(endpoint: str) -> dict[str, Any]:
    """override.tf.json: every aliased aws provider at moto, with test credentials and no lookups."""
    return {"provider": {"aws": [{
        "alias": alias,
        "access_key": "testing",
        "secret_key": "testing",
        "s3_use_path_style": True,
        "skip_credentials_validation": True,
        "skip_metadata_api_check": True,
        "skip_requesting_account_id": True,
        "endpoints": [{service: endpoint for service in SERVICES}],
    } for alias in ALIASES]}}


def _network(endpoint: str) -> dict[str, dict[str, Any]]:
    """A VPC with subnets in each region (what the example's tfvars name), and an image id moto knows."""
    import boto3

    made: dict[str, dict[str, Any]] = {}
    for alias, region in ALIASES.items():
        ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=region,
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        vpc = ec2.create_vpc(CidrBlock=CIDRS[alias])["Vpc"]["VpcId"]
        subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=CIDRS[alias].replace(".0.0/16", f".{i}.0/24"),
                                     AvailabilityZone=f"{region}{zone}")["Subnet"]["SubnetId"]
                   for i, zone in enumerate("abc", start=1)]
        image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        made[alias] = {"vpc_id": vpc, "subnet_ids": subnets, "ami_id": image}
    return made


def _tfvars(net: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def region(alias: str, name: str, peer: str) -> dict[str, Any]:
        return {
            "name": name, "aws_region": ALIASES[alias], "vpc_id": net[alias]["vpc_id"],
            "subnet_ids": net[alias]["subnet_ids"], "cidr": CIDRS[alias], "link_costs": {"home": 2, peer: 8},
            "node": {"ami_id": net[alias]["ami_id"], "instance_types": ["g6e.xlarge", "g5.2xlarge"],
                     "max_size": 2, "desired_capacity": 1, **(MIXED if alias == "region_a" else {})},
            "kafka": {"mode": "external", "bootstrap": f"redpanda-0.{name}.internal:9092",
                      "security_protocol": "PLAINTEXT", "external_cidrs": [CIDRS[alias]]},
        }

    return {
        "run": "emulated-r1",
        "home": {"aws_region": ALIASES["home"], "vpc_id": net["home"]["vpc_id"],
                 "subnet_id": net["home"]["subnet_ids"][0], "cidr": CIDRS["home"],
                 "trainer": {"ami_id": net["home"]["ami_id"], "instance_type": "p5.48xlarge", "root_volume_gb": 50},
                 "mqtt": {"ami_id": net["home"]["ami_id"]}},
        "regions": [region("region_a", "us-west-2", "eu-west-1"), region("region_b", "eu-west-1", "us-west-2")],
        "metrics_cidrs": ["10.0.0.0/16"],
        "algorithm": {"groups_per_step": 64, "n_samples": 16, "lr": 1e-6},
        "detailed_monitoring": False,
        "force_destroy_stores": True,
    }


@pytest.fixture
def moto_endpoint(tmp_path: pathlib.Path) -> Iterator[str]:
    """moto_server (every AWS service it emulates) on a free loopback port, stopped by this fixture; its
    request recorder (`/moto-api/recorder/...`) writes into the test's folder."""
    # This virtualenv's moto (the constraints pin it), serving one request at a time (serial_moto.py says why).
    serial, port = pathlib.Path(__file__).with_name("serial_moto.py"), devstack.free_port()
    env = {"MOTO_RECORDER_FILEPATH": str(tmp_path / "moto-requests.jsonl"), "MOTO_PORT": str(port)}
    argv = [sys.executable, str(serial), "127.0.0.1", str(port)]
    with devstack.ServerProcess("moto", argv, port, env=env, log_path=tmp_path / "moto.log") as server:
        yield f"http://127.0.0.1:{server.port}"


def _recorder(endpoint: str, what: str) -> bytes:
    import urllib.request

    method = "GET" if what == "download-recording" else "POST"
    with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/recorder/{what}", method=method),
                                timeout=scaled(60)) as reply:
        return bytes(reply.read())


def _recorded(recording: bytes) -> Iterator[tuple[dict[str, str], dict[str, str], str]]:
    """(lower-cased headers, flat query parameters, url) of every request in moto's recording, in order."""
    import base64
    import urllib.parse

    for line in recording.decode().splitlines():
        entry = json.loads(line)
        body = entry.get("body") or ""
        text = base64.b64decode(body).decode(errors="replace") if entry.get("body_encoded") else str(body)
        headers = {k.lower(): v for k, v in entry.get("headers", {}).items()}
        yield headers, dict(urllib.parse.parse_qsl(text)), entry.get("url", "?")


def _asg_requests(recording: bytes) -> list[tuple[str, dict[str, str]]]:
    """(action, flat query parameters) of every auto scaling request the recorder saw, in order."""
    return [(params["Action"], params) for _, params, _ in _recorded(recording)
            if params.get("Action", "").endswith("AutoScalingGroup")]


def _retried(recording: bytes) -> list[str]:
    """The actions the AWS SDK sent more than once (its `amz-sdk-request: attempt=N` header, N > 1)."""
    return [params.get("Action", url) for headers, params, url in _recorded(recording)
            if not headers.get("amz-sdk-request", "attempt=1").startswith("attempt=1")]


def _leaves(value: Any, unknown: Any, path: str = "") -> Iterator[tuple[str, Any, bool]]:
    """(path without list indexes, value, unknown after apply) of every leaf of a plan value."""
    if isinstance(value, dict) or isinstance(unknown, dict):
        value, unknown = value if isinstance(value, dict) else {}, unknown if isinstance(unknown, dict) else {}
        for key in set(value) | set(unknown):
            yield from _leaves(value.get(key), unknown.get(key), f"{path}.{key}" if path else key)
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            yield from _leaves(item, unknown[i] if isinstance(unknown, list) and i < len(unknown) else None,
                               f"{path}")
    else:
        yield path, value, unknown is True


def _drift(change: dict[str, Any]) -> set[str]:
    """Attribute paths an update would set to something other than what moto returned. A value known
    only after the apply (a launch template's next version number) follows from the update: not drift."""
    before = sorted((p, json.dumps(v)) for p, v, _ in _leaves(change["change"]["before"], None))
    after = sorted((p, json.dumps(v)) for p, v, unknown in _leaves(change["change"]["after"],
                                                                    change["change"].get("after_unknown"))
                   if not unknown)
    computed = {p for p, _, unknown in _leaves(change["change"]["after"], change["change"].get("after_unknown"))
                if unknown}
    return {p for p, _ in set(before) ^ set(after) if p not in computed}


def _explained(kind: str, path: str) -> bool:
    return any(kind == k and (path == p or path.startswith(p + ".")) for k, p in MOTO_OMISSIONS)


def _left_in_moto(endpoint: str, run: str) -> dict[str, list[str]]:
    """What the environment could have left behind in moto (active things only: a secret or a KMS key
    scheduled for deletion is gone as far as AWS is concerned)."""
    import boto3

    def client(service: str, region: str) -> Any:
        return boto3.client(service, endpoint_url=endpoint, region_name=region,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    left: dict[str, list[str]] = {}
    left["s3"] = [b["Name"] for b in client("s3", "us-east-1").list_buckets()["Buckets"]]
    iam = client("iam", "us-east-1")
    left["iam"] = [r["RoleName"] for r in iam.list_roles()["Roles"] if run in r["RoleName"]] + \
        [p["InstanceProfileName"] for p in iam.list_instance_profiles()["InstanceProfiles"]]
    for region in ALIASES.values():
        ec2 = client("ec2", region)
        reservations = ec2.describe_instances()["Reservations"]
        left[f"{region} instances"] = [i["InstanceId"] for r in reservations for i in r["Instances"]
                                       if i["State"]["Name"] != "terminated"]
        left[f"{region} security groups"] = [g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]
                                             if g["GroupName"] != "default"]
        left[f"{region} launch templates"] = [t["LaunchTemplateName"] for t in
                                              ec2.describe_launch_templates()["LaunchTemplates"]]
        left[f"{region} volumes"] = [v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]
                                     if any(run in tag["Value"] for tag in v.get("Tags", []))]
        left[f"{region} auto-scaling groups"] = [
            g["AutoScalingGroupName"] for g in client("autoscaling", region).describe_auto_scaling_groups()[
                "AutoScalingGroups"]]
        left[f"{region} secrets"] = [s["Name"] for s in client("secretsmanager", region).list_secrets()["SecretList"]
                                     if "DeletedDate" not in s]
        kms = client("kms", region)
        # Keys behind alias/aws/* are the service keys AWS (and moto) make on first use (S3, Secrets Manager).
        service_keys = {a.get("TargetKeyId") for a in kms.list_aliases()["Aliases"]
                        if a["AliasName"].startswith("alias/aws/")}
        states = {k["KeyId"]: kms.describe_key(KeyId=k["KeyId"])["KeyMetadata"]["KeyState"]
                  for k in kms.list_keys()["Keys"] if k["KeyId"] not in service_keys}
        left[f"{region} kms keys"] = [key for key, state in states.items() if state != "PendingDeletion"]
        left[f"{region} log groups"] = [g["logGroupName"] for g in
                                        client("logs", region).describe_log_groups()["logGroups"]]
    return {what: names for what, names in left.items() if names}


def _asg_instances(endpoint: str) -> dict[str, int]:
    """In-service instances of each auto-scaling group, by AWS region."""
    import boto3

    counts = {}
    for region in (ALIASES["region_a"], ALIASES["region_b"]):
        asg = boto3.client("autoscaling", endpoint_url=endpoint, region_name=region,
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        groups = asg.describe_auto_scaling_groups()["AutoScalingGroups"]
        counts[region] = sum(i["LifecycleState"] == "InService" for g in groups for i in g["Instances"])
    return counts


def _mixed_policies(endpoint: str) -> dict[str, dict[str, Any]]:
    """Each auto-scaling group's MixedInstancesPolicy as moto's DescribeAutoScalingGroups returns it."""
    import boto3

    out = {}
    for region in (ALIASES["region_a"], ALIASES["region_b"]):
        asg = boto3.client("autoscaling", endpoint_url=endpoint, region_name=region,
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        for g in asg.describe_auto_scaling_groups()["AutoScalingGroups"]:
            out[region] = g.get("MixedInstancesPolicy", {})
    return out


def _count(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    assert found, text[-3000:]
    return int(found.group(1))


def _sdk_retries(provider_log: pathlib.Path) -> list[str]:
    """`<time> <service>/<operation>, attempt N` of each request the AWS SDK repeated, from a provider debug
    log. The SDK logs no cause: an attempt with no `HTTP Response Received` lost its answer on the way in."""
    text = provider_log.read_text(errors="replace") if provider_log.exists() else ""
    return [f"{t} {what}" for t, what in re.findall(r"^(\S+) \[DEBUG\] [^:]*: retrying request ([^:]+):", text, re.M)]


def _diagnosis(moto_endpoint: str, provider_log: pathlib.Path) -> str:
    """What a failed terraform command leaves to explain a repeated request: the SDK's retries (provider log) and
    the requests moto's recorder saw more than once (`amz-sdk-request: attempt=N`, N > 1)."""
    repeated = _retried(_recorder(moto_endpoint, "download-recording"))
    return (f"SDK retries in {provider_log}: {_sdk_retries(provider_log) or 'none'}\n"
            f"requests the SDK sent more than once (moto's recorder): {repeated or 'none'}")


@pytest.mark.timeout(900)
def test_apply_plan_destroy_against_moto(terraform: Terraform, plugin_dir: pathlib.Path, moto_endpoint: str,
                                         tmp_path: pathlib.Path) -> None:
    started = time.monotonic()
    env_dir = copy_tree(tmp_path / "terraform") / "environments" / "two-regions"
    (env_dir / "emulated_override.tf.json").write_text(json.dumps(_provider_override(moto_endpoint), indent=2))
    tfvars = _tfvars(_network(moto_endpoint))
    (env_dir / "emulated.tfvars.json").write_text(json.dumps(tfvars, indent=2))
    _recorder(moto_endpoint, "start-recording")
    env = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/dev/null",
           "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    terraform.init(env_dir, plugin_dir)

    steps = itertools.count(1)

    def tf(*args: str) -> str:
        """terraform `args`, the provider debug log in tmp_path; a failure says which requests the SDK repeated."""
        t0, log = time.monotonic(), tmp_path / f"provider-{next(steps)}-{args[0]}.log"
        try:
            out = terraform.run(*args, "-no-color", "-input=false", cwd=env_dir, timeout_s=STEP_TIMEOUT_S,
                                env={**env, "TF_LOG_PROVIDER": "DEBUG", "TF_LOG_PATH": str(log)}).stdout
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diagnosis(moto_endpoint, log)}") from exc
        waits = re.findall(r"^(\S+): (?:Creation|Destruction|Modifications) complete after (\d+m)?(\d+)s", out, re.M)
        slow = sorted(((int(m[:-1] or 0) * 60 + int(s), a) for a, m, s in waits), reverse=True)[:4]
        print(f"terraform {args[0]}: {time.monotonic() - t0:.0f} s; SDK retries: {_sdk_retries(log) or 'none'}; "
              f"longest waits: {slow}")
        return out

    # MSK and detailed monitoring (the defaults) as far as moto goes: a plan, which reads the account.
    msk = {**tfvars, "detailed_monitoring": True,
           "regions": [{**r, "kafka": {}} for r in tfvars["regions"]]}
    (env_dir / "msk.tfvars.json").write_text(json.dumps(msk, indent=2))
    msk_plan = tf("plan", "-var-file=msk.tfvars.json")
    msk_clusters = msk_plan.count("aws_msk_cluster.kafka[0] will be created")
    to_add = _count(r"Plan: (\d+) to add", msk_plan)
    print(f"msk plan: {to_add} to add, {msk_clusters} MSK clusters")
    assert msk_clusters == 2

    applied = tf("apply", "-auto-approve", "-var-file=emulated.tfvars.json")
    added = _count(r"Apply complete! Resources: (\d+) added", applied)
    managed = [a for a in terraform.run("state", "list", cwd=env_dir, env=env).stdout.split()
               if not a.startswith("data.") and ".data." not in a]
    print(f"apply: {added} added, {len(managed)} managed in state ({time.monotonic() - started:.0f} s)")
    assert added == len(managed)
    kinds = {a.split(".")[-2] for a in managed}
    assert kinds >= {"aws_autoscaling_group", "aws_launch_template", "aws_instance", "aws_s3_bucket",
                     "aws_secretsmanager_secret_version", "aws_ebs_volume", "aws_iam_role"}
    # Each region's group launched its node from the launch template (desired_capacity 1).
    assert _asg_instances(moto_endpoint) == {ALIASES["region_a"]: 1, ALIASES["region_b"]: 1}
    # The mixed-instances policy as Terraform sent it (moto's request recorder): region_a's on-demand base,
    # spot above it, its allocation strategy and maximum price, and both instance types; region_b all spot.
    _recorder(moto_endpoint, "stop-recording")
    created = [p for action, p in _asg_requests(_recorder(moto_endpoint, "download-recording"))
               if action == "CreateAutoScalingGroup"]
    names = [r["name"] for r in tfvars["regions"]]
    sent = {n: p for p in created for n in names
            if p["AutoScalingGroupName"].startswith(f"fleetrl-{tfvars['run']}-{n}-")}
    dist = "MixedInstancesPolicy.InstancesDistribution."
    override = "MixedInstancesPolicy.LaunchTemplate.Overrides.member."
    mixed = sent[names[0]]
    assert {k.removeprefix(dist): v for k, v in mixed.items() if k.startswith(dist)} == {
        "OnDemandBaseCapacity": "1", "OnDemandPercentageAboveBaseCapacity": "0",
        "SpotAllocationStrategy": "capacity-optimized", "SpotMaxPrice": "2.5"}
    assert [mixed[f"{override}{i}.InstanceType"] for i in (1, 2)] == ["g6e.xlarge", "g5.2xlarge"]
    assert mixed["CapacityRebalance"] == "true"
    spot = sent[names[1]]
    assert (spot[f"{dist}OnDemandBaseCapacity"], spot[f"{dist}OnDemandPercentageAboveBaseCapacity"],
            spot[f"{dist}SpotAllocationStrategy"]) == ("0", "0", "price-capacity-optimized")
    # moto echoes a policy it was created with, but its UpdateAutoScalingGroup sets the policy to the
    # request's, and the provider's update after the create carries none: DescribeAutoScalingGroups then
    # shows no policy (MOTO_OMISSIONS), and moto launches every instance on demand, of no type.
    print("mixed-instances policies as moto returns them after the apply:",
          json.dumps(_mixed_policies(moto_endpoint), default=str))

    fleet_yaml = tmp_path / "fleet.yaml"
    fleet_yaml.write_text(terraform.run("output", "-raw", "fleet_yaml", cwd=env_dir, env=env).stdout)
    check = subprocess.run([sys.executable, "-m", "fleetrl.cli", "config", "check", str(fleet_yaml)],
                           capture_output=True, text=True, timeout=scaled(60), check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    rendered = yaml.safe_load(fleet_yaml.read_text())["regions"]
    assert rendered[0]["pools"][0] == {"capacity": "on_demand", "price": 3.4}
    assert rendered[0]["pools"][1]["price"]["source"] == "aws" and rendered[1]["capacity"] == "spot"

    tf("plan", "-var-file=emulated.tfvars.json", "-out=second.tfplan")
    plan = json.loads(terraform.run("show", "-json", "second.tfplan", cwd=env_dir, env=env).stdout)
    changes = [c for c in plan.get("resource_changes", []) if c["change"]["actions"] not in (["no-op"], ["read"])]
    drift = {c["address"]: sorted(_drift(c)) for c in changes}
    tops = {a: sorted({p for p in ps if not any(p.startswith(q + ".") for q in ps)}) for a, ps in drift.items()}
    print(f"second plan: {len(changes)} to change:", tops)
    assert {c["address"]: c["change"]["actions"] for c in changes} == {a: ["update"] for a in drift}
    types = {c["address"]: c["type"] for c in changes}
    assert {(a, p) for a, paths in drift.items() for p in paths if not _explained(types[a], p)} == set()

    # The second plan has just refreshed every resource: destroy what the state holds, without another refresh.
    _recorder(moto_endpoint, "start-recording")
    destroyed = tf("destroy", "-auto-approve", "-refresh=false", "-var-file=emulated.tfvars.json")
    gone = _count(r"Destroy complete! Resources: (\d+) destroyed", destroyed)
    print(f"destroy: {gone} destroyed ({time.monotonic() - started:.0f} s in all)")
    assert gone == added
    assert terraform.run("state", "list", cwd=env_dir, env=env).stdout.split() == []
    assert _left_in_moto(moto_endpoint, tfvars["run"]) == {}
