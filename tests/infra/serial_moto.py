"""moto's server answering one request at a time, each answer in one send: `python serial_moto.py HOST PORT`.

`moto_server` always serves with a thread per request, and moto's backends are not written for concurrent
requests; the AWS provider sends up to ten at once. Served one at a time, the provider's requests queue on the
socket instead, and no two meet inside a backend.

Werkzeug sends a response's status line and headers, then its body, in two sends. On loaded cores moto can lose
the CPU between them, and the provider's Go HTTP client (aws-sdk-go-v2 on net/http) then sometimes closes the
connection once the headers are in, before the body comes: a packet capture showed the client's FIN
acknowledging exactly the header bytes, then its RST when the body arrived. The SDK counts the failed body read
as a connection error and sends the request again (`amz-sdk-request: attempt=2`, with no `HTTP Response
Received` logged for attempt 1), though moto has carried it out: a repeated RevokeSecurityGroupIngress then
fails with InvalidPermission.NotFound, a repeated AuthorizeSecurityGroupEgress as a duplicate. Sent at once, the
body is in the client's first read with the headers (every answer to a call that changes something here is
under Go's 4 KiB read buffer).
"""

from __future__ import annotations

import sys

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


class OneSendHandler(MotoRequestHandler):
    """Buffers the response (werkzeug flushes once, after the body), so headers and body leave in one send."""

    wbufsize = 1 << 22  # above any answer moto gives here (DescribeImages of every region's images: ~1.2 MB)


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    run_simple(host, port, DomainDispatcherApplication(create_backend_app), threaded=False,
               request_handler=OneSendHandler)


if __name__ == "__main__":
    main()
