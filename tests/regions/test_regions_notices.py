"""Cloud preemption-notice watchers against local servers that speak each metadata protocol."""

from __future__ import annotations

import asyncio
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
import structlog
from metadata_servers import AwsImds, AzureImds, GcpMetadata, MetadataServer, free_port
from pydantic import TypeAdapter, ValidationError
from slowdown import scaled

from fleetrl.config import FleetConfig
from fleetrl.config.preemption import (
    AwsPreemptionConfig,
    AzurePreemptionConfig,
    FilePreemptionConfig,
    GcpPreemptionConfig,
    NoPreemptionConfig,
    PreemptionConfig,
)
from fleetrl.regions.cloud_notices import (
    AwsSpotWatcher,
    AzureEvictionWatcher,
    GcpPreemptionWatcher,
    node_capacity,
    watchers_from_config,
)
from fleetrl.regions.preemption import Notice, NoticeFileWatcher

POLL_S = 0.05
BOUND_S = 10.0  # every wait below ends well within this on 2 shared cores (the reference figure: scaled where used)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = BOUND_S) -> None:
    """Wait for `condition` (checked every 20 ms), failing with `what` after `timeout_s` (the reference
    machine's figure, scaled by the machine's slowdown)."""
    timeout_s = scaled(timeout_s)
    async def check() -> None:
        while not condition():
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(check(), timeout_s)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def still_waiting(task: asyncio.Task[Notice], polls: Callable[[], int], n: int = 3) -> None:
    """The watcher has polled `n` more times and has not returned."""
    start = polls()
    await until(lambda: polls() >= start + n or task.done(), f"{n} polls")
    assert not task.done(), task.result()


# -- config ---------------------------------------------------------------------------------------


def test_config_defaults_per_source() -> None:
    adapter: TypeAdapter[PreemptionConfig] = TypeAdapter(PreemptionConfig)
    aws = adapter.validate_python({"source": "aws"})
    assert isinstance(aws, AwsPreemptionConfig)
    assert (aws.base_url, aws.poll_s, aws.notice_window_s, aws.token_ttl_s) == ("http://169.254.169.254", 5, 120, 21600)
    gcp = adapter.validate_python({"source": "gcp"})
    assert isinstance(gcp, GcpPreemptionConfig)
    assert (gcp.base_url, gcp.notice_window_s) == ("http://metadata.google.internal", 30)
    azure = adapter.validate_python({"source": "azure"})
    assert isinstance(azure, AzurePreemptionConfig)
    assert (azure.api_version, azure.acknowledge, azure.notice_window_s) == ("2020-07-01", True, 30)
    assert adapter.validate_python({"source": "file", "path": "/run/notice"}).notice_window_s == 120
    none = NoPreemptionConfig()
    assert none.source == "none" and none.notice_window_s > 0 and none.poll_s > 0


