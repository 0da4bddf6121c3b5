"""What `llmgw cordon`, `uncordon`, `drain`, `status` and `apply` share about cordons: the
store's cordons read and written the way `llmgw keys` reaches the store
(``cli/store_access.py``: opened here, or the command run on the gateway host with
``--store-dir``), the JSON they exchange with the gateway host (parsed as hostile data),
and the table `status` shows. Imported when one of them runs."""

from __future__ import annotations

import getpass
import json
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from rich.table import Table
from rich.text import Text

from llmgw_cli.cli.session import Session
from llmgw_cli.cli.store_access import forward, store_of, with_store
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.planning.cordon import REASON_MOST, Cordon, clean_reason, unknown_node
from llmgw_cli.errors import LlmgwError, UsageError
from llmgw_cli.gateway.store.sqlite import Store, open_store
from llmgw_cli.remote.gateway_store import on_gateway_host, shown, store_host

T = TypeVar("T")
NO_STATE_FOLDER = 3  # what the gateway host's command exits with before its first apply


def caller() -> str:
    """``user@host`` of whoever runs this command (recorded with the cordon)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def checked_node(spec: ClusterSpec | None, name: str) -> str:
    """``name`` when it names a node of the cluster file (without one, on the gateway
    host's side of a forwarded command: the caller checked it); a UsageError listing the
    nodes otherwise."""
    if spec is not None:
        why = unknown_node(spec, name)
        if why is not None:
            raise UsageError(why)
    elif not name or len(name) > 63 or not all(c.isalnum() or c == "-" for c in name):
        raise UsageError(f"not a node name: {name!r}")
    return name


def checked_reason(text: str) -> str:
    try:
        return clean_reason(text)
    except ValueError as exc:
        raise UsageError(f"--reason: {exc}") from None


# --- the JSON of `cordons --json`, read back from the gateway host ------------------------


def cordons_json(cordons: list[Cordon]) -> str:
    return json.dumps([c.as_dict() for c in cordons], indent=1)


def parse_cordons(text: str) -> list[Cordon]:
    """``cordons_json``'s output, from another machine: a bad answer is an error."""
    try:
        rows = json.loads(text)
    except ValueError:
        rows = None
    if not isinstance(rows, list):
        raise LlmgwError("the gateway host's answer is not a list of cordons (an older llmgw there?)")
    found = []
    for row in rows:
        try:
            found.append(_cordon(row))
        except (ValueError, TypeError) as exc:
            raise LlmgwError(f"the gateway host's answer has a bad cordon ({exc})") from None
    return found


def _cordon(row: Any) -> Cordon:
    if not isinstance(row, dict):
        raise ValueError("not an object")
    texts = [row.get(k) or "" for k in ("node", "reason", "by")]
    if not all(isinstance(t, str) and len(t) <= REASON_MOST and t.isprintable() for t in texts):
        raise ValueError("node, reason or by")
    since, draining = row.get("since") or 0.0, row.get("draining")
    if isinstance(since, bool) or not isinstance(since, int | float) or not isinstance(draining, bool):
        raise ValueError("since or draining")
    return Cordon(texts[0], texts[1], texts[2], float(since), draining)


# --- reaching the store ------------------------------------------------------------------


def remote_host(spec: ClusterSpec | None) -> str | None:
    """The gateway host the command runs on, or None: the store is reached from here."""
    return store_host(spec) if spec is not None else None


def stored_cordons(spec: ClusterSpec | None, file: Path | None, store_dir: Path | None) -> list[Cordon]:
    """The store's cordons (``llmgw cordons --json`` on the gateway host when it is
    another machine)."""
    host = remote_host(spec)
    if spec is not None and file is not None and host is not None:
        return parse_cordons(forward(spec, file, host, ["cordons"], ["--json"]))
    return with_store(store_of(spec, store_dir), lambda store: store.cordons())


async def _in_store(spec: ClusterSpec, call: Callable[[Store], Awaitable[T]]) -> T:
    store = open_store(spec)
    try:
        return await call(store)
    finally:
        await store.close()


def stored_cordons_in(spec: ClusterSpec, session: Session) -> tuple[list[Cordon], str]:
    """The store's cordons for `apply`, `plan`, `status` and `drain`, over ``session``'s
    loop and connections, and a warning ("" when none): a store that cannot be read (a
    gateway host that does not answer) has none, said in the warning. Before the gateway's
    first start (no state folder, no SQLite file) nobody cordoned a node in it: none."""
    try:
        host = store_host(spec)
        if host is None:
            if spec.gateway.store is None and not (Path(spec.gateway.state_dir) / "gateway.sqlite3").exists():
                return [], ""
            return session.run(_in_store(spec, lambda store: store.cordons())), ""
        result = session.run(on_gateway_host(spec, session.conns, host, ["cordons"], ["--json"]))
        if result.exit_status == NO_STATE_FOLDER:
            return [], ""
        if not result.ok:
            raise LlmgwError(shown(result.stderr or result.stdout).removeprefix("error: "))
        return parse_cordons(result.stdout), ""
    except LlmgwError as exc:
        return (
            [],
            f"the cordons in the gateway's store could not be read ({exc}): only the cluster file's count",
        )


def write_cordon_in(
    spec: ClusterSpec, session: Session, node: str, *, reason: str | None, by: str, draining: bool
) -> None:
    """Cordon ``node`` (``set_cordon``) over ``session``: `drain` marks it draining, then not."""
    host = store_host(spec)
    if host is None:
        session.run(_in_store(spec, lambda store: set_cordon(store, node, reason, by, draining)))
        return
    args = [f"--by={by}", f"--draining={'yes' if draining else 'no'}", "--json"]
    args += [f"--reason={reason}"] if reason is not None else []
    result = session.run(on_gateway_host(spec, session.conns, host, ["cordon"], [*args, "--", node]))
    if not result.ok:
        said = shown(result.stderr or result.stdout).removeprefix("error: ")
        raise LlmgwError(f"on the gateway host {host}: {said or f'exit status {result.exit_status}'}")


def change(
    spec: ClusterSpec | None,
    file: Path,
    store_dir: Path | None,
    command: list[str],
    args: list[str],
    *,
    local: Callable[[Store], Awaitable[None]],
) -> str | None:
    """Run a cordon change: forwarded to the gateway host (its JSON answer returned), or
    ``local(store)`` on the store reached from here (None returned)."""
    host = remote_host(spec)
    if spec is not None and host is not None:
        cut = args.index("--") if "--" in args else len(args)  # options before the node's name
        return forward(spec, file, host, command, [*args[:cut], "--json", *args[cut:]])
    with_store(store_of(spec, store_dir), local)
    return None


async def set_cordon(store: Store, node: str, reason: str | None, by: str, draining: bool | None) -> Cordon:
    """Cordon ``node`` (a cordon it has keeps its reason when ``reason`` is None, and its
    draining mark when ``draining`` is None; its time and who are the new ones)."""
    had = next((c for c in await store.cordons() if c.node == node), None)
    made = Cordon(
        node=node,
        reason=reason if reason is not None else (had.reason if had else ""),
        by=by,
        since=had.since if had is not None else time.time(),
        draining=draining if draining is not None else (had.draining if had else False),
    )
    await store.cordon(made)
    return made


def no_such_cordon(spec: ClusterSpec | None, node: str) -> str:
    """What `uncordon` says of a node the store has no cordon for."""
    if spec is not None and any(n.name == node and n.cordoned for n in spec.nodes):
        return f"{node} is cordoned by the cluster file (cordoned: true): remove that line to uncordon it"
    return f"{node} was not cordoned"


# --- the table `status` shows -----------------------------------------------------------


def cordons_view(cordons: list[Cordon], now: float) -> Table:
    """Cordoned nodes: their state (cordoned, draining), reason, who and since when. Every
    text is shown as text, never markup (the store's rows are someone else's writing)."""
    table = Table(title="Cordoned nodes", title_justify="left")
    for column in ("node", "state", "reason", "by", "since"):
        table.add_column(column)
    for c in cordons:
        state = "draining" if c.draining else "cordoned"
        since = _since(c.since, now) if c.since else "—"
        by = c.by if c.source == "store" else "cluster file"
        table.add_row(Text(c.node), Text(state), Text(c.reason or "—"), Text(by or "—"), Text(since))
    return table


def _since(since: float, now: float) -> str:
    """``2026-12-05 21:50 UTC (3m ago)``."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(since))
    ago = max(0.0, now - since)
    if ago < 120:
        return f"{stamp} ({int(ago)}s ago)"
    if ago < 7200:
        return f"{stamp} ({int(ago // 60)}m ago)"
    return f"{stamp} ({ago / 3600:.1f}h ago)"
