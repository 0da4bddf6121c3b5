"""The rule of tests/skips.py, run on a small suite in a pytest subprocess: with
CI=true a skip not listed fails the run and is named with its reason; a listed one
does not; off CI a skip is a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SUITE = """\
import pytest

def test_runs() -> None:
    pass

def test_skips_up_front() -> None:
    pytest.skip("no frobnicator here")

@pytest.mark.skipif(True, reason="marked away")
def test_marked() -> None:
    pass
"""
SKIPPED_MODULE = 'import pytest\npytest.skip("the whole module", allow_module_level=True)\n'


def run(tmp_path: Path, allowed: dict[str, str], ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "test_module_skip.py").write_text(SKIPPED_MODULE)
    (tmp_path / "conftest.py").write_text(
        "from tests.skips import SkipRule\n\n"
        "def pytest_configure(config):\n"
        f"    config.pluginmanager.register(SkipRule({allowed!r}), 'llmgw-skip-rule')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_on_ci_an_unlisted_skip_fails_the_run_and_is_named_with_its_reason(tmp_path: Path) -> None:
    done = run(tmp_path, {"test_suite.py::test_marked": "listed"}, ci="true")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "CI=true: 2 test(s) skipped and not listed" in done.stdout
    assert "test_suite.py::test_skips_up_front: no frobnicator here" in done.stdout
    assert "test_module_skip.py: the whole module" in done.stdout
    assert "test_marked" not in done.stdout.split("CI=true:")[1]


def test_on_ci_listed_skips_pass(tmp_path: Path) -> None:
    allowed = {"test_suite.py::test_*": "allowed here", "test_module_skip.py": "and this module"}
    done = run(tmp_path, allowed, ci="true")
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert "1 passed, 3 skipped" in done.stdout


def test_off_ci_a_skip_is_a_skip(tmp_path: Path) -> None:
    done = run(tmp_path, {}, ci=None)
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert "CI=true" not in done.stdout
