"""The known_hosts file is parsed once per content, not once per connection, and a file
rewritten in between (a reinstalled node's new key, same size, same second) is read anew:
a cache keyed on anything but the content would keep trusting the old key."""

from __future__ import annotations

from pathlib import Path

import asyncssh

from llmgw_cli.remote import ssh


def line(host: str, key: asyncssh.SSHKey) -> str:
    return f"{host} {key.export_public_key().decode().strip()}\n"


def test_a_rewritten_file_is_parsed_again(tmp_path: Path) -> None:
    old, new = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    path = tmp_path / "known_hosts"
    path.write_text(line("10.0.0.1", old))
    first = ssh._known_hosts(path)
    assert first is not None and ssh._known_hosts(path) is first  # parsed once
    path.write_text(line("10.0.0.1", new))  # the same length: only the content differs
    again = ssh._known_hosts(path)
    assert again is not None and again is not first
    trusted = again.match("10.0.0.1", "", 22)[0]
    assert [k.public_data for k in trusted] == [new.public_data]


def test_an_unreadable_file_is_no_known_hosts(tmp_path: Path) -> None:
    assert ssh._known_hosts(tmp_path / "missing") is None
    (tmp_path / "binary").write_bytes(b"\xff\xfe not text")
    assert ssh._known_hosts(tmp_path / "binary") is None
    assert not ssh._matches(ssh._known_hosts(tmp_path / "missing"), "10.0.0.1", 22)
