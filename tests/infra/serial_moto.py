"""moto's server answering one request at a time: `python serial_moto.py HOST PORT`.

`moto_server` always serves with a thread per request, and moto's backends are not written for
concurrent requests. The AWS provider sends up to ten at once. Under load, an apply or destroy
failed on moto refusing a request the SDK had repeated after moto had already carried it out (a
second AuthorizeSecurityGroupEgress, RevokeSecurityGroupIngress or AddRoleToInstanceProfile; the
recorder shows `amz-sdk-request: attempt=2` a few requests after the first attempt, so an error answer,
not a timeout). Served one at a time, the provider's requests queue on the socket instead, and no two
meet inside a backend.
"""

from __future__ import annotations

import sys

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    run_simple(host, port, DomainDispatcherApplication(create_backend_app), threaded=False,
               request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
