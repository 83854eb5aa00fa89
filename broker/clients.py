"""What every Kafka client of the broker layer shares: connection settings, error translation, retries.

The producer, the consumer and the topic tooling all reach a region's cluster the same way
(`client_kwargs`), turn aiokafka's exceptions into `KafkaError` at the boundary (`translated`),
keeping aiokafka's `retriable` flag, and retry retriable failures a bounded number of times with
exponential backoff (`with_retries`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import aiokafka.errors as ak_errors

from fleetrl.broker.errors import KafkaError
from fleetrl.config import FleetConfig, KafkaClusterConfig, SecretError, SecretField
from fleetrl.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")

# Dead letters carry their original bytes plus error headers, so the dead-letter topic and every
# client that reads or writes it get this much room above the data topics' max.message.bytes.
DEAD_LETTER_SLACK_BYTES = 64 * 1024


def cluster(config: FleetConfig, region: str) -> KafkaClusterConfig:
    """The Kafka cluster of `region`; a KeyError names the regions the config knows."""
    return config.region(region).kafka


def client_kwargs(config: FleetConfig, region: str, client_id: str) -> dict[str, Any]:
    """aiokafka keyword arguments shared by every Kafka client of a region: producers, consumers, admin
    clients, the topic tooling, lag, audit and dead-letter tools all connect through here (TLS, SASL)."""
    c = cluster(config, region)
    kwargs: dict[str, Any] = {
        "bootstrap_servers": c.bootstrap,
        "client_id": client_id,
        "request_timeout_ms": int(config.kafka.request_timeout_s * 1000),
        "security_protocol": c.security_protocol,
    }
    if c.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = _ssl_context(c, region)
    if c.sasl_mechanism is not None:
        if c.sasl_mechanism == "OAUTHBEARER":
            raise KafkaError(f"region {region!r}: OAUTHBEARER needs a token provider, which FleetRL lacks")
        try:
            password = SecretField(f"regions[{region}].kafka.sasl_password", c, "sasl_password").value()
        except SecretError as exc:
            raise KafkaError(f"region {region!r}: {exc}") from exc
        if c.sasl_username is None or password is None:
            raise KafkaError(f"region {region!r}: {c.sasl_mechanism} needs kafka.sasl_username and a password "
                             f"(kafka.sasl_password_file or sasl_password_env)")
        kwargs["sasl_mechanism"] = c.sasl_mechanism
        kwargs["sasl_plain_username"] = c.sasl_username
        kwargs["sasl_plain_password"] = password
    return kwargs


def _ssl_context(c: KafkaClusterConfig, region: str) -> ssl.SSLContext:
    """Verifying TLS context: the system CAs, or only `ca_file` when set; hostnames are checked."""
    from aiokafka.helpers import create_ssl_context

    try:
        return create_ssl_context(cafile=c.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise KafkaError(f"region {region!r}: cannot load kafka.ca_file {c.ca_file}: {exc}") from exc


async def connect(start: Awaitable[None], config: FleetConfig, region: str, what: str) -> None:
    """Start a client, bounded (`uncancelled_start`). A TLS or SASL failure that no retry can fix becomes
    one non-retriable line naming the region, instead of a generic bootstrap failure retried until it
    times out."""
    try:
        await uncancelled_start(start, config.kafka.request_timeout_s, what)
    except Exception as exc:
        failure = _auth_failure(exc, region, config) or await _tls_probe(config, region)
        if failure is not None:
            raise failure from exc
        raise


def _auth_failure(exc: BaseException, region: str, config: FleetConfig) -> KafkaError | None:
    c = cluster(config, region)
    chain = [exc, exc.__cause__, exc.__context__]
    if any(isinstance(e, ssl.SSLCertVerificationError) for e in chain):
        return _untrusted(c, region)
    # aiokafka's SCRAM client fails with KeyError('v') when the server answers "e=..." (refused) instead
    # of its verifier; a real Kafka sends SaslAuthenticationFailed.
    refused = any(isinstance(e, ak_errors.SaslAuthenticationFailed | ak_errors.IllegalSaslStateError) for e in chain)
    scram_refused = c.sasl_mechanism is not None and isinstance(exc, KeyError)
    unsupported = isinstance(exc, ak_errors.UnsupportedSaslMechanismError)
    if unsupported:
        return KafkaError(f"region {region!r}: Kafka {c.bootstrap} does not offer SASL mechanism {c.sasl_mechanism} "
                          f"(kafka.sasl_mechanism)")
    if refused or scram_refused:
        return KafkaError(f"region {region!r}: Kafka {c.bootstrap} refused the {c.sasl_mechanism} login of user "
                          f"{c.sasl_username!r}: wrong user name or password (kafka.sasl_password)")
    return None


def _untrusted(c: KafkaClusterConfig, region: str) -> KafkaError:
    return KafkaError(f"region {region!r}: Kafka {c.bootstrap} presented a TLS certificate that is not trusted "
                      f"(kafka.ca_file = {c.ca_file or 'system CAs'})")


async def _tls_probe(config: FleetConfig, region: str) -> KafkaError | None:
    """After a failed bootstrap over TLS, a handshake of our own says whether the certificate was the cause
    (aiokafka only logs it and reports that it could not bootstrap)."""
    c = cluster(config, region)
    if c.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    host, _, port = c.bootstrap.split(",")[0].strip().rpartition(":")
    try:
        # As long as any request may take: a handshake cut short on a loaded machine would hide the cause
        # (seen once in the suite: the probe timed out and the error fell back to a bare bootstrap failure).
        async with asyncio.timeout(config.kafka.request_timeout_s):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port), ssl=_ssl_context(c, region))
        writer.close()  # and wait for it, briefly: a TLS transport left closing is an unclosed socket at exit
        with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
            async with asyncio.timeout(5.0):
                await writer.wait_closed()
    except ssl.SSLCertVerificationError:
        return _untrusted(c, region)
    except (OSError, TimeoutError, ssl.SSLError):
        return None
    return None


def to_kafka_error(exc: BaseException, what: str) -> KafkaError:
    """`KafkaError` for a client failure while doing `what`; timeouts and lost connections retry."""
    if isinstance(exc, KafkaError):
        return exc
    retriable = bool(getattr(exc, "retriable", False)) or isinstance(
        exc, ak_errors.KafkaTimeoutError | TimeoutError | ConnectionError
    )
    return KafkaError(f"{what}: {type(exc).__name__}: {exc}", retriable=retriable)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Re-raise aiokafka (and socket/timeout) errors as `KafkaError`, naming `what` failed."""
    try:
        yield
    except (ak_errors.KafkaError, TimeoutError, ConnectionError) as exc:
        raise to_kafka_error(exc, what) from exc