@pytest.mark.parametrize("bad", [
    {"source": "ibm"},
    {"source": "aws", "base_url": "http://169.254.169.254/latest"},
    {"source": "gcp", "poll_s": 0},
    {"source": "aws", "token_ttl_s": 21601},
    {"source": "azure", "api_version": "latest"},
    {"source": "file"},
    {"source": "gcp", "token_ttl_s": 60},
])
def test_config_refuses(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(PreemptionConfig).validate_python(bad)


def test_watchers_from_config() -> None:
    assert watchers_from_config(NoPreemptionConfig()) == []
    (file_watcher,) = watchers_from_config(FilePreemptionConfig(path="/run/fleetrl/notice", poll_s=0.5))
    assert isinstance(file_watcher, NoticeFileWatcher)
    assert (file_watcher.poll_s, file_watcher.window_s) == (0.5, 120)
    (aws,) = watchers_from_config(AwsPreemptionConfig(base_url="http://127.0.0.1:1", poll_s=2, token_ttl_s=60))
    assert isinstance(aws, AwsSpotWatcher) and aws.url.startswith("http://127.0.0.1:1/latest/")
    assert (aws.poll_s, aws.token_ttl_s) == (2, 60)
    (gcp,) = watchers_from_config(GcpPreemptionConfig())
    assert isinstance(gcp, GcpPreemptionWatcher) and gcp.url.startswith("http://metadata.google.internal/")
    (azure,) = watchers_from_config(AzurePreemptionConfig(acknowledge=False))
    assert isinstance(azure, AzureEvictionWatcher) and not azure.acknowledge


# -- AWS ------------------------------------------------------------------------------------------


async def test_aws_notice_after_preempt_with_window_to_its_time() -> None:
    with AwsImds() as imds:
        watcher = AwsSpotWatcher(imds.url, poll_s=POLL_S)
        task = asyncio.create_task(watcher.wait())
        try:
            await still_waiting(task, lambda: imds.action_gets)
            posted = time.monotonic()
            imds.preempt("terminate", in_s=90)
            notice = await asyncio.wait_for(task, scaled(BOUND_S))
            seen_s = time.monotonic() - posted
        finally:
            task.cancel()
    assert notice.reason == "preempted" and "terminate" in notice.detail
    # 90 s minus the time the watcher took to see it (however busy the machine), in whole seconds
    assert notice.window_s is not None and 90 - math.ceil(seen_s) - 1 <= notice.window_s <= 90
    assert imds.token_puts == 1 and imds.unauthorized == 0  # one session token served every poll


@pytest.mark.parametrize(("in_s", "when", "expected"), [
    (600, None, 120),  # further away than a spot notice can be: capped by notice_window_s
    (-30, None, 0),  # already past: nothing left
    (0, "soon", 120),  # unreadable time: notice_window_s
])
async def test_aws_window_bounds(in_s: float, when: str | None, expected: float) -> None:
    with AwsImds() as imds:
        imds.preempt("stop", in_s=in_s, when=when)
        notice = await asyncio.wait_for(AwsSpotWatcher(imds.url, poll_s=POLL_S).wait(), scaled(BOUND_S))
    assert notice.window_s == expected and "stop" in notice.detail


async def test_aws_token_renewed_after_401() -> None:
    with AwsImds() as imds:
        watcher = AwsSpotWatcher(imds.url, poll_s=POLL_S)
        task = asyncio.create_task(watcher.wait())
        try:
            await still_waiting(task, lambda: imds.action_gets)
            imds.revoke_tokens()
            await until(lambda: imds.token_puts == 2, "a second token after the 401")
            await still_waiting(task, lambda: imds.action_gets)
            imds.preempt()
            notice = await asyncio.wait_for(task, scaled(BOUND_S))
        finally:
            task.cancel()
    assert notice.reason == "preempted"
    assert imds.unauthorized == 1 and imds.token_puts == 2  # the refused read was retried at once


async def test_aws_token_renewed_before_it_expires() -> None:
    with AwsImds() as imds:
        # renewed after 2 s: a watcher stalled for under 2 s on busy cores still renews in time (with 1 s,
        # renewed after 0.5 s, a stall of half a second read with an expired token); a slower machine
        # stalls longer, so the lifetime is scaled by its slowdown
        watcher = AwsSpotWatcher(imds.url, poll_s=POLL_S, token_ttl_s=math.ceil(scaled(4)))
        task = asyncio.create_task(watcher.wait())
        try:
            await until(lambda: imds.token_puts >= 3 or task.done(), "three tokens")
            assert not task.done()
        finally:
            task.cancel()
    assert imds.unauthorized == 0  # never read with an expired token


# -- GCP ------------------------------------------------------------------------------------------


async def test_gcp_notice_after_preempt() -> None:
    with GcpMetadata() as server:
        watcher = GcpPreemptionWatcher(server.url, poll_s=POLL_S, notice_window_s=30)
        task = asyncio.create_task(watcher.wait())
        try:
            await still_waiting(task, lambda: server.gets)
            server.preempt()
            notice = await asyncio.wait_for(task, scaled(BOUND_S))
        finally:
            task.cancel()
    assert notice == Notice("preempted", "gcp instance/preempted is TRUE", 30)
    assert server.refused == 0


def test_gcp_server_enforces_the_metadata_flavor_header() -> None:
    """A client without the header is refused, so the watcher's requests above carried it."""
    with GcpMetadata() as server:
        request = urllib.request.Request(f"{server.url}{GcpMetadata.PREEMPTED_PATH}")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=scaled(5))
        refused.value.close()
    assert refused.value.code == 403 and server.refused == 1 and server.gets == 0


# -- Azure ----------------------------------------------------------------------------------------


async def test_azure_preempt_of_this_vm_is_the_notice_and_close_approves_it() -> None:
    with AzureImds(vm_name="node-7") as imds:
        watcher = AzureEvictionWatcher(imds.url, poll_s=POLL_S, notice_window_s=30)
        task = asyncio.create_task(watcher.wait())
        try:
            await still_waiting(task, lambda: imds.event_gets)
            imds.preempt(resources=["node-8"])  # a neighbour's eviction
            imds.preempt(resources=["node-7"], event_type="Reboot")  # not a preemption
            await still_waiting(task, lambda: imds.event_gets)
            posted = time.monotonic()
            event_id = imds.preempt(resources=["node-7"], not_before_in_s=20)
            notice = await asyncio.wait_for(task, scaled(BOUND_S))
            seen_s = time.monotonic() - posted
            assert imds.acks == []  # nothing approved before the agent has handed over
            watcher.close()
            watcher.close()  # idempotent: one approval
        finally:
            task.cancel()
    assert watcher.vm_name == "node-7" and event_id in notice.detail
    # 20 s minus the time the watcher took to see it; NotBefore has whole seconds
    assert notice.window_s is not None and 20 - math.ceil(seen_s) - 2 <= notice.window_s <= 20
    assert imds.acks == [event_id] and imds.refused == 0


