"""Local stand-ins for the clouds' instance metadata services, speaking their preemption protocols.

Each server is a stdlib `ThreadingHTTPServer` on 127.0.0.1 (a free port, or one given), run in a
thread by `with Server() as s:` and stopped on exit. `s.url` is what a watcher takes as `base_url`,
`s.preempt(...)` posts the notice, and counters record what clients did. They enforce what the real
services enforce for these paths (tokens, headers), so a watcher that passes here speaks the protocol:

* `AwsImds`: IMDSv2. `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` (1-21600)
  gives a token that expires; `GET /latest/meta-data/spot/instance-action` needs a live token in
  `X-aws-ec2-metadata-token` (401 otherwise) and answers 404 until preempted.
* `GcpMetadata`: `GET /computeMetadata/v1/instance/preempted` needs `Metadata-Flavor: Google` (403
  otherwise) and answers `FALSE` / `TRUE`.
* `AzureImds`: `GET|POST /metadata/scheduledevents?api-version=...` and
  `GET /metadata/instance/compute/name?api-version=...&format=text` need `Metadata: true` (400
  otherwise); events are served as Scheduled Events documents and approvals are recorded.

`fail_with(status)` makes any of them answer every request with that status (a broken endpoint).
"""

from __future__ import annotations

import email.utils
import json
import secrets
import threading
import time
import urllib.parse
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, ClassVar, Self

from slowdown import scaled

from fleetrl import devstack

Answer = tuple[int, dict[str, str], bytes]


def free_port() -> int:
    """A loopback port nobody listens on (now): a closed endpoint, or one to start a server on later
    (the dev stack's race-free pick: no other test process is handed it meanwhile)."""
    return devstack.free_port()


def _text(status: int, text: str, **headers: str) -> Answer:
    return status, {"Content-Type": "text/plain", **headers}, text.encode()


def _json(status: int, value: Any) -> Answer:
    return status, {"Content-Type": "application/json"}, json.dumps(value).encode()


class _Handler(BaseHTTPRequestHandler):
    app: ClassVar[MetadataServer]
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        status, headers, payload = self.app.answer(self.command, self.path, dict(self.headers.items()), body)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass


class MetadataServer:
    """Base: a threaded HTTP server whose `handle()` answers each request under one lock."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request, in order."""
        self._lock = threading.Lock()
        self._failing: int | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        handler = type(f"{type(self).__name__}Handler", (_Handler,), {"app": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"{type(self).__name__}:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=scaled(5))
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def fail_with(self, status: int | None) -> None:
        """Answer every request with `status` (None: behave again)."""
        with self._lock:
            self._failing = status

    def answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Answer:
        parts = urllib.parse.urlsplit(target)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query).items()}
        lowered = {k.lower(): v for k, v in headers.items()}
        with self._lock:
            self.requests.append((method, target))
            if self._failing is not None:
                return _text(self._failing, "injected failure")
            return self.handle(method, parts.path, query, lowered, body)

    def handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str],
               body: bytes) -> Answer:
        """Answer one request (called under the lock; header names lower-cased)."""
        raise NotImplementedError


class AwsImds(MetadataServer):
    """EC2 instance metadata service, IMDSv2 only (the `http_tokens = "required"` setting)."""

    TOKEN_PATH = "/latest/api/token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    LIFE_CYCLE_PATH = "/latest/meta-data/instance-life-cycle"

    def __init__(self, port: int = 0) -> None:
        super().__init__(port)
        self.token_puts = 0
        """Session tokens handed out."""
        self.unauthorized = 0
        """Requests refused with 401 (no token, an unknown or an expired one)."""
        self.action_gets = 0
        """Authorized reads of spot/instance-action."""
        self.action: dict[str, str] | None = None
        self.life_cycle = "spot"
        """What `meta-data/instance-life-cycle` answers (`spot`, `on-demand`, `scheduled`)."""
        self._tokens: dict[str, float] = {}  # token -> monotonic expiry

    def preempt(self, action: str = "terminate", in_s: float = 120.0, when: str | None = None) -> None:
        """Post a spot interruption notice for `in_s` seconds from now (or with the raw `when` text)."""
        moment = (datetime.now(UTC) + timedelta(seconds=in_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self._lock:
            self.action = {"action": action, "time": when if when is not None else moment}

    def revoke_tokens(self) -> None:
        """Forget every session token (as an IMDS restart does): the next read with one gets 401."""
        with self._lock:
            self._tokens.clear()

    def handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str],
               body: bytes) -> Answer:
        if path == self.TOKEN_PATH and method == "PUT":
            return self._token(headers)
        if path in (self.ACTION_PATH, self.LIFE_CYCLE_PATH) and method == "GET":
            expiry = self._tokens.get(headers.get("x-aws-ec2-metadata-token", ""))
            if expiry is None or expiry <= time.monotonic():
                self.unauthorized += 1
                return _text(401, "Unauthorized")
            if path == self.LIFE_CYCLE_PATH:
                return _text(200, self.life_cycle)
            self.action_gets += 1
            return _json(200, self.action) if self.action is not None else _text(404, "Not Found")
        return _text(404 if method == "GET" else 405, "Not Found")

    def _token(self, headers: dict[str, str]) -> Answer:
        if "x-forwarded-for" in headers:  # IMDS refuses tokens to requests that went through a proxy
            return _text(403, "Forbidden")
        try:
            ttl_s = int(headers["x-aws-ec2-metadata-token-ttl-seconds"])
        except (KeyError, ValueError):
            return _text(400, "Bad Request")
        if not 1 <= ttl_s <= 21600:
            return _text(400, "Bad Request")
        token = secrets.token_urlsafe(32)
        self._tokens[token] = time.monotonic() + ttl_s
        self.token_puts += 1
        return _text(200, token, **{"X-aws-ec2-metadata-token-ttl-seconds": str(ttl_s)})


