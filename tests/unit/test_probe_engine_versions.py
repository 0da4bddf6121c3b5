"""The probe's engine versions: read from the node without starting an engine (a Python
distribution's metadata beside the program, ``llama-server --version``), and taken only
when they look like a version."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.parse.probe import parse_probe, section_script


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A folder everyone may enter: the probe asks a program for its version as nobody."""
    with tempfile.TemporaryDirectory(prefix="llmgw-versions-") as name:
        Path(name).chmod(0o755)
        yield Path(name)


def spec_for(root: Path) -> ClusterSpec:
    return parse_cluster(
        f"""\
cluster: {{name: t}}
nodes: [{{name: a, address: 10.0.0.1}}]
profiles:
  vllm: {{engine: vllm, command: [{root}/opt/vllm/bin/vllm, serve]}}
  sglang: {{engine: sglang, command: [{root}/opt/sglang/bin/python3, -m, sglang.launch_server]}}
  llama: {{engine: llama-server, command: [{root}/bin/llama-server]}}
  gone: {{engine: vllm, command: [{root}/missing/vllm, serve]}}
models: []
"""
    )


def write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def probed(root: Path) -> dict[str, str]:
    spec = spec_for(root)
    script = section_script("engines", spec, spec.nodes[0])
    out = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=30, check=True)
    facts = parse_probe(spec.nodes[0], out.stdout)
    return {e.path.removeprefix(str(root)): e.version for e in facts.engines}


def metadata(name: str, version: str) -> str:
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n"


def test_versions_from_metadata_beside_the_program_and_from_version(tmp_path: Path) -> None:
    site = "lib/python3.11/site-packages"
    write(tmp_path / "opt/vllm/bin/vllm", "#!/bin/sh\nexit 1\n", 0o755)
    write(tmp_path / f"opt/vllm/{site}/vllm-0.32.0+cpu.dist-info/METADATA", metadata("vllm", "0.32.0+cpu"))
    # a venv's interpreter is a link to the base one: the venv's own site-packages counts
    base = tmp_path / "usr/bin/python3.11"
    write(base, "#!/bin/sh\nexit 1\n", 0o755)
    (tmp_path / "opt/sglang/bin").mkdir(parents=True)
    (tmp_path / "opt/sglang/bin/python3").symlink_to(base)
    write(tmp_path / f"opt/sglang/{site}/sglang-0.5.23.dist-info/METADATA", metadata("sglang", "0.5.23"))
    # no `#!`: the shell runs it as if it were a binary (execvp's fallback), and says who ran it
    write(
        tmp_path / "bin/llama-server",
        '[ "$1" = --version ] || exit 9\necho "version: 0.5.0-dev-u$(id -u) (build 1)" >&2\n',
        0o755,
    )
    asked = 65534 if os.geteuid() == 0 else os.geteuid()  # never root
    assert probed(tmp_path) == {
        "/opt/vllm/bin/vllm": "0.32.0+cpu",
        "/opt/sglang/bin/python3": "0.5.23",
        "/bin/llama-server": f"0.5.0-dev-u{asked}",
        "/missing/vllm": "unknown",
    }


def test_a_script_in_llama_servers_place_is_not_run(tmp_path: Path) -> None:
    write(tmp_path / "bin/llama-server", f"#!/bin/sh\ntouch {tmp_path}/ran\necho 'version: 1.0'\n", 0o755)
    assert probed(tmp_path)["/bin/llama-server"] == "unknown"
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "said",
    [
        "0.32.0; rm -rf /",
        "$(reboot)",
        "0.32.0 \x1b[31mred",
        "v0.32",
        "9" * 200,
        "",
    ],
)
def test_a_version_that_does_not_look_like_one_is_unknown(tmp_path: Path, said: str) -> None:
    write(tmp_path / "opt/vllm/bin/vllm", "#!/bin/sh\n", 0o755)
    write(
        tmp_path / "opt/vllm/lib/python3.12/site-packages/vllm-x.dist-info/METADATA", metadata("vllm", said)
    )
    assert probed(tmp_path)["/opt/vllm/bin/vllm"] == "unknown"


def test_a_forged_line_in_the_version_opens_no_section(tmp_path: Path) -> None:
    write(tmp_path / "opt/vllm/bin/vllm", "#!/bin/sh\n", 0o755)
    forged = "Version: 1.0\n@@ units\n"
    write(tmp_path / "opt/vllm/lib/python3.12/site-packages/vllm-1.dist-info/METADATA", forged)
    assert probed(tmp_path)["/opt/vllm/bin/vllm"] == "1.0"
