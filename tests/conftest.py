"""Suite-wide rules.

Integration tests (``@pytest.mark.integration``) talk to real components: a fresh venv
install, systemd tools, the lab cluster. Off CI they may skip when something is missing;
with ``CI=true`` any skipped test fails the whole run unless ``tests/skips.py`` lists it
with its reason, so a green CI means every test ran.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants

from tests import pg
from tests.hub_standin import HubStandin
from tests.integration import visible_llmgw
from tests.integration.conftest import NODES, STATE, Lab, LabNode, lab_unavailable, llmgw
from tests.skips import ALLOWED, SkipRule


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipRule(ALLOWED), "llmgw-skip-rule")
    # A shell starts a background job with Ctrl-C ignored, and an ignored signal stays
    # ignored in every program started below it: the llmgw commands the tests interrupt
    # would never see it. A handler (unlike an ignore) is reset to the default by exec.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def promtool_check_metrics() -> Callable[[str], None]:
    """``promtool check metrics`` on an exposition text; a test asking for it skips up
    front where promtool is missing (off CI only: see tests/skips.py)."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus, scripts/obs-packages.txt)")

    def check(text: str) -> None:
        done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr

    return check


@pytest.fixture
def hub_standin() -> Iterator[HubStandin]:
    """A stand-in for the Hugging Face Hub on 127.0.0.1 (``tests/hub_standin.py``), with
    no repos yet: ``hub_standin.repo("org/name").push({...})`` adds them."""
    with HubStandin() as hub:
        yield hub


@pytest.fixture
def hf_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    """huggingface_hub in a home of its own: no cache, no saved token, no ``HF_TOKEN`` and
    not offline, whatever the machine has. Its settings are read when it is imported, so
    they are set on its ``constants`` as well as in the environment."""
    home = str(tmp_path_factory.mktemp("hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", home)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(constants, "HF_HOME", home)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", f"{home}/hub")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", f"{home}/token")
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", f"{home}/stored_tokens")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    return home


@pytest.fixture(scope="session")
def postgres() -> Iterator[pg.Postgres]:
    """A real PostgreSQL server for the session (``tests/pg.py``): ``url`` (no password,
    as a cluster file names it), ``password``, ``dsn`` (both), ``new_database()`` for a
    test of its own, ``stop()``. A test that needs other listen addresses (the lab's
    bridge) starts its own with ``pg.start(listen=..., allow=...)``."""
    reason = pg.unavailable()
    if reason:
        pytest.skip(reason)
    server = pg.start()
    try:
        yield server
    finally:
        server.stop()


LAB_TURN = Path("/run/llmgw-lab-session.lock")


@pytest.fixture(scope="session")
def lab_turn() -> Iterator[None]:
    """This test session's turn at the machine's one lab, held until the session ends.

    Only one lab fits on a machine, and a session begins by tearing down the lab it finds
    (a crashed run's): a second test session run beside the first (a developer's while CI
    runs) would tear down the lab under the first one's tests. It waits here instead,
    with a line that says so."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    with LAB_TURN.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"\nwaiting for {LAB_TURN}: another test session holds the lab", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def lab(lab_turn: None) -> Iterator[Lab]:
    """The session's lab cluster (``tests/integration/conftest.py`` says what it holds),
    shared by every module that asks for it: only one lab fits on a machine."""
    llmgw("lab", "down", "--state", str(STATE), check=False)  # a stale lab from a crashed run
    visible_llmgw.build()  # before the nodes boot: their root is an overlay on this machine's
    llmgw("lab", "up", "--nodes", str(NODES), "--state", str(STATE))
    try:
        record = json.loads((STATE / "lab.json").read_text())
        nodes = [LabNode(n["name"], n["index"], n["ip"], n["pid1"]) for n in record["nodes"]]
        yield Lab(
            state=STATE,
            nodes=nodes,
            key=STATE / "id_ed25519",
            known_hosts=STATE / "known_hosts",
            ssh_config=STATE / "ssh_config",
            cluster_file=STATE / "cluster.yaml",
        )
    finally:
        llmgw("lab", "down", "--state", str(STATE))


@pytest.fixture
def clean(lab: Lab) -> Iterator[Lab]:
    """The lab with no fault and no llmgw unit, before the test and after it. A module whose
    tests leave more behind defines its own ``clean`` around this rule."""
    from tests.integration.lab_helpers import reset  # noqa: PLC0415 (lab tests only)

    reset(lab)
    yield lab
    reset(lab)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that boot their own lab go first, before the session lab is up."""
    items.sort(key=lambda item: 0 if item.path.name == "test_lab_lifecycle.py" else 1)
