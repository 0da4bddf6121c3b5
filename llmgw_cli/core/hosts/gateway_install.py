"""What `apply` puts on the gateway host (pure: inputs in, files out).

The gateway runs as ``llmgw-gateway.service`` under its own account, ``llmgw-gateway``
(never the engines' account, never root), from files under ``/etc/llmgw/gateway``:

- ``cluster.yaml``: the cluster file as the operator wrote it (comments included);
- ``pins.json``: the commit apply chose for each repository llmgw fetches (``core/weights/pins.py``),
  beside the cluster file, which is where the gateway looks for it: its on-demand starts
  use those commits and never ask the Hub. Written on every apply, empty when no model
  needs a pin, so a stale one never outlives the models it was made for;
- ``id_ed25519``: the gateway's own SSH key, made on the gateway host by ``apply``
  (``ssh-keygen`` there, llmgw-gateway 0600; only its public half is read back). Each
  node lets it in as ``llmgw-gateway`` and runs the node helper for it, nothing else
  (``core/hosts/node_access.py``). The operator's key is never copied anywhere;
- ``known_hosts``: the host keys the control host trusts, so the gateway checks them too;
- the units in ``/etc/systemd/system``: ``llmgw-gateway.socket`` (the listeners, held by
  systemd), ``llmgw-gateway.service`` and ``llmgw-gateway-handover.service`` (the same
  gateway, run beside the first while an upgrade restarts it).

- ``engine-keys.json``: the engine key of every node (keys are per node), written by
  ``apply`` beside these (``remote/gateway_install.py``), readable by the gateway's account
  only; the gateway reads it again on SIGHUP;
- the PostgreSQL password file (``gateway.store_password_file``), root:llmgw-gateway
  0640, when the machine that runs ``apply`` has that file: apply copies it to the same
  path on every gateway host and never prints it. Without it there, the file is the
  operator's to put on each gateway host;
- ``hub.env`` (``HF_ENDPOINT``, ``HF_TOKEN``), root:llmgw-gateway 0640, when the machine
  that runs ``apply`` has either in its environment: the gateway's on-demand starts fetch
  repositories from that Hub with that token, as apply does. Without either there, the
  file is left as it is (the operator may put it on the gateway host); a change of it is a
  hand-over, since a process reads its environment when it starts.

With several gateway hosts (``gateway.hosts``) every host gets the same files, each its
own SSH key (every node's ``authorized_keys`` lets each of them in).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engines import UNIT_DIR
from llmgw_cli.core.hosts.paths import ENGINE_KEYS_FILE
from llmgw_cli.core.hosts.units import (
    GATEWAY_HANDOVER_UNIT,
    GATEWAY_SOCKET,
    GATEWAY_UNIT,
    HUB_ENV_NAME,
    gateway_socket_unit,
    gateway_unit,
)
from llmgw_cli.core.weights.pins import PINS_NAME
from llmgw_cli.errors import InputError

__all__ = ["ENGINE_KEYS_FILE"]  # re-exported: where callers have always found it

GATEWAY_DIR = "/etc/llmgw/gateway"
CLUSTER_FILE = f"{GATEWAY_DIR}/cluster.yaml"
# The commits of the fetched repositories (core/weights/pins.py): beside CLUSTER_FILE, where the
# gateway reads it (``core/pins.pins_file``), re-read with it on SIGHUP.
PINS_FILE = f"{GATEWAY_DIR}/{PINS_NAME}"
GATEWAY_KEY = f"{GATEWAY_DIR}/id_ed25519"
# Where llmgw before the gateway had its own key put a copy of the operator's root key:
# apply deletes it.
OLD_OPERATOR_KEY = f"{GATEWAY_DIR}/ssh-key"
KNOWN_HOSTS = f"{GATEWAY_DIR}/known_hosts"
HUB_ENV_FILE = f"{GATEWAY_DIR}/{HUB_ENV_NAME}"  # the unit's EnvironmentFile=
HUB_VARIABLES = ("HF_ENDPOINT", "HF_TOKEN")
# What a Hub URL or token may hold in a systemd environment file: no quote, backslash,
# dollar, space or control character (each would be read as syntax, or end the line)
_HUB_VALUE = re.compile(r"[A-Za-z0-9._~:/?#\[\]@!&()*+,;=%-]{1,4096}")
# The engine keys by node (JSON), root:<the gateway's account> 0640, re-read on SIGHUP:
# ENGINE_KEYS_FILE (core/hosts/paths.py), in GATEWAY_DIR, the same path as in units.py.
# The gateway's own account: never the engines' (which must not read every node's key).
GATEWAY_ACCOUNT = "llmgw-gateway"
UNIT_FILE = f"{UNIT_DIR}/{GATEWAY_UNIT}"
SOCKET_FILE = f"{UNIT_DIR}/{GATEWAY_SOCKET}"
HANDOVER_FILE = f"{UNIT_DIR}/{GATEWAY_HANDOVER_UNIT}"
UNIT_FILES = (SOCKET_FILE, UNIT_FILE, HANDOVER_FILE)
# What a running gateway takes by SIGHUP: a change of these alone is a reload.
RELOADED = frozenset({CLUSTER_FILE, PINS_FILE})


def hub_env_text(environ: Mapping[str, str]) -> str | None:
    """``hub.env`` for the gateway from apply's own ``HF_ENDPOINT`` and ``HF_TOKEN`` (None
    when neither is set); InputError for a value an environment file cannot hold as is."""
    lines = []
    for name in HUB_VARIABLES:
        value = environ.get(name)
        if not value:
            continue
        if not _HUB_VALUE.fullmatch(value):
            raise InputError(
                f"${name} holds a space, quote, backslash, '$' or control character (or is over "
                "4096 characters): the gateway's environment file cannot carry it; fix the variable"
            )
        lines.append(f"{name}={value}\n")
    return "".join(lines) or None


def installed_gateway_unit(spec: ClusterSpec, *, llmgw_bin: str, handover: bool = False) -> str:
    """``llmgw-gateway.service`` as apply installs it (or, with ``handover``, its hand-over
    twin): run as the gateway's own account, with the cluster file, SSH key and
    known_hosts from ``GATEWAY_DIR``. ``llmgw render gateway-unit`` prints the same."""
    return gateway_unit(
        spec,
        llmgw_bin=llmgw_bin,
        config_path=CLUSTER_FILE,
        user=GATEWAY_ACCOUNT,
        ssh_key=GATEWAY_KEY,
        known_hosts=KNOWN_HOSTS,
        handover=handover,
    )


@dataclass(frozen=True)
class GatewayFile:
    path: str
    text: str = field(repr=False)  # a secret file's text is never shown, not even in a traceback
    mode: int
    secret: bool = False  # never printed
    group: str = ""  # set as the file's group (root owns it) when not ""

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def state(self) -> str:
        """What the host must show for this file to count as in place: its digest, and for
        a file given to a group its mode and group too (the same text as root's alone
        would lock the gateway out)."""
        return f"{self.digest} {self.mode:o} {self.group}" if self.group else self.digest


def gateway_files(
    spec: ClusterSpec,
    *,
    cluster_text: str,
    pins_text: str,
    llmgw_bin: str,
    known_hosts: str,
    store_password: str | None = None,
    hub_env: str | None = None,
) -> tuple[GatewayFile, ...]:
    """The files of one gateway host. ``pins_text``: the pins file of the spec apply
    planned (``core/pins.pins_text``). ``store_password``: the text of the store's password
    file as the machine running apply has it (None: not there, not copied). ``hub_env``:
    ``hub_env_text`` of apply's environment (None: not written)."""
    units = {
        handover: installed_gateway_unit(spec, llmgw_bin=llmgw_bin, handover=handover)
        for handover in (False, True)
    }
    files = [
        GatewayFile(CLUSTER_FILE, cluster_text, 0o644),
        GatewayFile(PINS_FILE, pins_text, 0o644),
        GatewayFile(KNOWN_HOSTS, known_hosts, 0o644),
        GatewayFile(SOCKET_FILE, gateway_socket_unit(spec), 0o644),
        GatewayFile(UNIT_FILE, units[False], 0o644),
        GatewayFile(HANDOVER_FILE, units[True], 0o644),
    ]
    if hub_env is not None:
        files.append(GatewayFile(HUB_ENV_FILE, hub_env, 0o640, secret=True, group=GATEWAY_ACCOUNT))
    password_file = spec.gateway.store_password_file
    if password_file in (*(f.path for f in files), ENGINE_KEYS_FILE, GATEWAY_KEY, GATEWAY_KEY + ".pub"):
        raise InputError(
            f"gateway.store_password_file {password_file}: one of the gateway's own files; "
            "put the password in a file of its own (e.g. /etc/llmgw/store-password)"
        )
    if password_file and store_password is not None:
        files.append(GatewayFile(password_file, store_password, 0o640, secret=True, group=GATEWAY_ACCOUNT))
    return tuple(files)


