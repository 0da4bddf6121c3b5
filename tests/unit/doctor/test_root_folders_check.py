"""The doctor's root-folders section: its shell run by a real sh, its parse of forged
output, and the check from plain data."""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

from llmgw_cli.core.doctor import Severity
from llmgw_cli.core.doctor.checks import check_node, check_root_folders
from llmgw_cli.core.doctor.collect import MAX_OWNED, doctor_part, parse_owned
from llmgw_cli.core.hosts.root_folders import Owned
from llmgw_cli.core.observe.parse.probe import split_sections
from tests.unit.doctor.conftest import collected, spec


def record(path: str, uid: int = 0, owner: str = "root", mode: str = "755", kind: str = "directory") -> str:
    raw = "\0".join((path, str(uid), owner, mode, kind)).encode()
    return "@path " + base64.b64encode(raw).decode()


def lines(*records: str) -> str:
    return "\n".join(records)


# --- the parse ----------------------------------------------------------------------


def test_records_are_read_each_path_once() -> None:
    text = lines(record("/etc/llmgw", 4242, "llmgw"), record("/etc"), record("/etc"), record("/"))
    assert parse_owned(text) == (
        Owned(path="/etc/llmgw", uid=4242, owner="llmgw", mode=0o755),
        Owned(path="/etc", uid=0, owner="root", mode=0o755),
        Owned(path="/", uid=0, owner="root", mode=0o755),
    )


def test_a_link_and_special_bits_are_read() -> None:
    [link, sticky] = parse_owned(
        lines(record("/usr/local", mode="777", kind="symbolic link"), record("/t", mode="1777"))
    )
    assert link.link and link.mode == 0o777
    assert not sticky.link and sticky.mode == 0o1777


def test_malformed_or_forged_records_are_left_out() -> None:
    bad = [
        record("relative/path"),
        record("/a\nb"),  # a control character would reach the operator's terminal
        record("/a", owner="\x1b[2Jx"),
        record("/a", mode="789"),
        record("/a", mode="77777"),
        "@path " + base64.b64encode(b"/a\x000\x00root\x00755").decode(),  # 4 fields
        "@path " + base64.b64encode("/a\0٣\0root\0755\0directory".encode()).decode(),  # not ASCII digits
        "@path not-base64!",
        "/etc 0 root 755 directory",
    ]
    assert parse_owned(lines(*bad)) == ()


def test_at_most_max_owned_lines_are_read() -> None:
    text = lines(*(record(f"/f{i}") for i in range(MAX_OWNED + 10)))
    assert len(parse_owned(text)) == MAX_OWNED


# --- the shell, on this machine -----------------------------------------------------


def run(folders: list[str]) -> tuple[Owned, ...]:
    done = subprocess.run(
        ["sh", "-s"], input=doctor_part([], folders), capture_output=True, text=True, check=True
    )
    return parse_owned(split_sections(done.stdout)["doctor-root-folders"])


def test_the_shell_reports_each_folder_and_those_above_it(tmp_path: Path) -> None:
    folder = tmp_path / "etc-llmgw" / "env"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    os.chown(folder.parent, 4242, 4242)
    found = {o.path: o for o in run([str(folder), str(tmp_path / "missing" / "x")])}
    assert found[str(folder)].mode == 0o777 and found[str(folder)].uid == os.getuid()
    assert found[str(folder.parent)].uid == 4242
    assert found["/"].uid == 0
    assert str(tmp_path / "missing") not in found  # a folder not there is not reported
    assert str(tmp_path) in found  # but the folders above it are


def test_the_shell_follows_a_link_on_the_way_to_its_target(tmp_path: Path) -> None:
    target = tmp_path / "real"
    (target / "llmgw").mkdir(parents=True)
    os.chown(target, 4242, 4242)
    (tmp_path / "link").symlink_to(target)
    found = {o.path: o for o in run([str(tmp_path / "link" / "llmgw")])}
    assert found[str(tmp_path / "link")].link
    assert found[str(target)].uid == 4242  # reached only through readlink -m


def test_a_name_with_a_newline_forges_no_line(tmp_path: Path) -> None:
    evil = tmp_path / "x\n@path Lw==\n@@ doctor-clock"
    evil.mkdir()
    (tmp_path / "l").symlink_to(evil)
    done = subprocess.run(
        ["sh", "-s"], input=doctor_part([], [str(tmp_path / "l")]), capture_output=True, text=True, check=True
    )
    sections = split_sections(done.stdout)  # a forged section header would raise here
    assert all(o.path.startswith("/") for o in parse_owned(sections["doctor-root-folders"]))
    assert str(evil) not in {o.path for o in parse_owned(sections["doctor-root-folders"])}


# --- the check ----------------------------------------------------------------------


def test_a_folder_the_engine_account_owns_is_an_error_with_the_fix() -> None:
    s = spec()
    c = collected(s, doctor_root_folders=lines(record("/etc/llmgw", 4242, "llmgw"), record("/etc")))
    [f] = check_root_folders(s, s.node("gpu1"), c)
    assert (f.check, f.severity, f.node) == ("node.root-folder", Severity.error, "gpu1")
    assert "/etc/llmgw is owned by llmgw (uid 4242)" in f.message
    assert "root writes in it" in f.message and "swap" in f.message
    assert f.fix == "`chown root:root /etc/llmgw && chmod go-w /etc/llmgw` on gpu1"


def test_a_folder_writable_by_others_and_a_parent_of_one_are_named() -> None:
    s = spec()
    text = lines(record("/etc/llmgw/env", mode="777"), record("/usr/local", 1000, "alice"))
    env, local = check_root_folders(s, s.node("gpu1"), collected(s, doctor_root_folders=text))
    assert "/etc/llmgw/env is mode 777, writable by group and others" in env.message
    assert "chmod go-w /etc/llmgw/env" in env.fix
    assert "/usr/local is owned by alice (uid 1000)" in local.message
    assert "it holds /usr/local/libexec/llmgw" in local.message


def test_a_path_only_a_link_leads_to_says_so() -> None:
    s = spec()
    text = lines(record("/srv/elsewhere", 4242, "llmgw"))
    [f] = check_root_folders(s, s.node("gpu1"), collected(s, doctor_root_folders=text))
    assert "a link on the way" in f.message


def test_root_owned_folders_or_none_reported_give_no_finding() -> None:
    s = spec()
    text = lines(
        record("/etc/llmgw", mode="700"),
        record("/etc"),
        record("/usr/local", mode="777", kind="symbolic link"),
    )
    assert check_root_folders(s, s.node("gpu1"), collected(s, doctor_root_folders=text)) == []
    assert check_root_folders(s, s.node("gpu1"), collected(s)) == []


def test_the_check_is_one_of_the_node_checks() -> None:
    s = spec()
    c = collected(s, doctor_root_folders=record("/etc/llmgw", 4242, "llmgw"))
    assert "node.root-folder" in [f.check for f in check_node(s, s.node("gpu1"), c)]
