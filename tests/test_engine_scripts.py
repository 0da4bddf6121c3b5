"""scripts/build-llama-server's cache logic, without building (no cmake, no network)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts/build-llama-server"


def _run(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMGW_CACHE_DIR": str(cache)}
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, check=False)


def test_no_build_reports_the_keyed_path_and_a_cached_binary_is_used(tmp_path: Path) -> None:
    absent = _run(tmp_path, "--print-path", "--no-build")
    assert absent.returncode == 1 and absent.stdout == ""
    match = re.search(r"not built yet: (\S+)", absent.stderr)
    assert match is not None
    binary = Path(match.group(1))
    assert binary.parent.parent == tmp_path and re.fullmatch(r"llama-server-[0-9a-f]{16}", binary.parent.name)

    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    for args in (("--print-path", "--no-build"), ("--print-path",)):
        hit = _run(tmp_path, *args)
        assert (hit.returncode, hit.stdout) == (0, f"{binary}\n")
    assert not (tmp_path / "sdist").exists()  # a cache hit downloads nothing


def test_unknown_argument_exits_2(tmp_path: Path) -> None:
    assert _run(tmp_path, "--fast").returncode == 2
