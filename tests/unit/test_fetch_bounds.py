"""What a fetch job may reach as root on a node: the node helper's URL, address and secret
checks against the bounds ``apply`` writes into ``/etc/llmgw/node-helper.json``, and the
node program's own refusals of a server without an address or a secret."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.hosts import node_access
from llmgw_cli.node import fetch_disk, fetch_serve
from llmgw_cli.node import helper as node_helper
from llmgw_cli.node.helper import Refused, check_job_bounds, check_url, literal_host_refused

ROOT = Path(__file__).resolve().parents[2]
SECRET = secrets.token_urlsafe(24)  # what llmgw gives its peer servers
MODEL_URL = "https://models.example.org/q/model.gguf"
CONFIG: dict[str, list[str]] = {
    "programs": [],
    "users": [],
    "weights": ["/data/models"],
    "paths": [],
    "origins": [MODEL_URL, "https://huggingface.co/"],
    "peers": ["10.1.0.12", "fd00::12"],
    "addresses": ["10.1.0.11"],
}


def spec_with(*models: dict[str, Any]) -> ClusterSpec:
    """The lab's cluster file (one fabric of four nodes) with these models instead."""
    data = yaml.safe_load((ROOT / "inventories/lab.yaml").read_text())
    data["models"] = list(models)
    return parse_cluster(yaml.safe_dump(data))


URL_MODEL = {"name": "file", "source": MODEL_URL, "profile": "llama-cpp", "scaling": {"min": 0, "max": 1}}
REPO_MODEL = {"name": "repo", "source": "acme/tiny@main", "fetch": {}, "profile": "vllm"}


@pytest.mark.parametrize(
    "url",
    [
        MODEL_URL,
        "https://huggingface.co/org/name/resolve/0123456789abcdef0123456789abcdef01234567/a%20b.json",
        f"http://10.1.0.12:40123/{SECRET}/model.gguf",
        f"http://[fd00::12]:40123/{SECRET}/sub/dir/x.safetensors",
    ],
)
def test_the_clusters_origins_and_fabric_peers_are_fetched(url: str) -> None:
    assert check_url(url, CONFIG) == url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/shadow", "only http and https"),
        ("ftp://models.example.org/q/model.gguf", "only http and https"),
        ("gopher://10.1.0.12:70/", "only http and https"),
        ("http://127.0.0.1:22/", "loopback"),
        ("http://127.1:22/", "loopback"),
        ("http://2130706433/", "loopback"),
        ("http://0x7f.0.0.1/", "loopback"),
        ("http://[::1]:8080/", "loopback"),
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("http://localhost:9090/", "localhost"),
        ("http://0.0.0.0:22/", "unspecified"),
        ("http://169.254.169.254/latest/meta-data/iam/security-credentials/", "link-local"),
        ("http://[fe80::1]/", "link-local"),
        ("https://user:pw@models.example.org/q/model.gguf", "user name or password"),
        ("https://huggingface.co@127.0.0.1/x", "user name or password"),
        ("https://models.example.org/q/model.gguf.other", "neither an origin"),
        ("https://huggingface.co.example.net/x", "neither an origin"),
        ("https://evil.example/x", "neither an origin"),
        ("http://10.1.0.13:40123/" + SECRET + "/x", "neither an origin"),  # not of this fabric
        ("http://10.1.0.12:40123//model.gguf", "secret"),  # an empty secret
        ("http://10.1.0.12:40123/short/model.gguf", "secret"),
        (f"https://10.1.0.12:40123/{SECRET}/x", "http://<peer>"),
        (f"http://10.1.0.12/{SECRET}/x", "http://<peer>"),  # no port: not a peer server
        (f"http://10.1.0.12:40123/{SECRET}/x?y=1", "http://<peer>"),
        ("https://models.example.org/q/model.gguf\n", "printable"),
        ("", "printable"),
    ],
)
def test_other_urls_are_refused_with_why(url: str, why: str) -> None:
    with pytest.raises(Refused, match=why.replace("?", r"\?")):
        check_url(url, CONFIG)


def test_a_loopback_origin_in_the_config_is_refused_all_the_same() -> None:
    config = {**CONFIG, "origins": ["http://127.0.0.1:8000/"]}
    with pytest.raises(Refused, match="loopback"):
        check_url("http://127.0.0.1:8000/model.gguf", config)


def test_host_names_are_left_to_the_lists() -> None:
    assert literal_host_refused("models.example.org") is None
    assert literal_host_refused("10.1.0.12") is None
    assert literal_host_refused("deadbeef") is None  # hex letters alone: a name, not a number


