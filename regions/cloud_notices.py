"""Preemption notices from a cloud's instance metadata service (DESIGN.md §1: preemptible regions).

Each watcher polls one local metadata endpoint every `poll_s` and returns a `Notice` (reason
`preempted`, with `window_s`, the seconds the node has left) once the cloud says the node is going.
The region agent races them with `SignalWatcher` and hands its groups over within the window.

* `AwsSpotWatcher`: EC2 spot `spot/instance-action` through IMDSv2 (session token, renewed before
  it ends and after a 401); the window runs to the notice's `time`.
* `GcpPreemptionWatcher`: Compute Engine `instance/preempted` (`TRUE` once preempted; 30 s).
* `AzureEvictionWatcher`: Azure Scheduled Events, a `Preempt` event naming this VM; the window runs
  to its `NotBefore`. With `acknowledge`, `close()` approves the event after the agent has handed
  over, so the platform may take the node at once instead of waiting for `NotBefore`.

HTTP goes through the standard library (`urllib.request` in a thread, no proxy, short timeouts).
An unreachable or misbehaving endpoint never ends `wait()`: the failure is logged
(`notice.poll_failed`, then at most once a minute while it lasts, `notice.poll_recovered` when it
ends) and the endpoint is polled again.
"""

from __future__ import annotations

import asyncio
import email.utils
import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fleetrl.config import Capacity, FleetConfig
from fleetrl.config.preemption import (
    AwsPreemptionConfig,
    AzurePreemptionConfig,
    FilePreemptionConfig,
    GcpPreemptionConfig,
    NoPreemptionConfig,
    PreemptionConfig,
)
from fleetrl.log import get_logger
from fleetrl.regions.errors import RegionsError
from fleetrl.regions.preemption import Notice, NoticeFileWatcher, PreemptionWatcher

__all__ = ["AwsSpotWatcher", "AzureEvictionWatcher", "GcpPreemptionWatcher", "node_capacity", "watchers_from_config"]

log = get_logger(__name__)

_HTTP_TIMEOUT_S = 2.0  # link-local services answer in milliseconds; a hung one must not stall a poll
_MAX_BODY = 64 * 1024  # metadata answers are tiny; never read an unbounded body
_QUOTE = 200  # how much of an unexpected answer is quoted in an error
_LOG_EVERY_S = 60.0  # while an endpoint keeps failing, one log line per this many seconds
# Metadata services are link-local: a proxy from the environment (http_proxy) would send the request
# off the host, where it cannot be answered (or worse, is answered by someone else).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _EndpointError(RegionsError):
    """A metadata endpoint answered something a watcher cannot use (caught and logged in `wait`)."""

    retriable = True


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: bytes

    def quote(self) -> str:
        return self.body[:_QUOTE].decode("utf-8", "replace").strip()


def _http(method: str, url: str, headers: dict[str, str], body: bytes | None = None) -> _Reply:
    """One blocking request; an HTTP error status is a reply, a network failure raises OSError."""
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with _OPENER.open(request, timeout=_HTTP_TIMEOUT_S) as response:
            return _Reply(response.status, response.read(_MAX_BODY))
    except urllib.error.HTTPError as exc:
        try:
            return _Reply(exc.code, exc.read(_MAX_BODY) if exc.fp is not None else b"")
        finally:
            exc.close()


class _FailureLog:
    """Logs an endpoint's first failure at once, then one line per `_LOG_EVERY_S` while it lasts."""

    def __init__(self, source: str, event: str) -> None:
        self.source, self.event = source, event
        self.failures = 0
        self._logged_at = 0.0

    def failed(self, url: str, exc: BaseException) -> None:
        self.failures += 1
        now = time.monotonic()
        if self.failures == 1 or now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            log.warning(self.event, source=self.source, url=url, failures=self.failures,
                        error=f"{type(exc).__name__}: {exc}")

    def recovered(self, url: str) -> None:
        if self.failures:
            log.info("notice.poll_recovered", source=self.source, url=url, failures=self.failures)
            self.failures = 0


