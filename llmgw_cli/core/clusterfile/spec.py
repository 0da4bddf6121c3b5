"""The cluster file as frozen pydantic models.

Every model forbids unknown keys, so a typo is an error rather than a silently ignored
setting. The ``description`` of each field is the documentation: docs/configuration.md
and the JSON Schema are generated from these classes (``scripts/regen``).

The strings that reach units, shells and sockets (user names, hosts, listeners, the
store URL, firewall entries) are types of ``values.py``. Each shorthand the file may use
(``ports: 8100-8199``, ``hcas: [mlx5_0:1]``, ``weights: [/data]``) is read by a
before-validator here, which also gives the JSON Schema its pattern beside the long form.

Checks that need more than one field of one object (a profile that a model names must
exist, node names must be unique, ...) live in ``refs.py`` so that they run even when
another part of the file failed to validate.
"""

from __future__ import annotations

import ipaddress
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from llmgw_cli.core.clusterfile import grammar
from llmgw_cli.core.clusterfile.grammar import whole
from llmgw_cli.core.clusterfile.quantities import Duration, PositiveDuration, Size
from llmgw_cli.core.clusterfile.values import (
    CONTROL_CHARACTER,
    AbsolutePlainWord,
    EngineUser,
    EnvName,
    FirewallEntry,
    Host,
    Interface,
    IpAddress,
    JumpHost,
    Listen,
    PlainWord,
    StoreUrl,
    UserName,
    find_forbidden,
)
from llmgw_cli.core.observe.health import DEFAULT_START_TIMEOUT
from llmgw_cli.core.weights.snapshot import RepoRef, Selection, parse_repo_ref

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REF_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
HF_REPO_PATTERN = (
    rf"^(?![^@]*--)(?!.*\.\.){_PART}/{_PART}(?<!\.git)"
    rf"(@(?=[^@]{{1,255}}$)(?!.*\.lock(/|$)){_REF_PART}(/{_REF_PART})*)?$"
)
"""A Hugging Face repo id, ``org/name`` or ``org/name@revision``, as the JSON Schema says
it: the rules of ``core.snapshot.parse_repo_ref`` (which says what is wrong) as one regex."""
_REPO_SHAPE = r"^[^/@:\s.][^/@:\s]*/[^/@:\s]+(@|$)"  # meant as a repo id: parse_repo_ref says what is wrong
# Where a model's weights come from (classify_source): what the JSON Schema says of it.
SOURCE_PATTERN = r"^(https://|\.?/)|" + HF_REPO_PATTERN


