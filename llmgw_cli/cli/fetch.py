"""`llmgw fetch`: put model weights on the nodes. Its steps (``cli/fetch_steps.py``)
are imported when it runs."""

from typing import Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, NodesOption
from llmgw_cli.core.weights.peers import Peers


def fetch(
    models: Annotated[
        list[str] | None,
        typer.Argument(help="Models to fetch (default: every model that is not switched off)."),
    ] = None,
    *,
    file: ClusterFile = DEFAULT_FILE,
    nodes: NodesOption = None,
    peers: Annotated[
        Peers,
        typer.Option(
            help="Who copies from whom: `fabric` (one origin download per fabric), `cluster` "
            "(one for the whole cluster) or `off` (every node downloads from the origin)."
        ),
    ] = Peers.fabric,
    token_env: Annotated[
        str,
        typer.Option(help="Environment variable holding the Hugging Face token for gated repositories."),
    ] = "HF_TOKEN",
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be fetched, from where, and stop.")
    ] = False,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the plan (with --dry-run) or the results as JSON, for scripts; the rest goes to stderr.",
        ),
    ] = False,
) -> None:
    """Download the weights of models onto the nodes: https URLs, and Hugging Face
    repositories (their snapshot at the commit the revision names now; not those that say `fetch: engine`).

    Each file is written as NAME.part and renamed only once its size and sha256 check out.

    An interrupted download resumes where it stopped (HTTP Range).

    One node per fabric downloads from the origin; the others copy from a peer.

    A repository's files come from the Hub once per fabric too; each is copied from a peer as soon as the peer has it, and checked against the Hub's sha256.

    A repo id with `fetch: engine` is left to the engine; a path is only checked.

    The token ($HF_TOKEN) goes only to huggingface.co or $HF_ENDPOINT, and is never printed.

    Asks before it fetches (--yes: does not; without a terminal it refuses without --yes).

    Exit code 0 when every wanted node has its weights, 1 when some failed, 2 on bad input.
    """
    from llmgw_cli.cli import fetch_steps

    fetch_steps.fetch(
        models or [], file, nodes, peers, token_env, dry_run=dry_run, yes=yes, json_out=json_out
    )
