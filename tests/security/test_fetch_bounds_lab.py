"""The weights fetcher attacked through the gateway's own key, on lab nodes (real sshd,
sudo, systemd): a gateway account under an attacker's control sends the node helper's
``fetch`` verb jobs that would make root download this node's secrets, its loopback
services or the cloud's metadata address into a weights folder, or start a peer server
on every interface or without a secret. Each job must be refused by the helper before
anything runs as root, nothing may be written, and a peer server the helper does start
listens on the node's own address only."""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from llmgw_cli.core.hosts.node_access import AUTHORIZED_KEYS, authorized_key_line
from tests.integration.conftest import Lab
from tests.integration.lab_helpers import reset, run
from tests.security.test_least_privilege import Installed

pytestmark = pytest.mark.integration

NODE = "node01"
PEER = "node02"
WEIGHTS = "/data/models"
REPO = "lab/bounds"
FOLDER = f"{WEIGHTS}/hf/lab--bounds"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SECRET = secrets.token_urlsafe(24)
CLEAN = f"rm -rf {FOLDER} {WEIGHTS}/stolen* {WEIGHTS}/.stolen*"


def address(lab: Lab, name: str) -> str:
    return next(n.ip for n in lab.nodes if n.name == name)


def snapshot_job(url: str, **more: object) -> dict[str, object]:
    file = {"path": "config.json", "size": 10, "git_sha1": "0" * 40, "url": url}
    return {"mode": "snapshot", "folder": FOLDER, "repo": REPO, "commit": COMMIT, "files": [file], **more}


def serve_job(bind: str | None, secret: str) -> dict[str, object]:
    job = {"mode": "serve-snapshot", "folder": FOLDER, "repo": REPO, "commit": COMMIT, "secret": secret}
    return {**job, "idle": 30} if bind is None else {**job, "idle": 30, "bind": bind}


@pytest.fixture(scope="module")
def installed(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """The node helper as ``apply`` installs it, and a key that reaches it on NODE as a
    gateway host's key does: the ``authorized_keys`` line apply writes for one (no gateway
    is started: what it does with its key is the attacker's choice here)."""
    folder = tmp_path_factory.mktemp("fetch-bounds")
    data = yaml.safe_load(lab.cluster_file.read_text())
    for model in data["models"]:
        model["scaling"] = {**model.get("scaling", {}), "min": 0}
    data["gateway"] = {**data["gateway"], "install": False}
    cluster = folder / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(data, sort_keys=False))
    reset(lab)
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    key = folder / "gateway-key"
    made = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=False)
    assert made.returncode == 0
    line = shlex.quote(authorized_key_line(Path(f"{key}.pub").read_text()))
    assert lab.ssh(NODE, f"printf %s {line} >> {AUTHORIZED_KEYS}").returncode == 0
    try:
        yield Installed(cluster, key, lab.known_hosts, {n.name: n.ip for n in lab.nodes})
    finally:
        lab.ssh(NODE, f": > {AUTHORIZED_KEYS}")
        reset(lab)


@pytest.fixture
def clean(lab: Lab, installed: Installed) -> Iterator[None]:
    lab.ssh(NODE, CLEAN)
    yield
    lab.ssh(NODE, CLEAN)


def hostile_jobs(lab: Lab) -> dict[str, dict[str, object]]:
    peer = address(lab, PEER)
    target = f"{WEIGHTS}/stolen.bin"
    return {
        "a root-only file": {"mode": "fetch", "url": "file:///etc/shadow", "target": target},
        "sshd on loopback": {"mode": "fetch", "url": "http://127.0.0.1:22/", "target": target},
        "the metadata address": {
            "mode": "fetch",
            "url": "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
            "target": target,
        },
        "loopback spelled as a number": {"mode": "fetch", "url": "http://2130706433:22/", "target": target},
        "a snapshot from loopback": snapshot_job("http://127.0.0.1:22/config.json", peer=True),
        "a peer URL without a secret": snapshot_job(f"http://{peer}:40000//config.json", peer=True),
        "an origin the cluster does not name": {
            "mode": "fetch",
            "url": "https://weights.example.com/model.gguf",
            "target": target,
        },
        "a server without a secret": serve_job(address(lab, NODE), ""),
        "a server with a short secret": serve_job(address(lab, NODE), "s3cr3t"),
        "a server on every interface": serve_job("0.0.0.0", SECRET),
        "a server without an address": serve_job(None, SECRET),
    }


def listening(lab: Lab) -> set[str]:
    """The node's listening TCP sockets, as ``address:port``."""
    done = lab.ssh(NODE, "ss -Hltn")
    assert done.returncode == 0, done.stderr
    return {line.split()[3] for line in done.stdout.splitlines() if line.strip()}


def test_the_gateways_key_cannot_aim_root_at_secrets_or_every_interface(
    lab: Lab, installed: Installed, clean: None
) -> None:
    lab.ssh(NODE, f"mkdir -p {FOLDER}")
    before = listening(lab)
    for what, job in hostile_jobs(lab).items():
        done = installed.as_key("llmgw-gateway", NODE, "fetch", stdin=json.dumps(job))
        assert done.returncode != 0 and "node-helper: refused" in done.stderr, (
            what,
            done.stdout,
            done.stderr,
        )
    written = lab.ssh(NODE, f"find {WEIGHTS} -maxdepth 1 -name '*stolen*'; find {FOLDER} -mindepth 1")
    assert written.stdout.split() == [], written.stdout
    assert listening(lab) <= before, "a refused job started a server"


def test_a_peer_server_listens_on_the_nodes_own_address_only(
    lab: Lab, installed: Installed, clean: None
) -> None:
    lab.ssh(NODE, f"mkdir -p {FOLDER}")
    own = address(lab, NODE)
    done = installed.as_key("llmgw-gateway", NODE, "fetch", stdin=json.dumps(serve_job(own, SECRET)))
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["state"] == "serving", answer
    try:
        port = answer["port"]
        mine = sorted(a for a in listening(lab) if a.rsplit(":", 1)[1] == str(port))
        assert mine == [f"{own}:{port}"], mine  # not 0.0.0.0, not [::] or *
    finally:
        lab.ssh(NODE, f"kill {int(answer['pid'])}")