class Spec(BaseModel):
    """Base of every cluster-file model: frozen, unknown keys refused, and no string of any
    field, present or future, may hold a control character: values become lines of systemd
    units and words of shell commands, where a newline starts a new directive.

    Strict: a value keeps the type YAML gave it. `"8"` is no count, `"yes"` no boolean and
    a number no text, as in the JSON Schema that editors check the file against. (The
    loader reads a number without a fractional part as an integer, as JSON does.) Enum
    fields say ``strict=False``: strict, they would take only enum members, never words."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_control_characters(cls, value: Any) -> Any:
        found = find_forbidden(value)
        if found is not None:
            raise PydanticCustomError(
                CONTROL_CHARACTER,
                "holds {what}: values end up in systemd units and shell commands, where a "
                "control character would start a new directive or command; remove it "
                "(write the value on one line, without tabs or escapes such as \\n)",
                {"what": found[2]},
            )
        return value


# --- ssh ----------------------------------------------------------------------------


class Become(StrEnum):
    none = "none"
    sudo = "sudo"


class SshOverrides(Spec):
    """Per-node SSH settings; each one left out falls back to the top-level ``ssh`` block."""

    user: UserName | None = Field(None, description="Login user on this node.")
    port: int | None = Field(None, ge=1, le=65535, description="SSH port on this node.")
    identity_file: str | None = Field(None, description="Private key for this node.")
    jump_host: JumpHost | None = Field(None, description="Jump host for this node (`[user@]host[:port]`).")
    become: Become | None = Field(None, strict=False, description="`sudo` or `none` on this node.")


class SshSettings(Spec):
    """How llmgw reaches nodes. Host keys are always checked: a changed key is never bypassed."""

    user: UserName = Field("root", description="Login user.")
    port: int = Field(22, ge=1, le=65535, description="SSH port.")
    identity_file: str | None = Field(
        None,
        description="Private key file; a relative path is relative to the cluster file. "
        "Unset: the SSH agent and the user's default keys.",
    )
    known_hosts: str = Field(
        "~/.ssh/known_hosts",
        description="known_hosts file checked strictly; a relative path is relative to the cluster file.",
    )
    accept_unknown_hosts: bool = Field(
        False,
        description="Accept (and record) the key of a host not yet in known_hosts. "
        "A host whose key changed is refused whatever this says.",
    )
    connect_timeout: Duration = Field(10.0, description="Time allowed to connect and authenticate.")
    command_timeout: Duration = Field(60.0, description="Time allowed for one remote command.")
    max_parallel: int = Field(64, ge=1, le=4096, description="Nodes talked to at once.")
    jump_host: JumpHost | None = Field(None, description="Jump host (`[user@]host[:port]`) for every node.")
    become: Become = Field(
        Become.none,
        strict=False,
        description="`sudo`: the login user is not root, and actions that need root run "
        "through `sudo -n` (a missing sudo right is reported per node).",
    )


# --- gateway ------------------------------------------------------------------------


class UpstreamTimeouts(Spec):
    """Timeouts between the gateway and an engine, split so a long generation is never cut
    by one fixed total."""

    connect: Duration = Field(5.0, description="Time to open a connection to a replica.")
    first_byte: Duration = Field(
        600.0,
        description="Time from sending a request to the first byte of the answer. A "
        "non-streamed answer arrives whole, so this bounds the longest non-streamed generation.",
    )
    idle: Duration = Field(120.0, description="Longest silence between two chunks of an answer.")


class ClientTimeouts(Spec):
    """Timeouts between a client and the gateway's public listener, so a slow or stalled
    client holds a socket and a model slot for a bounded time only."""

    header: PositiveDuration = Field(
        65.0,
        description="Time a client connection has, from its opening or from the end of its "
        "previous answer, to send a whole request head; then it is closed. Bytes that trickle "
        "in do not restart it, so a client sending one byte at a time is dropped. It also "
        "bounds an idle keep-alive connection (keep it above a TLS proxy's upstream keep-alive, "
        "nginx: 60s).",
    )
    body: PositiveDuration = Field(
        60.0, description="Time to receive a whole request body once its head is in; else 408."
    )
    write: PositiveDuration = Field(
        60.0,
        description="A client that stops reading: once its socket has stayed full this long, the "
        "connection is dropped, its model slot freed and the engine's request cancelled.",
    )


class GatewayTls(Spec):
    """TLS on the public listener (PEM files on the gateway host, read at start)."""

    cert: str = Field(description="Certificate chain (PEM), server certificate first.")
    key: str = Field(description="Private key (PEM) of the certificate.")


class GatewaySettings(Spec):
    """The OpenAI-compatible gateway daemon (`llmgw gateway run`)."""

    model_config = ConfigDict(
        # `_one_host_list` in the schema's words: several hosts need a store.
        json_schema_extra={
            "if": {"required": ["hosts"], "properties": {"hosts": {"minItems": 2}}},
            "then": {"required": ["store"], "properties": {"store": {"type": "string"}}},
        }
    )

    host: Host = Field(
        "localhost",
        description="Where the gateway runs: a node name, `localhost`, or an address. With "
        "`hosts`, the first of them (leave it unset).",
    )
    hosts: list[Host] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra={"uniqueItems": True},
        description="Several gateway hosts instead of one `host`, behind one address (a TCP "
        "load balancer or DNS): `apply` installs the gateway on each. They share the store, "
        "so `store` must be PostgreSQL.",
    )
    workers: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Gateway processes per host, accepting on the same port. Unset: one per "
        "CPU core of the host, at most 8.",
    )
    store: StoreUrl | None = Field(
        None,
        description="Where the gateways keep keys, usage and their coordination: a "
        "`postgresql://user@host:port/database` URL, the password never in it (see "
        "`store_password_file`). Unset: SQLite in `state_dir`, for the workers of one host.",
    )
    store_password_file: AbsolutePlainWord | None = Field(
        None,
        description="File holding the PostgreSQL password (on every gateway host, and where "
        "`llmgw keys` and `llmgw usage` run). Unset: `$LLMGW_STORE_PASSWORD`, else none "
        "(peer or certificate authentication).",
    )
    listen: Listen = Field("0.0.0.0:8080", description="Public OpenAI API listener.")
    admin_listen: Listen = Field(
        "127.0.0.1:9090", description="Admin API and dashboard listener (loopback by default)."
    )
    metrics_listen: Listen | None = Field(
        None, description="Listener serving only `/metrics` and `/health`, for monitoring."
    )
    metrics_keys: int = Field(
        100,
        ge=0,
        le=10_000,
        description="API keys named in the metrics' `key` label: every key while there are at "
        "most this many, else the ones that used the most tokens over the last 7 days; the "
        "others are counted as `other`. Bounds the series a scrape returns.",
    )
    state_dir: PlainWord = Field("/var/lib/llmgw", description="Directory of the gateway's own data.")
    llmgw_bin: AbsolutePlainWord | None = Field(
        None,
        description="Absolute path of `llmgw` on the gateway host, for its systemd unit: somewhere "
        "the unit's sandbox shows and its account reads (e.g. /opt/llmgw/bin/llmgw; not under "
        "/tmp, /var/tmp or /root), which `plan` checks. Unset: whichever `llmgw` is on the host's PATH.",
    )
    install: bool = Field(
        True,
        description="`apply` installs and updates `llmgw-gateway.service` on `host`. Off: "
        "you run the gateway yourself.",
    )
    load_wait: Duration = Field(
        20.0,
        description="How long a request for a model that is starting waits before it is "
        "answered 503 with Retry-After.",
    )
    timeouts: UpstreamTimeouts = Field(default_factory=UpstreamTimeouts, description="Upstream timeouts.")
    max_request_size: Size = Field(
        4 * 1024 * 1024, description="Largest request body accepted; a bigger one is answered 413."
    )
    model_concurrency: int = Field(
        256,
        ge=1,
        le=100_000,
        description="Requests forwarded at once to each ready replica of a model; more wait "
        "in the model's queue.",
    )
    model_queue: int = Field(
        1024,
        ge=0,
        le=1_000_000,
        description="Requests that wait for a slot of one model; one more is answered 429.",
    )
    key_queue_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Largest share of a model's queue that one API key may fill; a key "
        "beyond it is answered 429 while other keys still queue. Waiting keys take turns "
        "for freed slots, so one key's backlog does not starve the others.",
    )
    client_timeouts: ClientTimeouts = Field(
        default_factory=ClientTimeouts, description="Timeouts of clients of the public listener."
    )
    tls: GatewayTls | None = Field(
        None, description="TLS on the public listener. Unset: plain HTTP (put a TLS proxy in front)."
    )
    drain_timeout: Duration = Field(
        30.0,
        description="How long requests and streams in flight may still run: in the gateway on "
        "SIGTERM, and on a replica that `apply` retires (drains) before it stops it. A model's "
        "`drain_timeout` overrides it for its replicas.",
    )
    scale_out_wait: Duration = Field(
        5.0,
        description="When requests for a model have waited this long in its queue and `max` "
        "allows, the gateway starts one more replica.",
    )
    eviction_grace: Duration = Field(
        120.0,
        description="A replica is never evicted this soon after it became ready, so two "
        "on-demand models cannot take turns evicting each other.",
    )
    node_grace: Duration = Field(
        20.0,
        description="A replica on a node that stopped answering the gateway's probe is "
        "replaced on another node after this long (an SSH hiccup is not a lost node), counted "
        "from its first failed health check.",
    )
    unhealthy_restart: Duration = Field(
        60.0,
        description="A replica that was ready and then failed its health check for this long is restarted.",
    )
    start_backoff: Duration = Field(
        5.0,
        description="After a failed start, the gateway waits this long before it starts the "
        "model again; the wait doubles with each failure in a row, up to 5 minutes. Requests "
        "meanwhile get 503 `model_start_failed` with Retry-After and a request id (the reason is in "
        "the gateway's log under it).",
    )
    discover_every: PositiveDuration = Field(
        15.0,
        description="How often the leading gateway process probes the nodes over SSH for the "
        "replicas that run (sooner when a ready replica fails its health check, or when "
        "`apply` asks). `llmgw gateway run --discover-every SECONDS` overrides it.",
    )
    health_every: PositiveDuration = Field(
        2.0,
        description="How often each gateway process checks the health of every replica it "
        "routes to. `--health-every SECONDS` overrides it.",
    )
    flush_every: PositiveDuration = Field(
        5.0,
        description="How often each gateway process writes its usage totals and last-use "
        "times to the store (and once more when it stops). `--flush-every SECONDS` overrides it.",
    )
    manage_replicas: bool = Field(
        True,
        description="Start on-demand models at their first request, stop idle replicas, "
        "evict and scale out. Off: the gateway only routes to what `apply` started.",
    )
    signals_interval: PositiveDuration = Field(
        1.0,
        description="How often each gateway process reads every ready replica's own "
        "`/metrics` (its engine's queue and KV cache) for routing, give or take a fifth so "
        "processes do not scrape in step.",
    )
    signals_timeout: PositiveDuration = Field(
        0.5,
        description="Longest wait for one replica's `/metrics`; at most `signals_interval`. A "
        "scrape that fails or times out leaves that replica routed by the gateway's own "
        "in-flight count until a scrape succeeds again.",
    )
    engine_clients: list[FirewallEntry] = Field(
        default_factory=list,
        description="Addresses or CIDR blocks the gateway connects to engines from, besides "
        "`host` (taken when it is a node or an IP address). Every engine's firewall lets "
        "only these, the engine's own node, its peer nodes and localhost in.",
    )

    @model_validator(mode="after")
    def _signals_timeout_within_interval(self) -> GatewaySettings:
        if self.signals_timeout > self.signals_interval:
            raise ValueError(
                f"signals_timeout ({self.signals_timeout:g}s) is longer than signals_interval "
                f"({self.signals_interval:g}s): scrapes would overlap"
            )
        return self

    @model_validator(mode="after")
    def _one_host_list(self) -> GatewaySettings:
        if not self.hosts:
            return self
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"gateway.hosts: a host is listed twice: {', '.join(self.hosts)}")
        if "host" in self.model_fields_set and self.host != self.hosts[0]:
            raise ValueError("give `gateway.hosts` or `gateway.host`, not both")
        if len(self.hosts) > 1 and self.store is None:
            raise ValueError(
                "gateway.hosts: several gateway hosts share their keys, usage and replicas through "
                "a PostgreSQL store: set gateway.store to postgresql://user@host:5432/database"
            )
        # Everything that needs one gateway host (the cluster file's first gateway) reads `host`.
        object.__setattr__(self, "host", self.hosts[0])
        return self

    @property
    def all_hosts(self) -> list[str]:
        """Every gateway host: `hosts`, or the one `host`."""
        return list(self.hosts) if self.hosts else [self.host]


# --- fabrics and nodes --------------------------------------------------------------


class Fabric(Spec):
    """A network over which multi-node replicas talk (NCCL)."""

    kind: Literal["infiniband", "roce"] = Field(description="`infiniband` or `roce`.")
    socket_interface: Interface | None = Field(
        None, description="Interface for NCCL's bootstrap (`NCCL_SOCKET_IFNAME`), e.g. `eth0`."
    )


def _shorthand(pattern: str) -> Any:
    """The JSON Schema of a shorthand: a string of this pattern (the loader's own check
    reads it with a regex of the same form and gives the parts to the model's fields)."""
    return Annotated[str, WithJsonSchema({"type": "string", "pattern": pattern})]


_HCA_SHORTHAND = re.compile(r"([A-Za-z0-9_]+)(?::([0-9]+))?")
HCA_SHORTHAND_PATTERN = whole(f"[A-Za-z0-9_]+(:0*{grammar.int_range(1, 255)})?")


def _hca_shorthand(value: Any) -> Any:
    """``mlx5_0`` or ``mlx5_0:1`` stand for ``{name: mlx5_0, port: 1}``."""
    if not isinstance(value, str):
        return value
    match = _HCA_SHORTHAND.fullmatch(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not an adapter: write its name (mlx5_0) or its name and a port (mlx5_0:1)"
        )
    name, port = match.groups()
    return {"name": name} if port is None else {"name": name, "port": int(port)}


class Hca(Spec):
    """A declared InfiniBand/RoCE adapter; write `mlx5_0` or `mlx5_0:1` for short."""

    name: str = Field(pattern=r"^[A-Za-z0-9_]+$", description="Adapter name, e.g. `mlx5_0`.")
    port: int | None = Field(None, ge=1, le=255, description="Port number; unset: every port.")


def _weights_shorthand(value: Any) -> Any:
    """A bare path stands for ``{path: ...}`` (local storage)."""
    return {"path": value} if isinstance(value, str) else value


class WeightDir(Spec):
    """A directory holding model weights; write a bare path for local storage."""

    path: str = Field(pattern=r"^/", description="Absolute directory path on the node.")
    shared: bool = Field(
        False, description="Shared storage (NFS, Lustre...) seen by every node of the fabric."
    )


class ExpectedGpus(Spec):
    """What the node is expected to have; the probe cross-checks it."""

    gpu_class: str = Field(alias="class", description="GPU class, e.g. `H100-80GB`.")
    count: int = Field(ge=1, le=64, description="Number of GPUs.")


class Node(Spec):
    """A server that runs engines."""

    name: str = Field(pattern=NAME_PATTERN, description="Unique short name (lowercase, digits, `-`).")
    address: Host = Field(description="Host name or IP address that SSH connects to.")
    engine_address: IpAddress | None = Field(
        None,
        description="IP address the node's engines listen on and the gateway connects to; "
        "unset: `address`. Engines never listen on every interface.",
    )
    connection: Literal["ssh", "local"] = Field(
        "ssh", description="`local`: this machine itself, without SSH."
    )
    ssh: SshOverrides = Field(
        default_factory=SshOverrides, description="Overrides of the top-level `ssh` settings."
    )
    fabric: str | None = Field(None, description="Name of the fabric (under `fabrics`) the node is on.")
    hcas: list[
        Annotated[
            Hca,
            BeforeValidator(_hca_shorthand, json_schema_input_type=_shorthand(HCA_SHORTHAND_PATTERN) | Hca),
        ]
    ] = Field(default_factory=list, description="Adapters that attach the node to its fabric.")
    weights: list[
        Annotated[
            WeightDir,
            BeforeValidator(_weights_shorthand, json_schema_input_type=_shorthand("^/") | WeightDir),
        ]
    ] = Field(default_factory=list, description="Directories scanned for model weights.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels.")
    gpus: ExpectedGpus | None = Field(None, description="Expected GPUs, checked against the probe.")
    # --- maintenance (docs/operations.md, "Maintenance: cordon, drain, uncordon")
    cordoned: bool = Field(
        False,
        description="Out for maintenance: `apply` and the gateway place no new replica here "
        "(those running keep serving; `llmgw drain` moves them). For a short stay, "
        "`llmgw cordon NODE` does the same without editing this file.",
    )
    cordon_reason: str | None = Field(
        None,
        max_length=200,
        pattern=r"^[^\x00-\x1f\x7f]*$",
        description="Why the node is cordoned, shown by `llmgw status` (one line).",
    )

    @property
    def engine_host(self) -> str:
        """Where the node's engines listen and are reached."""
        return self.engine_address or self.address


# --- profiles -----------------------------------------------------------------------


class Engine(StrEnum):
    vllm = "vllm"
    sglang = "sglang"
    llama_server = "llama-server"


DEFAULT_COMMAND: dict[Engine, list[str]] = {
    Engine.vllm: ["vllm", "serve"],
    Engine.sglang: ["python3", "-m", "sglang.launch_server"],
    Engine.llama_server: ["llama-server"],
}


class Readiness(Spec):
    """How llmgw decides that a replica is ready."""

    path: str = Field("/health", pattern=r"^/[!-~]*$", description="HTTP path that answers 200 when ready.")
    start_timeout: Duration = Field(
        DEFAULT_START_TIMEOUT,
        description="Longest time from start to ready before the start counts as failed.",
    )


_PORT_RANGE = re.compile(r" *([0-9]+) *- *([0-9]+) *")
_RANGE_PORT = f"0*{grammar.int_range(1024, 65535)}"
PORT_RANGE_PATTERN = whole(f" *{_RANGE_PORT} *- *{_RANGE_PORT} *")


def _port_range_shorthand(value: Any) -> Any:
    """``8100-8199`` stands for ``{first: 8100, last: 8199}``."""
    if not isinstance(value, str):
        return value
    match = _PORT_RANGE.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a port range: write first-last, such as 8100-8199")
    return {"first": int(match[1]), "last": int(match[2])}


class PortRange(Spec):
    """Ports handed to replicas; write `8100-8199` for short."""

    first: int = Field(ge=1024, le=65535)
    last: int = Field(ge=1024, le=65535)

    @model_validator(mode="after")
    def _ordered(self) -> PortRange:
        if self.last < self.first:
            raise ValueError(f"last ({self.last}) is below first ({self.first})")
        return self


# systemd reads a leading - @ : + ! of ExecStart='s program as a flag (Profile._plain_program).
Command = Annotated[
    list[str],
    Field(min_length=1, json_schema_extra={"prefixItems": [{"type": "string", "pattern": "^[^-@:+!]"}]}),
]


class Profile(Spec):
    """How to run one engine: binary, arguments, environment."""

    engine: Engine = Field(strict=False, description="`vllm`, `sglang` or `llama-server`.")
    command: Command | None = Field(
        None,
        description="Program and leading arguments; unset: `vllm serve`, "
        "`python3 -m sglang.launch_server` or `llama-server`.",
    )
    version: str | None = Field(
        None,
        pattern=r"^[0-9][0-9A-Za-z.+-]{0,63}$",
        description="The engine version this profile is written for (e.g. `0.32.0`): its flags are "
        "checked against that version's flag table, and against the version each node really has "
        "(probed).",
    )
    args: list[str] = Field(default_factory=list, description="Extra arguments for every model.")
    env: dict[EnvName, str] = Field(default_factory=dict, description="Extra environment variables.")
    secret_env: list[EnvName] = Field(
        default_factory=list,
        description="Names in `env` (here or in a model) whose values are secrets: they go to a "
        "root-only file on the node, never into the unit. `HF_TOKEN` and "
        "`HUGGING_FACE_HUB_TOKEN` always do.",
    )
    network_allow: list[FirewallEntry] = Field(
        default_factory=list,
        description="More addresses or CIDR blocks the engine may exchange traffic with (a "
        "proxy or hub mirror it downloads weights through): the engine's firewall works "
        "both ways, so without them it reaches only the gateway and its peers.",
    )
    user: EngineUser = Field(
        "llmgw", description="Unprivileged account the engine runs as (never root: engines run model code)."
    )
    multi_node: Literal["native", "ray"] = Field(
        "native", description="vLLM only: multi-node replicas with `--nnodes` (native) or Ray."
    )
    readiness: Readiness = Field(default_factory=Readiness, description="Readiness check.")
    ports: Annotated[
        PortRange,
        BeforeValidator(
            _port_range_shorthand, json_schema_input_type=_shorthand(PORT_RANGE_PATTERN) | PortRange
        ),
    ] = Field(
        default_factory=lambda: PortRange(first=8100, last=8199),
        description="Port range for replicas of this profile.",
    )

    @field_validator("command")
    @classmethod
    def _plain_program(cls, command: list[str] | None) -> list[str] | None:
        # systemd reads a leading - @ : + ! of ExecStart='s program as a flag, even quoted:
        # `+/bin/sh` would run as root, ignoring User=.
        if command and (not command[0] or command[0][0] in "-@:+!"):
            raise ValueError(
                f"the program {command[0]!r} must be a path or a name, not start with one of - @ : + ! "
                "(systemd reads those as flags; `+` runs it as root)"
            )
        return command

    @property
    def argv0(self) -> list[str]:
        """The command, with the engine's default when none is given."""
        return list(self.command) if self.command else list(DEFAULT_COMMAND[self.engine])


# --- models -------------------------------------------------------------------------


class ScalingMode(StrEnum):
    off = "off"
    on_demand = "on-demand"
    always = "always"


class Scaling(Spec):
    """How many replicas run. `min: 0, max: 0` is off; `min: 0, max >= 1` on demand;
    `min >= 1` that many always running. `max` is never filled in for you."""

    min: int = Field(
        ge=0, le=1024, description="Replicas always running (never idled or evicted below this)."
    )
    max: int = Field(ge=0, le=1024, description="Most replicas ever running.")
    idle_timeout: Duration | None = Field(
        None, description="Stop a replica above `min` after nobody used it this long; unset: never."
    )

    @model_validator(mode="after")
    def _max_not_below_min(self) -> Scaling:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self


class RoutePolicy(StrEnum):
    prefix = "prefix"
    least_load = "least_load"
    round_robin = "round_robin"


class Routing(Spec):
    """How the gateway picks one of a model's ready replicas for each request (see
    docs/gateway.md, Routing)."""

    policy: RoutePolicy = Field(
        RoutePolicy.prefix,
        strict=False,
        description="`prefix`: requests whose prompts start alike (the first 1 KiB) or that "
        "name one session (`user`, `x-session-id`) go to the same replica, for its prefix "
        "cache, unless it is overloaded; `least_load`: the replica whose engine reports the "
        "least work; `round_robin`: each replica in turn.",
    )
    max_waiting: float = Field(
        4.0,
        ge=0,
        le=1_000_000,
        description="`prefix`: a replica whose engine queues more requests than this is "
        "overloaded and yields its requests to the next replica.",
    )
    max_kv_usage: float = Field(
        0.9,
        gt=0,
        le=1,
        description="`prefix`: a replica whose engine's KV cache is fuller than this share is overloaded.",
    )
    load_factor: float = Field(
        0.25,
        ge=0,
        le=1000,
        description="`prefix`: a replica with more requests in flight from this gateway process "
        "than (1 + load_factor) times the mean of the model's ready replicas, plus one, is overloaded.",
    )


class SourceKind(StrEnum):
    hf_repo = "hf-repo"
    path = "path"
    url = "url"


def classify_source(source: str) -> SourceKind:
    """Hugging Face repo id, absolute or ``./`` path, or https URL; anything else is refused."""
    if source.startswith("https://"):
        return SourceKind.url
    if source.startswith(("/", "./")):
        return SourceKind.path
    if re.match(_REPO_SHAPE, source):
        parse_repo_ref(source)  # the Hub's exact rules (BadSource, a ValueError, says why)
        return SourceKind.hf_repo
    if source.startswith("http://"):
        raise ValueError(f"{source!r}: only https URLs are fetched")
    raise ValueError(
        f"{source!r} is not a source: give a Hugging Face repo id (org/name), "
        "an absolute or ./relative path, or an https URL"
    )


def download_name(url: str) -> str:
    """The file name a URL source is downloaded under (in a node's first weights folder):
    the URL's last path segment."""
    return url.rsplit("/", 1)[-1]


class FetchFiles(Spec):
    """Which files of a repository are fetched onto the nodes (glob patterns matched against
    each file's path in the repository, ``*`` crossing ``/``)."""

    include: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(
        None,
        max_length=100,
        description="Only these files; unset: safetensors weights, configs and tokenizer files.",
    )
    exclude: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list, max_length=100, description="Never these files, whatever `include` says."
    )

    def selection(self) -> Selection:
        return Selection(
            include=tuple(self.include) if self.include is not None else None, exclude=tuple(self.exclude)
        )


