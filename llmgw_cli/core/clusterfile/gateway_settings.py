"""The ``gateway`` section of the cluster file: the daemon's listeners, store, timeouts,
queues and controller settings (its ``description`` texts are the documentation, as in
``spec.py``, which re-exports these classes)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from llmgw_cli.core.clusterfile.base import Spec
from llmgw_cli.core.clusterfile.quantities import Duration, PositiveDuration, Size
from llmgw_cli.core.clusterfile.values import (
    AbsolutePlainWord,
    FirewallEntry,
    Host,
    Listen,
    PlainWord,
    StoreUrl,
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
    http_server: Literal["httptools", "aiohttp"] = Field(
        "httptools",
        description="The HTTP server of the public listener: `httptools`, the gateway's own "
        "lean HTTP/1.1 server (less CPU per request), or `aiohttp`'s. Both keep the same "
        "timeouts, limits and answers; the admin and metrics listeners are always aiohttp's.",
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