class _MetadataWatcher:
    """Polls `_poll()` in a thread every `poll_s` until it returns a notice; failures are logged."""

    source = "metadata"

    def __init__(self, url: str, poll_s: float, notice_window_s: float) -> None:
        if poll_s <= 0 or notice_window_s <= 0:
            raise ValueError(f"{self.source} watcher: poll_s and notice_window_s must be > 0, "
                             f"got {poll_s} and {notice_window_s}")
        self.url, self.poll_s, self.notice_window_s = url, poll_s, notice_window_s
        self.polls = 0
        """Polls made so far (answered or not): how tests and operators see that it is alive."""
        self.notice: Notice | None = None
        self._failures = _FailureLog(self.source, "notice.poll_failed")

    async def wait(self) -> Notice:
        """Return the notice once the cloud posts it; again at once if called after that."""
        while self.notice is None:
            self.polls += 1
            try:
                notice = await asyncio.to_thread(self._poll)
            except Exception as exc:  # an endpoint down or answering nonsense: log it, poll again
                self._failures.failed(self.url, exc)
            else:
                self._failures.recovered(self.url)
                if notice is not None:
                    self.notice = notice
                    break
            await asyncio.sleep(self.poll_s)
        return self.notice

    def _poll(self) -> Notice | None:
        """One look at the endpoint (blocking, in a thread): the notice, or None while there is none."""
        raise NotImplementedError

    def close(self) -> None:
        """Nothing is held between polls."""

    def _window(self, deadline: datetime | None) -> float:
        """Seconds until `deadline`, within [0, notice_window_s]; notice_window_s without one."""
        if deadline is None:
            return self.notice_window_s
        left_s = (deadline - datetime.now(UTC)).total_seconds()
        return min(self.notice_window_s, max(0.0, left_s))


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _iso_time(text: Any) -> datetime | None:
    """`2026-11-24T08:22:00Z` (AWS's format) or None."""
    if not isinstance(text, str):
        return None
    try:
        return _utc(datetime.fromisoformat(text.strip()))
    except ValueError:
        return None


