"""The Hub stand-in answers huggingface_hub as the Hub does: the real client, pointed at it.

If these pass, a test that resolves or downloads through the stand-in exercises the same
requests, headers and redirects it would against huggingface.co.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder

from tests.hub_standin import HubStandin, git_blob_sha1

WEIGHTS = bytes(range(256)) * 1024  # 256 KiB
CONFIG = b'{"architectures": ["LlamaForCausalLM"]}\n'
FILES = {
    "config.json": CONFIG,
    "model.safetensors": WEIGHTS,
    "tokenizer.json": b'{"version": "1.0"}',
    "original/params.json": b"{}",
    "original/consolidated.00.pth": b"pickle" * 10,
}


@pytest.fixture
def hub(hub_standin: HubStandin, hf_home: str) -> HubStandin:
    hub_standin.repo("acme/tiny").push(FILES)
    return hub_standin


def test_model_info_names_the_commit_and_the_files(hub: HubStandin) -> None:
    commit = hub.repos["acme/tiny"].refs["main"]
    info = HfApi(endpoint=hub.url, token=False).model_info("acme/tiny", revision="main")
    assert info.sha == commit
    assert info.gated is False
    assert sorted(s.rfilename for s in info.siblings or []) == sorted(FILES)

    detailed = HfApi(endpoint=hub.url, token=False).model_info("acme/tiny", files_metadata=True)
    by_name = {s.rfilename: s for s in detailed.siblings or []}
    assert by_name["model.safetensors"].lfs is not None
    assert by_name["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert by_name["config.json"].lfs is None
    assert by_name["config.json"].blob_id == git_blob_sha1(CONFIG)


def test_list_repo_tree_gives_sizes_and_lfs_sha256_across_pages(hub: HubStandin) -> None:
    hub.page_size = 2  # the Hub's is 1000: pages are followed through the Link header
    tree = list(HfApi(endpoint=hub.url, token=False).list_repo_tree("acme/tiny", recursive=True))
    files = {e.path: e for e in tree if isinstance(e, RepoFile)}
    assert sorted(files) == sorted(FILES)
    assert [e.path for e in tree if isinstance(e, RepoFolder)] == ["original"]
    st = files["model.safetensors"]
    assert st.size == len(WEIGHTS)
    assert st.lfs is not None
    assert st.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert st.lfs.size == len(WEIGHTS)
    assert files["config.json"].lfs is None
    assert files["config.json"].blob_id == git_blob_sha1(CONFIG)
    links = [r for r in hub.requests if "cursor=" in r.path]
    assert len(links) == 2  # 6 entries (5 files, 1 folder): 3 pages of 2, the first without a cursor

    top = list(HfApi(endpoint=hub.url, token=False).list_repo_tree("acme/tiny"))
    assert sorted(e.path for e in top) == ["config.json", "model.safetensors", "original", "tokenizer.json"]
    sub = list(HfApi(endpoint=hub.url, token=False).list_repo_tree("acme/tiny", "original"))
    assert sorted(e.path for e in sub) == ["original/consolidated.00.pth", "original/params.json"]
    expanded = list(HfApi(endpoint=hub.url, token=False).list_repo_tree("acme/tiny", expand=True))
    assert all(e.last_commit is not None for e in expanded)


def test_hf_hub_download_fetches_git_and_lfs_files(hub: HubStandin, hf_home: str) -> None:
    commit = hub.repos["acme/tiny"].refs["main"]
    config = hf_hub_download("acme/tiny", "config.json", endpoint=hub.url, token=False)
    assert Path(config).read_bytes() == CONFIG
    assert f"/snapshots/{commit}/" in config
    assert config.startswith(hf_home)
    weights = hf_hub_download("acme/tiny", "model.safetensors", endpoint=hub.url, token=False)
    assert Path(weights).read_bytes() == WEIGHTS
    # The LFS file came from the CDN, through the resolve's redirect.
    assert [r.method for r in hub.requests if r.server == "cdn"] == ["GET"]

    meta = get_hf_file_metadata(hf_hub_url("acme/tiny", "model.safetensors", endpoint=hub.url), token=False)
    assert meta.commit_hash == commit
    assert meta.etag == hashlib.sha256(WEIGHTS).hexdigest()
    assert meta.size == len(WEIGHTS)
    assert meta.location.startswith(hub.cdn_url)


def test_a_pinned_commit_keeps_its_files_after_the_branch_moves(hub: HubStandin) -> None:
    repo = hub.repos["acme/tiny"]
    old = repo.refs["main"]
    new = repo.push({**FILES, "config.json": b"{}"})
    api = HfApi(endpoint=hub.url, token=False)
    assert api.model_info("acme/tiny").sha == new
    assert api.model_info("acme/tiny", revision=old).sha == old
    old_config = hf_hub_download("acme/tiny", "config.json", revision=old, endpoint=hub.url, token=False)
    assert Path(old_config).read_bytes() == CONFIG
    repo.tag("v1", old)
    assert api.model_info("acme/tiny", revision="v1").sha == old


def test_errors_carry_the_codes_huggingface_hub_maps(hub: HubStandin) -> None:
    api = HfApi(endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/nothing")
    with pytest.raises(RevisionNotFoundError):
        api.model_info("acme/tiny", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        list(api.list_repo_tree("acme/tiny", revision="0" * 40))
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("acme/tiny", "missing.json", endpoint=hub.url, token=False)


def test_a_gated_repo_needs_its_token_and_the_cdn_never_sees_it(hub: HubStandin) -> None:
    hub.repo("acme/gated", gated=True, token="hf_right").push(FILES)
    api = HfApi(endpoint=hub.url, token=False)
    assert api.model_info("acme/gated").gated == "manual"  # metadata is public, as on the Hub
    with pytest.raises(GatedRepoError) as no_token:
        hf_hub_download("acme/gated", "model.safetensors", endpoint=hub.url, token=False)
    assert no_token.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as wrong:
        hf_hub_download("acme/gated", "model.safetensors", endpoint=hub.url, token="hf_wrong")
    assert wrong.value.response.status_code == 403

    path = hf_hub_download("acme/gated", "model.safetensors", endpoint=hub.url, token="hf_right")
    assert Path(path).read_bytes() == WEIGHTS
    assert "Bearer hf_right" in hub.seen("hub", "Authorization")
    assert hub.seen("cdn", "Authorization") == []


def test_a_private_repo_is_not_found_without_its_token(hub: HubStandin) -> None:
    hub.repo("acme/private", private=True, token="hf_right").push(FILES)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token=False).model_info("acme/private")
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token="hf_wrong").model_info("acme/private")
    assert HfApi(endpoint=hub.url, token="hf_right").model_info("acme/private").sha


def test_a_cut_download_resumes_with_a_range(hub: HubStandin, monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub writes (and counts towards a resume) whole chunks of 10 MiB: smaller
    # ones let this small file be cut after a chunk has been kept.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    sha = hashlib.sha256(WEIGHTS).hexdigest()
    hub.cut_after[sha] = 100_000  # not a multiple of the chunk: the last partial one is lost
    path = hf_hub_download("acme/tiny", "model.safetensors", endpoint=hub.url, token=False)
    assert Path(path).read_bytes() == WEIGHTS
    gets = [r for r in hub.requests if r.server == "cdn"]
    assert [(g.status, g.headers.get("range")) for g in gets] == [
        (200, None),
        (206, f"bytes={6 * 16 * 1024}-"),
    ]


def test_the_cdn_answers_ranges(hub: HubStandin) -> None:
    sha = hashlib.sha256(WEIGHTS).hexdigest()
    url = f"{hub.cdn_url}/blobs/{sha}"
    with httpx.Client() as client:
        part = client.get(url, headers={"Range": "bytes=10-19"})
        assert part.status_code == 206
        assert part.headers["content-range"] == f"bytes 10-19/{len(WEIGHTS)}"
        assert part.content == WEIGHTS[10:20]
        tail = client.get(url, headers={"Range": f"bytes={len(WEIGHTS) - 5}-"})
        assert tail.content == WEIGHTS[-5:]
        beyond = client.get(url, headers={"Range": f"bytes={len(WEIGHTS)}-"})
        assert beyond.status_code == 416
        assert beyond.headers["content-range"] == f"bytes */{len(WEIGHTS)}"
        changed = client.get(url, headers={"Range": "bytes=10-", "If-Range": '"other"'})
        assert changed.status_code == 200
        assert changed.content == WEIGHTS
        assert client.get(url, headers={"Range": "bytes=0-", "If-Range": f'"{sha}"'}).status_code == 206
        assert client.get(f"{hub.cdn_url}/blobs/{'0' * 64}").status_code == 404
