"""The node helper's checks, as pure functions: every unit llmgw renders passes, and each
way a unit could run something else, or as someone else, is refused."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engine_access import ENGINE_ENV_FILE, SECRET_ENV_DIR, secret_env_file
from llmgw_cli.core.engine.engines import unit_name
from llmgw_cli.core.hosts import node_access
from llmgw_cli.core.planning import drain
from llmgw_cli.node import helper as node_helper
from llmgw_cli.node.helper import Refused, check_unit, check_words, parse_words
from llmgw_cli.remote import fetch
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


def units(spec: ClusterSpec) -> list[tuple[str, str]]:
    """(unit name, text) of every replica unit ``spec`` renders."""
    return [(unit.name, unit.text) for unit in every_replica_unit(spec)]


def vllm_unit(spec: ClusterSpec) -> tuple[str, str]:
    return next((name, text) for name, text in units(spec) if "/opt/vllm/bin/vllm" in text)


def test_the_helper_and_apply_agree_on_paths() -> None:
    assert node_helper.DRAIN_DIR == drain.DRAIN_DIR
    assert node_helper.HELPER == node_access.HELPER
    assert node_helper.PROBE == node_access.PROBE
    assert node_helper.NODEFETCH == node_access.NODEFETCH
    assert node_helper.CONFIG == node_access.HELPER_CONFIG
    assert node_helper.ENGINE_ENV_FILE == ENGINE_ENV_FILE
    assert node_helper.SECRET_ENV_DIR == SECRET_ENV_DIR
    assert node_helper.environment_files(unit_name("Org/Some_Model.v2", 3)) == {
        ENGINE_ENV_FILE,
        secret_env_file("Org/Some_Model.v2"),
    }


@pytest.mark.parametrize("inventory", ["hgx-two-fabrics.yaml", "single-box.yaml", "lab.yaml"])
def test_every_unit_llmgw_renders_is_accepted(inventory: str) -> None:
    spec = parse_cluster((ROOT / "inventories" / inventory).read_text())
    rendered = units(spec)
    assert rendered
    for name, text in rendered:
        check_unit(text, config(spec), name)


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
        (("EnvironmentFile=/etc/llmgw/engine.env", "EnvironmentFile=/root/.ssh/id_ed25519"), "may read"),
        (("EnvironmentFile=/etc/llmgw/engine.env", "EnvironmentFile=/etc/llmgw/../shadow"), "may read"),
        (("Type=exec", "Type=exec \\\n"), "continuation"),
        (("Type=exec", "Type=exec\r"), "control"),
        (("Type=exec", "Type=exec\nLoadCredential=k:/etc/shadow"), "LoadCredential= is not allowed"),
        (("Wants=network-online.target", "Wants=debug-shell.service"), "may name only"),
        (
            ("After=network-online.target", "After=network-online.target\nRequires=rescue.target"),
            "not allowed",
        ),
        (
            ("EnvironmentFile=/etc/llmgw/engine.env", "EnvironmentFile=/etc/llmgw/gateway/id_ed25519"),
            "may read",
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
    name, text = vllm_unit(spec)
    old, new = edit
    assert old in text
    with pytest.raises(Refused, match=why):
        check_unit(text.replace(old, new, 1), config(spec), name)


def test_a_quoted_semicolon_is_an_argument_not_a_second_command() -> None:
    spec = lab_spec()
    name, text = vllm_unit(spec)
    check_unit(
        text.replace("ExecStart=/opt/vllm/bin/vllm serve", 'ExecStart=/opt/vllm/bin/vllm serve ";"', 1),
        config(spec),
        name,
    )


ENGINE_KEY_LINE = "EnvironmentFile=/etc/llmgw/engine.env"


@pytest.mark.parametrize(
    "line",
    [
        # globs: systemd reads every file they match, as root
        "EnvironmentFile=/etc/llmgw/env/*.env",
        "EnvironmentFile=/etc/llmgw/engine.en?",
        "EnvironmentFile=/etc/llmgw/env/[a-z]*.env",
        "EnvironmentFile=/etc/llmgw/*/*",
        # '-' makes a file optional; the template never writes it, even for its own files
        "EnvironmentFile=-/etc/llmgw/env/qwen2.5-7b-instruct.env",
        "EnvironmentFile=-/etc/llmgw/gateway/hub.env",
        "EnvironmentFile=-/etc/llmgw/engine.env",
        # another model's secrets, a folder, specifiers, spellings systemd simplifies
        "EnvironmentFile=/etc/llmgw/env/qwen2.5-7b-instruct.env",
        "EnvironmentFile=/etc/llmgw/env",
        "EnvironmentFile=/etc/llmgw/env/%N.env",
        "EnvironmentFile=%E/llmgw/engine.env",
        "EnvironmentFile=/etc/llmgw//engine.env",
        "EnvironmentFile=/etc/llmgw/./engine.env",
        'EnvironmentFile="/etc/llmgw/engine.env"',
        # an empty assignment resets the list systemd built so far
        "EnvironmentFile=",
    ],
)
def test_environment_files_only_exactly_as_the_template_writes_them(line: str) -> None:
    spec = lab_spec()
    name, text = vllm_unit(spec)
    assert ENGINE_KEY_LINE in text
    with pytest.raises(Refused, match=r"EnvironmentFile=.* is not one this unit may read"):
        check_unit(text.replace(ENGINE_KEY_LINE, f"{ENGINE_KEY_LINE}\n{line}", 1), config(spec), name)


@pytest.mark.parametrize(
    ("section", "line"),
    [
        # a folder loads every file in it as a credential the engine can read
        ("Service", "LoadCredential=k:/etc/llmgw/gateway"),
        ("Service", "LoadCredential=k:/etc/llmgw/env"),
        ("Service", "LoadCredential=k:/etc/llmgw"),
        ("Service", "LoadCredential=k:/etc/llmgw/engine.env"),
        ("Service", "LoadCredentialEncrypted=k:/etc/llmgw/env"),
        ("Service", "ImportCredential=*"),
        ("Service", "SetCredential=k:v"),
        ("Service", "BindPaths=/etc/llmgw:/tmp/x"),
        ("Service", "BindReadOnlyPaths=/etc/llmgw/gateway"),
        ("Service", "ReadWritePaths=/etc"),
        ("Service", "WorkingDirectory=/etc/llmgw"),
        ("Service", "RootDirectory=/srv/root"),
        ("Service", "RootImage=/srv/root.img"),
        ("Service", "TemporaryFileSystem=/etc/llmgw:rw"),
        ("Service", "PassEnvironment=SSH_AUTH_SOCK"),
        ("Service", "StandardInput=file:/etc/llmgw/engine.env"),
        ("Service", "ExecStartPost=/opt/vllm/bin/vllm"),
        ("Service", "ExecCondition=/opt/vllm/bin/vllm"),
        ("Service", "ExecStopPost=/opt/vllm/bin/vllm"),
        ("Unit", "ConditionPathExists=/etc/llmgw/engine.env"),
        ("Unit", "SourcePath=/etc/llmgw/engine.env"),
        ("Unit", "OnFailure=debug-shell.service"),
        ("Install", "Alias=sshd.service"),
        ("Install", "Also=debug-shell.service"),
    ],
)
def test_directives_the_template_never_writes_are_refused(section: str, line: str) -> None:
    spec = lab_spec()
    name, text = vllm_unit(spec)
    key = line.partition("=")[0]
    hostile = text.replace(f"[{section}]\n", f"[{section}]\n{line}\n", 1)
    assert hostile != text
    with pytest.raises(Refused, match=rf"{key}= is not allowed in \[{section}\]"):
        check_unit(hostile, config(spec), name)


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        # systemd strips only space, tab, CR and LF: with an NBSP or NEL around it the key
        # is unknown to systemd, which would ignore User= and run the engine as root
        (("User=llmgw", "\u00a0User=llmgw"), "is not allowed"),
        (("User=llmgw", "User\u00a0=llmgw"), "is not allowed"),
        (("User=llmgw", "\x85User=llmgw"), "is not allowed"),
        (("User=llmgw", "User=llmgw\u00a0"), "not an engine account"),
        (("ExecStart=/opt/vllm/bin/vllm", "ExecStart=/opt/vllm/bin/vllm\u00a0x"), "not an engine program"),
        (("WantedBy=multi-user.target", "WantedBy=rescue.target"), "WantedBy= may name only"),
        (
            ("WantedBy=multi-user.target", "WantedBy=multi-user.target sshd.service"),
            "WantedBy= may name only",
        ),
        (("Type=exec", "Type=exec\udcff"), "not UTF-8"),
    ],
)
def test_what_systemd_reads_differently_is_refused(edit: tuple[str, str], why: str) -> None:
    spec = lab_spec()
    name, text = vllm_unit(spec)
    old, new = edit
    assert old in text
    with pytest.raises(Refused, match=why):
        check_unit(text.replace(old, new, 1), config(spec), name)


def test_a_model_reads_its_own_secrets_and_no_other_models() -> None:
    data = yaml.safe_load((ROOT / "inventories/lab.yaml").read_text())
    for model in data["models"]:
        model["env"] = {**model.get("env", {}), "HF_TOKEN": "hf_x"}
    spec = parse_cluster(yaml.safe_dump(data))
    rendered = units(spec)
    own = [(name, text) for name, text in rendered if "EnvironmentFile=/etc/llmgw/env/" in text]
    assert len(own) == len(rendered)
    for name, text in own:
        check_unit(text, config(spec), name)
    (name, text), (other, _) = own[0], next(u for u in own if u[0] != own[0][0])
    with pytest.raises(Refused, match="EnvironmentFile="):
        check_unit(text, config(spec), other)


@pytest.mark.parametrize(
    "unit",
    [
        "llmgw-a-0.service.d/override.conf",
        "llmgw-a-0.service.d",
        "llmgw-.service.d/override.conf",
        "llmgw-a-.service.d/x.conf",
        "llmgw-a-0.service/../x.conf",
        "../llmgw-a-0.service",
        "llmgw-a@-0.service",
        "llmgw-a-0.socket",
        "llmgw-a-0.service.wants",
        "llmgw-a-0.service x.conf",
        "llmgw-a-0.service\n",
    ],
)
def test_write_unit_writes_a_replica_unit_file_and_nothing_else(unit: str) -> None:
    with pytest.raises(Refused):
        check_words(parse_words([], f"write-unit {shlex.quote(unit)}"))
    with pytest.raises(Refused):
        check_words(["write-unit", unit])


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
        "drain-mark llmgw-gateway.service 30",  # replica units only
        "drain-mark llmgw-a-0.service",
        "drain-mark llmgw-a-0.service -5",
        "drain-mark llmgw-a-0.service 1e9",
        "drain-mark llmgw-a-0.service 9999999",  # beyond a week
        "drain-mark ../../etc/passwd 30",
        "drain-clear",
        "drain-clear llmgw-a-0.service ../x",
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
        "drain-mark llmgw-a-0.service 30.000",
        "drain-clear llmgw-a-0.service llmgw-a-1.service",
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


def test_drain_mark_writes_the_deadline_on_the_nodes_clock_and_clear_takes_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    markers = tmp_path / "draining"
    monkeypatch.setattr(node_helper, "DRAIN_DIR", str(markers))
    monkeypatch.setattr(node_helper.time, "time", lambda: 1_700_000_000.0)
    words = ["drain-mark", "llmgw-a-0.service", "45.5"]
    check_words(words)
    assert node_helper.run_verb(words, {}) == 0
    assert capsys.readouterr().out == "1700000045.500\n"
    assert oct(markers.stat().st_mode & 0o777) == "0o755"  # made, readable by the gateway's probe
    text = (markers / "llmgw-a-0.service").read_text()
    assert drain.parse_markers([("llmgw-a-0.service", text)]) == {"llmgw-a-0.service": 1_700_000_045.5}
    assert [p.name for p in markers.iterdir()] == ["llmgw-a-0.service"]  # no temporary left
    assert node_helper.run_verb(["drain-clear", "llmgw-a-0.service", "llmgw-a-1.service"], {}) == 0
    assert list(markers.iterdir()) == []


def test_drain_mark_refuses_a_folder_another_account_could_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    markers = tmp_path / "draining"
    markers.mkdir()
    markers.chmod(0o777)
    monkeypatch.setattr(node_helper, "DRAIN_DIR", str(markers))
    with pytest.raises(Refused, match="not a folder of root's alone"):
        node_helper.run_verb(["drain-mark", "llmgw-a-0.service", "30"], {})
    markers.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(markers)
    monkeypatch.setattr(node_helper, "DRAIN_DIR", str(link))
    with pytest.raises(Refused):
        node_helper.run_verb(["drain-mark", "llmgw-a-0.service", "30"], {})
    assert list(markers.iterdir()) == []


# --- exists: what a path source is, before its units start -------------------------------


def exists_config(tmp_path: Path) -> dict[str, list[str]]:
    return {"programs": [], "users": [], "weights": [str(tmp_path / "w")], "paths": [str(tmp_path / "src")]}


def answer(
    words: list[str], config: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> dict[str, dict[str, object]]:
    check_words(words)
    assert node_helper.run_verb(words, config) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1  # one JSON line, data only
    parsed: dict[str, dict[str, object]] = json.loads(out)
    return parsed


def test_exists_says_what_is_at_each_path_without_opening_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = tmp_path / "w"
    (w / "folder").mkdir(parents=True)
    (w / "folder" / "config.json").write_text("{}")
    (w / "bare").mkdir()
    (w / "m.gguf").write_bytes(b"GGUF")
    (w / "empty.gguf").write_bytes(b"")
    os.mkfifo(w / "fifo")  # opening it would block: only stat is used
    (w / "link").symlink_to(w / "m.gguf")  # followed, as the engine will
    (w / "loop").symlink_to(w / "loop")
    (w / "program").write_text("#!/bin/sh\ntouch " + str(tmp_path / "ran") + "\n")
    (w / "program").chmod(0o755)
    names = ["folder", "bare", "m.gguf", "empty.gguf", "fifo", "link", "loop", "program", "gone", "m.gguf/x"]
    got = answer(["exists", *(str(w / n) for n in names)], exists_config(tmp_path), capsys)
    assert {Path(p).relative_to(w).as_posix(): (a["kind"], a["empty"]) for p, a in got.items()} == {
        "folder": ("dir", False),
        "bare": ("dir", True),
        "m.gguf": ("file", False),
        "empty.gguf": ("file", True),
        "fifo": ("other", True),
        "link": ("file", False),
        "loop": ("unreadable", True),
        "program": ("file", False),
        "gone": ("missing", True),
        "m.gguf/x": ("missing", True),
    }
    assert not (tmp_path / "ran").exists()


def test_exists_answers_about_a_path_source_of_the_cluster_file_outside_the_weights_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.safetensors").write_bytes(b"x")
    got = answer(["exists", str(tmp_path / "src")], exists_config(tmp_path), capsys)
    assert got == {str(tmp_path / "src"): {"kind": "dir", "empty": False}}


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder every account may enter (pytest's own are root's alone)."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming the engine's account takes root, as the helper has")
def test_exists_names_the_first_file_the_engine_account_cannot_read(
    open_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = open_folder / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "model.safetensors").write_bytes(b"x")
    (src / "sub" / "model.safetensors").chmod(0o600)  # root's alone
    config = {"programs": [], "users": ["nobody", "no-such-account"], "weights": [], "paths": [str(src)]}
    got = answer(["exists", str(src)], config, capsys)
    assert got[str(src)]["unreadable"] == {
        "nobody": {"path": str(src / "sub" / "model.safetensors"), "owner": "root", "mode": "0600"}
    }  # an account not made yet is not asked
    (src / "sub" / "model.safetensors").chmod(0o644)
    (src / "sub").chmod(0o700)  # a folder it cannot enter is named, not what lies in it
    got = answer(["exists", str(src)], config, capsys)
    assert got[str(src)]["unreadable"] == {
        "nobody": {"path": str(src / "sub"), "owner": "root", "mode": "0700"}
    }
    (src / "sub").chmod(0o755)
    assert answer(["exists", str(src)], config, capsys)[str(src)]["unreadable"] == {"nobody": None}
    open_folder.chmod(0o700)  # a folder above it
    got = answer(["exists", str(src)], config, capsys)
    assert got[str(src)]["unreadable"] == {
        "nobody": {"path": str(open_folder), "owner": "root", "mode": "0700"}
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming the engine's account takes root, as the helper has")
def test_exists_says_whether_each_engine_account_may_run_an_engine_program(
    open_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = open_folder / "bin"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    engine = folder / "engine"
    engine.write_text(f"#!/bin/sh\ntouch {open_folder}/ran\n")
    engine.chmod(0o700)  # root's alone: systemd would answer 203/EXEC as the engine's account
    config = {
        "programs": [str(engine), "sh", "no-such-engine"],
        "users": ["nobody"],
        "weights": [],
        "paths": [],
    }
    got = answer(["exists", str(engine)], config, capsys)
    assert got == {
        str(engine): {
            "kind": "file",
            "empty": False,
            "path": str(engine),
            "unrunnable": {"nobody": {"path": str(engine), "owner": "root", "mode": "0700"}},
        }
    }
    engine.chmod(0o755)
    assert answer(["exists", str(engine)], config, capsys)[str(engine)]["unrunnable"] == {"nobody": None}
    folder.chmod(0o700)  # a folder above it that the account cannot enter
    got = answer(["exists", str(engine)], config, capsys)
    assert got[str(engine)]["unrunnable"] == {
        "nobody": {"path": str(folder), "owner": "root", "mode": "0700"}
    }
    # a bare name is looked up where systemd looks, not on the caller's PATH
    got = answer(["exists", "sh", "no-such-engine"], config, capsys)
    assert got["sh"]["path"] == shutil.which("sh", path=node_helper.PATH)
    assert got["sh"]["unrunnable"] == {"nobody": None}
    assert got["no-such-engine"] == {"kind": "missing", "empty": True, "path": None}
    assert not (open_folder / "ran").exists()  # looked at, never run
    for other in ("/usr/bin/id", "id"):  # not an engine program of the cluster file
        with pytest.raises(Refused, match="neither in a weights folder"):
            node_helper.run_verb(["exists", other], config)


@pytest.mark.parametrize(
    "path",
    [
        "/etc/shadow",  # neither in a weights folder nor a path source
        "/root/.ssh/id_ed25519",
        "{tmp}/src/inside",  # a path source is answered exactly, not what lies below it
        "{tmp}/w",  # the weights folder itself: only what is inside it
        "{tmp}/wx/m.gguf",  # a sibling folder whose name starts like the weights folder
    ],
)
def test_exists_refuses_paths_the_cluster_file_does_not_name(
    tmp_path: Path, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    words = ["exists", str(tmp_path / "w" / "ok"), path.format(tmp=tmp_path)]
    check_words(words)
    with pytest.raises(Refused, match="neither in a weights folder nor a path source"):
        node_helper.run_verb(words, exists_config(tmp_path))
    assert capsys.readouterr().out == ""  # refused before anything is looked at


@pytest.mark.parametrize(
    "words",
    [
        ["exists"],
        ["exists", "data/models/x"],
        ["exists", "/data/models/../../etc/shadow"],
        ["exists", "/data/models/./x"],
        ["exists", "/data//models/x"],
        ["exists", "//data/models/x"],
        ["exists", "/data/models/x/"],
        ["exists", "/data/models/x\x00"],
        ["exists", "/data/models/x\n/etc/shadow"],
        ["exists", "/" + "a" * 4096],
        ["exists", *[f"/data/models/{i}" for i in range(65)]],
    ],
)
def test_exists_refuses_paths_that_are_not_plain_and_too_many(words: list[str]) -> None:
    with pytest.raises(Refused, match="exists"):
        check_words(words)


def test_exists_through_the_forced_command_line_is_checked_like_argv() -> None:
    check_words(parse_words([], f"{node_helper.HELPER} exists /data/models/a /data/models/b"))
    for line in ("exists /data/models/../x", "exists '/data/models/x;id'/..", "exists $(id)"):
        with pytest.raises(Refused):
            check_words(parse_words([], line))


def test_a_config_written_before_path_sources_were_listed_still_loads(tmp_path: Path) -> None:
    old = tmp_path / "node-helper.json"
    old.write_text(json.dumps({"programs": ["/bin/x"], "users": ["llmgw"], "weights": ["/w"]}))
    assert node_helper.load_config(str(old))["paths"] == []
    old.write_text(json.dumps({"programs": [], "users": [], "weights": [], "paths": "/etc"}))
    with pytest.raises(Refused, match="paths must be a list"):
        node_helper.load_config(str(old))


def run_piped(words: list[str], config: str) -> subprocess.CompletedProcess[str]:
    """What apply runs on a node as root: the helper's code on stdin of ``python3 -I -``."""
    script = fetch.piped_helper(words, config)
    return subprocess.run(
        ["python3", "-I", "-"], input=script, capture_output=True, text=True, timeout=30, check=False
    )


