"""What apply installs on the gateway host, and how the running gateway takes a change."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from llmgw_cli.cli.render import app as render_app
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.hosts.gateway_install import (
    CLUSTER_FILE,
    GATEWAY_ACCOUNT,
    GATEWAY_KEY,
    HANDOVER_FILE,
    KNOWN_HOSTS,
    PINS_FILE,
    SOCKET_FILE,
    UNIT_FILE,
    gateway_change,
    gateway_files,
)
from llmgw_cli.core.weights.pins import PINS_NAME, pins_text

TEXT = "cluster: {name: c}\ngateway: {host: localhost}\n"
REPO = (
    TEXT + "profiles: {v: {engine: vllm}}\nmodels: [{name: r, source: org/r@main, profile: v, fetch: {}}]\n"
)
NO_PINS = pins_text(parse_cluster(TEXT), {})


def files(  # type: ignore[no-untyped-def]
    text: str = TEXT, known: str = "h k\n", llmgw_bin: str = "/usr/local/bin/llmgw", pins: str = NO_PINS
):
    return gateway_files(
        parse_cluster(text), cluster_text=text, pins_text=pins, llmgw_bin=llmgw_bin, known_hosts=known
    )


def on_host(found) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {f.path: f.digest for f in found}


def test_the_files_and_the_unit_that_uses_them() -> None:
    found = {f.path: f for f in files()}
    # No private key travels: the gateway's own is made on its host, the operator's stays home.
    assert set(found) == {CLUSTER_FILE, PINS_FILE, KNOWN_HOSTS, SOCKET_FILE, UNIT_FILE, HANDOVER_FILE}
    assert not any(f.secret or "PRIVATE KEY" in f.text for f in found.values())
    assert found[CLUSTER_FILE].text == TEXT  # the operator's file, comments and all
    # the pins beside it, where the gateway looks (world-readable: commits are no secret);
    # written even when nothing is pinned, so an older file never stays
    assert str(Path(CLUSTER_FILE).with_name(PINS_NAME)) == PINS_FILE
    assert (found[PINS_FILE].text, found[PINS_FILE].mode) == (NO_PINS, 0o644)
    assert '"models": {}' in NO_PINS
    unit = found[UNIT_FILE].text
    (exec_start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert exec_start.startswith(f"ExecStart=/usr/local/bin/llmgw gateway run -f {CLUSTER_FILE} ")
    assert f" --identity-file {GATEWAY_KEY} " in exec_start
    assert exec_start.endswith(f" --known-hosts {KNOWN_HOSTS}")
    assert f"User={GATEWAY_ACCOUNT}\n" in unit and GATEWAY_ACCOUNT != "llmgw"
    assert "PrivateTmp=yes" in unit
    assert "Type=notify\nNotifyAccess=main\nSockets=llmgw-gateway.socket\n" in unit
    # The hand-over instance is the same service, never enabled on its own.
    handover = found[HANDOVER_FILE].text
    assert "[Install]" in unit and "[Install]" not in handover
    assert [x for x in handover.splitlines() if x.startswith(("ExecStart=", "Sockets=", "User="))] == [
        x for x in unit.splitlines() if x.startswith(("ExecStart=", "Sockets=", "User="))
    ]
    socket_unit = found[SOCKET_FILE].text
    assert [x for x in socket_unit.splitlines() if x.startswith("ListenStream=")] == [
        "ListenStream=0.0.0.0:8080",
        "ListenStream=127.0.0.1:9090",
    ]
    under_tmp = {f.path: f for f in files(llmgw_bin="/tmp/x/bin/llmgw")}[UNIT_FILE].text
    assert "PrivateTmp=yes" not in under_tmp and "ReadWritePaths=/tmp\n" in under_tmp


def test_nothing_changed_is_nothing_to_do_unless_the_gateway_is_down() -> None:
    current = on_host(files())
    assert gateway_change(files(), current, active=True, listeners_changed=False).how == "none"
    down = gateway_change(files(), current, active=False, listeners_changed=False)
    assert down.how == "restart" and down.write == ()
    # its socket unit runs unchanged: started under it, the queued connections kept
    assert not down.rebind and not down.interrupts
    assert gateway_change(files(), current, active=False, listeners_changed=False, socket_active=False).rebind


def test_a_changed_cluster_file_is_a_reload_unless_listeners_moved() -> None:
    current = on_host(files())
    changed = files(TEXT + "# a comment\n")
    reload = gateway_change(changed, current, active=True, listeners_changed=False)
    assert reload.how == "reload" and [f.path for f in reload.write] == [CLUSTER_FILE]
    # Listeners written differently that bind the same sockets (localhost, 127.0.0.1): the
    # socket unit is unchanged, a new process takes them over.
    assert gateway_change(changed, current, active=True, listeners_changed=True).how == "handover"
    assert gateway_change(changed, current, active=False, listeners_changed=False).how == "restart"


def test_new_pins_alone_or_with_the_cluster_file_are_a_reload() -> None:
    """apply resolved a branch to a newer commit: the running gateway reads its pins again
    on SIGHUP, as it does the cluster file; no new process."""
    current = on_host(files(REPO, pins=pins_text(parse_cluster(REPO), {"r": "a" * 40})))
    moved = files(REPO, pins=pins_text(parse_cluster(REPO), {"r": "b" * 40}))
    reload = gateway_change(moved, current, active=True, listeners_changed=False)
    assert reload.how == "reload" and [f.path for f in reload.write] == [PINS_FILE]
    both = files(REPO + "# a comment\n", pins=pins_text(parse_cluster(REPO), {"r": "b" * 40}))
    reload = gateway_change(both, current, active=True, listeners_changed=False)
    assert reload.how == "reload" and {f.path for f in reload.write} == {CLUSTER_FILE, PINS_FILE}
    # with anything else the reload is not enough
    upgraded = files(REPO, llmgw_bin="/b", pins=pins_text(parse_cluster(REPO), {"r": "b" * 40}))
    assert gateway_change(upgraded, current, active=True, listeners_changed=False).how == "handover"
    # a host from before pins files: the first one is a reload too
    before = {p: d for p, d in on_host(files(REPO)).items() if p != PINS_FILE}
    first = gateway_change(files(REPO), before, active=True, listeners_changed=False)
    assert first.how == "reload" and [f.path for f in first.write] == [PINS_FILE]


def test_new_host_keys_or_a_fresh_host_restarts() -> None:
    current = on_host(files())
    new_known = gateway_change(files(known="h2 k2\n"), current, active=True, listeners_changed=False)
    assert new_known.how == "handover" and [f.path for f in new_known.write] == [KNOWN_HOSTS]
    assert not new_known.interrupts
    fresh = gateway_change(files(), {}, active=False, listeners_changed=True)
    assert fresh.how == "restart" and len(fresh.write) == 6 and not fresh.interrupts


def test_a_changed_unit_of_a_running_gateway_is_a_hand_over() -> None:
    current = on_host(files())
    upgraded = gateway_change(
        files(llmgw_bin="/opt/llmgw/bin/llmgw"), current, active=True, listeners_changed=False
    )
    assert upgraded.how == "handover" and not upgraded.interrupts
    assert {f.path for f in upgraded.write} == {UNIT_FILE, HANDOVER_FILE}


def test_new_sockets_under_a_running_gateway_interrupt_it_once() -> None:
    moved_text = TEXT.replace("host: localhost", "host: localhost, admin_listen: '127.0.0.1:9191'")
    current = on_host(files())
    moved = gateway_change(files(moved_text), current, active=True, listeners_changed=True)
    assert moved.how == "restart" and moved.interrupts and moved.rebind
    assert SOCKET_FILE in {f.path for f in moved.write}
    # A host upgraded from a gateway that bound its own ports: no socket unit yet.
    before_sockets = {p: d for p, d in current.items() if p != SOCKET_FILE}
    first = gateway_change(files(), before_sockets, active=True, listeners_changed=False, socket_active=False)
    assert first.how == "restart" and first.interrupts
    # The socket unit's file is in place but it does not run: the same.
    idle_socket = gateway_change(
        files(llmgw_bin="/b"), current, active=True, listeners_changed=False, socket_active=False
    )
    assert idle_socket.how == "restart" and idle_socket.interrupts


def test_render_prints_the_units_apply_installs(tmp_path: Path) -> None:
    """`llmgw render gateway-unit` and `gateway-socket` for a hand install or a review print
    the very files apply writes: same cluster file path, account, key and known_hosts."""
    runner = CliRunner()
    file = tmp_path / "cluster.yaml"

    def render(*args: str) -> str:
        result = runner.invoke(render_app, [*args, "-f", str(file)])
        assert result.exit_code == 0, result.output
        return result.stdout

    # gateway.llmgw_bin set: apply runs that one, and so does the rendered unit
    text = TEXT.replace("{host: localhost}", "{host: localhost, llmgw_bin: /opt/llmgw/bin/llmgw}")
    file.write_text(text)
    installed = {f.path: f.text for f in files(text, llmgw_bin="/opt/llmgw/bin/llmgw")}
    assert render("gateway-unit") == installed[UNIT_FILE]
    assert render("gateway-unit", "--handover") == installed[HANDOVER_FILE]
    assert render("gateway-socket") == installed[SOCKET_FILE]
    # unset: apply takes the llmgw on the host's PATH, which the operator names here
    file.write_text(TEXT)
    plain = {f.path: f.text for f in files(TEXT, llmgw_bin="/usr/local/bin/llmgw")}
    assert render("gateway-unit", "--llmgw-bin", "/usr/local/bin/llmgw") == plain[UNIT_FILE]
