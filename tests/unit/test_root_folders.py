"""The folders root writes in on a node, and the rule each keeps (pure)."""

from __future__ import annotations

from llmgw_cli.core.hosts.root_folders import ROOT_FOLDERS, Owned, ancestors, fix, problem
from llmgw_cli.core.planning.drain import DRAIN_DIR


def test_the_list_holds_every_folder_root_writes_in() -> None:
    for folder in ("/etc/llmgw", "/etc/llmgw/env", "/usr/local/libexec/llmgw", "/etc/systemd/system"):
        assert folder in ROOT_FOLDERS
    assert "/etc/sudoers.d" in ROOT_FOLDERS
    assert DRAIN_DIR in ROOT_FOLDERS
    assert "/var/lib/llmgw-gateway/.ssh" in ROOT_FOLDERS


def test_ancestors_run_up_to_the_root() -> None:
    assert ancestors("/etc/llmgw/env") == ["/etc/llmgw/env", "/etc/llmgw", "/etc", "/"]
    assert ancestors("/") == ["/"]
    assert ancestors("/a//b/") == ["/a/b", "/a", "/"]


def test_root_owned_and_not_writable_by_group_or_others_is_fine() -> None:
    for mode in (0o755, 0o700, 0o750, 0o555, 0o4755):
        assert problem(Owned(path="/etc/llmgw", uid=0, owner="root", mode=mode)) is None


def test_another_owner_or_a_group_or_others_write_bit_is_named() -> None:
    engine = Owned(path="/etc/llmgw", uid=4242, owner="llmgw", mode=0o755)
    assert problem(engine) == "owned by llmgw (uid 4242)"
    assert problem(Owned(path="/etc/llmgw/env", uid=0, owner="root", mode=0o777)) == (
        "mode 777, writable by group and others"
    )
    assert problem(Owned(path="/x", uid=0, owner="root", mode=0o775)) == "mode 775, writable by group"
    assert problem(Owned(path="/x", uid=0, owner="root", mode=0o1757)) == "mode 1757, writable by others"
    both = Owned(path="/x", uid=7, owner="UNKNOWN", mode=0o757)
    assert problem(both) == "owned by UNKNOWN (uid 7), mode 757, writable by others"


def test_a_link_is_judged_by_its_owner_only() -> None:
    assert problem(Owned(path="/usr/local", uid=0, owner="root", mode=0o777, link=True)) is None
    link = Owned(path="/usr/local", uid=4242, owner="llmgw", mode=0o777, link=True)
    assert problem(link) == "owned by llmgw (uid 4242)"
    assert fix(link) == "chown -h root:root /usr/local"


def test_the_fix_quotes_a_name_from_the_node() -> None:
    assert fix(Owned(path="/etc/llmgw", uid=1, owner="x", mode=0o755)) == (
        "chown root:root /etc/llmgw && chmod go-w /etc/llmgw"
    )
    assert fix(Owned(path="/a b;rm", uid=1, owner="x", mode=0o755)) == (
        "chown root:root '/a b;rm' && chmod go-w '/a b;rm'"
    )