def test_apply_pipes_the_same_helper_with_the_config_it_writes(tmp_path: Path) -> None:
    """No helper installed and no config file on the node: apply's question gets the
    helper's answer, bounded by the configuration apply is about to write."""
    spec = parse_cluster(
        f"cluster: {{name: t}}\nnodes:\n  - {{name: n1, address: 10.0.0.1, weights: [{tmp_path}/w]}}\n"
        f"profiles: {{p: {{engine: llama-server}}}}\nmodels:\n"
        f"  - {{name: a, source: {tmp_path}/src.gguf, profile: p}}\n"
        "  - {name: b, source: ./b.gguf, profile: p}\n"
    )
    (tmp_path / "w").mkdir()
    (tmp_path / "src.gguf").write_bytes(b"GGUF")
    config = node_access.helper_config(spec, spec.node("n1"))
    done = run_piped(["exists", f"{tmp_path}/src.gguf", f"{tmp_path}/w/b.gguf"], config)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        f"{tmp_path}/src.gguf": {"kind": "file", "empty": False},
        f"{tmp_path}/w/b.gguf": {"kind": "missing", "empty": True},
    }
    refused = run_piped(["exists", "/etc/shadow"], config)
    assert refused.returncode == 2 and "node-helper: refused" in refused.stderr and refused.stdout == ""
    bad = run_piped(["exists", f"{tmp_path}/w/../src.gguf"], config)
    assert bad.returncode == 2 and "not a plain absolute path" in bad.stderr
    # only the reading verbs may be piped: nothing that writes or starts
    other = run_piped(["start", "llmgw-a-0.service"], config)
    assert other.returncode == 2 and "may be piped" in other.stderr


def test_hostile_paths_travel_to_the_piped_helper_as_data(tmp_path: Path) -> None:
    """Quotes and code in a path reach the helper as one word, which it refuses or
    answers about; they never run."""
    hostile = f"{tmp_path}/w/x'); import os; os.system('touch {tmp_path}/ran'); ('"
    config = json.dumps({"programs": [], "users": [], "weights": [f"{tmp_path}/w"], "paths": []})
    done = run_piped(["exists", hostile], config)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {hostile: {"kind": "missing", "empty": True}}
    assert not (tmp_path / "ran").exists()
