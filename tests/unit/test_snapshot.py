"""Whole-repo weights, the pure part: the source grammar, the file selection, hostile
paths, the layout on a node and the manifest (llmgw_cli/core/weights/snapshot.py)."""

from __future__ import annotations

import json
import posixpath
import string

import pytest
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import filter_repo_objects, validate_repo_id
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmgw_cli.core.weights.snapshot import (
    BadPath,
    BadSource,
    Digest,
    OnDisk,
    RepoRef,
    Selection,
    Snapshot,
    SnapshotFile,
    WeightFormat,
    check_endpoint,
    check_repo_id,
    check_repo_path,
    check_repo_paths,
    check_revision,
    complete_snapshot,
    file_path,
    manifest_matches,
    manifest_path,
    manifest_text,
    one_format,
    parse_manifest,
    parse_repo_ref,
    snapshot_folder,
    weight_format,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "f" * 40
SHA = "ab" * 32
PROPERTY = settings(max_examples=300, deadline=None)

# --- the source grammar ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "ref"),
    [
        ("Qwen/Qwen2.5-7B-Instruct", RepoRef("Qwen/Qwen2.5-7B-Instruct", "main")),
        ("meta-llama/Llama-3.1-8B@main", RepoRef("meta-llama/Llama-3.1-8B", "main")),
        (f"org/name@{COMMIT}", RepoRef("org/name", COMMIT)),
        ("org/name@v1.0", RepoRef("org/name", "v1.0")),
        ("org/name@refs/pr/12", RepoRef("org/name", "refs/pr/12")),
        ("_o/n_", RepoRef("_o/n_", "main")),
    ],
)
def test_sources_that_parse(source: str, ref: RepoRef) -> None:
    assert parse_repo_ref(source) == ref


def test_a_ref_built_directly_is_checked_too() -> None:
    with pytest.raises(BadSource):
        RepoRef("../../api/x")
    with pytest.raises(BadSource):
        RepoRef("org/name", "../main")


def test_only_a_commit_pins() -> None:
    assert parse_repo_ref(f"o/n@{COMMIT}").pinned
    assert not parse_repo_ref("o/n@main").pinned
    assert not parse_repo_ref("o/n@" + "A" * 40).pinned  # upper case: a branch name, not a commit
    assert str(parse_repo_ref("o/n")) == "o/n@main"


@pytest.mark.parametrize(
    "source",
    [
        "",
        "name",  # the org is required: it names the folder on the node
        "a/b/c",
        "/abs/path",
        "org/name@",
        "org/name@@x",
        "org/name@a@b",
        "org/name@../x",
        "org/name@a..b",
        "org/name@/main",
        "org/name@main/",
        "org/name@a//b",
        "org/name@.hidden",
        "org/name@a/.b",
        "org/name@x.lock",
        "org/name@a b",
        "org/name@a\nb",
        "org/name@a\x00b",
        "org/name@a~1",
        "org/name@a:b",
        "org/name@a\\b",
        "org/name@" + "a" * 256,
        "org--x/name",
        "org/na..me",
        "org/name.git",
        "-org/name",
        "org/name-",
        "org/.name",
        "o" * 97 + "/name",
        "org/nämé",
        "org/name\n",
        "org /name",
    ],
)
def test_sources_that_are_refused(source: str) -> None:
    with pytest.raises(BadSource):
        parse_repo_ref(source)


REPO_CHARS = string.ascii_letters + string.digits + "_.-/"


@PROPERTY
@given(st.text(alphabet=REPO_CHARS + "é@ ", max_size=40))
@example("a/b")
@example("a-/b")
@example("a/b.git")
def test_repo_ids_are_what_huggingface_hub_accepts_with_an_org(repo: str) -> None:
    """The same rules as huggingface_hub's own check, the org made compulsory."""
    try:
        validate_repo_id(repo)
        theirs = repo.count("/") == 1
    except HFValidationError:
        theirs = False
    try:
        check_repo_id(repo)
        ours = True
    except BadSource:
        ours = False
    assert ours == theirs


