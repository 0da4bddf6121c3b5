"""The values the gateways' store keeps, and how both implementations write and read
them: ``sqlite.py`` (the protocol, SQLite) and ``postgres.py`` (PostgreSQL) share this module,
so neither imports the other. Callers import these names from ``sqlite.py``.

Everything read back from a store is treated as written by someone else: a publication
that does not parse is read as an empty one, a key row that does not parse as a revoked
key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime

from llmgw_cli.core.planning.cordon import REASON_MOST, Cordon
from llmgw_cli.core.serving.keys import ApiKey
from llmgw_cli.core.serving.limits import Limits, as_dict, from_dict, window_end

MEMBER_TTL = 10.0  # seconds without a heartbeat after which a gateway process counts as gone
# 1: keys, usage and last use only (one gateway process); 2: shared; 3: key limits; 4: cordons
SCHEMA_VERSION = 4
BATCHES_KEPT = 7 * 86400.0  # seconds a usage batch id is remembered (its retries come sooner)
COUNTERS_KEPT = 300.0  # seconds a counter's window is kept after it ended
COUNTERS = ("requests", "tokens", "budget")  # the names of the counters kept per key and window
KEY_COLUMNS = "name, digest, models, expires, created, revoked, admin, limits"  # parse_key's order
CORDON_COLUMNS = "node, reason, who, since, draining"  # parse_cordon's order


@dataclass(frozen=True)
class Usage:
    """Totals for one (day, key, model)."""

    day: str
    key: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    latency_ms: float = 0.0  # sum; divide by requests for the mean

    def row(self) -> tuple[str, str, str, int, int, int, int, float]:
        """In the column order of both stores' ``usage`` table."""
        return (
            self.day,
            self.key,
            self.model,
            self.requests,
            self.prompt_tokens,
            self.completion_tokens,
            self.errors,
            self.latency_ms,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "day": self.day,
            "key": self.key,
            "model": self.model,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "errors": self.errors,
            "mean_latency_ms": round(self.latency_ms / self.requests, 3) if self.requests else 0.0,
        }


@dataclass(frozen=True)
class ModelState:
    """One model as the leader's controller sees it, published for the followers: what
    ``/v1/models`` and a 503 answer say about a model no follower controls itself."""

    phase: str  # core.controller.Phase's value
    progress: str = ""  # what a start does now ("fetching weights on node03", ...)
    failures: int = 0  # starts failed in a row
    last_failure: str = ""  # why the last start failed
    retry_at: float | None = None  # Unix time the back-off ends; None: no back-off runs


@dataclass(frozen=True)
class Published:
    """The replica set the leader publishes after every look at the fleet: the serving
    addresses by model (what discovery found: followers health-check them themselves), the
    addresses being drained, and each model's state. ``version`` grows with every
    publication; ``fence`` is the leader's fencing number when it wrote it."""

    version: int
    fence: int
    leader: str  # the member that wrote it
    at: float  # Unix time it was written
    replicas: dict[str, list[str]]
    draining: list[str]
    models: dict[str, ModelState]


@dataclass(frozen=True)
class Publication:
    """What a leader hands the store to publish (``Published`` is what is read back)."""

    replicas: dict[str, list[str]]
    draining: list[str]
    models: dict[str, ModelState]


# --- the publication as stored: JSON, read back as hostile data -------------------------


def encode_published(publication: Publication) -> str:
    return json.dumps(
        {
            "replicas": {m: sorted(a) for m, a in sorted(publication.replicas.items())},
            "draining": sorted(publication.draining),
            "models": {m: asdict(s) for m, s in sorted(publication.models.items())},
        },
        separators=(",", ":"),
    )


def _strings(value: object) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _model_state(value: object) -> ModelState | None:
    if not isinstance(value, dict) or not isinstance(value.get("phase"), str):
        return None
    retry = value.get("retry_at")
    failures = value.get("failures")
    return ModelState(
        phase=value["phase"],
        progress=p if isinstance(p := value.get("progress"), str) else "",
        failures=failures if isinstance(failures, int) and not isinstance(failures, bool) else 0,
        last_failure=f if isinstance(f := value.get("last_failure"), str) else "",
        retry_at=float(retry) if isinstance(retry, int | float) and not isinstance(retry, bool) else None,
    )


def decode_published(text: str, version: int, fence: int, leader: str, at: float) -> Published:
    """A stored publication; what does not have the expected shape is left out."""
    try:
        data = json.loads(text)
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    replicas = data.get("replicas")
    models = data.get("models")
    states = {
        m: s
        for m, v in (models.items() if isinstance(models, dict) else [])
        if (s := _model_state(v)) is not None
    }
    return Published(
        version=version,
        fence=fence,
        leader=leader,
        at=at,
        replicas={m: _strings(a) for m, a in (replicas.items() if isinstance(replicas, dict) else [])},
        draining=_strings(data.get("draining")),
        models=states,
    )


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def encode_limits(limits: Limits) -> str:
    """The ``api_keys.limits`` column: ``as_dict``'s JSON."""
    return json.dumps(as_dict(limits), separators=(",", ":"))


def parse_key(r: tuple[object, ...]) -> ApiKey:
    """An ``api_keys`` row (``KEY_COLUMNS``). A row that does not parse fails closed: the
    key comes back revoked, never as one that allows every model (what an empty model
    list means), never expires or has no limits."""
    try:
        models = json.loads(str(r[2]))
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ValueError("models: not a list of names")
        expires = _time(r[3] if isinstance(r[3], str) else None)
        created = _time(r[4] if isinstance(r[4], str) else None)
        limits = from_dict(json.loads(str(r[7])))
    except ValueError:
        return ApiKey(name=str(r[0]), digest=str(r[1]), models=(), revoked=True)
    return ApiKey(
        name=str(r[0]),
        digest=str(r[1]),
        models=tuple(models),
        expires=expires,
        created=created,
        revoked=bool(r[5]),
        admin=bool(r[6]),
        limits=limits,
    )


def counter_end(counter: str, window: str) -> float:
    """When a counter's window ends, the time it may be pruned after; ValueError for a
    counter or a window of a form the stores do not keep (a caller's mistake)."""
    if counter not in COUNTERS:
        raise ValueError(f"counter {counter!r}: one of {', '.join(COUNTERS)}")
    return window_end(window)


# --- cordons (``core/planning/cordon.py``) ---------------------------------------------


def cordon_row(cordon: Cordon) -> tuple[str, str, str, float, bool]:
    """A ``cordons`` row (``CORDON_COLUMNS``)."""
    return (cordon.node, cordon.reason, cordon.by, cordon.since, cordon.draining)


def parse_cordon(r: tuple[object, ...]) -> Cordon | None:
    """A ``cordons`` row; None when it does not parse (never shown as it is)."""
    node, reason, who, since, draining = r
    if not all(isinstance(x, str) and len(x) <= REASON_MOST for x in (node, reason, who)):
        return None
    if isinstance(since, bool) or not isinstance(since, int | float):
        return None
    printable = all(c.isprintable() for c in f"{node}{reason}{who}")
    return Cordon(
        node=str(node),
        reason=str(reason) if printable else "?",
        by=str(who) if printable else "?",
        since=float(since),
        draining=bool(draining),
    )
