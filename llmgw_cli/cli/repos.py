"""The repositories a command works on, resolved to commits before it plans anything.

``plan``, ``apply`` and ``fetch`` call ``pinned`` right after reading the cluster file: a
model that llmgw fetches from a Hugging Face repository (any not ``fetch: engine``) is asked of the
Hub (``$HF_ENDPOINT``, else huggingface.co; ``$HF_TOKEN`` for a gated or private one), its
revision becomes the commit it names now, and the command goes on with that pinned spec
(``core/weights/pins.py``). Each resolution is printed, so the plan says which commit it starts.
``gateway_pins`` is the pins file apply installs beside the gateway's cluster file, so the
gateway's own starts use the same commits.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rich.text import Text

from llmgw_cli.errors import InputError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from rich.console import Console

    from llmgw_cli.core.clusterfile.spec import ClusterSpec
    from llmgw_cli.core.weights.snapshot import Snapshot


def pinned(
    spec: ClusterSpec, console: Console, token_env: str = "HF_TOKEN"
) -> tuple[ClusterSpec, dict[str, Snapshot]]:
    """``spec`` with every fetched repository at a commit, and each one's snapshot (the
    files to fetch). No Hub is asked when no model fetches a repository."""
    if not any(m.selection is not None for m in spec.models):
        return spec, {}
    from llmgw_cli.core.weights.pins import pin
    from llmgw_cli.core.weights.snapshot import DEFAULT_ENDPOINT
    from llmgw_cli.errors import HubError
    from llmgw_cli.remote.hub import resolve_models

    endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    try:
        snapshots = resolve_models(spec, os.environ.get(token_env) or None, endpoint)
    except HubError as e:
        raise InputError(f"cannot resolve a repository: {e}") from None
    for name, snap in sorted(snapshots.items()):
        line = (
            f"repository {snap.repo}@{snap.revision}: commit {snap.commit[:12]}, "
            f"{len(snap.files)} files, {snap.total_bytes / 2**30:.2f} GiB ({name})"
        )
        console.print(Text(line, style="dim"), highlight=False, soft_wrap=True)
    return pin(spec, {n: s.commit for n, s in snapshots.items()}), snapshots


def gateway_pins(spec: ClusterSpec, snapshots: Mapping[str, Snapshot]) -> str:
    """The pins file for the gateway: the commit ``pinned`` chose for each model of
    ``spec`` (the cluster file as read, before ``pinned``) that needs one. No model to pin:
    a file that pins nothing, written all the same so that no older one is left."""
    from llmgw_cli.core.weights.pins import pins_text

    return pins_text(spec, {name: snap.commit for name, snap in snapshots.items()})