@PROPERTY
@given(st.text(alphabet=string.ascii_letters + string.digits + "_.-/~^:?*[\\ @{}\x00\x7f", max_size=60))
def test_an_accepted_revision_is_a_safe_git_ref_name(revision: str) -> None:
    try:
        check_revision(revision)
    except BadSource:
        return
    assert revision and len(revision) <= 255
    assert ".." not in revision and "//" not in revision and "@" not in revision
    assert not revision.startswith("/") and not revision.endswith("/")
    for component in revision.split("/"):
        assert not component.startswith(".") and not component.endswith(".lock")
        assert set(component) <= set(string.ascii_letters + string.digits + "_.-")


def test_the_token_goes_to_an_https_endpoint_or_to_this_machine() -> None:
    assert check_endpoint("https://huggingface.co/") == "https://huggingface.co"
    assert check_endpoint("https://hub.example:8443") == "https://hub.example:8443"
    assert check_endpoint("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    for bad in [
        "http://hub.example",
        "ftp://hub.example",
        "https://user:pw@hub.example",
        "https://hub.example/api",
        "https://hub.example?x=1",
        "huggingface.co",
        "https://",
    ]:
        with pytest.raises(ValueError):
            check_endpoint(bad)


# --- hostile paths -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "../x",
        "a/../../x",
        "a/..",
        "..",
        ".",
        "./a",
        "a/./b",
        "/etc/passwd",
        "//x",
        "a//b",
        "a/",
        "",
        "a\\b",
        "..\\x",
        "a\x00b",
        "a\nb",
        "a\tb",
        "a\x7fb",
        "a\x85b",
        "a\u2028b",
        "a\udc80b",
        "x" * 256,
        "a/" * 600 + "b",
        None,
        7,
    ],
)
def test_hostile_paths_are_refused_with_a_reason(path: object) -> None:
    with pytest.raises(BadPath) as refused:
        check_repo_path(path)
    assert str(refused.value)


@pytest.mark.parametrize(
    "path", ["config.json", "a/b/c.safetensors", ".gitattributes", "a..b", "...", "é/ü.json", "x" * 255]
)
def test_ordinary_paths_pass(path: str) -> None:
    assert check_repo_path(path) == path


@PROPERTY
@given(st.text(alphabet=st.sampled_from(["a", "b", ".", "/", "\\", "\x00", "\n", "é", " "]), max_size=30))
@example("../etc/passwd")
@example("a/../../b")
def test_an_accepted_path_stays_inside_the_snapshot_folder(path: str) -> None:
    try:
        check_repo_path(path)
    except BadPath:
        return
    base = "/w/hf/o--n/" + COMMIT
    joined = posixpath.normpath(posixpath.join(base, path))
    assert joined.startswith(base + "/")
    assert joined == f"{base}/{path}"  # nothing in it that normalising would change
    assert not any(ord(c) < 0x20 for c in path)


def test_a_listing_is_refused_for_duplicates_and_file_folder_clashes() -> None:
    assert check_repo_paths(["a/b", "a/c", "d"]) == ["a/b", "a/c", "d"]
    with pytest.raises(BadPath, match="twice"):
        check_repo_paths(["a", "a"])
    with pytest.raises(BadPath, match="file and as a folder"):
        check_repo_paths(["a/b/c", "a/b"])
    with pytest.raises(BadPath, match=r"\.\."):
        check_repo_paths(["ok", "../x"])


# --- the selection -----------------------------------------------------------------------

LLAMA = [
    ".gitattributes",
    "LICENSE",
    "README.md",
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "pytorch_model-00001-of-00002.bin",
    "pytorch_model-00002-of-00002.bin",
    "pytorch_model.bin.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "merges.txt",
    "modeling_custom.py",
    "original/consolidated.00.pth",
    "original/params.json",
    "original/tokenizer.model",
    "model.gguf",
    "onnx/model.onnx",
    "onnx/config.json",
    "flax_model.msgpack",
    "tf_model.h5",
    "training_args.bin",
]


def test_the_default_brings_safetensors_config_and_tokenizer() -> None:
    assert Selection().select(LLAMA) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "chat_template.jinja",
        "merges.txt",
    ]