def _fetch_kind(value: Any) -> str:
    return "files" if isinstance(value, dict | FetchFiles) else "engine"


# `engine` or a mapping: each form's own errors (not both at once, as a plain union gives)
FetchSetting = Annotated[
    Annotated[Literal["engine"], Tag("engine")] | Annotated[FetchFiles, Tag("files")],
    Discriminator(_fetch_kind),
]


def _model_name(name: str) -> str:
    if not re.fullmatch(MODEL_NAME_PATTERN, name):
        raise ValueError(
            f"{name!r} is not a model name: letters, digits and . _ : / -, beginning with a "
            "letter or a digit, at most 128 characters"
        )
    return name


# a name clients may send in `model`: an alias, or a model named as a fallback
ModelName = Annotated[
    str, AfterValidator(_model_name), Field(json_schema_extra={"pattern": MODEL_NAME_PATTERN})
]
MAX_ALIASES = 32
MAX_FALLBACKS = 16


# --- adapters (LoRA) ------------------------------------------------------------------

MAX_ADAPTERS = 64


class Adapter(Spec):
    """A LoRA adapter of a model: served under its own name by the model's replicas,
    which load it at run time on first request (vLLM's `/v1/load_lora_adapter`)."""

    name: ModelName = Field(
        description="Served name of the adapter: what clients put in `model`. Same rules as a "
        "model's name; no model, alias or other adapter may have it."
    )
    source: str = Field(
        json_schema_extra={"pattern": SOURCE_PATTERN},
        description="A Hugging Face repo id at a commit (`org/name@<40-hex commit>`: fetched onto "
        "the nodes of the model, beside its weights, with llmgw's default files), or an absolute "
        "or `./`relative path of an adapter folder already on the nodes (`./x`: in the node's "
        "first weights folder).",
    )

    @field_validator("source")
    @classmethod
    def _adapter_source(cls, source: str) -> str:
        kind = classify_source(source)
        if kind is SourceKind.url:
            msg = f"{source!r}: an adapter is a folder (adapter_config.json and its weights): "
            raise ValueError(msg + "give a repo id at a commit or a path, not a URL")
        if kind is SourceKind.path and ".." in source.split("/"):
            raise ValueError(f"{source!r}: a path with `..` in it; name the adapter's folder itself")
        if kind is SourceKind.hf_repo and not parse_repo_ref(source).pinned:
            msg = f"{source!r}: an adapter's repo id names its commit (`org/name@<40-hex commit>`), so that "
            raise ValueError(
                msg + "every replica loads the same files (the Hub's page of the repository has it)"
            )
        return source

    @property
    def repo_ref(self) -> RepoRef | None:
        """The repo and commit of a repo id source; None for a path."""
        return parse_repo_ref(self.source) if classify_source(self.source) is SourceKind.hf_repo else None


