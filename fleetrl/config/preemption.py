"""Where a region's nodes learn that they are about to be preempted (`regions[].preemption`).

One variant per source, picked by `source`: `none` (SIGTERM only), `file` (a notice file a sidecar
writes), or a cloud's instance metadata service (`aws`, `gcp`, `azure`). The watchers that read them
live in `fleetrl.regions.cloud_notices`; every variant has `poll_s` and `notice_window_s` so the agent
reads them the same way whatever the source.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fleetrl.config.base import Model

__all__ = [
    "AwsPreemptionConfig",
    "AzurePreemptionConfig",
    "FilePreemptionConfig",
    "GcpPreemptionConfig",
    "NoPreemptionConfig",
    "PreemptionConfig",
]

_MAX_POLL_S = 60.0  # a notice gives 30 s (GCP, Azure) to 120 s (AWS): polling slower misses it
_URL = r"^https?://[^\s/]+$"  # scheme and host[:port], no path: the watchers append the paths


class NoPreemptionConfig(Model):
    """No notice source: the node learns that it must go only from SIGTERM."""

    source: Literal["none"] = "none"
    """Notice source."""
    poll_s: float = Field(5.0, gt=0, le=_MAX_POLL_S)
    """Unused (nothing is polled); present so every source reads alike."""
    notice_window_s: float = Field(60.0, gt=0)
    """Seconds a node is assumed to have once told to go, when nothing says otherwise (the packaged
    systemd unit waits 90 s between SIGTERM and SIGKILL)."""


class FilePreemptionConfig(Model):
    """A notice file: a sidecar, cron job or cloud agent creates it when the node must go."""

    source: Literal["file"] = "file"
    """Notice source."""
    path: str = Field(min_length=1)
    """Absolute path of the notice file; its existence is the notice (its first bytes are logged)."""
    poll_s: float = Field(1.0, gt=0, le=_MAX_POLL_S)
    """How often the file's existence is checked."""
    notice_window_s: float = Field(120.0, gt=0)
    """Seconds the node has left once the file appears (a file carries no deadline of its own)."""


class AwsPreemptionConfig(Model):
    """EC2 spot interruption notices from the instance metadata service (IMDSv2)."""

    source: Literal["aws"] = "aws"
    """Notice source."""
    base_url: str = Field("http://169.254.169.254", pattern=_URL)
    """Instance metadata endpoint (IPv6 instances: `http://[fd00:ec2::254]`)."""
    poll_s: float = Field(5.0, gt=0, le=_MAX_POLL_S)
    """How often `spot/instance-action` is read; AWS recommends every 5 s."""
    notice_window_s: float = Field(120.0, gt=0)
    """Seconds the node has left when a notice carries no readable `time` (AWS gives two minutes),
    and the cap on the window computed from `time`."""
    token_ttl_s: int = Field(21600, ge=1, le=21600)
    """Lifetime asked for each IMDSv2 session token (AWS allows 1 s to 6 h); renewed before it ends."""


class GcpPreemptionConfig(Model):
    """Compute Engine spot / preemptible VM notices from the metadata server."""

    source: Literal["gcp"] = "gcp"
    """Notice source."""
    base_url: str = Field("http://metadata.google.internal", pattern=_URL)
    """Metadata server endpoint (also reachable as `http://169.254.169.254`)."""
    poll_s: float = Field(5.0, gt=0, le=_MAX_POLL_S)
    """How often `instance/preempted` is read."""
    notice_window_s: float = Field(30.0, gt=0)
    """Seconds the node has left once `preempted` is TRUE (Compute Engine gives 30 s)."""


class AzurePreemptionConfig(Model):
    """Azure spot VM evictions from the Scheduled Events service (`Preempt` events)."""

    source: Literal["azure"] = "azure"
    """Notice source."""
    base_url: str = Field("http://169.254.169.254", pattern=_URL)
    """Instance Metadata Service endpoint."""
    poll_s: float = Field(5.0, gt=0, le=_MAX_POLL_S)
    """How often `metadata/scheduledevents` is read."""
    notice_window_s: float = Field(30.0, gt=0)
    """Seconds the node has left when an event carries no readable `NotBefore` (Azure gives at least
    30 s for `Preempt`), and the cap on the window computed from it."""
    api_version: str = Field("2020-07-01", pattern=r"^\d{4}-\d{2}-\d{2}$")
    """Scheduled Events API version sent as `api-version`."""
    acknowledge: bool = True
    """Approve the event (`StartRequests`) once the agent has decided to leave: the platform may then
    evict before `NotBefore`, which shortens the window but frees the node sooner."""


PreemptionConfig = Annotated[
    NoPreemptionConfig | FilePreemptionConfig | AwsPreemptionConfig | GcpPreemptionConfig | AzurePreemptionConfig,
    Field(discriminator="source"),
]
"""One of the sources above, chosen by `source`."""
