"""What `apply` installs on every node so that the gateway needs no root key (pure).

On each node, as root over the operator's own transport:

- ``/usr/local/libexec/llmgw/node-helper`` (root, 0755): the only program the gateway's
  key may run there (``node/helper.py``), with the probe script rendered for the
  node beside it (``probe.sh``) and the weights fetcher (``nodefetch.py``, the
  ``node/fetch_*.py`` modules joined);
- ``/etc/llmgw/node-helper.json`` (root, 0644): what the helper lets the gateway start,
  look at and fetch: the cluster's engine programs and engine accounts, the node's weights
  folders, the path sources of the cluster's models as the node sees them, the origins
  weights come from (``fetch_origins``), the node's fabric peers (``fabric_peers``) and
  its own address, the only one its peer servers listen on;
- the account ``llmgw-gateway`` (system, no password) whose ``authorized_keys`` (root,
  0644, in a root-owned home) holds one line per gateway host (``gateway.hosts``): that
  host's public key, restricted to the helper;
- ``/etc/sudoers.d/llmgw-gateway`` (0440, checked with ``visudo -cf``): that account
  may run the helper, and nothing else, as root.

Each gateway host makes its own key pair (``remote/gateway_install.py``); only the
public halves are ever read back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node, SourceKind
from llmgw_cli.core.engine.engines import ray_program
from llmgw_cli.core.hosts.gateway_install import GATEWAY_ACCOUNT
from llmgw_cli.core.hosts.paths import DEFAULT_WEIGHTS
from llmgw_cli.core.observe.facts import NodeAccess
from llmgw_cli.core.weights.path_sources import node_paths
from llmgw_cli.core.weights.snapshot import DEFAULT_ENDPOINT, check_endpoint

GATEWAY_USER = GATEWAY_ACCOUNT
GATEWAY_HOME = "/var/lib/llmgw-gateway"
AUTHORIZED_KEYS = f"{GATEWAY_HOME}/.ssh/authorized_keys"
LIBEXEC = "/usr/local/libexec/llmgw"
HELPER = f"{LIBEXEC}/node-helper"
PROBE = f"{LIBEXEC}/probe.sh"
NODEFETCH = f"{LIBEXEC}/nodefetch.py"
HELPER_CONFIG = "/etc/llmgw/node-helper.json"
SUDOERS = "/etc/sudoers.d/llmgw-gateway"
SHEBANG = "#!/usr/bin/python3 -I\n"  # -I: no PYTHON* variables, no user site, as root


@dataclass(frozen=True)
class NodeFile:
    path: str
    text: str
    mode: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def engine_users(spec: ClusterSpec) -> list[str]:
    """Every account an engine of this cluster runs as."""
    return sorted({p.user for p in spec.profiles.values()})


def engine_programs(spec: ClusterSpec) -> list[str]:
    """Every program a replica unit of this cluster starts (ExecStart, ExecStartPre)."""
    programs = set()
    for profile in spec.profiles.values():
        programs.add(profile.argv0[0])
        programs.add(ray_program(profile))
    return sorted(programs)


def fetch_origins(spec: ClusterSpec, hub: str | None = None) -> list[str]:
    """Where a node may download weights from as root: every URL source of the cluster's
    models exactly, and everything under the Hub endpoint (``hub``, else huggingface.co)
    when a repository is fetched by llmgw. A prefix ends in ``/``, so that the endpoint's
    host cannot be extended into another one's (``huggingface.co.example``)."""
    origins = {m.source for m in spec.models if m.source_kind is SourceKind.url}
    if any(m.selection is not None for m in spec.models):
        # an endpoint that is not one lets nothing be fetched: the Hub's listing says why
        with contextlib.suppress(ValueError):
            origins.add(check_endpoint(hub or DEFAULT_ENDPOINT) + "/")
    return sorted(origins)


def fabric_peers(spec: ClusterSpec, node: Node) -> list[str]:
    """The addresses ``node`` may copy weights from: those of the other nodes of its
    fabric (nodes without one form one group), as their peer servers' URLs name them."""
    return sorted({n.engine_host for n in spec.nodes if n.fabric == node.fabric and n.name != node.name})