def test_snapshot_jobs_are_checked_file_by_file() -> None:
    good = {"url": f"http://10.1.0.12:40123/{SECRET}/config.json"}
    job = {"mode": "snapshot", "files": [good, {"url": "http://169.254.169.254/"}]}
    with pytest.raises(Refused, match="link-local"):
        check_job_bounds(job, CONFIG)
    check_job_bounds({"mode": "snapshot", "files": [good]}, CONFIG)
    with pytest.raises(Refused):
        check_job_bounds({"mode": "snapshot", "files": [{"path": "x"}]}, CONFIG)


@pytest.mark.parametrize("mode", ["serve", "serve-snapshot"])
@pytest.mark.parametrize(
    ("bind", "secret", "why"),
    [
        (None, SECRET, "own address"),
        ("0.0.0.0", SECRET, "own address"),
        ("::", SECRET, "own address"),
        ("10.1.0.12", SECRET, "own address"),  # a peer's address is not this node's
        ("10.1.0.11", "", "secret"),
        ("10.1.0.11", None, "secret"),
        ("10.1.0.11", "s3cr3t", "secret"),
        ("10.1.0.11", "a" * 31, "secret"),
        ("10.1.0.11", SECRET[:-1] + "/", "secret"),
    ],
)
def test_servers_listen_on_the_nodes_address_with_a_long_secret(
    mode: str, bind: str | None, secret: str | None, why: str
) -> None:
    with pytest.raises(Refused, match=why):
        check_job_bounds({"mode": mode, "bind": bind, "secret": secret}, CONFIG)
    check_job_bounds({"mode": mode, "bind": "10.1.0.11", "secret": SECRET}, CONFIG)


def test_the_helper_refuses_a_job_before_the_fetcher_runs() -> None:
    job = {"mode": "fetch", "target": "/data/models/shadow", "url": "file:///etc/shadow"}
    with pytest.raises(Refused, match="only http and https"):
        node_helper._fetch(job, CONFIG)  # it would open the installed fetcher next


def test_a_config_written_before_the_bounds_allows_no_fetch() -> None:
    config = node_helper.config_from({"weights": ["/data/models"]}, "old")
    assert config["origins"] == config["peers"] == config["addresses"] == []
    with pytest.raises(Refused, match="neither an origin"):
        check_url(MODEL_URL, config)


@pytest.mark.parametrize("value", [None, "", "0.0.0.0", "::", "0:0::0", "a b", "10.0.0.1;x"])
def test_the_node_program_refuses_every_interface(value: object) -> None:
    with pytest.raises(fetch_disk.JobFailed, match="bind"):
        fetch_serve.check_bind(value)
    assert fetch_serve.check_bind("10.1.0.11") == "10.1.0.11"
    assert fetch_serve.check_bind("node01.fabric") == "node01.fabric"


@pytest.mark.parametrize("value", [None, "", "short", "x" * 31, "x" * 257, SECRET + "/", SECRET + "%"])
def test_the_node_program_refuses_a_short_secret(value: object) -> None:
    with pytest.raises(fetch_disk.JobFailed, match="secret"):
        fetch_serve.check_secret(value)
    assert fetch_serve.check_secret(SECRET) == SECRET


def test_node_program_and_helper_agree_on_secrets() -> None:
    assert node_helper.SECRET.pattern == fetch_serve.SECRET.pattern


def test_apply_writes_the_clusters_origins_and_the_nodes_fabric() -> None:
    spec = spec_with(URL_MODEL, REPO_MODEL)
    node = spec.node("node01")
    config = json.loads(node_access.helper_config(spec, node, "https://hub.example:8443"))
    assert config["origins"] == ["https://hub.example:8443/", MODEL_URL]
    assert config["peers"] == ["10.213.0.12", "10.213.0.13", "10.213.0.14"]  # not itself
    assert config["addresses"] == ["10.213.0.11"]
    assert node_helper.config_from(config, "apply's")["origins"] == config["origins"]


def test_the_hub_is_an_origin_only_when_a_repository_is_fetched() -> None:
    assert node_access.fetch_origins(spec_with(REPO_MODEL), None) == ["https://huggingface.co/"]
    assert node_access.fetch_origins(spec_with(URL_MODEL), None) == [MODEL_URL]
    assert node_access.fetch_origins(spec_with({**REPO_MODEL, "fetch": "engine"}), None) == []
    assert node_access.fetch_origins(spec_with(REPO_MODEL), "http://mirror.example") == []  # not one
