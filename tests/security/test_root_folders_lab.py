"""A folder root writes in on a node, handed to another account, as an attacker (or a
careless hand) would leave it: the engines' account (`llmgw`, uid 4242) owning
/etc/llmgw, or /etc/llmgw/env open to everyone. That account could then swap the unit
environment and secrets root writes there, or plant a link root writes through. `llmgw
doctor` must name the node's folder, what is wrong and the fix; once restored, the
finding is gone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llmgw_cli.lab.nodefs import LAB_UID
from tests.integration.conftest import Lab
from tests.integration.test_doctor_lab import clean, doctor

pytestmark = pytest.mark.integration

__all__ = ["clean"]  # test_doctor_lab's fixture: a lab with no fault and no llmgw unit

NODE = "node03"
FOLDERS = ("/etc/llmgw", "/etc/llmgw/env")


@pytest.fixture
def folders(clean: Lab) -> Iterator[Lab]:
    """Both folders there, root's and 0755; afterwards as they were (those made, removed)."""
    made = clean.ssh(
        NODE, "for d in " + " ".join(FOLDERS) + "; do [ -d $d ] || { mkdir -m 755 $d && echo $d; }; done"
    )
    assert made.returncode == 0, made.stderr
    before = clean.ssh(NODE, "stat -c '%n %u:%g %a' " + " ".join(FOLDERS))
    assert before.returncode == 0, before.stderr
    try:
        yield clean
    finally:
        restore = [
            f"chown {owner} {path} && chmod {mode} {path}"
            for path, owner, mode in map(str.split, before.stdout.splitlines())
        ]
        restore += [f"rmdir {path}" for path in reversed(made.stdout.split())]
        done = clean.ssh(NODE, " && ".join(restore))
        assert done.returncode == 0, done.stderr


def about(findings: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    return [
        f
        for f in findings
        if f["node"] == NODE and f["check"] == "node.root-folder" and f["message"].startswith(f"{path} is ")
    ]


@pytest.mark.parametrize(
    ("attack", "path", "wrong"),
    [
        (f"chown {LAB_UID} /etc/llmgw", "/etc/llmgw", f"owned by llmgw (uid {LAB_UID})"),
        ("chmod 777 /etc/llmgw/env", "/etc/llmgw/env", "mode 777, writable by group and others"),
    ],
)
def test_a_folder_root_writes_in_handed_to_another_account_is_reported_with_the_fix(
    folders: Lab, attack: str, path: str, wrong: str
) -> None:
    assert about(doctor(folders.cluster_file, "--nodes", NODE)[1], path) == []
    done = folders.ssh(NODE, attack)
    assert done.returncode == 0, done.stderr
    code, findings = doctor(folders.cluster_file, "--nodes", NODE)
    assert code == 1, findings
    [finding] = about(findings, path)
    assert finding["severity"] == "error"
    assert wrong in finding["message"] and "swap" in finding["message"]
    assert finding["fix"] == f"`chown root:root {path} && chmod go-w {path}` on {NODE}"
    fixed = folders.ssh(NODE, f"chown root:root {path} && chmod go-w {path}")
    assert fixed.returncode == 0, fixed.stderr
    assert about(doctor(folders.cluster_file, "--nodes", NODE)[1], path) == []
