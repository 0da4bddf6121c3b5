"""Loopback ports for the servers the tests start."""

from __future__ import annotations

import socket

_GIVEN: set[int] = set()  # every port free_port returned in this process


def free_port() -> int:
    """A loopback port nothing listens on now, and one this process was not given before.

    The kernel may hand the port it just gave for one ``bind`` to the next: a gateway's
    public, admin and metrics ports picked one after the other could be the same port, and
    the gateway then fails with "address already in use" on its second listener. So a port
    is handed out once per process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