async def test_azure_without_a_name_any_preempt_counts_and_no_ack_when_disabled() -> None:
    with AzureImds(vm_name="node-7") as imds:
        imds.name_available = False
        event_id = imds.preempt(resources=["someone-else"], not_before_in_s=None)
        watcher = AzureEvictionWatcher(imds.url, poll_s=POLL_S, notice_window_s=25, acknowledge=False)
        notice = await asyncio.wait_for(watcher.wait(), scaled(BOUND_S))
        watcher.close()
    assert watcher.vm_name is None and event_id in notice.detail
    assert notice.window_s == 25  # no NotBefore: notice_window_s
    assert imds.acks == []


# -- endpoints that are down or broken -----------------------------------------------------------


def _aws(url: str) -> AwsSpotWatcher:
    return AwsSpotWatcher(url, poll_s=POLL_S)


def _gcp(url: str) -> GcpPreemptionWatcher:
    return GcpPreemptionWatcher(url, poll_s=POLL_S)


def _azure(url: str) -> AzureEvictionWatcher:
    return AzureEvictionWatcher(url, poll_s=POLL_S)


WATCHERS = [(AwsImds, _aws), (GcpMetadata, _gcp), (AzureImds, _azure)]


@pytest.mark.parametrize(("server_type", "make"), WATCHERS, ids=["aws", "gcp", "azure"])
async def test_endpoint_down_then_up(server_type: type[MetadataServer], make: Callable[[str], object]) -> None:
    port = free_port()
    watcher = make(f"http://127.0.0.1:{port}")
    assert isinstance(watcher, AwsSpotWatcher | GcpPreemptionWatcher | AzureEvictionWatcher)
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(watcher.wait())
        try:
            await still_waiting(task, lambda: watcher.polls, n=5)
            with server_type(port) as server:
                await still_waiting(task, lambda: watcher.polls)
                server.preempt()  # type: ignore[attr-defined]
                notice = await asyncio.wait_for(task, scaled(BOUND_S))
        finally:
            task.cancel()
    assert notice.reason == "preempted"
    events = [e["event"] for e in logs if e["event"].startswith("notice.poll")]
    assert events[:2] == ["notice.poll_failed", "notice.poll_recovered"]  # one line for the whole outage
    assert events.count("notice.poll_failed") == 1


@pytest.mark.parametrize(("server_type", "make"), WATCHERS, ids=["aws", "gcp", "azure"])
async def test_endpoint_answering_errors_is_polled_again(server_type: type[MetadataServer],
                                                         make: Callable[[str], object]) -> None:
    with server_type() as server:
        server.fail_with(500)
        watcher = make(server.url)
        assert isinstance(watcher, AwsSpotWatcher | GcpPreemptionWatcher | AzureEvictionWatcher)
        task = asyncio.create_task(watcher.wait())
        try:
            await still_waiting(task, lambda: watcher.polls, n=3)
            server.fail_with(None)
            server.preempt()  # type: ignore[attr-defined]
            notice = await asyncio.wait_for(task, scaled(BOUND_S))
        finally:
            task.cancel()
    assert notice.reason == "preempted"


# -- a node's capacity type -----------------------------------------------------------------------


def _fleet(base_url: str, **region: object) -> FleetConfig:
    return FleetConfig.model_validate({"run": "cap", "regions": [{
        "name": "east", "kafka": "127.0.0.1:9092", "store": "/tmp/east", "nodes": [{"name": "base"}],
        "preemption": {"source": "aws", "base_url": base_url}, **region}]})


def test_an_auto_scaled_node_reads_its_capacity_from_the_instance_metadata() -> None:
    pools = {"pools": [{"capacity": "on_demand", "price": 3.0, "nodes": ["base"]}, {"capacity": "spot", "price": 1.0}]}
    with AwsImds() as imds:
        config = _fleet(imds.url, **pools)
        assert node_capacity(config, "east", "i-0abc") == "spot"  # IMDSv2: a token, then instance-life-cycle
        assert imds.token_puts == 1 and imds.unauthorized == 0
        imds.life_cycle = "on-demand"
        assert node_capacity(config, "east", "i-0def") == "on_demand"
        asked = len(imds.requests)
        assert node_capacity(config, "east", "base") == "on_demand"  # the config places it: no question
        assert len(imds.requests) == asked
        imds.fail_with(500)  # an unreadable metadata service: the config's answer
        assert node_capacity(config, "east", "i-0fed") == "on_demand"
        assert node_capacity(_fleet(imds.url, capacity="spot"), "east", "i-0fed") == "spot"
    closed = _fleet(f"http://127.0.0.1:{free_port()}", capacity="spot", price=1.0)
    assert node_capacity(closed, "east", "i-0abc") == "spot"
