#!/usr/bin/env python3
"""Fetch a FleetRL node's secrets at boot into a systemd EnvironmentFile (and a few files).

Run by fleetrl-secrets.service before any FleetRL daemon starts:

    fetch-secrets.py /etc/fleetrl/secrets.json /run/fleetrl/env [--node NAME] [--wait-s S]

`secrets.json` (written by Terraform, holding secret ARNs, never values) looks like
`{"env": {"FLEETRL_HUB_KEY": {"arn": "...", "json_key": null}}, "files": {"/etc/fleetrl/hub.pub": {...}}}`.
Values are read from AWS Secrets Manager (the region is taken from each ARN) and written to a
root-only file under /run (tmpfs), so they never reach user data, Terraform state or disk.
The node's identity, FLEETRL_NODE, is the EC2 instance id (IMDSv2), else the short host name.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import socket
import sys
import time
import urllib.request
from typing import Any

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
IMDS = "http://169.254.169.254/latest"
ATTEMPTS = 5


class SecretProblem(Exception):
    """A secret that cannot be fetched or used; the message names the secret and its target."""


def instance_identity(imds: str = IMDS, timeout_s: float = 2.0) -> str | None:
    """EC2 instance id via IMDSv2, or None off EC2."""
    try:
        token_req = urllib.request.Request(
            f"{imds}/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
        )
        with urllib.request.urlopen(token_req, timeout=timeout_s) as resp:
            token = resp.read().decode()
        id_req = urllib.request.Request(f"{imds}/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": token})
        with urllib.request.urlopen(id_req, timeout=timeout_s) as resp:
            return str(resp.read().decode().strip())
    except OSError:
        return None


def node_name(explicit: str | None) -> str:
    name = (explicit or instance_identity() or socket.gethostname().split(".")[0]).lower()
    if not NAME_RE.match(name):
        raise SecretProblem(f"node name {name!r} does not match {NAME_RE.pattern}; pass --node")
    return name


def fetch(arn: str, json_key: str | None, target: str, wait_s: float = 0.0) -> str:
    """One secret's value. Transient errors (throttling, a role not yet propagated) are retried a
    few times; any error, a missing value included, is retried until `wait_s` has passed, so nodes
    can boot before an operator has stored a key."""
    import boto3  # installed with FleetRL; imported late so --help works anywhere
    from botocore.exceptions import BotoCoreError, ClientError

    parts = arn.split(":")
    if len(parts) < 7 or parts[2] != "secretsmanager":
        raise SecretProblem(f"{target}: {arn!r} is not a Secrets Manager ARN")
    client = boto3.client("secretsmanager", region_name=parts[3])
    deadline = time.monotonic() + wait_s
    attempt = 0
    while True:
        try:
            text = client.get_secret_value(SecretId=arn)["SecretString"]
            break
        except (BotoCoreError, ClientError) as exc:
            attempt += 1
            code = exc.response["Error"]["Code"] if isinstance(exc, ClientError) else ""
            transient = code != "ResourceNotFoundException"
            if time.monotonic() >= deadline and (not transient or attempt >= ATTEMPTS):
                raise SecretProblem(f"{target}: cannot read secret {arn}: {exc}") from exc
            print(f"fleetrl-secrets: {target}: {code or type(exc).__name__}, retrying", file=sys.stderr)
            time.sleep(min(2.0**attempt, 30.0))
    if json_key is None:
        return str(text)
    try:
        return str(json.loads(text)[json_key])
    except (ValueError, KeyError, TypeError) as exc:
        raise SecretProblem(f"{target}: secret {arn} has no JSON key {json_key!r}") from exc


def env_line(name: str, value: str, arn: str) -> str:
    value = value.strip()
    if "\n" in value or not value:
        raise SecretProblem(f"{name}: secret {arn} is empty or has several lines; store one line (e.g. hex)")
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return f'{name}="{escaped}"\n'


def write_private(path: pathlib.Path, text: str, mode: int, group: str | None = None) -> None:
    """Write atomically (temp file, then rename) so a daemon never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    if group is not None and os.geteuid() == 0:
        import grp

        os.chown(tmp, 0, grp.getgrnam(group).gr_gid)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=pathlib.Path, help="secrets.json written by Terraform")
    parser.add_argument("env_file", type=pathlib.Path, help="EnvironmentFile to write")
    parser.add_argument("--node", help="node name (default: EC2 instance id, else short host name)")
    parser.add_argument("--file-group", default="fleetrl", help="group that may read secret files")
    parser.add_argument("--wait-s", type=float, default=0.0, help="keep retrying missing secrets this long")
    args = parser.parse_args(argv)
    try:
        spec: dict[str, Any] = json.loads(args.spec.read_text())
        lines = [f"FLEETRL_NODE={node_name(args.node)}\n"]
        for name, src in sorted(spec.get("env", {}).items()):
            lines.append(env_line(name, fetch(src["arn"], src.get("json_key"), name, args.wait_s), src["arn"]))
        for path, src in sorted(spec.get("files", {}).items()):
            value = fetch(src["arn"], src.get("json_key"), path, args.wait_s)
            write_private(pathlib.Path(path), value.strip() + "\n", 0o640, args.file_group)
        write_private(args.env_file, "".join(lines), 0o600)
    except (SecretProblem, OSError, ValueError, KeyError) as exc:
        print(f"fleetrl-secrets: {exc}", file=sys.stderr)
        return 1
    print(f"fleetrl-secrets: wrote {len(lines)} variables to {args.env_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
