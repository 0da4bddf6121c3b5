"""The node helper's checks, as pure functions: every unit llmgw renders passes, and each
way a unit could run something else, or as someone else, is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_cli.core import drain, node_access
from llmgw_cli.core.load import parse_cluster
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.remote import node_helper
from llmgw_cli.remote.node_helper import Refused, check_unit, check_words, parse_words
from tests.rendered_units import every_replica_unit

ROOT = Path(__file__).resolve().parents[2]


def lab_spec() -> ClusterSpec:
    return parse_cluster((ROOT / "inventories/lab.yaml").read_text())


def config(spec: ClusterSpec) -> dict[str, list[str]]:
    return {
        "programs": node_access.engine_programs(spec),
        "users": node_access.engine_users(spec),
        "weights": ["/data/models"],
    }


def units(spec: ClusterSpec) -> list[str]:
    return [unit.text for unit in every_replica_unit(spec)]


def test_the_helper_and_apply_agree_on_paths() -> None:
    assert node_helper.DRAIN_DIR == drain.DRAIN_DIR
    assert node_helper.HELPER == node_access.HELPER
    assert node_helper.PROBE == node_access.PROBE
    assert node_helper.NODEFETCH == node_access.NODEFETCH
    assert node_helper.CONFIG == node_access.HELPER_CONFIG


@pytest.mark.parametrize("inventory", ["hgx-two-fabrics.yaml", "single-box.yaml", "lab.yaml"])
def test_every_unit_llmgw_renders_is_accepted(inventory: str) -> None:
    spec = parse_cluster((ROOT / "inventories" / inventory).read_text())
    rendered = units(spec)
    assert rendered
    for text in rendered:
        check_unit(text, config(spec))


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (("ExecStart=", "ExecStartPre=+/bin/sh -c 'id > /root/owned'\nExecStart="), "prefix"),
        (("ExecStart=", "ExecStartPre=!/opt/vllm/bin/vllm\nExecStart="), "prefix"),
        (("User=llmgw", "User=root"), "not an engine account"),
        (("User=llmgw", "User=0"), "not an engine account"),
        (("User=llmgw\n", ""), "exactly one User="),
        (("User=llmgw\n", "User=llmgw\nUser=root\n"), "exactly one User="),
        (
            ("ExecStart=/opt/vllm/bin/vllm", "ExecStart=/bin/sh -c /opt/vllm/bin/vllm"),
            "not an engine program",
        ),
        (("ExecStart=/opt/vllm/bin/vllm serve", "ExecStart=/opt/vllm/bin/vllm serve ; /bin/sh"), "second"),
        (("Type=exec", "Type=exec\nExecStartPost=/bin/sh -c id"), "not allowed"),
        (("Type=exec", "Type=exec\nPAMName=login"), "not allowed"),
        (("Type=exec", "Type=exec\nGroup=root"), "not allowed"),
        (("EnvironmentFile=/etc/llmgw/engine.env", "EnvironmentFile=/root/.ssh/id_ed25519"), "under"),
        (("EnvironmentFile=/etc/llmgw/engine.env", "EnvironmentFile=/etc/llmgw/../shadow"), "under"),
        (("Type=exec", "Type=exec \\\n"), "continuation"),
        (("Type=exec", "Type=exec\r"), "control"),
        (("Type=exec", "Type=exec\nLoadCredential=k:/etc/shadow"), "not a file under"),
        (("Wants=network-online.target", "Wants=debug-shell.service"), "may name only"),
        (
            ("After=network-online.target", "After=network-online.target\nRequires=rescue.target"),
            "not allowed",
        ),
        (
            ("EnvironmentFile=/etc/llmgw/engine.env", "EnvironmentFile=/etc/llmgw/gateway/id_ed25519"),
            "not a file",
        ),
        # shell rules would read these programs as the allowed one; systemd reads another path
        (("ExecStart=/opt/vllm/bin/vllm", "ExecStart=/opt/vllm/bin/vl\\lm"), "quotes, escapes"),
        (("ExecStart=/opt/vllm/bin/vllm", 'ExecStart="/opt/vllm/bin/vllm"x'), "quotes, escapes"),
        (("ExecStart=/opt/vllm/bin/vllm", "ExecStart=/opt/vllm/bin/vllm%h"), "quotes, escapes"),
        (("[Install]", "[Service]"), "section"),
        (("[Install]", "[X-Other]"), "section"),
    ],
)
def test_hostile_unit_is_refused(edit: tuple[str, str], why: str) -> None:
    spec = lab_spec()
    text = next(u for u in units(spec) if "/opt/vllm/bin/vllm" in u)
    old, new = edit
    assert old in text
    with pytest.raises(Refused, match=why):
        check_unit(text.replace(old, new, 1), config(spec))


def test_a_quoted_semicolon_is_an_argument_not_a_second_command() -> None:
    spec = lab_spec()
    text = next(u for u in units(spec) if "/opt/vllm/bin/vllm" in u)
    check_unit(
        text.replace("ExecStart=/opt/vllm/bin/vllm serve", 'ExecStart=/opt/vllm/bin/vllm serve ";"', 1),
        config(spec),
    )


@pytest.mark.parametrize(
    "line",
    [
        "id",
        "sh -c id",
        "stop ssh.service",
        "stop sshd",
        "start llmgw-gateway.service",
        "remove ../../etc/passwd",
        "write-unit llmgw-gateway.service",
        "write-unit /etc/systemd/system/llmgw-x-0.service",
        "journal llmgw-x-0.service 0 1000000",
        "journal llmgw-x-0.service '$(id)' 10",
        "show",
        "probe extra",
        "date; id",
        "",
    ],
)
def test_commands_outside_the_verbs_are_refused(line: str) -> None:
    with pytest.raises(Refused):
        check_words(parse_words([], line))


def test_verbs_the_gateway_uses_are_accepted() -> None:
    for line in (
        "probe",
        "date",
        "show llmgw-gateway.service llmgw-qwen2.5-7b-instruct-0.service",
        "journal llmgw-a-0.service 1700000000 15",
        "journal llmgw-a-0.service - 15",
        "stop llmgw-a-0.service llmgw-b-1.service",
        "start llmgw-a-0.service",
        "remove llmgw-a-0.service",
        "write-unit llmgw-a-0.service",
        "daemon-reload",
        f"{node_helper.HELPER} date",
    ):
        check_words(parse_words([], line))


def test_fetch_only_into_the_weights_folders() -> None:
    cfg = {"programs": [], "users": [], "weights": ["/data/models"]}
    assert node_helper._under_weights("/data/models/x.gguf", cfg) == "/data/models/x.gguf"
    for path in ("/etc/sudoers", "/data/models/../../etc/shadow", "/data/models/a/b", "data/models/x"):
        with pytest.raises(Refused):
            node_helper._under_weights(path, cfg)


def test_snapshot_jobs_only_in_a_repository_folder_of_a_weights_folder() -> None:
    cfg = {"programs": [], "users": [], "weights": ["/data/models", "/scratch/w/"]}
    for path in ("/data/models/hf/org--name", "/scratch/w/hf/Qwen--Qwen2.5-7B"):
        assert node_helper._repo_folder_under_weights(path, cfg) == path


def test_authorized_keys_line_restricts_the_key_to_the_helper() -> None:
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0 llmgw-gateway@gw"
    assert node_access.valid_public_key(key)
    line = node_access.authorized_key_line(key)
    assert line == f'restrict,command="{node_access.HELPER}" ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0\n'
    assert not node_access.valid_public_key('command="/bin/sh" ssh-ed25519 AAAA')
    assert not node_access.valid_public_key("ssh-ed25519 AAAA\nssh-ed25519 BBBB")


@pytest.mark.parametrize(
    "job",
    [
        {"mode": "fetch", "target": "/etc/sudoers", "url": "http://x/y"},
        {"mode": "serve", "file": "/etc/shadow"},
        {"mode": "poll", "target": "/data/models/../../root/.ssh/id_ed25519"},
        {"mode": "run", "target": "/data/models/x"},
        {"target": "/data/models/x"},
        {"mode": "snapshot", "folder": "/data/models"},
        {"mode": "snapshot", "folder": "/data/models/hf"},
        {"mode": "snapshot", "folder": "/etc/hf/org--name"},
        {"mode": "snapshot", "folder": "/data/models/hf/org--name/x"},
        {"mode": "serve-snapshot", "folder": "/data/models/hf/../../../etc--x"},
        {"mode": "poll-snapshot", "folder": "/data/models/hf/noseparator"},
        {"mode": "verify-snapshot", "target": "/data/models/hf/org--name"},
        {"mode": "snapshot", "folder": "/data/models/hf/org..x--name"},
    ],
)
def test_fetch_jobs_outside_the_weights_folders_are_refused(job: dict[str, str]) -> None:
    cfg = {"programs": [], "users": [], "weights": ["/data/models"]}
    with pytest.raises(Refused):
        node_helper._fetch(job, cfg)


def test_journal_reads_the_lines_about_a_unit_not_only_those_of_its_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """systemd's child logs why it could not execute the engine with UNIT=, and is often
    gone before journald reads its cgroup: `-u` (UNIT= from PID 1 only) can miss that line."""
    ran: list[list[str]] = []
    monkeypatch.setattr(node_helper.subprocess, "call", lambda cmd, **_: ran.append(cmd) or 0)
    assert node_helper.run_verb(["journal", "llmgw-m-0.service", "1700000000", "15"], {}) == 0
    sync, read = ran
    assert sync == ["journalctl", "--sync"]
    assert read[:4] == ["journalctl", "_SYSTEMD_UNIT=llmgw-m-0.service", "+", "UNIT=llmgw-m-0.service"]
    assert "-u" not in read and read[read.index("--since") + 1] == "@1700000000"


def test_remove_deletes_the_unit_file_and_its_drain_marker_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    units, markers = tmp_path / "units", tmp_path / "draining"
    units.mkdir()
    markers.mkdir()
    for folder in (units, markers):
        for name in ("llmgw-a-0.service", "llmgw-a-1.service"):
            (folder / name).write_text("x")
    monkeypatch.setattr(node_helper, "UNIT_DIR", str(units))
    monkeypatch.setattr(node_helper, "DRAIN_DIR", str(markers))
    monkeypatch.setattr(node_helper.subprocess, "call", lambda *_a, **_k: 0)  # systemctl disable
    assert node_helper.run_verb(["remove", "llmgw-a-0.service"], {}) == 0
    assert sorted(p.name for p in units.iterdir()) == ["llmgw-a-1.service"]
    assert sorted(p.name for p in markers.iterdir()) == ["llmgw-a-1.service"]
    assert node_helper.run_verb(["remove", "llmgw-a-0.service"], {}) == 0  # gone already: fine
