"""TLS for the integration tests: a test CA made at run time and a TLS terminator in front of a server.

tansu cannot serve TLS itself (FACTS.md), so `TlsRelay` accepts TLS on a loopback port and relays the
plain bytes to the server behind it, as stunnel or a load balancer would in production. The relay
runs its own event loop in a thread, so in-process clients and CLI subprocesses reach it alike; it
is stopped, with every connection it holds, by `stop()` (bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import pathlib
import ssl
import threading
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from slowdown import scaled


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate it signed for 127.0.0.1/localhost, and an unrelated CA."""

    ca_file: pathlib.Path
    cert_file: pathlib.Path
    key_file: pathlib.Path
    other_ca_file: pathlib.Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_pki(folder: pathlib.Path) -> Pki:
    """A fresh CA and server certificate in `folder` (ECDSA P-256, valid for a day)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("fleetrl test CA")
    _, other_cert = _ca("fleetrl untrusted CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    pki = Pki(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "other-ca.pem")
    pki.ca_file.write_bytes(ca_cert.public_bytes(pem))
    pki.other_ca_file.write_bytes(other_cert.public_bytes(pem))
    pki.cert_file.write_bytes(cert.public_bytes(pem))
    pki.key_file.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    pki.key_file.chmod(0o600)
    return pki


class TlsRelay:
    """TLS on 127.0.0.1:`port` (0 picks one), plain TCP to 127.0.0.1:`target_port`."""

    def __init__(self, pki: Pki, target_port: int, port: int = 0) -> None:
        self.target_port, self.port = target_port, port
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(pki.cert_file, pki.key_file)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-relay", daemon=True)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        """TLS connections accepted (each relayed to the target)."""

    def start(self) -> TlsRelay:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=scaled(10))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._relay, "127.0.0.1", self.port, ssl=self._context,
                                          ssl_handshake_timeout=scaled(10))

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(client_w)
        server_w: asyncio.StreamWriter | None = None
        try:
            server_r, server_w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.target_port),
                                                      scaled(5))
            self._writers.add(server_w)
            pipes = [asyncio.ensure_future(self._pipe(client_r, server_w)),
                     asyncio.ensure_future(self._pipe(server_r, client_w))]
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        except (OSError, TimeoutError):
            pass
        finally:
            for writer in (client_w, server_w):
                if writer is not None:
                    writer.close()
                    self._writers.discard(writer)
            self._handlers.discard(task)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ssl.SSLError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    def stop(self) -> None:
        """Close the listener and every connection it accepted or opened, on the relay's loop, before the
        loop stops (a transport left open is an unclosed socket when it is collected, charged as a
        ResourceWarning to whichever test runs the collection)."""
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()
            for _ in range(3):  # connection_lost callbacks run on the next turns
                await asyncio.sleep(0)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=scaled(10))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=scaled(10))
        self._loop.close()

    def __enter__(self) -> TlsRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def settle_tls_connections(turns: int = 50) -> int:
    """Let the TLS connections of the running loop finish closing, then abort what is left; returns how
    many were aborted.

    A client that closes a TLS connection without waiting (aiokafka closes its bootstrap connection so)
    leaves a shutdown exchange on the loop; if the loop is closed first, the socket under it is never
    closed, and the collector later charges an unraisable ResourceWarning to whichever test runs then.
    Bounded by loop turns (each a heap scan and a 20 ms sleep), not by a deadline."""
    import gc
    from asyncio import sslproto

    loop = asyncio.get_running_loop()

    def open_here() -> list[sslproto.SSLProtocol]:
        # type(), not isinstance(): isinstance reads `__class__`, and some objects on the heap warn when
        # asked (torch.distributed's deprecated `reduce_op`, once imported by another test of the worker).
        return [p for p in gc.get_objects()
                if type(p) is sslproto.SSLProtocol and p._loop is loop and p._transport is not None]

    for _ in range(turns):
        left = open_here()
        if not left:
            return 0
        await asyncio.sleep(0.02)
    left = open_here()
    for protocol in left:
        protocol._transport.abort()
    await asyncio.sleep(0)
    return len(left)
