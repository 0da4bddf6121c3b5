"""The node program's record of an origin download and what it decides from it, on a
temporary folder (pure file logic: no origin, no node)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw_cli.node.fetch_disk import hash_target, open_folder, origin_record, side_files
from llmgw_cli.node.fetch_http import _present

URL = "https://example.org/w/m.gguf"
BODY = b"weights" * 1000


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[tuple[int, str]]:
    target = tmp_path / "m.gguf"
    target.write_bytes(BODY)
    fd = open_folder(str(tmp_path), create=False)
    yield fd, str(target)
    os.close(fd)


def record(target: str, **changes: Any) -> None:
    data = {"url": URL, "size": len(BODY), "sha256": hashlib.sha256(BODY).hexdigest()} | changes
    Path(side_files(target)["origin"]).write_text(json.dumps(data))


def test_a_record_is_read_only_for_its_url_and_when_well_formed(folder: tuple[int, str]) -> None:
    fd, target = folder
    assert origin_record(fd, target, URL) is None  # none yet
    record(target)
    assert origin_record(fd, target, URL) == origin_record(fd, target, None) != None  # noqa: E711
    assert origin_record(fd, target, URL + "x") is None  # another URL's file of the same name
    for bad in ({"size": -1}, {"size": True}, {"sha256": "abc"}, {"sha256": None}):
        record(target, **bad)
        assert origin_record(fd, target, URL) is None, bad


def test_an_unpinned_file_without_a_record_is_downloaded_again(folder: tuple[int, str]) -> None:
    fd, target = folder
    config: dict[str, Any] = {"target": target, "url": URL}
    assert _present(fd, config) is None
    assert "no record of an origin download" in config["replacing"]


def test_an_unpinned_file_of_another_size_than_its_record_is_downloaded_again(
    folder: tuple[int, str],
) -> None:
    fd, target = folder
    record(target, size=len(BODY) + 1)
    config: dict[str, Any] = {"target": target, "url": URL}
    assert _present(fd, config) is None
    assert f"has {len(BODY)} bytes" in config["replacing"]


def test_an_unpinned_file_is_kept_once_it_hashes_to_its_record(folder: tuple[int, str]) -> None:
    fd, target = folder
    record(target)
    config: dict[str, Any] = {"target": target, "url": URL}
    assert _present(fd, config) is None and config["check"]  # never hashed: the job hashes it
    assert config["keep_sha256"] == hashlib.sha256(BODY).hexdigest()
    hash_target(fd, target)  # what that job does, remembered by inode, size and times
    answer = _present(fd, {"target": target, "url": URL})
    assert answer is not None and answer["state"] == "present" and answer["origin"]["url"] == URL


def test_an_unpinned_file_changed_since_its_record_is_replaced(folder: tuple[int, str]) -> None:
    fd, target = folder
    record(target, sha256="0" * 64)
    hash_target(fd, target)
    config: dict[str, Any] = {"target": target, "url": URL}
    assert _present(fd, config) is None
    assert "not what the origin sent" in config["replacing"]


def test_a_peer_copy_checks_the_record_of_the_models_url_not_the_peers(folder: tuple[int, str]) -> None:
    fd, target = folder
    record(target)
    hash_target(fd, target)
    peer = {"target": target, "url": "http://10.0.0.2:4000/s/m.gguf", "origin": {"url": URL}}
    assert _present(fd, peer) is not None
