"""The doctor's shell sections run by a real sh: the awk that keeps only the Fabric block
of `nvidia-smi -q` is fed the recorded real capture through a stand-in nvidia-smi."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from llmgw_cli.core.doctor.collect import doctor_part, doctor_script, parse_doctor, parse_fabric
from llmgw_cli.core.observe.parse.probe import parse_probe, split_sections
from tests.unit.doctor.conftest import FIXTURES, spec


def run_section(tmp_path: Path, q_output: str) -> str:
    if shutil.which("awk") is None:
        pytest.fail("awk is missing")
    (tmp_path / "q.txt").write_text(q_output)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\n[ "$1" = "-q" ] && cat {tmp_path / "q.txt"}\n')
    smi.chmod(0o755)
    script = doctor_part([])
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, env=env, check=True)
    return split_sections(done.stdout)["doctor-fabric"]


def real_q() -> str:
    return "\n".join(
        line
        for line in (FIXTURES / "nvidia-smi_q_h100_gpu0_healthy.txt").read_text().splitlines()
        if not line.startswith("#")
    )


def test_fabric_block_of_the_real_capture(tmp_path: Path) -> None:
    [gpu] = parse_fabric(run_section(tmp_path, real_q()))
    assert (gpu.gpu, gpu.state, gpu.status) == ("00000000:53:00.0", "Completed", "Success")


def test_fabric_block_still_training(tmp_path: Path) -> None:
    text = real_q().replace(": Completed", ": In Progress").replace(": Success", ": N/A")
    [gpu] = parse_fabric(run_section(tmp_path, text))
    assert (gpu.state, gpu.status) == ("In Progress", "N/A")


def test_the_script_is_the_probe_plus_the_doctor_sections() -> None:
    s = spec()
    script = doctor_script(s, s.node("gpu1"))
    assert script.index("@@ engines") < script.index("@@ doctor-memlock") < script.index("@@ doctor-end")
    assert "d=/data/models" in script.split("@@ doctor-disks")[1]


def test_both_parsers_read_one_output() -> None:
    s = spec()
    text = (
        "@@ host\nclock 5.0\n@@ engines\n@engine /opt/vllm/bin/vllm found\n@@ end\n"
        "@@ doctor-memlock\nsoft 64\nhard unlimited\n@@ doctor-clock\n7.25\n@@ doctor-end\n"
    )
    facts, doctor = parse_probe(s.node("gpu1"), text), parse_doctor("gpu1", text)
    assert facts.clock == 5.0 and facts.engines[0].found
    assert (doctor.memlock_soft, doctor.memlock_hard, doctor.clock_end) == (64 * 1024, "unlimited", 7.25)
