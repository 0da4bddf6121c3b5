"""An llmgw that the installed gateway unit can run, wherever this checkout is.

The lab's nodes see this machine's files (their root is an overlay on ours), but the
unit apply installs hides /tmp and /var/tmp from its service (``PrivateTmp=yes``), and
``plan``/``apply`` refuse a ``gateway.llmgw_bin`` it could not run. The tests that install
a gateway on a node therefore never point it at this checkout's own environment (a
clone under /var/tmp would be refused): they use ``LLMGW``, in a virtual environment
under /var/cache, outside every folder the unit hides, made before the lab boots by
``build``: this interpreter's base Python, this environment's libraries (hard links
where the file system allows, so it takes a second) and a copy of this checkout's
``llmgw_cli`` with its templates, as a wheel would install them. It is made again for
every session, so the gateway on the nodes runs the code under test.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = Path("/var/cache/llmgw-tests")
# one per checkout and environment: two worktrees never share (or remove) each other's
VENV = HOME / ("venv-" + hashlib.sha256(f"{ROOT}\0{sys.prefix}".encode()).hexdigest()[:12])
LLMGW = str(VENV / "bin/llmgw")
# What this environment holds of llmgw itself (an editable install points at the
# checkout): left out, the copy of the checkout stands in for it.
_OWN = ("llmgw_cli", "llmgw-", "_editable_impl_llmgw", "__editable__")
ENTRY = "#!{python}\nimport sys\nfrom llmgw_cli.cli.main import main\nsys.exit(main())\n"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links refused: a copy
        shutil.copy2(src, dst)


def build() -> str:
    """Make ``VENV`` afresh; returns its llmgw (``LLMGW``)."""
    HOME.mkdir(parents=True, exist_ok=True)
    HOME.chmod(0o755)
    shutil.rmtree(VENV, ignore_errors=True)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(VENV)
    VENV.chmod(0o755)
    ours = Path(sysconfig.get_paths()["purelib"])
    (target,) = (VENV / "lib").glob("python*/site-packages")
    for entry in ours.iterdir():
        if entry.name.startswith(_OWN) or entry.name == "__pycache__":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(target / entry.name))
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "llmgw_cli", target / "llmgw_cli", ignore=skip)
    shutil.copytree(ROOT / "templates", target / "llmgw_cli/templates", ignore=skip)
    llmgw = VENV / "bin/llmgw"
    llmgw.write_text(ENTRY.format(python=VENV / "bin/python"))
    llmgw.chmod(0o755)
    return str(llmgw)
