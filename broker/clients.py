"""What every Kafka client of the broker layer shares: connection settings, error translation, retries.

The producer, the consumer and the topic tooling all reach a region's cluster the same way
(`client_kwargs`), turn aiokafka's exceptions into `KafkaError` at the boundary (`translated`),
keeping aiokafka's `retriable` flag, and retry retriable failures a bounded number of times with
exponential backoff (`with_retries`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import aiokafka.errors as ak_errors

from fleetrl.broker.errors import KafkaError
from fleetrl.config import FleetConfig, KafkaClusterConfig
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
    """aiokafka keyword arguments shared by producers, consumers and admin clients of a region."""
    c = cluster(config, region)
    kwargs: dict[str, Any] = {
        "bootstrap_servers": c.bootstrap,
        "client_id": client_id,
        "request_timeout_ms": int(config.kafka.request_timeout_s * 1000),
        "security_protocol": c.security_protocol,
    }
    if c.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        kwargs["ssl_context"] = create_ssl_context(cafile=c.ca_file)
    if c.sasl_mechanism is not None:
        if c.sasl_mechanism == "OAUTHBEARER":
            raise KafkaError(f"region {region!r}: OAUTHBEARER needs a token provider, which FleetRL lacks")
        kwargs["sasl_mechanism"] = c.sasl_mechanism
        kwargs["sasl_plain_username"] = c.sasl_username
        kwargs["sasl_plain_password"] = os.environ.get(c.sasl_password_env or "", None)
    return kwargs


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