class LoraLimits(Spec):
    """How many adapters a replica holds at once, and how large (vLLM's `--max-loras`,
    `--max-lora-rank`)."""

    max_loras: int = Field(
        4, ge=1, le=256, description="Adapters a replica runs in one batch (`--max-loras`)."
    )
    max_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16, description="The largest rank (`r`) of an adapter the replica loads (`--max-lora-rank`)."
    )


class Model(Spec):
    """A model in the catalog."""

    name: str = Field(pattern=MODEL_NAME_PATTERN, description="Served name: what clients put in `model`.")
    source: str = Field(
        json_schema_extra={"pattern": SOURCE_PATTERN},
        description="Hugging Face repo id, absolute or `./`relative path, or https URL.",
    )
    sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="Checksum of a single-file source."
    )
    profile: str = Field(description="Name of the profile (under `profiles`) that runs it.")
    gpu_class: str | None = Field(None, description="Only GPUs of this class, e.g. `H100-80GB`.")
    tensor_parallel: int = Field(
        1,
        ge=1,
        le=64,
        json_schema_extra={"enum": [2**i for i in range(7)]},  # _power_of_two
        description="GPUs per node for one replica.",
    )
    nodes: int = Field(1, ge=1, le=64, description="Nodes per replica (more than 1: multi-node).")
    gpu_memory: Size | None = Field(None, description="Memory needed on each GPU, e.g. `40GiB`.")
    args: list[str] = Field(default_factory=list, description="Arguments added to the profile's.")
    env: dict[EnvName, str] = Field(default_factory=dict, description="Environment added to the profile's.")
    secret_env: list[EnvName] = Field(
        default_factory=list, description="Names in `env` whose values are secrets (see the profile's)."
    )
    fetch: FetchSetting | None = Field(
        None,
        description="A repo id source only: which files of the repository llmgw fetches "
        "onto the nodes, at the commit its revision had when the plan was made; the engine "
        "runs from that local copy with the Hub switched off. Unset or `{}`: safetensors "
        "weights, configs and tokenizer files; `{include, exclude}`: those files. `engine`: "
        "llmgw fetches nothing and the engine downloads the repository itself when it starts.",
    )
    scaling: Scaling | None = Field(None, description="Replica counts; unset: the model is off.")
    drain_timeout: Duration | None = Field(
        None,
        description="How long a replica being retired (replaced by `apply`) may finish its "
        "requests in flight before it is stopped; it then stops, cutting what still runs. "
        "Unset: `gateway.drain_timeout`. Changing it replaces no replica.",
    )
    routing: Routing = Field(
        default_factory=Routing,
        description="Which ready replica takes each request. Changing it replaces no replica.",
    )
    aliases: list[ModelName] = Field(
        default_factory=list,
        max_length=MAX_ALIASES,
        json_schema_extra={"uniqueItems": True},
        description="More names clients may send in `model` for this model (e.g. `gpt-4o-mini`): "
        "each answers as this model (the engine gets, and the answer names, the model's own "
        "name), is listed in `/v1/models` as an entry of its own, and is metered under the "
        "model's name. A key limited to some models may use the aliases of those. No alias may "
        "be a model's name or another model's alias. Changing them replaces no replica.",
    )
    fallbacks: list[ModelName] = Field(
        default_factory=list,
        max_length=MAX_FALLBACKS,
        json_schema_extra={"uniqueItems": True},
        description="Catalog models (names, not aliases) tried in this order when this one cannot "
        "answer: none of its replicas is ready within `gateway.load_wait` (the gateway's 503 or "
        "404 `model_off`), or its engine answered a 5xx or failed before a byte of the answer "
        "reached the client. A fallback's own fallbacks follow it; a key skips those it may not "
        "use; a cycle (a -> b -> a) is refused. The answer's `x-llmgw-served-by` header and "
        "`model` field name the model that served, and the request is metered under it. "
        "Changing them replaces no replica.",
    )

    # --- adapters (LoRA) ---
    adapters: list[Adapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters of this model (vLLM only), each requested by its own name: "
        "listed in `/v1/models` with this model as `parent`, metered and limited under its "
        "name (a key limited to some models needs the adapter's name in its list). Its files "
        "are fetched onto the nodes that run this model; the gateway loads it onto a ready "
        "replica on its first request there, and prefers replicas that have it loaded. "
        "Adding or removing an adapter replaces no replica once the model has one.",
    )
    lora: LoraLimits = Field(
        default_factory=LoraLimits, description="With `adapters`: how many and how large, per replica."
    )

    @field_validator("source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        classify_source(source)
        return source

    @model_validator(mode="after")
    def _fetch_only_for_repos(self) -> Model:
        if self.fetch is not None and classify_source(self.source) is not SourceKind.hf_repo:
            raise ValueError(
                "`fetch` is for a repo id source (org/name): a URL is fetched whole and a path is used as is"
            )
        return self

    @field_validator("tensor_parallel")
    @classmethod
    def _power_of_two(cls, tp: int) -> int:
        if tp & (tp - 1):
            raise ValueError(f"{tp} is not a power of two (1, 2, 4, 8, ...)")
        return tp

    @property
    def source_kind(self) -> SourceKind:
        return classify_source(self.source)

    @property
    def repo_ref(self) -> RepoRef | None:
        """The repo and revision of a repo id source; None for a URL or a path."""
        return parse_repo_ref(self.source) if self.source_kind is SourceKind.hf_repo else None

    @property
    def selection(self) -> Selection | None:
        """The files llmgw fetches of a repo id source: the default files with ``fetch``
        unset (as ``fetch: {}``), those ``fetch: {include, exclude}`` names; None when llmgw
        fetches none (a URL or a path source, or ``fetch: engine``)."""
        if self.source_kind is not SourceKind.hf_repo or self.fetch == "engine":
            return None
        return (self.fetch if isinstance(self.fetch, FetchFiles) else FetchFiles()).selection()

    @property
    def mode(self) -> ScalingMode:
        """off (no scaling block, or max 0), on-demand (min 0), or always (min >= 1)."""
        if self.scaling is None or self.scaling.max == 0:
            return ScalingMode.off
        return ScalingMode.always if self.scaling.min >= 1 else ScalingMode.on_demand


# --- the file -----------------------------------------------------------------------


class ClusterInfo(Spec):
    name: str = Field(pattern=NAME_PATTERN, description="Name of the cluster.")


class ClusterSpec(Spec):
    """A whole cluster file."""

    cluster: ClusterInfo = Field(description="The cluster's identity.")
    ssh: SshSettings = Field(default_factory=SshSettings, description="How nodes are reached.")
    gateway: GatewaySettings = Field(default_factory=GatewaySettings, description="The gateway daemon.")
    fabrics: dict[str, Fabric] = Field(default_factory=dict, description="Fabrics by name.")
    nodes: list[Node] = Field(default_factory=list, description="The servers.")
    profiles: dict[str, Profile] = Field(default_factory=dict, description="Engine profiles by name.")
    models: list[Model] = Field(default_factory=list, description="The catalog.")

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def model(self, name: str) -> Model:
        return next(m for m in self.models if m.name == name)

    def ssh_for(self, node: Node) -> SshSettings:
        """The top-level ``ssh`` settings with the node's overrides applied."""
        overrides = node.ssh.model_dump(exclude_none=True)
        return self.ssh.model_copy(update=overrides) if overrides else self.ssh


def is_address(text: str) -> bool:
    """True for an IP address or a dotted host name (something that is not a node name)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return "." in text
    return True
