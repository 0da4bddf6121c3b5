"""Ask the Hugging Face Hub what a whole-repo source is: its commit and the files to fetch.

``resolve`` turns ``org/name@revision`` into a ``Snapshot`` (``core/weights/snapshot.py``) with
huggingface_hub's ``HfApi``, the Hub's own client, rather than hand-written requests:

1. ``model_info(repo, revision)`` (``GET /api/models/{repo}/revision/{rev}``) names the
   commit the revision points at now (``sha``) and whether the repo is gated.
2. ``list_repo_tree(repo, revision=<that commit>, recursive=True)``
   (``GET /api/models/{repo}/tree/{commit}?recursive=true``, pages followed through the
   ``Link`` header) gives every file's path, size, git blob id and, for an LFS file, its
   sha256 (``lfs.oid``). It is asked at the commit, not the branch, so a push between the
   two calls cannot mix two commits' files. ``expand`` is not asked: it adds each file's
   last commit and security scan, which are not needed, and cuts pages from 1000 entries to 50.
3. For a gated repo (whose metadata and file list are public), one ``HEAD`` of a selected
   file's ``/resolve/`` URL says whether the token may download, so a missing or wrong token
   is reported here, before any node starts.

Everything the Hub answers is hostile data: the commit must be 40 hex (and the one asked
for, when a commit was asked for), every path of the tree passes ``check_repo_path`` (one
bad path refuses the whole snapshot, naming it), sizes and digests must have their
shapes. The token goes only to ``endpoint`` (https, or http to this machine:
``check_endpoint``); without one, none is sent, even if huggingface_hub could find one in
``HF_TOKEN`` or its token file, since the caller alone decides where a token may go.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import httpx2
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model
from llmgw_cli.core.weights.snapshot import (
    COMMIT,
    DEFAULT_ENDPOINT,
    MAX_FILES,
    SHA256,
    Digest,
    RepoRef,
    Selection,
    Snapshot,
    SnapshotFile,
    check_endpoint,
    check_repo_path,
    check_repo_paths,
)
from llmgw_cli.errors import BadPath, HubError

TIMEOUT = 30.0
LIBRARY = "llmgw"


_known: dict[tuple[str, str, str, Selection], Snapshot] = {}
"""Snapshots resolved in this process, by (endpoint, repo, commit, selection): the files of
a commit never change, so a command that resolved a branch once (to plan) does not ask the
Hub again for the same commit (to fetch)."""


def resolve(
    ref: RepoRef,
    token: str | None,
    endpoint: str = DEFAULT_ENDPOINT,
    selection: Selection | None = None,
) -> Snapshot:
    """The commit ``ref`` names now and the files of it that ``selection`` keeps (default:
    ``Selection()``), each with its size and the Hub's digest; HubError saying why not.
    A commit resolved before in this process is answered from memory."""
    selection = selection or Selection()
    if ref.pinned:
        known = _known.get((endpoint, ref.repo, ref.revision, selection))
        if known is not None:
            return known
    snapshot = _resolve(ref, token, endpoint, selection)
    _known[(endpoint, ref.repo, snapshot.commit, selection)] = snapshot
    return snapshot


def _resolve(ref: RepoRef, token: str | None, endpoint: str, selection: Selection) -> Snapshot:
    try:
        endpoint = check_endpoint(endpoint)
    except ValueError as e:
        raise HubError("unsafe", str(e)) from None
    api = HfApi(endpoint=endpoint, token=token or False, library_name=LIBRARY)
    try:
        info = api.model_info(ref.repo, revision=ref.revision, timeout=TIMEOUT)
        commit = info.sha
        if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
            raise HubError("bad-answer", f"{endpoint} answered {commit!r} as the commit of {ref}")
        if ref.pinned and commit != ref.revision:
            raise HubError("bad-answer", f"{endpoint} answered commit {commit} for {ref}")
        listed = _listing(api.list_repo_tree(ref.repo, revision=commit, recursive=True), ref, commit)
        files = _files(listed, selection, ref, commit)
        if info.gated:
            _check_access(ref, commit, files[0].path, token, endpoint)
    except HubError:
        raise
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
        raise _hub_error(e, ref, endpoint, token) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # huggingface_hub builds its objects from the answer's JSON: one without the fields
        # it reads (or not JSON at all) fails there.
        raise HubError("bad-answer", f"{endpoint}'s answer about {ref} is not the Hub's: {e!r}") from None
    return Snapshot(ref.repo, commit, tuple(files), revision=ref.revision)


def _listing(tree: Iterable[RepoFile | RepoFolder], ref: RepoRef, commit: str) -> list[RepoFile]:
    """The tree's files; its folders' paths are checked too, then left out."""
    files: list[RepoFile] = []
    for entry in tree:
        if len(files) >= MAX_FILES:
            raise HubError("bad-answer", f"{ref.repo}@{commit} lists more than {MAX_FILES} files")
        try:
            check_repo_path(entry.path)
        except BadPath as e:
            raise HubError("unsafe", f"{ref.repo}@{commit} lists a path that is refused: {e}") from None
        if isinstance(entry, RepoFile):
            files.append(entry)
    try:
        check_repo_paths(f.path for f in files)
    except BadPath as e:
        raise HubError("unsafe", f"{ref.repo}@{commit}: the file list is refused: {e}") from None
    return files


def _files(listed: list[RepoFile], selection: Selection, ref: RepoRef, commit: str) -> list[SnapshotFile]:
    by_path = {f.path: f for f in listed}
    kept = selection.select(sorted(by_path))
    if not kept:
        include, _ = selection.patterns(by_path)
        raise HubError(
            "empty", f"{ref.repo}@{commit}: no file is kept by the selection (include: {', '.join(include)})"
        )
    files = []
    for path in kept:
        f = by_path[path]
        try:
            if f.lfs is not None:
                if (
                    f.lfs.size != f.size
                    or not isinstance(f.lfs.sha256, str)
                    or not SHA256.fullmatch(f.lfs.sha256)
                ):
                    raise ValueError(
                        f"LFS sha256 {f.lfs.sha256!r} and size {f.lfs.size!r} for {f.size!r} bytes"
                    )
                files.append(SnapshotFile(path, f.size, f.lfs.sha256, Digest.sha256))
            else:
                files.append(SnapshotFile(path, f.size, f.blob_id, Digest.git_sha1))
        except ValueError as e:
            raise HubError("bad-answer", f"{ref.repo}@{commit}: {path!r}: {e}") from None
    return files


def _check_access(ref: RepoRef, commit: str, path: str, token: str | None, endpoint: str) -> None:
    """A gated repo lists its files to anyone: ask for one of them, as a download would."""
    url = hf_hub_url(ref.repo, path, revision=commit, endpoint=endpoint)
    get_hf_file_metadata(url, token=token or False, timeout=TIMEOUT, endpoint=endpoint)


def _hub_error(e: Exception, ref: RepoRef, endpoint: str, token: str | None) -> HubError:
    status = e.response.status_code if isinstance(e, HfHubHTTPError) else None
    page = f"{endpoint}/{ref.repo}"
    if isinstance(e, GatedRepoError):
        if token is None or status == 401:
            return HubError(
                "gated",
                f"{ref.repo} is gated: ask for access on {page}, then set HF_TOKEN to a token of that account",
            )
        return HubError(
            "gated", f"{ref.repo} is gated and the token given has no access to it: ask for access on {page}"
        )
    if isinstance(e, RepositoryNotFoundError):
        hint = (
            "set HF_TOKEN to a token that can read it"
            if token is None
            else "is the token one that can read it?"
        )
        return HubError(
            "not-found", f"{ref.repo}: no such repository on {endpoint} (or it is private: {hint})"
        )
    if isinstance(e, RevisionNotFoundError):
        return HubError(
            "revision", f"{ref.repo} has no revision {ref.revision!r}: give a branch, a tag or a commit of it"
        )
    if isinstance(e, RemoteEntryNotFoundError):
        return HubError(
            "bad-answer", f"{endpoint} lists a file of {ref.repo} that it then does not have: {e}"
        )
    if status in {401, 403}:
        return HubError("auth", f"{endpoint} refused the token for {ref.repo} ({status}): check HF_TOKEN")
    if status is not None:
        return HubError("bad-answer", f"{endpoint} answered {status} about {ref}")
    return HubError("network", f"cannot reach {endpoint} about {ref}: {type(e).__name__}: {e}")


def resolve_models(
    spec: ClusterSpec, token: str | None, endpoint: str = DEFAULT_ENDPOINT
) -> dict[str, Snapshot]:
    """The snapshot of every model llmgw fetches from a repository (not ``fetch: engine``), at
    the commit its revision names now (a pinned one at its own), asked in parallel; the
    first HubError, its model named, if any cannot be resolved."""
    models = [m for m in spec.models if m.selection is not None and m.repo_ref is not None]

    def one(model: Model) -> Snapshot:
        assert model.repo_ref is not None
        try:
            return resolve(model.repo_ref, token, endpoint, model.selection)
        except HubError as e:
            raise HubError(e.kind, f"model {model.name}: {e}") from None

    if not models:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(models))) as pool:
        return dict(zip((m.name for m in models), pool.map(one, models), strict=True))