def _http_date(text: Any) -> datetime | None:
    """`Mon, 24 Nov 2026 08:22:00 GMT` (Azure's RFC 1123 format) or None."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        return _utc(email.utils.parsedate_to_datetime(text))
    except (TypeError, ValueError):
        return None


class AwsSpotWatcher(_MetadataWatcher):
    """EC2 spot interruption notice: IMDSv2 `GET /latest/meta-data/spot/instance-action`.

    404 means no notice; 200 carries `{"action": "terminate"|"stop"|"hibernate", "time": ...}`. The
    session token (`PUT /latest/api/token`) is renewed a minute (at most half its life) before it
    ends, and at once when the service answers 401.
    """

    source = "aws"

    def __init__(self, base_url: str = "http://169.254.169.254", *, poll_s: float = 5.0,
                 notice_window_s: float = 120.0, token_ttl_s: int = 21600) -> None:
        super().__init__(f"{base_url}/latest/meta-data/spot/instance-action", poll_s, notice_window_s)
        self.token_url = f"{base_url}/latest/api/token"
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._renew_at = 0.0

    def _poll(self) -> Notice | None:
        reply = self._get_action()
        if reply.status == 401:  # the token ended early (revoked, clock) or IMDS restarted
            self._token = None
            reply = self._get_action()
        if reply.status == 404:
            return None
        if reply.status != 200:
            raise _EndpointError(f"GET {self.url} answered {reply.status}: {reply.quote()!r}")
        return self._notice(reply)

    def _get_action(self) -> _Reply:
        return _http("GET", self.url, {"X-aws-ec2-metadata-token": self._session_token()})

    def instance_life_cycle(self) -> str:
        """`meta-data/instance-life-cycle`: `spot`, `on-demand` or `scheduled` (blocking). A node of a
        mixed-instances group learns its capacity type this way: its launch template is the same for both."""
        url = self.url.replace("spot/instance-action", "instance-life-cycle")
        reply = _http("GET", url, {"X-aws-ec2-metadata-token": self._session_token()})
        if reply.status == 401:
            self._token = None
            reply = _http("GET", url, {"X-aws-ec2-metadata-token": self._session_token()})
        if reply.status != 200:
            raise _EndpointError(f"GET {url} answered {reply.status}: {reply.quote()!r}")
        return reply.body.decode("ascii", "replace").strip()

    def _session_token(self) -> str:
        now = time.monotonic()
        if self._token is None or now >= self._renew_at:
            reply = _http("PUT", self.token_url, {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)})
            if reply.status != 200 or not reply.body.strip():
                raise _EndpointError(f"PUT {self.token_url} (IMDSv2 session token) answered {reply.status}: "
                                     f"{reply.quote()!r}")
            self._token = reply.body.decode("ascii", "replace").strip()
            # `now` was taken before the request, so the service's own expiry is never earlier.
            self._renew_at = now + self.token_ttl_s - min(60.0, self.token_ttl_s / 2)
        return self._token

    def _notice(self, reply: _Reply) -> Notice:
        try:
            action = json.loads(reply.body)
        except ValueError:
            action = None
        if not isinstance(action, dict):  # the item exists only when a notice was posted: still one
            return Notice("preempted", f"aws spot instance-action: {reply.quote()!r}", self.notice_window_s)
        when = action.get("time")
        return Notice("preempted", f"aws spot instance-action: {action.get('action')} at {when}",
                      self._window(_iso_time(when)))


class GcpPreemptionWatcher(_MetadataWatcher):
    """Compute Engine preemption: `GET /computeMetadata/v1/instance/preempted` answers TRUE or FALSE."""

    source = "gcp"

    def __init__(self, base_url: str = "http://metadata.google.internal", *, poll_s: float = 5.0,
                 notice_window_s: float = 30.0) -> None:
        super().__init__(f"{base_url}/computeMetadata/v1/instance/preempted", poll_s, notice_window_s)

    def _poll(self) -> Notice | None:
        reply = _http("GET", self.url, {"Metadata-Flavor": "Google"})
        if reply.status != 200:
            raise _EndpointError(f"GET {self.url} answered {reply.status}: {reply.quote()!r}")
        answer = reply.quote().upper()
        if answer == "FALSE":
            return None
        if answer == "TRUE":
            return Notice("preempted", "gcp instance/preempted is TRUE", self.notice_window_s)
        raise _EndpointError(f"GET {self.url} answered {answer!r}, expected TRUE or FALSE")


class AzureEvictionWatcher(_MetadataWatcher):
    """Azure spot eviction: a `Preempt` event in `GET /metadata/scheduledevents` naming this VM.

    The VM's name comes from `GET /metadata/instance/compute/name`. Until that lookup has answered,
    any `Preempt` event counts: draining for a neighbour's eviction costs a few groups' progress,
    missing our own costs all of it. The lookup is tried again on every poll until it answers.
    """

    source = "azure"

    def __init__(self, base_url: str = "http://169.254.169.254", *, poll_s: float = 5.0,
                 notice_window_s: float = 30.0, api_version: str = "2020-07-01", acknowledge: bool = True) -> None:
        super().__init__(f"{base_url}/metadata/scheduledevents?api-version={api_version}", poll_s, notice_window_s)
        self.name_url = f"{base_url}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
        self.acknowledge = acknowledge
        self.vm_name: str | None = None
        self.event_id: str | None = None
        """Id of the event that became the notice (what `close()` approves)."""
        self._acked = False
        self._name_failures = _FailureLog(self.source, "notice.vm_name_failed")

    def _poll(self) -> Notice | None:
        if self.vm_name is None:
            self._look_up_name()
        reply = _http("GET", self.url, {"Metadata": "true"})
        if reply.status != 200:
            raise _EndpointError(f"GET {self.url} answered {reply.status}: {reply.quote()!r}")
        try:
            events = json.loads(reply.body).get("Events") or []
        except (ValueError, AttributeError) as exc:
            raise _EndpointError(f"GET {self.url} answered no JSON object: {reply.quote()!r}") from exc
        for event in events:
            if isinstance(event, dict) and self._ours(event):
                self.event_id = str(event.get("EventId", ""))
                return Notice("preempted", f"azure scheduled event {self.event_id} Preempt "
                              f"({event.get('EventStatus')}, NotBefore {event.get('NotBefore')!r})",
                              self._window(_http_date(event.get("NotBefore"))))
        return None

    def _ours(self, event: dict[str, Any]) -> bool:
        if event.get("EventType") != "Preempt":
            return False
        resources = event.get("Resources")
        return self.vm_name is None or (isinstance(resources, list) and self.vm_name in resources)

    def _look_up_name(self) -> None:
        try:
            reply = _http("GET", self.name_url, {"Metadata": "true"})
            if reply.status != 200 or not reply.quote():
                raise _EndpointError(f"GET {self.name_url} answered {reply.status}: {reply.quote()!r}")
        except Exception as exc:  # any Preempt event counts until the name is known
            self._name_failures.failed(self.name_url, exc)
            return
        self._name_failures.recovered(self.name_url)
        self.vm_name = reply.quote()
        log.info("notice.vm_name", source=self.source, vm_name=self.vm_name)

    def close(self) -> None:
        """Approve the notice's event (once), when `acknowledge` is set and a notice was returned.

        The agent closes its watchers after it has handed over and gone offline, so approving here
        lets the platform evict early without shortening the time the handover had. Blocking, at
        most one short request; a failure is logged (the platform then evicts at `NotBefore`).
        """
        if not self.acknowledge or self.event_id is None or self._acked:
            return
        self._acked = True
        body = json.dumps({"StartRequests": [{"EventId": self.event_id}]}).encode()
        try:
            reply = _http("POST", self.url, {"Metadata": "true", "Content-Type": "application/json"}, body)
        except (OSError, http.client.HTTPException) as exc:
            log.warning("notice.ack_failed", source=self.source, event_id=self.event_id, error=str(exc))
            return
        if reply.status != 200:
            log.warning("notice.ack_failed", source=self.source, event_id=self.event_id, status=reply.status,
                        answer=reply.quote())
        else:
            log.info("notice.acknowledged", source=self.source, event_id=self.event_id)


def watchers_from_config(cfg: PreemptionConfig) -> list[PreemptionWatcher]:
    """The watchers a region's `preemption` section asks for (none: SIGTERM alone, added by the agent)."""
    if isinstance(cfg, NoPreemptionConfig):
        return []
    if isinstance(cfg, FilePreemptionConfig):
        return [NoticeFileWatcher(cfg.path, poll_s=cfg.poll_s, window_s=cfg.notice_window_s)]
    if isinstance(cfg, AwsPreemptionConfig):
        return [AwsSpotWatcher(cfg.base_url, poll_s=cfg.poll_s, notice_window_s=cfg.notice_window_s,
                               token_ttl_s=cfg.token_ttl_s)]
    if isinstance(cfg, GcpPreemptionConfig):
        return [GcpPreemptionWatcher(cfg.base_url, poll_s=cfg.poll_s, notice_window_s=cfg.notice_window_s)]
    if isinstance(cfg, AzurePreemptionConfig):
        return [AzureEvictionWatcher(cfg.base_url, poll_s=cfg.poll_s, notice_window_s=cfg.notice_window_s,
                                     api_version=cfg.api_version, acknowledge=cfg.acknowledge)]
    raise TypeError(f"unknown preemption source {cfg!r}")


def node_capacity(config: FleetConfig, region: str, node: str) -> Capacity:
    """The node's capacity type (blocking): the pool that lists it, else, on AWS (`preemption.source:
    aws`), what the instance metadata says (`instance-life-cycle`: the nodes of a mixed-instances group
    share one launch template, so only the instance knows), else the region's `capacity`. An unreadable
    metadata service is logged and the config's answer kept."""
    r = config.region(region)
    if any(node in pool.nodes for pool in r.pools) or not isinstance(r.preemption, AwsPreemptionConfig):
        return r.node_capacity(node)
    watcher = AwsSpotWatcher(r.preemption.base_url, token_ttl_s=min(r.preemption.token_ttl_s, 300))
    try:
        life_cycle = watcher.instance_life_cycle()
    except (OSError, http.client.HTTPException, RegionsError) as exc:
        log.warning("agent.capacity_unknown", region=region, node=node, error=str(exc), capacity=r.node_capacity(node))
        return r.node_capacity(node)
    return "spot" if life_cycle == "spot" else "on_demand"
