"""`plan` and `apply` refuse a gateway unit that could not run its llmgw (real systemd on a
lab node): an llmgw in a virtual environment under /var/tmp works for root, yet the unit's
``PrivateTmp=yes`` hides it from the service, which would fail with 203/EXEC. The refusal
names the path and the directive, and comes before anything is installed; the same
cluster file with an llmgw the unit sees plans the install."""

from __future__ import annotations

import shlex
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Lab
from .lab_helpers import reset, run
from .test_gateway_install_lab import CLEAN, GATEWAY_FILES, _cluster
from .visible_llmgw import ENTRY, LLMGW, VENV

pytestmark = pytest.mark.integration

HOST = "node02"  # _cluster's gateway host
HIDDEN = "/var/tmp/llmgw-venv"  # where a user who cloned under /var/tmp has llmgw


@pytest.fixture
def hidden_venv(lab: Lab) -> Iterator[str]:
    """A working llmgw under /var/tmp on the gateway host: a venv of the same Python whose
    libraries are the test venv's (a .pth file), with its own ``bin/llmgw``."""
    reset(lab)
    lab.ssh(HOST, CLEAN)
    site = f"{HIDDEN}/lib/python{sysconfig.get_python_version()}/site-packages"
    entry = ENTRY.format(python=f"{HIDDEN}/bin/python")
    made = lab.ssh(
        HOST,
        f"rm -rf {HIDDEN} && {VENV}/bin/python -m venv --without-pip {HIDDEN} && "
        f"echo {VENV}/lib/python{sysconfig.get_python_version()}/site-packages > {site}/test-venv.pth && "
        f"printf %s {shlex.quote(entry)} > {HIDDEN}/bin/llmgw && chmod 755 {HIDDEN}/bin/llmgw && "
        f"{HIDDEN}/bin/llmgw --version",
    )
    assert made.returncode == 0, made.stdout + made.stderr
    yield f"{HIDDEN}/bin/llmgw"
    lab.ssh(HOST, f"rm -rf {HIDDEN}; {CLEAN}")
    reset(lab)


def test_an_llmgw_the_unit_cannot_see_is_refused_before_anything_is_installed(
    lab: Lab, hidden_venv: str, tmp_path: Path
) -> None:
    hidden = _cluster(lab, tmp_path, llmgw_bin=hidden_venv)
    for command in (("plan",), ("apply", "--yes")):
        refused = run(*command, "-f", str(hidden))
        said = " ".join((refused.stdout + refused.stderr).split())  # as wrapped on any width
        assert refused.returncode != 0, said
        assert f"the executable {hidden_venv} is hidden from the service by its unit's PrivateTmp=yes" in said
        assert f"its interpreter {HIDDEN}/bin/python is hidden" in said
        assert "Nothing was changed" in said
        assert "gateway.llmgw_bin: /opt/llmgw/bin/llmgw" in said
    units = lab.ssh(HOST, "ls /etc/systemd/system").stdout
    assert "llmgw-gateway" not in units, units
    assert lab.ssh(HOST, f"test -e {GATEWAY_FILES}").returncode != 0  # not even its key
    assert lab.ssh(HOST, "systemctl is-active llmgw-gateway.service").stdout.strip() != "active"

    # The control: the same cluster with the llmgw the unit sees is planned for install.
    seen = run("plan", "-f", str(_cluster(lab, tmp_path, llmgw_bin=LLMGW)))
    assert seen.returncode == 0, seen.stdout + seen.stderr
    assert "gateway on node02: start or restart" in seen.stdout + seen.stderr