def test_without_safetensors_the_default_brings_the_pytorch_files() -> None:
    repo = [p for p in LLAMA if not p.endswith(".safetensors") and "safetensors" not in p]
    chosen = Selection().select(repo)
    assert "pytorch_model-00001-of-00002.bin" in chosen
    assert "pytorch_model.bin.index.json" in chosen
    assert "training_args.bin" not in chosen
    assert weight_format(chosen) is WeightFormat.pytorch
    assert weight_format(Selection().select(LLAMA)) is WeightFormat.safetensors
    assert weight_format(["config.json"]) is WeightFormat.none


def test_weights_are_never_brought_twice() -> None:
    everything = Selection(include=("*",)).select(LLAMA)
    assert not any(p.endswith(".bin") or p.endswith(".bin.index.json") for p in everything)
    assert "model-00001-of-00002.safetensors" in everything
    mistral = ["consolidated.safetensors", "model-00001-of-00001.safetensors", "params.json"]
    assert Selection(include=("*",)).select(mistral) == ["model-00001-of-00001.safetensors", "params.json"]
    only_consolidated = ["consolidated.safetensors", "params.json"]
    assert Selection(include=("*",)).select(only_consolidated) == only_consolidated


def test_an_include_replaces_the_defaults_and_an_exclude_adds_to_them() -> None:
    assert Selection(include=("original/",)).select(LLAMA) == [
        "original/consolidated.00.pth",
        "original/params.json",
        "original/tokenizer.model",
    ]
    assert "merges.txt" not in Selection(exclude=("*.txt",)).select(LLAMA)
    assert "original/params.json" not in Selection(exclude=("*.txt",)).select(LLAMA)
    with_code = Selection(include=("*.json", "*.safetensors", "*.py")).select(LLAMA)
    assert "modeling_custom.py" in with_code and "onnx/config.json" in with_code
    with pytest.raises(ValueError):
        Selection(include=("",)).select(LLAMA)


PATH_PART = st.sampled_from(
    ["a", "b", "sub", "original", "x.json", "y.bin", "z.txt", "w.safetensors", "A.JSON"]
)
PATTERN = st.sampled_from(
    ["*", "*.json", "sub/", "sub/*", "*/x.json", "a*", "original/*", "*.JSON", "[ab]", "?"]
)


@PROPERTY
@given(
    st.lists(st.lists(PATH_PART, min_size=1, max_size=3).map("/".join), max_size=8, unique=True),
    st.lists(PATTERN, min_size=1, max_size=3),
    st.lists(PATTERN, max_size=2),
)
def test_patterns_mean_what_they_mean_to_huggingface_hub(
    paths: list[str], include: list[str], exclude: list[str]
) -> None:
    theirs = list(filter_repo_objects(paths, allow_patterns=include, ignore_patterns=exclude or None))
    assert Selection(include=tuple(include), exclude=tuple(exclude)).select(paths) == one_format(theirs)


# --- the snapshot, its layout and its manifest -------------------------------------------


def _snapshot(*files: SnapshotFile) -> Snapshot:
    return Snapshot("org/name", COMMIT, files, revision="main")


WEIGHTS = SnapshotFile("model.safetensors", 1000, SHA, Digest.sha256)
CONFIG = SnapshotFile("config.json", 20, "1" * 40, Digest.git_sha1)


def test_a_snapshot_holds_checked_files() -> None:
    snap = _snapshot(WEIGHTS, CONFIG)
    assert snap.total_bytes == 1020
    assert snap.weight_format is WeightFormat.safetensors
    with pytest.raises(ValueError):
        Snapshot("org/name", "main", ())
    with pytest.raises(BadPath):
        _snapshot(WEIGHTS, WEIGHTS)
    with pytest.raises(BadPath):
        SnapshotFile("../x", 1, SHA, Digest.sha256)
    with pytest.raises(ValueError):
        SnapshotFile("x", -1, SHA, Digest.sha256)
    with pytest.raises(ValueError):
        SnapshotFile("x", True, SHA, Digest.sha256)
    with pytest.raises(ValueError):
        SnapshotFile("x", 1, "1" * 40, Digest.sha256)  # a git id is not a sha256
    with pytest.raises(ValueError):
        SnapshotFile("x", 1, SHA, Digest.git_sha1)


