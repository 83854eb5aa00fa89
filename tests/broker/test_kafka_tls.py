"""Kafka over TLS and SASL against real endpoints: tansu behind a TLS terminator, tansu requiring SCRAM.

tansu cannot serve TLS itself, so a TLS relay (tests/tls_testkit.py, a test CA made at run time)
terminates TLS in front of it and tansu advertises the relay's port: every connection a client makes,
bootstrap and partition leaders alike, is TLS. Every Kafka client of FleetRL — the topic tooling
(admin), the producer and consumers of the trainer and the rollout workers, the lag and log readers
that `topics lag`, `dlq show` and `audit` use — connects through `broker.clients.client_kwargs`, and
each is shown here to connect over TLS and to refuse a certificate from a CA it does not trust.

`tansu --authentication` checks SCRAM logins for real: a wrong password fails with one line naming
the region. (tansu offers no PLAIN, and no way to create a SCRAM user without being logged in, so a
successful SASL login is only built, not exercised.)
"""

from __future__ import annotations

import pathlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from broker_testkit import fleet_yaml, make_config, make_group, make_prompt, poll_until
from slowdown import scaled
from tls_testkit import Pki, TlsRelay, make_pki, settle_tls_connections

from fleetrl import devstack
from fleetrl.broker import (
    Consumer,
    KafkaError,
    Producer,
    RecordLimits,
    ensure_topics,
    group_lag,
    read_dead_letters,
    rollout_group,
    trainer_group,
)
from fleetrl.config import FleetConfig
from fleetrl.trainer.audit import read_topics

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
async def _tls_closed() -> Any:
    """Every test's TLS connections are closed before its loop is (see `settle_tls_connections`)."""
    yield
    await settle_tls_connections()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _behind_relay(pki: Pki, authentication: bool) -> Iterator[TlsRelay]:
    port = devstack.free_port()
    with TlsRelay(pki, port) as relay, devstack.tansu(port, advertised_port=relay.port,
                                                      authentication=authentication):
        yield relay


@pytest.fixture(scope="module")
def tls_kafka(pki: Pki) -> Iterator[TlsRelay]:
    """tansu reachable only as TLS on `relay.port`."""
    yield from _behind_relay(pki, authentication=False)


@pytest.fixture(scope="module")
def sasl_kafka(pki: Pki) -> Iterator[TlsRelay]:
    """tansu requiring a SCRAM login, behind TLS (SASL_SSL, as MSK)."""
    yield from _behind_relay(pki, authentication=True)


def _config(run_id: str, relay: TlsRelay, **kafka: Any) -> FleetConfig:
    data = fleet_yaml(run_id, f"127.0.0.1:{relay.port}")
    data["regions"][0]["kafka"] = {"bootstrap": f"127.0.0.1:{relay.port}", "security_protocol": "SSL", **kafka}
    return make_config(data)


async def _producer_starts(config: FleetConfig) -> None:
    async with Producer(config, "r1", "tls-producer"):
        pass


async def _consumer_starts(config: FleetConfig) -> None:
    async with Consumer(config, "r1", ["prompts"], rollout_group(config.run), RecordLimits.from_config(config),
                        None, "tls-consumer"):
        pass


async def test_every_kafka_client_connects_over_tls(run_id: str, tls_kafka: TlsRelay, pki: Pki) -> None:
    config = _config(run_id, tls_kafka, ca_file=str(pki.ca_file))
    before = tls_kafka.connections
    assert await ensure_topics(config, "r1")  # topic tooling: the admin client
    prompt, group = make_prompt("g-tls-1", run=run_id), make_group("g-tls-1", run=run_id)
    limits = RecordLimits.from_config(config)
    async with Producer(config, "r1", "tls-trainer") as producer:  # the trainer's dispatcher and the workers
        await producer.send("prompts", prompt.group_id, prompt)
        await producer.send("trajectories", group.group_id, group)
        async with Consumer(config, "r1", ["prompts"], rollout_group(run_id), limits, producer, "tls-worker") as c:
            got = await poll_until(c, 1)  # a rollout worker's consumer
            assert [d.key for d in got] == ["g-tls-1"]
            await c.commit(got)
        async with Consumer(config, "r1", ["trajectories"], trainer_group(run_id), limits, producer, "tls-coll") as c:
            got = await poll_until(c, 1)  # the trainer's collector
            assert [d.key for d in got] == ["g-tls-1"]
            await c.commit(got)
    assert await group_lag(config, "r1") is not None  # `topics lag`
    assert await read_dead_letters(config, "r1") == []  # `topics dlq show` (and replay's reader)
    view = await read_topics(config, timeout_s=scaled(30))  # `fleetrl audit`
    assert "g-tls-1" in view.dispatched and "g-tls-1" in view.arrived
    assert tls_kafka.connections > before


@pytest.mark.parametrize("client", ["admin", "producer", "consumer", "lag", "dlq", "audit"])
async def test_each_kafka_client_refuses_an_untrusted_certificate(
        run_id: str, tls_kafka: TlsRelay, pki: Pki, client: str) -> None:
    config = _config(run_id, tls_kafka, ca_file=str(pki.other_ca_file))
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "admin": lambda: ensure_topics(config, "r1"),
        "producer": lambda: _producer_starts(config),
        "consumer": lambda: _consumer_starts(config),
        "lag": lambda: group_lag(config, "r1"),
        "dlq": lambda: read_dead_letters(config, "r1"),
        "audit": lambda: read_topics(config, timeout_s=scaled(30)),
    }
    with pytest.raises(KafkaError) as info:
        await calls[client]()
    message = str(info.value)
    assert "\n" not in message and "region 'r1'" in message and "not trusted" in message
    assert str(pki.other_ca_file) in message and not info.value.retriable


async def test_a_wrong_scram_password_is_one_line_naming_the_region(
        run_id: str, sasl_kafka: TlsRelay, pki: Pki, tmp_path: pathlib.Path) -> None:
    (tmp_path / "kafka-password").write_text("not-the-password\n")
    config = _config(run_id, sasl_kafka, ca_file=str(pki.ca_file), security_protocol="SASL_SSL",
                     sasl_mechanism="SCRAM-SHA-512", sasl_username="fleetrl",
                     sasl_password_file=str(tmp_path / "kafka-password"))
    for call in (lambda: _producer_starts(config), lambda: ensure_topics(config, "r1")):
        with pytest.raises(KafkaError) as info:
            await call()
        message = str(info.value)
        assert "\n" not in message and "region 'r1'" in message and "SCRAM-SHA-512" in message
        assert "'fleetrl'" in message and "password" in message and "not-the-password" not in message


async def test_tls_without_a_trusted_ca_names_the_setting(run_id: str, tls_kafka: TlsRelay) -> None:
    """No ca_file: the system CAs do not know the test CA either."""
    with pytest.raises(KafkaError, match=r"region 'r1'.*not trusted \(kafka.ca_file = system CAs\)"):
        await _producer_starts(_config(run_id, tls_kafka))
