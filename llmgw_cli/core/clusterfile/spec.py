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
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from llmgw_cli.core.clusterfile import grammar
from llmgw_cli.core.clusterfile.grammar import whole
from llmgw_cli.core.clusterfile.quantities import Duration, Size
from llmgw_cli.core.clusterfile.values import (
    EngineUser,
    EnvName,
    FirewallEntry,
    Host,
    Interface,
    IpAddress,
    JumpHost,
    UserName,
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


# The base class and the gateway section live in their own modules; re-exported here.
from llmgw_cli.core.clusterfile.base import Spec  # noqa: E402
from llmgw_cli.core.clusterfile.gateway_settings import (  # noqa: E402
    ClientTimeouts,
    GatewaySettings,
    GatewayTls,
    UpstreamTimeouts,
)

__all__ = ["ClientTimeouts", "GatewaySettings", "GatewayTls", "Spec", "UpstreamTimeouts"]


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
