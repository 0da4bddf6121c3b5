"""Who may reach an engine, and how its secrets reach it (pure: spec in, text out).

Three things keep an engine answering only the gateway:

- it listens on the node's engine address (``nodes[].engine_address``, else ``address``),
  never on every interface;
- its unit carries a firewall for its own cgroup (systemd ``IPAddressDeny=any`` plus
  ``IPAddressAllow=``: localhost, its own node, its peer nodes, every gateway host's addresses),
  so paths an engine serves without its key (vLLM checks the key only under ``/v1``:
  ``/invocations``, ``/pooling``, ``/score``, ``/tokenize`` answer anyone) and the
  control ports of multi-node replicas are closed to everyone else;
- its key comes from a root-only file that systemd reads before it drops privileges,
  through the environment (or a credential file), never the command line, so ``ps``,
  ``/proc/PID/cmdline`` and the engine's own echo of its arguments never show it.

Keys are per node: each node's ``/etc/llmgw/engine.env`` holds that node's key; the
gateway holds the map node -> key.
"""

from __future__ import annotations

import ipaddress
import re

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Engine, Model, Node
from llmgw_cli.core.hosts.paths import ENGINE_ENV_FILE, ENGINE_KEY_VAR

__all__ = ["ENGINE_ENV_FILE", "ENGINE_KEY_VAR"]  # re-exported: where callers have always found them

SECRET_ENV_DIR = "/etc/llmgw/env"

# The variable each engine reads its key from, when no --api-key is given:
# - vLLM: ``args.api_key or envs.VLLM_API_KEY`` in its OpenAI server;
# - llama-server: ``--api-key`` has the env twin ``LLAMA_API_KEY`` (common/arg.cpp,
#   ``set_env("LLAMA_API_KEY")``), a comma-separated list of keys.
# SGLang has no such variable (``api_key`` is a plain ServerArgs field); it takes
# ``--config FILE.yaml`` instead, whose keys are merged into its arguments inside the
# process (``ConfigArgumentMerger``), so the key is in no process's argv. That file is
# one per engine account, readable by root and that account only (0440, root:account):
# SGLang opens it after systemd dropped privileges. The account holds its node's key in
# its own process anyway; no other account can read it. (systemd's LoadCredential= would
# keep it root-only on disk, but in the lab's nodes the engine got "Permission denied" on
# its credential, and a root ExecStartPre=+ copy is refused by the node helper.)
KEY_VARS = ("VLLM_API_KEY", "LLAMA_API_KEY")

# Environment names whose values are secrets whatever the cluster file says.
ALWAYS_SECRET = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def engine_env_text(key: str) -> str:
    """The node's key file: the key under every name an engine reads it from."""
    lines = [f"{ENGINE_KEY_VAR}={key}", *(f"{var}={key}" for var in KEY_VARS)]
    return (
        "# llmgw: this node's engine key (root only; `llmgw apply --rotate-engine-key`)\n"
        + "\n".join(lines)
        + "\n"
    )


def sglang_key_text(key: str) -> str:
    """SGLang's ``--config`` file holding only the key (quoted: a hex key may read as a number)."""
    return f'api-key: "{key}"\n'


# --- secrets in the environment -------------------------------------------------------


def secret_names(spec: ClusterSpec, model: Model) -> set[str]:
    profile = spec.profiles[model.profile]
    return {*ALWAYS_SECRET, *profile.secret_env, *model.secret_env}


def split_env(spec: ClusterSpec, model: Model, env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret): the secret part goes to a root-only file, never into the unit."""
    secret = secret_names(spec, model)
    plain = {k: v for k, v in env.items() if k not in secret}
    return plain, {k: v for k, v in env.items() if k in secret}


def secret_env_file(model: str) -> str:
    slug = re.sub(r"[^a-z0-9.-]+", "-", model.lower()).strip("-.")
    return f"{SECRET_ENV_DIR}/{slug}.env"


def secret_env_text(spec: ClusterSpec, model: Model) -> str | None:
    """The model's secret environment file, or None when it has no secret."""
    profile = spec.profiles[model.profile]
    _, secret = split_env(spec, model, {**profile.env, **model.env})
    if not secret:
        return None
    return "".join(f"{k}={env_file_quote(v)}\n" for k, v in sorted(secret.items()))


def env_file_quote(value: str) -> str:
    """A value for an ``EnvironmentFile=`` line, read back exactly: double quotes, inside
    which systemd (like a shell) takes ``\\`` before ``"``, ``\\``, `` ` `` and ``$`` literally."""
    return '"' + re.sub(r'(["\\`$])', r"\\\1", value) + '"'


def environment_quote(name: str, value: str) -> str:
    """One ``Environment=`` assignment as systemd reads it: the whole ``NAME=value`` in
    double quotes, C escapes for ``\\``, ``"`` and control characters, ``%`` doubled (a
    specifier otherwise). ``$`` stays as it is: systemd does not expand it here."""
    text = f"{name}={value}".replace("%", "%%")
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# --- the firewall -----------------------------------------------------------------------


def _ip(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def gateway_sources(spec: ClusterSpec) -> list[str]:
    """Where the gateways connect to engines from: each gateway host (``gateway.all_hosts``)
    that is a node (its engine and SSH addresses) or an IP address, plus
    ``gateway.engine_clients``. A host known only by a DNS name is left out (systemd takes
    no names): list its address in ``engine_clients``."""
    found: list[str] = []
    nodes = {n.name: n for n in spec.nodes}
    for host in spec.gateway.all_hosts:
        node = nodes.get(host)
        candidates = [node.engine_host, node.address] if node else [host]
        for text in candidates:
            ip = _ip(text)
            if ip:
                found.append(ip)
    found += spec.gateway.engine_clients
    return list(dict.fromkeys(found))


def allowed_addresses(spec: ClusterSpec, model: Model, nodes: list[Node]) -> list[str]:
    """``IPAddressAllow=`` of one member of a replica on ``nodes`` (the replica's
    members): localhost, the members' addresses (the node itself, its peers), the gateway
    and the profile's ``network_allow``. A member known only by a host name is left out:
    systemd takes no names there (``engine_address`` gives it an IP)."""
    entries = ["localhost"]
    for node in nodes:
        for text in (node.engine_host, node.address):
            ip = _ip(text)
            if ip:
                entries.append(ip)
    entries += gateway_sources(spec)
    entries += spec.profiles[model.profile].network_allow
    return list(dict.fromkeys(entries))


def sglang_key_file(user: str) -> str:
    """SGLang's ``--config`` file with the node's key, for the engine account ``user``."""
    return f"/etc/llmgw/engine-sglang-{user}.yaml"


def sglang_users(spec: ClusterSpec) -> list[str]:
    """The accounts SGLang engines run as: each gets its own key file on every node."""
    return sorted({p.user for p in spec.profiles.values() if p.engine is Engine.sglang})


def key_flags(engine: Engine, user: str) -> list[str]:
    """The engine's flags that point at its key (never the key itself)."""
    if engine is Engine.sglang:
        return ["--config", sglang_key_file(user)]
    return []
