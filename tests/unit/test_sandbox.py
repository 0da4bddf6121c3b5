"""What a unit's sandbox hides from its service, and the gateway's refusal of an llmgw it
could not run."""

from __future__ import annotations

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.hosts.gateway_install import installed_gateway_unit
from llmgw_cli.core.hosts.gateway_sight import read_sight, sight_problems, sight_refusal
from llmgw_cli.core.hosts.sandbox import Sandbox, hidden_by, read_sandbox

SPEC = parse_cluster("cluster: {name: c}\ngateway: {host: localhost}\n")


def gateway(llmgw_bin: str = "/opt/llmgw/bin/llmgw") -> str:
    return installed_gateway_unit(SPEC, llmgw_bin=llmgw_bin)


@pytest.mark.parametrize(
    ("path", "directive"),
    [
        ("/var/tmp/clone/.venv/bin/llmgw", "PrivateTmp=yes"),
        ("/tmp/x/bin/llmgw", "PrivateTmp=yes"),
        ("/var/tmp", "PrivateTmp=yes"),
        ("/var/tmp/../tmp/x", "PrivateTmp=yes"),  # as the kernel resolves it
        ("/opt/llmgw/bin/llmgw", None),
        ("/usr/bin/python3.11", None),
        ("/var/tmpfoo/llmgw", None),  # a name that starts alike is another folder
        ("/home/ann/venv/bin/llmgw", None),  # ProtectHome=read-only: read-only, not hidden
        ("/root/.pyenv/versions/3.11.7/bin/python3.11", None),
    ],
)
def test_the_installed_gateway_unit_hides_tmp_but_not_home(path: str, directive: str | None) -> None:
    """The unit apply installs, read back: its private /tmp and /var/tmp hide what is
    there; ProtectSystem=strict and ProtectHome=read-only hide nothing."""
    assert hidden_by(read_sandbox(gateway()), path) == directive


def test_a_gateway_under_tmp_gets_the_hosts_tmp() -> None:
    """The unit of an llmgw under /tmp keeps the host's /tmp (it would be hidden
    otherwise), so that path is seen; /var/tmp stays private."""
    unit = read_sandbox(gateway("/tmp/llmgw/bin/llmgw"))
    assert hidden_by(unit, "/tmp/llmgw/bin/llmgw") is None
    assert hidden_by(unit, "/var/tmp/x") is None  # no PrivateTmp at all


UNIT = """[Unit]
Description=x
PrivateTmp=yes
[Service]
ExecStart=/x
ProtectHome=tmpfs
InaccessiblePaths=-/srv/secret /data
InaccessiblePaths=+/mnt
TemporaryFileSystem=/var/lib/other:ro
"""


def test_directives_are_read_from_the_service_section_only() -> None:
    sandbox = read_sandbox(UNIT)
    assert sandbox == Sandbox(
        private_tmp="no",  # PrivateTmp= in [Unit] is no sandbox
        protect_home="tmpfs",
        inaccessible=("/srv/secret", "/data", "/mnt"),
        temporary=("/var/lib/other",),
    )
    assert hidden_by(sandbox, "/tmp/a") is None
    assert hidden_by(sandbox, "/root/.pyenv/bin/python") == "ProtectHome=tmpfs"
    assert hidden_by(sandbox, "/run/user/0/x") == "ProtectHome=tmpfs"
    assert hidden_by(sandbox, "/srv/secret/venv") == "InaccessiblePaths=/srv/secret"
    assert hidden_by(sandbox, "/mnt") == "InaccessiblePaths=/mnt"
    assert hidden_by(sandbox, "/var/lib/other/llmgw") == "TemporaryFileSystem=/var/lib/other"
    assert hidden_by(sandbox, "/srv/open") is None


def test_the_last_assignment_wins_and_an_empty_list_resets() -> None:
    text = "[Service]\nPrivateTmp=yes\nPrivateTmp=no\nProtectHome=yes\nInaccessiblePaths=/a\nInaccessiblePaths=\n"
    sandbox = read_sandbox(text)
    assert hidden_by(sandbox, "/var/tmp/x") is None
    assert hidden_by(sandbox, "/a/b") is None
    assert hidden_by(sandbox, "/home/x") == "ProtectHome=yes"


FOUND = (
    "executable\t/var/tmp/c/.venv/bin/llmgw\n"
    "interpreter\t/var/tmp/c/.venv/bin/python\n"
    "interpreter\t/usr/bin/python3.11\n"
    "stand-in\tllmgw-gateway\n"
    "account\tnobody\n"
    "denied\timport llmgw with /var/tmp/c/.venv/bin/python: PermissionError: [Errno 13]\n"
    "noise without a tab\n"
)


def test_each_hidden_path_and_each_denial_is_a_problem() -> None:
    sight = read_sight(FOUND)
    assert sight.account == "nobody"
    assert sight.stand_in == "llmgw-gateway"
    problems = sight_problems(gateway(), sight)
    assert problems == [
        "the executable /var/tmp/c/.venv/bin/llmgw is hidden from the service by its unit's PrivateTmp=yes",
        "its interpreter /var/tmp/c/.venv/bin/python is hidden from the service by its unit's PrivateTmp=yes",
        "an unprivileged account (llmgw-gateway does not exist yet; nobody stood in) cannot "
        "import llmgw with /var/tmp/c/.venv/bin/python: PermissionError: [Errno 13]",
    ]
    message = sight_refusal("node01", "/var/tmp/c/.venv/bin/llmgw", problems, "0.1.0")
    assert "Nothing was changed" in message
    assert "/opt/llmgw/bin/pip install llmgw==0.1.0" in message
    assert "gateway.llmgw_bin: /opt/llmgw/bin/llmgw" in message


def test_a_package_and_libraries_the_service_sees_are_no_problem() -> None:
    found = (
        "executable\t/opt/llmgw/bin/llmgw\ninterpreter\t/opt/llmgw/bin/python\n"
        "interpreter\t/usr/bin/python3.11\naccount\tllmgw-gateway\n"
        "package\t/opt/llmgw/lib/python3.11/site-packages/llmgw_cli\n"
        "library\t/usr/lib/python3.11\nlibrary\t/opt/llmgw/lib/python3.11/site-packages\n"
    )
    assert sight_problems(gateway(), read_sight(found)) == []
    # the same, with a library left in a checkout under /var/tmp (an editable install)
    hidden = read_sight(found + "library\t/var/tmp/checkout\n")
    assert sight_problems(gateway(), hidden) == [
        "the Python library folder /var/tmp/checkout is hidden from the service by its unit's PrivateTmp=yes"
    ]