async def with_retries(
    call: Callable[[], Awaitable[T]], *, what: str, retries: int, backoff_s: float, max_backoff_s: float = 10.0
) -> T:
    """Await `call()`, retrying a retriable `KafkaError` up to `retries` times with doubling backoff."""
    for attempt in range(retries + 1):
        try:
            return await call()
        except KafkaError as exc:
            if not exc.retriable or attempt == retries:
                raise
            delay = min(backoff_s * 2**attempt, max_backoff_s)
            log.warning("kafka.retry", what=what, attempt=attempt + 1, delay_s=delay, error=str(exc))
            await asyncio.sleep(delay)
    raise AssertionError("unreachable: the loop returns or raises")


async def bounded(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """Await with a deadline; a timeout becomes a retriable `KafkaError` naming `what`."""
    try:
        async with asyncio.timeout(timeout_s):
            with translated(what):
                return await awaitable
    except TimeoutError as exc:
        raise KafkaError(f"{what}: no answer within {timeout_s:.1f} s", retriable=True) from exc


START_GRACE_S = 5.0
"""How long a start abandoned by its caller (past its bound, or cancelled) may go on to reach its own end
before it is cancelled after all. A broker that answers at all ends a start within it; one that accepts and
never answers would hold the caller for aiokafka's whole request timeout (30 s by default): past the grace
the caller goes on, and the leak is only a warning."""


async def uncancelled_start(start: Awaitable[None], timeout_s: float, what: str) -> None:
    """`bounded(start, ...)`, but the start itself is not cancelled mid-way: aiokafka's `start()` cancelled
    while its bootstrap connection waits for metadata leaves that connection open, and the garbage
    collector later finds it (`Unclosed AIOKafkaConnection`, a ResourceWarning: 10 in 40 starts cancelled
    at random within 30 ms, against tansu). Past the bound, or when the caller is cancelled, the start is
    given `START_GRACE_S` to reach its own end, then cancelled; the timeout or the cancel is raised after
    that, and the caller stops a client whose start is over."""
    task = asyncio.ensure_future(start)
    try:
        await bounded(asyncio.shield(task), timeout_s, what)
    except BaseException:
        if not task.done():
            done, _ = await asyncio.wait({task}, timeout=START_GRACE_S)
            if not done:
                task.cancel()
                await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: the caller's error is the one raised
        raise


async def stop_client(stop: Awaitable[None], timeout_s: float, what: str) -> None:
    """Await an aiokafka client's `stop()` within `timeout_s` (a timeout raises `KafkaError`).

    aiokafka's fetcher, closing, cancels a fetch request task that is waiting out its retry backoff
    (its broker just went away) and then awaits it, so `stop()` raises that task's `CancelledError`
    although nobody cancelled the caller: a trainer that had drained and checkpointed crashed on it at
    exit. Such a cancel is swallowed (and logged); a cancel of the calling task itself still propagates.
    """
    task = asyncio.current_task()
    try:
        await bounded(stop, timeout_s, what)
    except asyncio.CancelledError:
        if task is None or task.cancelling():
            raise
        log.warning("kafka.stop_leaked_cancel", what=what)