class GcpMetadata(MetadataServer):
    """Compute Engine metadata server: the `instance/preempted` value."""

    PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, port: int = 0) -> None:
        super().__init__(port)
        self.preempted = False
        self.gets = 0
        """Reads of instance/preempted that carried the header."""
        self.refused = 0
        """Requests refused with 403 for lacking `Metadata-Flavor: Google`."""

    def preempt(self) -> None:
        with self._lock:
            self.preempted = True

    def handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str],
               body: bytes) -> Answer:
        if headers.get("metadata-flavor") != "Google" or "x-forwarded-for" in headers:
            self.refused += 1
            return _text(403, "Missing Metadata-Flavor:Google header.")
        if path == self.PREEMPTED_PATH and method == "GET":
            self.gets += 1
            return _text(200, "TRUE" if self.preempted else "FALSE", **{"Metadata-Flavor": "Google"})
        return _text(404, "Not Found", **{"Metadata-Flavor": "Google"})


class AzureImds(MetadataServer):
    """Azure Instance Metadata Service: Scheduled Events and the VM's name."""

    EVENTS_PATH = "/metadata/scheduledevents"
    NAME_PATH = "/metadata/instance/compute/name"

    def __init__(self, port: int = 0, vm_name: str = "fleetrl-node-0") -> None:
        super().__init__(port)
        self.vm_name = vm_name
        self.name_available = True
        """False: the name lookup answers 404 (what a watcher must survive)."""
        self.events: list[dict[str, Any]] = []
        self.incarnation = 1
        self.acks: list[str] = []
        """Event ids approved through `StartRequests`, in order."""
        self.event_gets = 0
        self.refused = 0
        """Requests refused with 400 for lacking `Metadata: true` or `api-version`."""

    def preempt(self, resources: list[str] | None = None, not_before_in_s: float | None = 30.0,
                event_type: str = "Preempt") -> str:
        """Schedule an event (by default a Preempt of this VM in 30 s); returns its EventId."""
        event_id = str(uuid.uuid4()).upper()
        not_before = "" if not_before_in_s is None else email.utils.formatdate(time.time() + not_before_in_s,
                                                                                 usegmt=True)
        with self._lock:
            self.events.append({
                "EventId": event_id, "EventStatus": "Scheduled", "EventType": event_type,
                "ResourceType": "VirtualMachine", "Resources": resources if resources is not None else [self.vm_name],
                "NotBefore": not_before, "Description": "", "EventSource": "Platform", "DurationInSeconds": -1,
            })
            self.incarnation += 1
        return event_id

    def handle(self, method: str, path: str, query: dict[str, str], headers: dict[str, str],
               body: bytes) -> Answer:
        if headers.get("metadata") != "true" or "x-forwarded-for" in headers or "api-version" not in query:
            self.refused += 1
            return _json(400, {"error": "Bad request. Required metadata header not specified"})
        if path == self.NAME_PATH and method == "GET":
            if not self.name_available:
                return _json(404, {"error": "Not found"})
            return _text(200, self.vm_name)
        if path == self.EVENTS_PATH and method == "GET":
            self.event_gets += 1
            return _json(200, {"DocumentIncarnation": self.incarnation, "Events": self.events})
        if path == self.EVENTS_PATH and method == "POST":
            return self._approve(body)
        return _json(404, {"error": "Not found"})

    def _approve(self, body: bytes) -> Answer:
        try:
            ids = [str(r["EventId"]) for r in json.loads(body)["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            return _json(400, {"error": "Bad request"})
        for event in self.events:
            if event["EventId"] in ids:
                event["EventStatus"] = "Started"
        self.acks.extend(ids)
        self.incarnation += 1
        return _text(200, "")
