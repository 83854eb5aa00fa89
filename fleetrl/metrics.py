"""Prometheus metrics for daemons: a registry of their own and its /metrics endpoint.

Like `fleetrl.log`, a cross-cutting piece every package may use. Each daemon subclasses
`MetricsRegistry`, declares its metrics (units in their names) against `self.registry`, and serves
them on its configured port.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


class MetricsRegistry:
    """A private CollectorRegistry (no process-global state) that can serve /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._server: Any = None

    def serve(self, port: int) -> int:
        """Serve /metrics on every interface at `port` (0 picks a free one); returns the port."""
        if self._server is not None:
            raise RuntimeError(f"metrics already served on port {self._server.server_port}")
        self._server, _ = start_http_server(port, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
