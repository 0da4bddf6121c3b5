"""The tests' port picker (tests/ports.py) never hands out one port twice."""

from __future__ import annotations

from tests.ports import free_port


def test_ports_handed_out_are_all_different() -> None:
    # 2,000 binds to port 0 draw from about 28,000 ephemeral ports: without the picker's
    # memory the kernel gives some port twice in nearly every run (the birthday bound).
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
