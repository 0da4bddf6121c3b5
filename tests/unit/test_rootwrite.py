"""rootwrite, root's one way to write on a node, attacked at every folder on the way.

Each case builds a tree of real folders under a root-owned temporary folder, hands one
component to another account (uid 4242, as the lab's engine account) or replaces it with
what such an account could plant there (a link, a FIFO, a hard link, a swapped folder),
then asks root to write below it. Nothing outside the intended folder may change: the
victim files are hashed before and after, and a write through a hostile component is
refused with the folder named.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.remote import rootwrite
from llmgw_cli.remote.transport import remove_command, write_command

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another account needs root")

OTHER = 4242  # a less trusted account
DEPTH = 3  # folders below the test's own: a/b/c


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A root-owned folder, 0755, every folder above it root's (pytest's own are)."""
    os.chmod(tmp_path, 0o755)
    return tmp_path


@pytest.fixture
def victims(base: Path) -> Iterator[dict[Path, str]]:
    """Root files an attacker would like root to clobber, with their hashes."""
    folder = base / "victims"
    folder.mkdir(mode=0o700)
    files = {folder / "shadow": "root:secret\n", folder / "engine.env": "LLMGW_ENGINE_KEY=aa\n"}
    for path, text in files.items():
        path.write_text(text)
        path.chmod(0o600)
    before = {p: digest(p) for p in files}
    yield before
    after = {p: digest(p) for p in files}
    assert after == before, "a victim file changed"
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == 0


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() + oct(path.stat().st_mode)


def tree(base: Path) -> list[Path]:
    folders = [base / "a", base / "a" / "b", base / "a" / "b" / "c"]
    for f in folders:
        f.mkdir(mode=0o755)
    return folders


def attack(kind: str, folder: Path, victims: dict[Path, str]) -> None:
    """What an account that owns ``folder``'s parent (or ``folder``) could do to it."""
    victim_dir = next(iter(victims)).parent
    if kind == "owned":
        os.chown(folder, OTHER, OTHER)
    elif kind == "group-writable":
        folder.chmod(0o775)
    elif kind == "world-writable":
        folder.chmod(0o777)
    elif kind in ("link", "fifo", "file", "hardlink", "swap"):
        keep = folder.with_name(folder.name + ".moved")
        folder.rename(keep)
        if kind == "link":
            folder.symlink_to(victim_dir)
        elif kind == "fifo":
            os.mkfifo(folder)
        elif kind == "file":
            folder.write_text("")
        elif kind == "hardlink":
            os.link(next(iter(victims)), folder)
        else:  # the same name, now a folder of the other account
            folder.mkdir()
            os.chown(folder, OTHER, OTHER)
    else:
        raise AssertionError(kind)


ATTACKS = ["owned", "group-writable", "world-writable", "link", "fifo", "file", "hardlink", "swap"]


@pytest.mark.parametrize("kind", ATTACKS)
@pytest.mark.parametrize("level", range(DEPTH))
def test_a_write_below_a_folder_another_account_can_change_is_refused(
    base: Path, victims: dict[Path, str], level: int, kind: str
) -> None:
    folders = tree(base)
    attack(kind, folders[level], victims)
    target = folders[-1] / "llmgw-m-0.service"
    with pytest.raises(rootwrite.Refused) as refused:
        rootwrite.write(str(target), b"1700000000.000\n", 0o644)
    assert str(folders[level]) in str(refused.value)
    assert not target.exists()


@pytest.mark.parametrize("kind", ["link", "hardlink", "fifo"])
def test_what_stands_at_the_target_name_is_replaced_never_written_through(
    base: Path, victims: dict[Path, str], kind: str
) -> None:
    # root's own folder: only root could have put it there, but even so the old name is
    # replaced by a rename, never opened
    folder = tree(base)[-1]
    target = folder / "engine-keys.json"
    victim = next(iter(victims))
    if kind == "link":
        target.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, target)
    else:
        os.mkfifo(target)
    rootwrite.write(str(target), b"{}\n", 0o640)
    assert not target.is_symlink() and target.read_bytes() == b"{}\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in folder.iterdir()) == ["engine-keys.json"]  # no temporary file left


