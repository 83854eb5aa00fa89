"""The processes and the folder of `fleetrl demo`: work directory, effective config, children.

Everything the demo starts is a `Child` (a `fleetrl` daemon) or a `devstack.ServerProcess` (tansu,
the MQTT broker); each owns exactly its process, stops it by its PID (SIGTERM, then SIGKILL after a
bound) and keeps its output in a log file under `<workdir>/logs/`. On Linux a child also gets
PR_SET_PDEATHSIG, so it dies with the demo even if the demo itself is killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

import yaml

from fleetrl.config import FleetConfig, SecretField, StoreConfig, secret_fields
from fleetrl.log import register_secret

MARKER = ".fleetrl-demo"
"""A work directory holding this file was made by the demo: it may be wiped."""
_LOOPBACK = {"127.0.0.1", "localhost"}


class DemoError(RuntimeError):
    """The demo cannot start or went wrong; the message is the one line the user sees."""


class ChildFailed(DemoError):
    """A child the demo did not expect to stop has exited; the message holds its log's last lines."""

    def __init__(self, name: str, pid: int, rc: int | None, log: pathlib.Path, tail: str) -> None:
        super().__init__(f"{name} (pid {pid}) exited with code {rc}; last lines of {log}:\n{tail}")

    @classmethod
    def of(cls, child: Child) -> ChildFailed:
        return cls(child.name, child.pid, child.returncode(), child.log_path, child.tail())


# -- the work directory and the config the children read ----------------------------------------


def default_workdir(config_path: pathlib.Path) -> pathlib.Path:
    return config_path.resolve().parent / ".fleetrl" / "demo"


def fresh_workdir(workdir: pathlib.Path, default: pathlib.Path) -> pathlib.Path:
    """Empty `workdir` (stores, checkpoints and logs of an earlier run) and mark it as the demo's.

    A non-empty folder that is neither the default nor marked is refused: `--workdir` pointing at
    someone's data must not be wiped.
    """
    workdir = workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        if not (workdir / MARKER).exists() and workdir != default.resolve():
            raise DemoError(f"--workdir {workdir} is not empty and was not made by the demo; "
                            f"refusing to wipe it (choose an empty or new folder)")
        for entry in workdir.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).write_text("made by `fleetrl demo`; wiped at the start of every demo run\n")
    return workdir


def effective_config(config: FleetConfig, workdir: pathlib.Path) -> FleetConfig:
    """The config with every store and the checkpoints under `workdir` (fresh for this run), and
    agents' metrics on free ports."""
    c = config.model_copy(deep=True)
    c.hub.home_store = StoreConfig(url=str(workdir / "stores" / "home"))
    for region in c.regions:
        region.store = StoreConfig(url=str(workdir / "stores" / region.name))
    c.trainer.checkpoint_dir = str(workdir / "checkpoints")
    if c.rollout.metrics_port:  # every agent runs on this machine: one fixed port cannot serve them all
        c.rollout.metrics_port = 0
    if c.hub.replicator_metrics_port:  # likewise the replicators
        c.hub.replicator_metrics_port = 0
    return c


def with_tracking(config: FleetConfig, args: argparse.Namespace, out: pathlib.Path) -> FleetConfig:
    """The trainer's experiment records under the run's output (`OUT/tracking/`: metrics.jsonl, event
    files, offline runs; emptied first, as every demo run starts fresh), unless the config names a folder;
    `--report-to` overrides `tracking.report_to`."""
    c = config.model_copy(deep=True)
    if getattr(args, "report_to", None) is not None:
        c.tracking.report_to = list(args.report_to)
    if c.tracking.output_dir is None:
        shutil.rmtree(out / "tracking", ignore_errors=True)
        c.tracking.output_dir = str(out / "tracking")
    return c


def write_config(config: FleetConfig, path: pathlib.Path) -> pathlib.Path:
    """The children's fleet.yaml. A secret given inline goes to a file beside it (mode 0600), named by
    its `*_file` field: no secret value is ever written into the YAML (it would read `**********`)."""
    c = config.model_copy(deep=True)
    for i, secret in enumerate(secret_fields(c)):
        inline = getattr(secret.owner, secret.name)
        if inline is not None:
            secret_file = path.parent / f"secret-{i}"
            secret_file.touch(mode=0o600)
            secret_file.write_text(inline.get_secret_value())
            setattr(secret.owner, secret.name, None)
            setattr(secret.owner, f"{secret.name}_file", str(secret_file))
    path.write_text("# written by `fleetrl demo` for its processes; edit the source config instead\n"
                    + yaml.safe_dump(c.model_dump(mode="json"), sort_keys=False))
    return path


def signing_keys(config: FleetConfig) -> dict[str, str]:
    """Prepare manifest signing for the demo; returns the variables only the trainer's environment gets.

    Ed25519 (the default): the trainer alone receives the private key (the configured one, or a pair
    made for this run), and the config the children share names only the public key, so agents and
    replicators run exactly as on a fleet, unable to sign. HMAC: every process shares one key.
    """
    s = config.hub.signing
    key_env = s.key_env or "FLEETRL_HUB_KEY"
    configured = SecretField("hub.signing.key", s, "key").value()
    if s.scheme == "hmac-sha256":
        s.key, s.key_file, s.key_env = None, None, key_env
        os.environ.setdefault(key_env, configured or f"fleetrl-demo-{secrets.token_hex(16)}")
        return {}
    from cryptography.hazmat.primitives import serialization

    from fleetrl.hub.signing import generate_ed25519, load_keys

    if configured is not None:
        keys = load_keys(s)
        private = keys.signing_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                 serialization.NoEncryption()).hex()
        public = keys.verify_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    else:
        private, public = generate_ed25519()
    register_secret(private)
    s.key, s.key_file, s.key_env, s.public_key, s.public_key_file = None, None, key_env, public, None
    os.environ.pop(key_env, None)  # children inherit os.environ: only the trainer gets the private key
    return {key_env: private}


