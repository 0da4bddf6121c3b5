"""``remote/hub.resolve`` against the Hub stand-in: a source becomes a commit and its files,
with the Hub's answers checked as hostile data and every failure said plainly."""

from __future__ import annotations

import hashlib
import re
import socket
from typing import Any

import pytest

from llmgw_cli.core.weights.snapshot import Digest, RepoRef, Selection, parse_repo_ref
from llmgw_cli.errors import HubError
from llmgw_cli.remote.hub import resolve
from tests import hub_standin
from tests.hub_standin import HubStandin, git_blob_sha1

SHARD1 = b"\x01" * 3000
SHARD2 = b"\x02" * 2000
CONFIG = b'{"model_type": "llama"}'
FILES = {
    "config.json": CONFIG,
    "model-00001-of-00002.safetensors": SHARD1,
    "model-00002-of-00002.safetensors": SHARD2,
    "model.safetensors.index.json": b"{}",
    "pytorch_model.bin": b"pickled",
    "tokenizer.json": b"{}",
    "README.md": b"# tiny",
    "original/consolidated.00.pth": b"pth",
}
DEFAULT_KEPT = [
    "config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
]


@pytest.fixture
def hub(hub_standin: HubStandin, hf_home: str) -> HubStandin:
    hub_standin.repo("acme/tiny").push(FILES)
    return hub_standin


def test_a_branch_resolves_to_its_commit_and_the_default_files(hub: HubStandin) -> None:
    commit = hub.repos["acme/tiny"].refs["main"]
    snap = resolve(parse_repo_ref("acme/tiny"), None, hub.url)
    assert (snap.repo, snap.commit, snap.revision) == ("acme/tiny", commit, "main")
    assert [f.path for f in snap.files] == DEFAULT_KEPT
    by_path = {f.path: f for f in snap.files}
    shard = by_path["model-00001-of-00002.safetensors"]
    assert (shard.size, shard.algorithm, shard.digest) == (
        3000,
        Digest.sha256,
        hashlib.sha256(SHARD1).hexdigest(),
    )
    config = by_path["config.json"]
    assert (config.size, config.algorithm, config.digest) == (
        len(CONFIG),
        Digest.git_sha1,
        git_blob_sha1(CONFIG),
    )
    assert snap.total_bytes == sum(len(FILES[p]) for p in DEFAULT_KEPT)
    # The tree was asked at the commit, not at the branch.
    trees = [r.path for r in hub.requests if "/tree/" in r.path]
    assert trees and all(f"/tree/{commit}" in t for t in trees)


def test_a_pinned_commit_keeps_its_files_after_the_branch_moves(hub: HubStandin) -> None:
    repo = hub.repos["acme/tiny"]
    old = repo.refs["main"]
    new = repo.push({"config.json": b"{}", "model.safetensors": b"\x03" * 10})
    assert resolve(RepoRef("acme/tiny"), None, hub.url).commit == new
    pinned = resolve(RepoRef("acme/tiny", old), None, hub.url)
    assert pinned.commit == old
    assert [f.path for f in pinned.files] == DEFAULT_KEPT
    repo.tag("v1.0", old)
    assert resolve(parse_repo_ref("acme/tiny@v1.0"), None, hub.url).commit == old