def helper_config(spec: ClusterSpec, node: Node, hub: str | None = None) -> str:
    """``/etc/llmgw/node-helper.json`` for ``node``; ``hub``: the Hub endpoint in use
    (``HF_ENDPOINT``), which a repository's files are downloaded from."""
    weights = [w.path.rstrip("/") or "/" for w in node.weights] or [DEFAULT_WEIGHTS]
    doc = {
        "programs": engine_programs(spec),
        "users": engine_users(spec),
        "weights": weights,
        "paths": node_paths(spec, node),
        "origins": fetch_origins(spec, hub),
        "peers": fabric_peers(spec, node),
        "addresses": [node.engine_host],
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def authorized_key_line(public_key: str) -> str:
    """The gateway's key, able to run the helper only: no shell, no forwarding, no pty."""
    key = " ".join(public_key.split()[:2])  # type and base64: a comment is not needed
    return f'restrict,command="{HELPER}" {key}\n'


def authorized_keys_text(public_keys: Sequence[str]) -> str:
    """Every gateway host's key line, in the order given (``gateway.all_hosts``), each key
    once: the same text on every node, so its digest says whether a node is up to date."""
    lines = dict.fromkeys(authorized_key_line(k) for k in public_keys)
    return "".join(lines)


def sudoers_rule() -> str:
    # A command without arguments in sudoers allows any arguments: the helper checks them.
    return f"{GATEWAY_USER} ALL=(root) NOPASSWD: {HELPER}\n"


def node_files(
    spec: ClusterSpec,
    node: Node,
    *,
    helper_source: str,
    nodefetch_source: str,
    probe_source: str,
    public_keys: Sequence[str],
    hub: str | None = None,
) -> tuple[NodeFile, ...]:
    """Every file ``apply`` keeps on ``node`` for the helper (the sudoers rule apart: it is
    checked with ``visudo`` before it takes effect). ``probe_source``: the node's probe
    script (``core/observe/parse/probe.py``, which reads these files' digests back);
    ``public_keys``: every gateway host's key (none yet: an empty ``authorized_keys``);
    ``hub``: the Hub endpoint in use (``helper_config``)."""
    files = [
        NodeFile(HELPER, SHEBANG + helper_source, 0o755),
        NodeFile(PROBE, probe_source, 0o644),
        NodeFile(NODEFETCH, nodefetch_source, 0o644),
        NodeFile(HELPER_CONFIG, helper_config(spec, node, hub), 0o644),
        NodeFile(AUTHORIZED_KEYS, authorized_keys_text(public_keys), 0o644),
    ]
    return tuple(files)


MANAGED_PATHS = (HELPER, PROBE, NODEFETCH, HELPER_CONFIG, AUTHORIZED_KEYS, SUDOERS)
"""Every file of ``node_files`` and the sudoers rule: what the probe reads digests of."""


def managed_accounts(spec: ClusterSpec) -> list[str]:
    """The accounts ``apply`` makes on every node: the gateway's, then the engines'."""
    return [GATEWAY_USER, *engine_users(spec)]


def helper_stale(files: tuple[NodeFile, ...], found: NodeAccess) -> bool:
    """Whether the node lacks an account or holds other files than ``files`` (from
    ``node_files``) and the sudoers rule: ``apply`` would install the helper again."""
    want = {f.path: f.digest for f in (*files, NodeFile(SUDOERS, sudoers_rule(), 0o440))}
    return bool(found.missing_accounts) or found.digests != want


def valid_public_key(text: str) -> bool:
    """One OpenSSH public key line: ``TYPE BASE64 [comment]``, nothing that could add an
    option or a second line to ``authorized_keys``."""
    words = text.strip().split()
    return (
        "\n" not in text.strip()
        and len(words) >= 2
        and words[0] in ("ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa")
        and all(c.isalnum() or c in "+/=" for c in words[1])
    )