@dataclass(frozen=True)
class GatewayChange:
    """What an install changes, and how the running gateway takes it.

    ``how``:
    - ``none``: nothing;
    - ``reload``: SIGHUP (the cluster file, the pins file, or both; connections stay);
    - ``handover``: a second gateway process starts on the same sockets, the first
      restarts while it serves, then it stops: no connection refused, none cut;
    - ``restart``: stop, then start (with the socket unit first). For a gateway that runs,
      that is a brief outage: its listeners move (the socket unit is new or changed).
    """

    write: tuple[GatewayFile, ...]
    how: str
    active: bool = False  # the gateway ran before the change
    rebind: bool = True  # a restart binds the sockets again (new or changed socket unit)

    @property
    def interrupts(self) -> bool:
        """A running gateway stops serving for a moment: connections are refused."""
        return self.active and self.how == "restart"


def gateway_change(
    files: tuple[GatewayFile, ...],
    current: dict[str, str],
    *,
    active: bool,
    listeners_changed: bool,
    socket_active: bool = True,
) -> GatewayChange:
    """Compare the wanted files with what was found on the host (``current``, by path: each
    file's ``GatewayFile.state``).
    A changed cluster file or pins file (or both) of a running gateway is a reload (SIGHUP
    reads both again and keeps connections), unless its listener addresses changed; anything else (a new key, unit) is a hand-over
    to a new gateway process on the same sockets, unless the sockets themselves change
    (new listener addresses, or no socket unit running yet: the gateway bound its ports
    itself), which needs a restart; a gateway that is not running is started."""
    write = tuple(f for f in files if current.get(f.path) != f.state)
    # A socket unit that runs unchanged keeps its sockets (and the connections queued on
    # them) when a gateway that is down is started.
    rebind = not socket_active or any(f.path == SOCKET_FILE for f in write)
    if not write:
        return GatewayChange((), "none" if active else "restart", active, rebind)
    if active and not listeners_changed and all(f.path in RELOADED for f in write):
        return GatewayChange(write, "reload", active, rebind)
    if active and not rebind:
        return GatewayChange(write, "handover", active, rebind)
    return GatewayChange(write, "restart", active, rebind)