def test_the_selection_is_applied(hub: HubStandin) -> None:
    only_config = resolve(RepoRef("acme/tiny"), None, hub.url, Selection(include=("*.json",)))
    assert [f.path for f in only_config.files] == [
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    no_tokenizer = resolve(RepoRef("acme/tiny"), None, hub.url, Selection(exclude=("tokenizer*",)))
    assert "tokenizer.json" not in [f.path for f in no_tokenizer.files]
    original = resolve(RepoRef("acme/tiny"), None, hub.url, Selection(include=("original/",)))
    assert [f.path for f in original.files] == ["original/consolidated.00.pth"]
    with pytest.raises(HubError, match="no file is kept") as empty:
        resolve(RepoRef("acme/tiny"), None, hub.url, Selection(include=("*.gguf",)))
    assert empty.value.kind == "empty"


def test_pages_of_the_tree_are_all_read(hub: HubStandin) -> None:
    hub.page_size = 2
    assert [f.path for f in resolve(RepoRef("acme/tiny"), None, hub.url).files] == DEFAULT_KEPT


@pytest.mark.parametrize(
    "hostile",
    ["../x.json", "/etc/passwd", "a/../../x.json", "a\\b.json", "a\x00b.json", "a//b.json", "x\n.json"],
)
def test_a_hostile_path_in_the_tree_refuses_the_snapshot(hub: HubStandin, hostile: str) -> None:
    hub.repo("evil/repo").push({"config.json": b"{}", hostile: b"owned"})
    with pytest.raises(HubError) as refused:
        resolve(RepoRef("evil/repo"), None, hub.url)
    assert refused.value.kind == "unsafe"
    assert "lists a path that is refused" in str(refused.value)


def test_a_hostile_path_is_refused_even_where_the_selection_would_skip_it(hub: HubStandin) -> None:
    hub.repo("evil/repo").push({"config.json": b"{}", "../../README.md": b"x"})
    with pytest.raises(HubError, match=re.escape("lists a path that is refused: '..'")) as refused:
        resolve(RepoRef("evil/repo"), None, hub.url)  # the folder '..' comes first in the listing
    assert refused.value.kind == "unsafe"


def test_errors_say_what_is_wrong(hub: HubStandin) -> None:
    with pytest.raises(HubError, match="no such repository") as missing:
        resolve(RepoRef("acme/nothing"), None, hub.url)
    assert missing.value.kind == "not-found"
    with pytest.raises(HubError, match="no revision 'nope'") as revision:
        resolve(RepoRef("acme/tiny", "nope"), None, hub.url)
    assert revision.value.kind == "revision"
    with pytest.raises(HubError) as unknown_commit:
        resolve(RepoRef("acme/tiny", "0" * 40), None, hub.url)
    assert unknown_commit.value.kind == "revision"


def test_a_gated_repo_is_reported_before_any_download(hub: HubStandin) -> None:
    hub.repo("acme/gated", gated=True, token="hf_right").push(FILES)
    with pytest.raises(HubError, match="is gated: ask for access") as no_token:
        resolve(RepoRef("acme/gated"), None, hub.url)
    assert no_token.value.kind == "gated"
    with pytest.raises(HubError, match="has no access") as wrong:
        resolve(RepoRef("acme/gated"), "hf_wrong", hub.url)
    assert wrong.value.kind == "gated"
    assert "hf_wrong" not in str(wrong.value)
    snap = resolve(RepoRef("acme/gated"), "hf_right", hub.url)
    assert [f.path for f in snap.files] == DEFAULT_KEPT


def test_a_private_repo_needs_its_token(hub: HubStandin) -> None:
    hub.repo("acme/private", private=True, token="hf_right").push(FILES)
    with pytest.raises(HubError, match="set HF_TOKEN") as missing:
        resolve(RepoRef("acme/private"), None, hub.url)
    assert missing.value.kind == "not-found"
    assert resolve(RepoRef("acme/private"), "hf_right", hub.url).files


def test_the_token_goes_only_to_the_endpoint(hub: HubStandin, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    resolve(RepoRef("acme/tiny"), None, hub.url)
    assert hub.seen("hub", "Authorization") == []  # none given: none sent, whatever the environment has
    resolve(RepoRef("acme/tiny"), "hf_given", hub.url)
    assert set(hub.seen("hub", "Authorization")) == {"Bearer hf_given"}
    assert hub.seen("cdn", "Authorization") == []
    with pytest.raises(HubError, match="plain http") as clear:
        resolve(RepoRef("acme/tiny"), "hf_given", "http://hub.example")
    assert clear.value.kind == "unsafe"


def test_an_unreachable_hub_is_a_network_error(hf_home: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HubError, match="cannot reach") as down:
        resolve(RepoRef("acme/tiny"), None, f"http://127.0.0.1:{port}")
    assert down.value.kind == "network"


def test_a_hub_that_lies_about_the_commit_is_refused(
    hub: HubStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = hub.repos["acme/tiny"]
    old = repo.refs["main"]
    new = repo.push(FILES)
    # A pinned commit answered with another one.
    monkeypatch.setattr(repo, "commit_of", lambda revision: new)
    with pytest.raises(HubError, match=f"answered commit {new}") as lied:
        resolve(RepoRef("acme/tiny", old), None, hub.url)
    assert lied.value.kind == "bad-answer"


@pytest.mark.parametrize(
    "change",
    [
        {"lfs": {"oid": "not-a-sha256", "size": 3000, "pointerSize": 130}},
        {"lfs": {"oid": "ab" * 32, "size": 1, "pointerSize": 130}},  # another size than the file's
        {"size": -1},
        {"oid": "short"},
        {"lfs": {"size": 3000}},  # fields huggingface_hub needs, missing
    ],
)
def test_a_file_entry_of_the_wrong_shape_is_refused(
    hub: HubStandin, monkeypatch: pytest.MonkeyPatch, change: dict[str, Any]
) -> None:
    real = hub_standin._file_fields

    def lying(repo: hub_standin.Repo, path: str, data: bytes) -> dict[str, Any]:
        fields = real(repo, path, data)
        return {**fields, **change} if path.endswith(".safetensors") or path == "config.json" else fields

    monkeypatch.setattr(hub_standin, "_file_fields", lying)
    with pytest.raises(HubError) as refused:
        resolve(RepoRef("acme/tiny"), None, hub.url)
    assert refused.value.kind == "bad-answer"
