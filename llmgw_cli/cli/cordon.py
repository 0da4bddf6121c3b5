"""`llmgw cordon`, `llmgw uncordon`, `llmgw drain`: take a node out for maintenance and
bring it back (docs/operations.md, "Maintenance: cordon, drain, uncordon"). The cordons
live in the gateway's store, reached as `llmgw keys` reaches it (``cli/cordon_steps.py``).
The hidden `llmgw cordons` lists them as JSON: what the commands run on the gateway host
answer with."""

import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, StoreDir, read_cluster

if TYPE_CHECKING:
    from llmgw_cli.gateway.store.sqlite import Store

Node = Annotated[str, typer.Argument(metavar="NODE", help="The node's name in the cluster file.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print the result as JSON, for scripts.")]
By = Annotated[
    str | None,
    typer.Option(
        "--by", hidden=True, help="user@host of the caller (a command forwarded to the gateway host)."
    ),
]


def cordon(
    node: Node,
    *,
    reason: Annotated[
        str | None, typer.Option("--reason", help="Why, shown by `llmgw status` (one line, 200 characters).")
    ] = None,
    file: ClusterFile = DEFAULT_FILE,
    json_out: JsonOut = False,
    store_dir: StoreDir = None,
    by: By = None,
    draining: Annotated[
        str | None, typer.Option("--draining", hidden=True, metavar="yes|no", help="Mark it draining or not.")
    ] = None,
) -> None:
    """Stop new placements on NODE: `apply`, the gateway's on-demand starts and its
    restores of a model's minimum place nothing there. Replicas already there keep
    serving (`llmgw drain` moves them). Every gateway sees it at its next start or
    replacement; it stays until `llmgw uncordon`. A second cordon replaces the reason."""
    from llmgw_cli.cli.cordon_steps import caller, change, checked_node, checked_reason, set_cordon
    from llmgw_cli.errors import UsageError

    spec = None if store_dir is not None else read_cluster(file)
    checked_node(spec, node)
    why = checked_reason(reason) if reason is not None else None
    who = by if by is not None else caller()
    if draining not in (None, "yes", "no"):
        raise UsageError("--draining: yes or no")
    mark = None if draining is None else draining == "yes"
    args = [f"--by={who}", *([f"--reason={why}"] if why is not None else [])]
    args += [f"--draining={draining}"] if draining is not None else []
    made: list[object] = []

    async def local(store: "Store") -> None:
        made.append(await set_cordon(store, node, why, who, mark))

    said = change(spec, file, store_dir, ["cordon"], [*args, "--", node], local=local)
    _report(said, made, json_out, f"cordoned {node}: no new replica goes there")


def uncordon(
    node: Node,
    *,
    file: ClusterFile = DEFAULT_FILE,
    json_out: JsonOut = False,
    store_dir: StoreDir = None,
) -> None:
    """Return NODE to placement: the next `apply` and the gateway's next starts may use it
    again. A cordon of the cluster file (`cordoned: true`) is lifted by editing the file."""
    from llmgw_cli.cli.cordon_steps import change, checked_node, no_such_cordon

    spec = None if store_dir is not None else read_cluster(file)
    checked_node(spec, node)
    lifted: list[object] = []

    async def local(store: "Store") -> None:
        lifted.append(await store.uncordon(node))

    said = change(spec, file, store_dir, ["uncordon"], ["--", node], local=local)
    if said is None:
        found = bool(lifted[0])
        note = f"uncordoned {node}" if found else no_such_cordon(spec, node)
        if spec is not None and found and any(n.name == node and n.cordoned for n in spec.nodes):
            note += f"; {no_such_cordon(spec, node)}"
        said = _json({"node": node, "uncordoned": found, "note": note})
    _report(said, [], json_out, "")


def drain(
    node: Node,
    *,
    file: ClusterFile = DEFAULT_FILE,
    allow_downtime: Annotated[
        bool,
        typer.Option(
            "--allow-downtime",
            help="Stop a replica that fits on no other node even when its model then has no"
            " serving replica. Without it drain refuses before changing anything.",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would move, and where; change nothing.")
    ] = False,
    json_out: JsonOut = False,
    lock_timeout: Annotated[
        float,
        typer.Option("--lock-timeout", min=0, help="Seconds to wait for the cluster lock."),
    ] = 600.0,
) -> None:
    """Cordon NODE and move its replicas away the way `apply` rolls a replacement: each
    one's successor starts first on another node, every gateway routes it, then the old
    one is drained (up to its `drain_timeout`) and stopped. Refuses, saying why, when a
    model would be left with no serving replica (no other node can take the successor),
    unless --allow-downtime. The node stays cordoned afterwards: `llmgw uncordon NODE`."""
    from llmgw_cli.cli import drain_steps

    drain_steps.drain(
        file,
        node,
        allow_downtime=allow_downtime,
        dry_run=dry_run,
        json_out=json_out,
        lock_timeout=lock_timeout,
    )


def cordons(
    file: ClusterFile = DEFAULT_FILE,
    json_out: JsonOut = False,
    store_dir: StoreDir = None,
) -> None:
    """The store's cordons (`llmgw status` shows them with the cluster file's)."""
    from rich.console import Console

    from llmgw_cli.cli.cordon_steps import cordons_json, cordons_view, stored_cordons

    spec = None if store_dir is not None else read_cluster(file)
    found = stored_cordons(spec, file if spec is not None else None, store_dir)
    if json_out:
        sys.stdout.write(cordons_json(found) + "\n")
    else:
        Console().print(cordons_view(found, time.time()))


def _json(value: object) -> str:
    import json

    return json.dumps(value, indent=1)


def _report(said: str | None, made: list[object], json_out: bool, text: str) -> None:
    """The result: the gateway host's JSON answer (``said``), or the cordon made here."""
    import json

    from rich.console import Console
    from rich.text import Text

    from llmgw_cli.cli.cordon_steps import parse_cordons
    from llmgw_cli.core.planning.cordon import Cordon
    from llmgw_cli.errors import LlmgwError
    from llmgw_cli.remote.gateway_store import shown

    if said is None:
        (cordon,) = made
        assert isinstance(cordon, Cordon)
        said = _json(cordon.as_dict())
    if json_out:
        sys.stdout.write(said.strip() + "\n")
        return
    try:
        data = json.loads(said)
    except ValueError:
        raise LlmgwError("the gateway host's answer is not JSON (an older llmgw there?)") from None
    if isinstance(data, dict) and "note" in data:
        Console().print(Text(shown(str(data["note"]))))
        return
    parse_cordons(f"[{said}]")  # checked as any answer from another machine
    Console().print(Text(text))
