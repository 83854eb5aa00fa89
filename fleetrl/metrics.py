"""Prometheus metrics for daemons: a registry of their own, served with a health check.

Like `fleetrl.log`, a cross-cutting piece every package may use. Each daemon subclasses
`MetricsRegistry`, declares its metrics (units in their names) against `self.registry`, and serves
them on its configured port: `GET /metrics` (Prometheus text format) and `GET /healthz` (JSON, 200
when the daemon says it is healthy, 503 otherwise; 200 with `{"ok": true}` when it has no check).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Health = Callable[[], tuple[bool, dict[str, Any]]]
"""A daemon's health check: (healthy, details shown on /healthz)."""


class MetricsRegistry:
    """A private CollectorRegistry (no process-global state) that can serve /metrics and /healthz."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._server: ThreadingHTTPServer | None = None

    def serve(self, port: int, health: Health | None = None, host: str = "") -> int:
        """Serve on every interface (or `host`) at `port` (0 picks a free one); returns the port."""
        if self._server is not None:
            raise RuntimeError(f"metrics already served on port {self._server.server_port}")
        self._server = ThreadingHTTPServer((host, port), _handler(self.registry, health))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def _handler(registry: CollectorRegistry, health: Health | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path == "/healthz":
                ok, details = health() if health is not None else (True, {})
                self._reply(200 if ok else 503, "application/json", json.dumps({"ok": ok, **details}).encode())
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /healthz\n")

        def _reply(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes are not events
            return

    return Handler
