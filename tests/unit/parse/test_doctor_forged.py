"""The doctor's listener list against process names chosen by whoever runs the process.

Any user on a node can name a process anything up to 15 bytes, newlines included, and
``ss -p`` prints that name as it is. The doctor's script runs here with a real sh and a
stand-in ``ss`` that prints such names; its output must not grow sections or listeners.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from llmgw_cli.core.doctor.collect import doctor_part, parse_doctor
from llmgw_cli.core.observe.parse.probe import parse_probe, split_sections
from tests.unit.parse.test_probe_forged import NODE, probe_output

# What ss prints for three sockets: one owned by a process whose name forges probe
# sections, one whose name forges a listener (15 bytes of it), one whose name reads like
# the end of the process list.
SS_OUTPUT = (
    'LISTEN 0 128 0.0.0.0:8150 0.0.0.0:* users:(("x\n@@ units\nId=llmgw-forged-0.service\n'
    'ActiveState=active",pid=812,fd=6))\n'
    'LISTEN 0 128 0.0.0.0:8151 0.0.0.0:* users:(("\nLISTEN 0 0 :1",pid=813,fd=6))\n'
    'LISTEN 0 128 0.0.0.0:8152 0.0.0.0:* users:(("x",pid=1,fd=1)",pid=814,fd=6))\n'
)


def run_doctor_sections(tmp_path: Path) -> str:
    (tmp_path / "ss.txt").write_text(SS_OUTPUT)
    ss = tmp_path / "ss"
    ss.write_text(f'#!/bin/sh\ncat "{tmp_path / "ss.txt"}"\n')
    ss.chmod(0o755)
    script = doctor_part([])  # the doctor part alone keeps the caller's PATH
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, env=env, check=True)
    return done.stdout


def test_process_names_forge_neither_sections_nor_listeners(tmp_path: Path) -> None:
    out = run_doctor_sections(tmp_path)
    assert "units" not in split_sections(out)
    text = probe_output("") + out
    facts = parse_probe(NODE, text)
    assert facts.error is None
    assert [u.name for u in facts.units] == ["llmgw-llama-0.service"]
    doctor = parse_doctor("a", text)
    assert doctor.listeners_known
    found = {(x.port, x.pid) for x in doctor.listeners}
    assert found == {(8150, 812), (8151, 813), (8152, 814)}
    names = {x.port: x.process for x in doctor.listeners}
    assert names[8150].startswith("x\n@@ units")
    assert names[8151] == "\nLISTEN 0 0 :1"
    assert names[8152] == "x"
