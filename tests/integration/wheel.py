"""The package as users install it: a wheel of this checkout, installed in a fresh venv."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_wheel(out: Path) -> Path:
    """A wheel of this checkout in ``out`` (no dependencies)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("llmgw-*.whl")
    return built


def install_wheel(wheel: Path, env_dir: Path) -> Path:
    """A fresh venv in ``env_dir`` with ``wheel`` and its dependencies: its ``llmgw``."""
    venv.EnvBuilder(with_pip=True).create(env_dir)
    subprocess.run(
        [str(env_dir / "bin/python"), "-m", "pip", "install", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return env_dir / "bin/llmgw"