def test_the_layout_on_a_node() -> None:
    assert snapshot_folder("/w", "org/name", COMMIT) == f"/w/hf/org--name/{COMMIT}"
    assert snapshot_folder("/w/", "org/name", COMMIT) == f"/w/hf/org--name/{COMMIT}"
    assert manifest_path("/w", "org/name", COMMIT) == f"/w/hf/org--name/{COMMIT}.manifest.json"
    assert file_path("/w", _snapshot(CONFIG), "a/b.json") == f"/w/hf/org--name/{COMMIT}/a/b.json"
    with pytest.raises(BadPath):
        file_path("/w", _snapshot(CONFIG), "../../etc/passwd")
    with pytest.raises(ValueError):
        snapshot_folder("/w", "org/name", "main")
    with pytest.raises(ValueError):
        snapshot_folder("relative", "org/name", COMMIT)
    with pytest.raises(BadSource):
        snapshot_folder("/w", "../x/name", COMMIT)


def test_the_manifest_round_trips_and_says_what_is_missing_or_wrong() -> None:
    snap = _snapshot(WEIGHTS, CONFIG)
    text = manifest_text(snap, {"model.safetensors": SHA, "config.json": "cd" * 32})
    manifest = parse_manifest(text)
    assert manifest.repo == "org/name" and manifest.commit == COMMIT
    assert manifest_matches(snap, manifest) == []
    assert complete_snapshot(
        {"model.safetensors": OnDisk(1000, SHA), "config.json": OnDisk(20)}, manifest
    ).complete

    check = complete_snapshot(
        {"model.safetensors": OnDisk(999), "notes.txt": OnDisk(3)},
        manifest,
    )
    assert not check.complete
    assert check.missing == ("config.json",)
    assert check.wrong == (("model.safetensors", "999 bytes, the manifest says 1000"),)
    assert check.extra == ("notes.txt",)
    wrong_hash = complete_snapshot(
        {"model.safetensors": OnDisk(1000, "00" * 32), "config.json": OnDisk(20)}, manifest
    )
    assert [p for p, _ in wrong_hash.wrong] == ["model.safetensors"]

    other = Snapshot("org/name", OTHER, (WEIGHTS,))
    assert manifest_matches(other, manifest) == [f"manifest is of org/name@{COMMIT}"]
    with pytest.raises(ValueError, match="the Hub says"):
        manifest_text(snap, {"model.safetensors": "00" * 32, "config.json": SHA})
    with pytest.raises(ValueError, match="no sha256"):
        manifest_text(snap, {"model.safetensors": SHA})


def _manifest(**changes: object) -> str:
    body: dict[str, object] = {
        "format": 1,
        "repo": "org/name",
        "commit": COMMIT,
        "files": [{"path": "a.json", "size": 1, "sha256": SHA}],
    }
    body.update(changes)
    return json.dumps(body)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        _manifest(format=2),
        _manifest(repo="../x"),
        _manifest(repo=["org/name"]),
        _manifest(commit="main"),
        _manifest(files={}),
        _manifest(files=["a.json"]),
        _manifest(files=[{"path": "../a", "size": 1, "sha256": SHA}]),
        _manifest(files=[{"path": "/etc/shadow", "size": 1, "sha256": SHA}]),
        _manifest(files=[{"path": "a", "size": -1, "sha256": SHA}]),
        _manifest(files=[{"path": "a", "size": True, "sha256": SHA}]),
        _manifest(files=[{"path": "a", "size": 1.5, "sha256": SHA}]),
        _manifest(files=[{"path": "a", "size": 1, "sha256": "x"}]),
        _manifest(files=[{"path": "a", "size": 1, "sha256": SHA}] * 2),
        b"\xff\xfe",
    ],
)
def test_a_hostile_manifest_is_refused(text: str | bytes) -> None:
    with pytest.raises(ValueError):
        parse_manifest(text)
