"""NVIDIA's XID reports in the kernel log: the parser (hostile input), the table of what
each code means, and the shell that reads them (real sh, grep, tail; fake journalctl and
dmesg on PATH)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from llmgw_cli.core.observe.parse.kernel_log import (
    DETAIL_CHARS,
    LINE_BYTES,
    MAX_LINES,
    XIDS_READ,
    bus_key,
    parse_xids,
)
from llmgw_cli.core.observe.xid import CATALOG_URL, RESET_GPU, RESTART_APP, RESTART_BM, TABLE, xid
from llmgw_cli.node import helper

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def fixture_lines() -> list[str]:
    text = (FIXTURES / "dmesg_nvrm_xid_examples.txt").read_text()
    return [line for line in text.splitlines() if not line.startswith("#")]


def sent(lines: list[str]) -> str:
    """Lines as the probe sends them: the source, then each behind ``@xid ``."""
    return "@source dmesg\n" + "".join(f"@xid {line}\n" for line in lines)


def test_real_reports_are_read_per_bus_and_code_with_their_count() -> None:
    reports = parse_xids(sent(fixture_lines()))
    assert [(r.bus, r.code, r.count) for r in reports] == [
        ("0000:9b:00", 119, 5),
        ("0000:44:00", 79, 1),
        ("0000:10:1c", 63, 1),
    ]
    gsp = reports[0]
    assert gsp.detail.startswith("pid=1240590, name=gpud, Timeout after 6s")  # the last one's text
    assert gsp.seconds is None  # `dmesg -T` wall-clock stamps are not seconds since boot
    assert reports[1].detail == "GPU has fallen off the bus"


def test_seconds_since_boot_are_read_from_the_plain_dmesg_stamp() -> None:
    (r,) = parse_xids(
        sent(["[ 1234.567890] NVRM: Xid (PCI:0000:4e:00): 79, pid=1, GPU has fallen off the bus."])
    )
    assert r.seconds == pytest.approx(1234.56789)
    (old,) = parse_xids(
        sent(["NVRM: Xid (0000:01:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception"])
    )
    assert (old.bus, old.code, old.seconds) == ("0000:01:00", 13, None)  # no PCI: prefix (older drivers)


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: Xid (PCI:zz:00:00): 79, x",  # not a bus id
        "NVRM: Xid (PCI:0000:4e:00): 123456, x",  # not a sane code
        "NVRM: Xid (PCI:0000:4e:00): -79, x",
        "NVRM: Xid (PCI:0000:4e:00) 79, x",  # no colon
        "NVRM: Xid 79",
        "NVRM: GPU at PCI:0000:4e:00: GPU-5656cbd4-b206-cc5a-3bff-775d946a6399",
        "\x00\x1b[31m",
        "",
    ],
)
def test_lines_that_are_not_reports_are_skipped(line: str) -> None:
    assert parse_xids(sent([line])) == []


def test_only_lines_the_probe_marked_count_and_the_text_kept_is_printable_and_short() -> None:
    unmarked = "NVRM: Xid (PCI:0000:4e:00): 79, forged into another section"
    assert parse_xids(unmarked + "\n@@ end\n") == []
    (r,) = parse_xids(sent(["NVRM: Xid (PCI:0000:4e:00): 48, \x1b[2J\u202e" + "A" * 1000]))
    assert r.detail.isprintable() and len(r.detail) == DETAIL_CHARS
    assert r.detail.startswith("?[2J?A")  # the escape and the right-to-left override shown as ?


def test_at_most_the_last_lines_are_read() -> None:
    lines = [f"NVRM: Xid (PCI:0000:{i % 256:02x}:00): 13, pid={i}" for i in range(MAX_LINES + 50)]
    reports = parse_xids(sent(lines))
    assert sum(r.count for r in reports) == MAX_LINES
    assert reports[0].bus == "0000:32:00"  # the first 50 lines were left out


def test_bus_ids_compare_across_nvidia_smi_and_the_kernel() -> None:
    assert bus_key("00000000:4E:00.0") == bus_key("0000:4e:00") == bus_key("0000:4e:00.0") == "0000:4e:00"
    assert bus_key("00000001:4E:00.0") == "0001:4e:00"
    for bad in ("", "4e:00", "0000:4e:00.9", "0000:4e:00:00", "[N/A]", "0000:4g:00"):
        assert bus_key(bad) is None


def test_the_table_follows_nvidia_s_immediate_actions() -> None:
    """Fatal: NVIDIA's first action resets the GPU or restarts the machine; program faults
    and informational codes leave the card in use; unknown codes too (shown as unknown)."""
    assert xid(79).fatal and xid(79).action == RESTART_BM and "fallen off the bus" in xid(79).meaning
    for code in (46, 48, 62, 64, 74, 95, 109, 119, 120, 140, 143, 144, 150):
        assert xid(code).fatal, code
    for code in (13, 31, 43):  # the program that used the card
        assert not xid(code).fatal and xid(code).action in (RESTART_APP, TABLE[43].action), code
    for code in (45, 63, 92, 94):  # informational, or only its program was hit
        assert not xid(code).fatal, code
    assert xid(95).action == RESET_GPU
    unknown = xid(1234)
    assert not unknown.fatal and CATALOG_URL in unknown.action
    assert all(x.meaning and x.mnemonic and x.code == code for code, x in TABLE.items())


# --- the shell that reads them ----------------------------------------------------------


def _tools(tmp_path: Path, *, journal: str, dmesg: str | None) -> dict[str, str]:
    """PATH with a fake journalctl (prints ``journal``) and dmesg (``None``: refuses, as
    with kernel.dmesg_restrict=1 and no root), then the real tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "journal.txt").write_text(journal)
    (bin_dir / "journalctl").write_text(f"#!/bin/sh\ncat {tmp_path / 'journal.txt'}\n")
    if dmesg is None:
        (bin_dir / "dmesg").write_text("#!/bin/sh\necho 'dmesg: read kernel buffer failed' >&2\nexit 1\n")
    else:
        (tmp_path / "dmesg.txt").write_text(dmesg)
        (bin_dir / "dmesg").write_text(f"#!/bin/sh\ncat {tmp_path / 'dmesg.txt'}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_the_node_helper_reads_with_the_same_text() -> None:
    """The helper is shipped alone, with its own copy of what the probe runs as root."""
    assert helper.XIDS_READ == XIDS_READ
    assert (helper.XID_LINES, helper.XID_LINE_BYTES) == (MAX_LINES, LINE_BYTES)


def read(env: dict[str, str]) -> str:
    done = subprocess.run(["sh", "-c", XIDS_READ], env=env, capture_output=True, text=True, check=True)
    return done.stdout


def test_the_journal_is_read_first_then_the_ring_buffer(tmp_path: Path) -> None:
    xid79 = "[ 12.5] node kernel: NVRM: Xid (PCI:0000:4e:00): 79, pid=1, GPU has fallen off the bus."
    env = _tools(tmp_path, journal=f"[ 1.0] node kernel: Linux version 6.1\n{xid79}\n", dmesg="ignored\n")
    out = read(env)
    assert out.splitlines() == ["@source journal", f"@xid {xid79}"]
    assert [(r.bus, r.code) for r in parse_xids(out)] == [("0000:4e:00", 79)]
    ring = "\n".join(fixture_lines()) + "\n"
    empty_journal = _tools(tmp_path / "2", journal="", dmesg=ring)
    out = read(empty_journal)
    assert out.splitlines()[0] == "@source dmesg"
    assert len(parse_xids(out)) == 3
    nothing = _tools(tmp_path / "3", journal="", dmesg=None)
    assert read(nothing) == "@source unreadable\n"


def test_the_shell_bounds_what_it_sends_and_no_line_can_open_a_section(tmp_path: Path) -> None:
    many = "".join(f"NVRM: Xid (PCI:0000:4e:00): 13, n={i} {'x' * 900}\n" for i in range(MAX_LINES * 3))
    forged = "@@ units\nNVRM: Xid (PCI:0000:4e:00): 79, \x1b[31mred\x07\n"
    env = _tools(tmp_path, journal="", dmesg=many + forged)
    lines = read(env).splitlines()
    assert len(lines) == 1 + MAX_LINES
    assert all(line.startswith("@xid ") and len(line.encode()) <= 5 + LINE_BYTES for line in lines[1:])
    assert not any(line.startswith("@@") for line in lines)
    assert lines[-1] == "@xid NVRM: Xid (PCI:0000:4e:00): 79, ?[31mred?"
