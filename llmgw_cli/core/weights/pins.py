"""Which commit each repository model runs: revisions resolved once, then held fixed.

A model whose source is a repo id (``org/name`` or ``org/name@revision``) and that llmgw
fetches (not ``fetch: engine``) runs from a snapshot of one commit on the node's disk. The
branch or tag it names is resolved to that commit when a plan is made (``llmgw apply``,
``llmgw fetch``), by asking the Hub, and the spec is then *pinned*: its source becomes
``org/name@<commit>``, and everything downstream (the engine's path, the unit, the spec
hash, the fetch jobs) follows from that pinned spec alone, so a branch moving later changes
nothing that runs. ``apply`` gives the gateway the same pins (the pins file beside its
cluster file), so an on-demand start uses the commit apply chose; only the next ``apply``
moves a model to a newer commit.

The pins file is JSON, ``{"format": 1, "models": {name: {"source": ..., "commit": ...}}}``:
a pin holds only while the model's source in the cluster file is still the one it was
made for. Read back, it is hostile data like any file a node or a host holds: a commit is
40 hex or the pin is ignored.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model
from llmgw_cli.core.weights.snapshot import COMMIT

PINS_FORMAT = 1
MAX_PINS_BYTES = 1 << 20
PINS_NAME = "pins.json"  # beside the cluster file: where apply puts it, where the gateway reads it


def fetched_repo(model: Model) -> bool:
    """Whether the model runs from a snapshot llmgw fetches."""
    return model.selection is not None


def needs_pin(model: Model) -> bool:
    """A fetched repository whose revision is not yet a commit."""
    ref = model.repo_ref
    return fetched_repo(model) and ref is not None and not ref.pinned


def unpinned(spec: ClusterSpec) -> list[str]:
    """The models a plan cannot be made for until their revision is resolved."""
    return [m.name for m in spec.models if needs_pin(m)]


def pin(spec: ClusterSpec, commits: Mapping[str, str]) -> ClusterSpec:
    """``spec`` with each model named in ``commits`` at that commit (``org/name@<commit>``).
    A model already at a commit keeps it; ValueError for a commit that is not 40 hex."""
    models = []
    for model in spec.models:
        ref = model.repo_ref
        commit = commits.get(model.name)
        if commit is None or ref is None or not fetched_repo(model) or ref.pinned:
            models.append(model)
            continue
        if not COMMIT.fullmatch(commit):
            raise ValueError(f"{model.name}: {commit!r} is not a 40-hex commit")
        models.append(model.model_copy(update={"source": f"{ref.repo}@{commit}"}))
    return spec.model_copy(update={"models": models})


def pins_text(spec: ClusterSpec, commits: Mapping[str, str]) -> str:
    """The pins file for the models of ``spec`` (unpinned sources) resolved to ``commits``:
    only the models that need a pin (one already at a commit carries its own)."""
    wanted = {m.name for m in spec.models if needs_pin(m)}
    body = {
        name: {"source": spec.model(name).source, "commit": commit}
        for name, commit in sorted(commits.items())
        if name in wanted
    }
    return json.dumps({"format": PINS_FORMAT, "models": body}, indent=1, sort_keys=True) + "\n"


def parse_pins(spec: ClusterSpec, text: str | bytes) -> dict[str, str]:
    """The commits of a pins file that still apply to ``spec``: the model exists, needs a
    pin, and its source is the one the pin was made for. Anything else is left out."""
    if len(text) > MAX_PINS_BYTES:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return {}
    models = data.get("models") if isinstance(data, dict) and data.get("format") == PINS_FORMAT else None
    if not isinstance(models, dict):
        return {}
    wanted = {m.name: m for m in spec.models if needs_pin(m)}
    found: dict[str, str] = {}
    for name, entry in models.items():
        model = wanted.get(name) if isinstance(name, str) else None
        if model is None or not isinstance(entry, dict):
            continue
        commit = entry.get("commit")
        if entry.get("source") == model.source and isinstance(commit, str) and COMMIT.fullmatch(commit):
            found[name] = commit
    return found


def pins_file(cluster_file: Path) -> Path:
    """Where the gateway looks for the pins of ``cluster_file``: beside it."""
    return Path(cluster_file).with_name(PINS_NAME)


def with_pins_file(spec: ClusterSpec, cluster_file: Path) -> ClusterSpec:
    """``spec`` pinned by the pins file beside ``cluster_file``, as the gateway loads it (at
    start and on SIGHUP). No file, one that cannot be read, or one whose content is not a
    pins file for this spec pins nothing: the models it would have pinned stay unresolved
    (``unpinned``), and the gateway refuses to start them rather than ask the Hub."""
    try:
        # not blocking on a FIFO, and never more than a pins file may hold
        fd = os.open(pins_file(cluster_file), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return spec
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a FIFO, a device: no pins
            return spec
        chunks: list[bytes] = []
        while (got := sum(map(len, chunks))) <= MAX_PINS_BYTES:
            chunk = os.read(fd, MAX_PINS_BYTES + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError:
        return spec
    finally:
        os.close(fd)
    return pin(spec, parse_pins(spec, b"".join(chunks)))


def pinned_commits(spec: ClusterSpec) -> tuple[tuple[str, str], ...]:
    """(model, commit) of each fetched repository of a pinned spec, by model name."""
    found = []
    for model in spec.models:
        ref = model.repo_ref
        if fetched_repo(model) and ref is not None and ref.pinned:
            found.append((model.name, ref.revision))
    return tuple(sorted(found))


def moved(saved: tuple[tuple[str, str], ...], now: tuple[tuple[str, str], ...]) -> list[str]:
    """A saved plan's commits against the commits resolved now: one line per repository
    whose revision names another commit since the plan was made."""
    current = dict(now)
    return [
        f"{name}: planned at commit {commit[:12]}, its revision names {current[name][:12]} now"
        for name, commit in saved
        if name in current and current[name] != commit
    ]