def test_missing_folders_are_made_root_only_and_the_mode_and_group_are_exact(base: Path) -> None:
    os.umask(0o077)  # made 0755 whatever the caller's umask
    try:
        target = base / "new" / "deeper" / "key.yaml"
        rootwrite.write(str(target), b"api-key: x\n", 0o440, group=str(OTHER))
    finally:
        os.umask(0o022)
    for folder in (base / "new", base / "new" / "deeper"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755 and folder.stat().st_uid == 0
    assert (target.stat().st_uid, target.stat().st_gid, stat.S_IMODE(target.stat().st_mode)) == (
        0,
        OTHER,
        0o440,
    )


def test_a_sticky_root_folder_may_stand_above_but_not_be_written_in(base: Path) -> None:
    sticky = base / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    rootwrite.write(str(sticky / "mine" / "f"), b"x", 0o600)  # /tmp/mine made by root: fine
    with pytest.raises(rootwrite.Refused, match="writable by group or others"):
        rootwrite.write(str(sticky / "f"), b"x", 0o600)


def test_remove_takes_the_name_not_what_it_points_at(base: Path, victims: dict[Path, str]) -> None:
    folder = tree(base)[-1]
    (folder / "m").symlink_to(next(iter(victims)))
    rootwrite.remove(str(folder / "m"))
    rootwrite.remove(str(folder / "gone"))  # nothing there: nothing to do
    rootwrite.remove(str(base / "nowhere" / "m"))
    assert list(folder.iterdir()) == []
    attack("owned", folder, victims)
    (folder / "m").write_text("")
    with pytest.raises(rootwrite.Refused):
        rootwrite.remove(str(folder / "m"))


def test_the_commands_run_the_same_code_as_a_program(base: Path, victims: dict[Path, str]) -> None:
    """What the transports send: the program's text to ``python3 -I -c`` with the content
    on stdin; exit 3 and the reason for a refusal."""
    folders = tree(base)
    target = folders[-1] / "unit.service"
    done = subprocess.run(
        ["sh", "-c", write_command(str(target), 0o644)], input=b"[Unit]\n", capture_output=True
    )
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == b"[Unit]\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
    done = subprocess.run(["sh", "-c", remove_command(str(target))], capture_output=True)
    assert done.returncode == 0 and not target.exists()
    attack("link", folders[1], victims)
    done = subprocess.run(["sh", "-c", write_command(str(target), 0o644)], input=b"x", capture_output=True)
    assert done.returncode == rootwrite.REFUSED
    assert b"refused:" in done.stderr and str(folders[1]).encode() in done.stderr


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A root folder another account can reach (pytest's own are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="llmgw-rootwrite-", dir="/var/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_written_as_an_account_its_own_folder_is_trusted_and_nothing_else(
    open_base: Path, victims: dict[Path, str]
) -> None:
    """``as_user``: a state folder of the gateway's account is written as that account
    (runuser), so the write can reach only what the account itself could."""
    base = open_base
    nobody = pwd.getpwnam("nobody").pw_uid
    state = base / "state"
    state.mkdir(mode=0o700)
    os.chown(state, nobody, nobody)
    (state / "engine-keys.json").symlink_to(next(iter(victims)))  # planted by the account
    command = write_command(str(state / "engine-keys.json"), 0o600, as_user="nobody")
    done = subprocess.run(["sh", "-c", command], input=b"{}\n", capture_output=True)
    assert done.returncode == 0, done.stderr
    written = state / "engine-keys.json"
    assert not written.is_symlink() and written.stat().st_uid == nobody and written.read_bytes() == b"{}\n"
    # and a folder of root's is not that account's to write in
    done = subprocess.run(
        ["sh", "-c", write_command(str(base / "f"), 0o600, as_user="nobody")], input=b"x", capture_output=True
    )
    assert done.returncode != 0 and not (base / "f").exists()
