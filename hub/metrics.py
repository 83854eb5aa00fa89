"""Prometheus metrics of a region's replicator (units in the names) on their own registry.

Served by `fleetrl replicator` on `hub.replicator_metrics_port` (0 picks a free port, logged as
`replicator.metrics`; None disables). WAN copies are counted per version, as DESIGN.md §5 promises
one per region per version.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetrl.metrics import MetricsRegistry


class ReplicatorMetrics(MetricsRegistry):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.versions_copied = Counter("fleetrl_replicator_versions_copied_total",
                                       "Versions copied into the region store (WAN copies)", ["region"], registry=r)
        self.copied_bytes = Counter("fleetrl_replicator_copied_bytes_total",
                                    "Object bytes copied into the region store from other stores", ["region"],
                                    registry=r)
        self.rebuilt_bytes = Counter("fleetrl_replicator_rebuilt_bytes_total",
                                     "Dense anchor bytes rebuilt in the region instead of copied", ["region"],
                                     registry=r)
        self.version = Gauge("fleetrl_replicator_version", "Newest version the region store holds (-1: none)",
                             ["region"], registry=r)
        self.lease_held = Gauge("fleetrl_replicator_lease_held", "1 while this replicator holds the region's lease",
                                ["region"], registry=r)
        self.copy_seconds = Histogram("fleetrl_replicator_copy_seconds", "Time to copy one version",
                                      ["region"], buckets=(0.1, 0.3, 1, 3, 10, 30, 100, 300), registry=r)