# -- ports ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ports:
    kafka: dict[str, int]
    """Region name -> Kafka port on 127.0.0.1."""
    mqtt: int


def loopback_ports(config: FleetConfig, source: str) -> Ports:
    """The demo's brokers listen where the config says; each address must be one loopback port."""
    kafka: dict[str, int] = {}
    for i, region in enumerate(config.regions):
        entries = [e.strip() for e in region.kafka.bootstrap.split(",")]
        host, _, port = entries[0].rpartition(":")
        if len(entries) != 1 or host not in _LOOPBACK:
            raise DemoError(f"{source}: regions[{i}].kafka must be one 127.0.0.1:PORT for the demo "
                            f"(got {region.kafka.bootstrap!r})")
        kafka[region.name] = int(port)
    url = urllib.parse.urlparse(config.mqtt.url)
    if url.scheme != "mqtt" or url.hostname not in _LOOPBACK or url.port is None:
        raise DemoError(f"{source}: mqtt.url must be mqtt://127.0.0.1:PORT for the demo (got {config.mqtt.url!r})")
    if len({*kafka.values(), url.port}) != len(kafka) + 1:
        raise DemoError(f"{source}: the regions' Kafka ports and the MQTT port must all differ")
    return Ports(kafka, url.port)


def check_free(ports: Ports, source: str) -> None:
    """Fail with one clear line when a port the demo needs is taken (an earlier demo still running?)."""
    named = [(p, f"Kafka of region {r}") for r, p in ports.kafka.items()] + [(ports.mqtt, "MQTT")]
    for port, what in named:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As the servers do: connections of an earlier run in TIME_WAIT must not count as "in use".
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                raise DemoError(f"port {port} ({what}, from {source}) is already in use: is another demo "
                                f"running? Stop it, or change the port in the config") from None


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of every child: one torch thread each (2 shared cores), no hub downloads."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return {**env, **(extra or {})}


# -- children -------------------------------------------------------------------------------------


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGTERM the child when the demo dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec


@dataclass
class Child:
    """One `fleetrl` daemon of the demo, its output in `log_path`."""

    name: str
    argv: list[str]
    log_path: pathlib.Path
    env: dict[str, str]
    stop_timeout_s: float = 10.0
    stdin_pipe: bool = False
    """Give the child a pipe on stdin (the fuzzer reads its orders there) instead of /dev/null."""
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> Child:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - held for the process's lifetime
        # A session of its own: Ctrl-C in the terminal reaches the demo only, which stops children in order.
        stdin = subprocess.PIPE if self.stdin_pipe else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=stdin,
                                     env=self.env, start_new_session=True, preexec_fn=_die_with_parent())
        self.starts += 1
        return self

    def restart(self) -> Child:
        """Start the same command again (after it died), its output appended to the same log."""
        if self.returncode() is None:
            raise DemoError(f"{self.name} (pid {self.pid}) is still running; it cannot be restarted")
        if self._log is not None:
            self._log.close()
        return self.start()

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> int | None:
        """Wait until `deadline` (monotonic) for the SIGTERM'd process, then SIGKILL it."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.returncode()

    def tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def fleetrl_child(name: str, args: list[str], config_path: pathlib.Path, workdir: pathlib.Path,
                  env: dict[str, str], stop_timeout_s: float) -> Child:
    argv = [sys.executable, "-m", "fleetrl.cli", *args, "--config", str(config_path), "--log-json"]
    return Child(name, argv, workdir / "logs" / f"{name}.log", env, stop_timeout_s)


def stop_all(children: list[Child]) -> dict[str, int | None]:
    """SIGTERM every child at once, then wait for each up to its own bound; SIGKILL the late ones."""
    for child in children:
        child.terminate()
    started = time.monotonic()
    return {c.name: c.wait_or_kill(started + c.stop_timeout_s) for c in children}


def kill_strays(workdir: pathlib.Path) -> list[str]:
    """SIGKILL every process of this machine, other than this one, whose command line names `workdir`: what
    the demo started and its own stop could not reach. A rollout worker is its agent's child; when the agent
    is killed the worker is reparented to init, and one that hangs at exit (it did: a library's finalizer
    waiting on a lock) would outlive the demo. Returns `name (pid)` of each one killed."""
    import psutil

    forms, killed = {str(workdir), str(workdir.resolve())}, []
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # this demo, and whatever started it

    def names_it(arg: str) -> bool:  # the folder or a path inside it, not a folder whose name extends it
        return any(arg == w or arg.endswith(f"={w}") or f"{w}{os.sep}" in arg for w in forms)

    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            if proc.info["pid"] in spared or not any(names_it(arg) for arg in proc.info["cmdline"] or ()):
                continue
            proc.kill()
            killed.append(f"{proc.info['name']} ({proc.info['pid']})")
        except psutil.Error:
            continue
    return killed

