"""The one Summary of the fleet: the capacity numbers shown by ``llmgw status``, the
dashboard and the metrics all come from ``summarize``, so they cannot drift apart.

The gateway adds what a probe cannot see (``Live``: replica health and last use, usage
by key); ``llmgw status`` passes none, and those parts stay empty.

Counting rules: a faulty card is neither used nor free; a GPU is used when a running
llmgw unit names it (label ``X-Llmgw-Gpus``); a whole node is free when it is reachable,
advertises its fabric and none of its cards is used or faulty (a crash-looping, failed
or stopped unit holds none); a model's replica runs when it is ready (``core/observe/health.py``:
the rule ``plan`` replaces by; ``Running.health``), and the others are counted by state.

``llmgw status --nodes a,b`` summarises those nodes only (``scope``): their rows, their
cards, the fabrics they are on and the models that have a unit on them; a replica with
members left out runs when its units on these nodes run, and a model's ``desired`` stays
the fleet's (its other replicas may run on nodes left out).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import Field

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.observe.facts import Fact, GpuHealth, NodeFacts
from llmgw_cli.core.observe.gpu_faults import FaultyCard, faulty_cards, xid_notes
from llmgw_cli.core.observe.hardware import fabric_status, gpu_class
from llmgw_cli.core.observe.health import ReplicaState, worst
from llmgw_cli.core.observe.parse.units import replica_units
from llmgw_cli.core.planning.plan import Answers, Running, running_replicas
from llmgw_cli.core.serving.engine_signals import Signals
from llmgw_cli.core.serving.routing import Health, RoutedReplica, serving_address

# A replica of a model without `scaling.idle_timeout` counts as held idle after this long
# without a request (it is never stopped for it; the dashboard and an alert show it).
IDLE_AFTER = 1800.0


class NodeRow(Fact):
    name: str
    address: str
    reachable: bool
    error: str | None
    gpu_class: str | None
    gpus: int
    used: int
    faulty: int  # cards listed faulty, and cards nvidia-smi cannot open (fallen off the bus)
    faulty_reasons: tuple[str, ...]
    expected: str | None  # mismatch against the declared `gpus`, or None
    topology: str  # "NVLink (7 peers)", "PCIe only", "unknown"
    nvlink_peers: int | None  # most NVLink peers of any card; None: topology unknown (not 0)
    fabric: str | None
    fabric_ok: bool
    fabric_reason: str
    rate_gbps: float | None
    memory_gib: float | None
    models: tuple[str, ...]
    warnings: tuple[str, ...]
    # engine program -> the version the probe read there ("unknown" when it could not)
    engines: dict[str, str] = Field(default_factory=dict)
    # each faulty card with its causes and what to do (``core/observe/gpu_faults.py``)
    faulty_cards: tuple[FaultyCard, ...] = ()

    def engine_versions(self, programs: Mapping[str, str]) -> str:
        """``vllm 0.32.0, sglang 0.5.23``: each engine found, by its name in ``programs``
        (program -> engine)."""
        return ", ".join(f"{programs.get(p, p)} {v}" for p, v in sorted(self.engines.items()))


class ClassRow(Fact):
    gpu_class: str
    total: int
    used: int
    free: int
    faulty: int


class FabricRow(Fact):
    name: str
    kind: str
    nodes: int
    advertising: int
    free_nodes: int
    rate_gbps: float | None
    models_held: tuple[str, ...]


class ModelRow(Fact):
    name: str
    mode: str
    desired: int
    maximum: int
    running: int
    where: tuple[str, ...]
    state: str | None = None  # controller.Phase value; None without the gateway's view
    progress: str = ""  # what a start under way is doing (the gateway's view)
    ready: int | None = None  # replicas in rotation; None without the gateway's view
    # replicas not ready by state (``core/observe/health.py``): {"crash-looping": 1}
    not_ready: dict[str, int] = Field(default_factory=dict)

    @property
    def short(self) -> bool:
        """An always-on model with fewer replicas ready than its ``min`` (the gateway starts
        an on-demand one when asked)."""
        return self.mode == "always" and self.running < self.desired


UNKNOWN = "\u2014"  # a signal no engine reading gives: shown as such, never as 0


class EngineLoad(Fact):
    """A replica's load as its engine reports it on its own /metrics
    (``core/serving/engine_signals.py``). ``read`` False: no usable reading (never read, the
    last one is too old to route on, or the page gave nothing), and the three values are
    None, not 0; a value the engine does not report is None too."""

    read: bool = False
    waiting: float | None = None  # requests queued inside the engine
    running: float | None = None  # requests it is computing
    kv_usage: float | None = None  # share of its KV cache in use, 0..1
    age_seconds: float | None = None  # since the last good reading; None: never read


def count_text(value: float | None) -> str:
    """A request count as shown: ``3``; a huge one in short (``1.2e+09``); None: ``UNKNOWN``."""
    if value is None:
        return UNKNOWN
    return f"{value:.0f}" if value < 1e6 else f"{value:.2g}"


def share_text(value: float | None) -> str:
    """A share of 0..1 as shown: ``42%``; None: ``UNKNOWN``."""
    return UNKNOWN if value is None else f"{value * 100:.0f}%"


def engine_load(signals: Signals | None, age: float | None, stale_after: float) -> EngineLoad:
    """The load to show from a replica's last good reading (``signals``, None: never read)
    taken ``age`` seconds ago: its values while the router would still use them
    (``stale_after``, as ``RoutedReplica.fresh_signals``), none once it is older."""
    if signals is None or age is None:
        return EngineLoad()
    age = round(max(0.0, age), 3)
    if age > stale_after:
        return EngineLoad(age_seconds=age)
    return EngineLoad(
        read=True,
        waiting=signals.waiting,
        running=signals.running,
        kv_usage=signals.kv_usage,
        age_seconds=age,
    )


class HealthRow(Fact):
    """One replica's state as its units say (``core/observe/health.py``)."""

    model: str
    replica: int
    nodes: tuple[str, ...]
    port: int
    state: str  # ReplicaState value
    restarts: int  # by systemd, since its last start by llmgw (its worst unit's)
    exit_status: int | None  # of its worst unit's last engine process
    journal: str = ""  # for one not ready, the journal line that says why (health.telling_line), when read
    load: EngineLoad = EngineLoad()  # its engine's /metrics read by `llmgw status`; not read: unknown


class LiveReplica(Fact):
    """One replica as the gateway sees it."""

    model: str
    address: str
    health: str  # routing.Health value
    in_flight: int
    idle_seconds: float | None  # since its last request or since it became ready; None: not ready
    load: EngineLoad = EngineLoad()  # its engine's /metrics as this gateway process last read it


class UseRow(Fact):
    """Usage of one key and model over a window ending now."""

    window: Literal["hour", "day"]
    key: str
    model: str
    requests: int
    tokens: int


class Live(Fact):
    """What the gateway knows that a probe cannot."""

    replicas: tuple[LiveReplica, ...] = ()
    usage: tuple[UseRow, ...] = ()
    phases: dict[str, str] = Field(default_factory=dict)  # model -> controller.Phase value
    progress: dict[str, str] = Field(default_factory=dict)  # model -> what its start is doing


class ReplicaRow(Fact):
    model: str
    address: str
    health: str
    in_flight: int
    idle_seconds: float | None
    idle: bool  # held with nobody asking: idle for the model's idle_timeout (or IDLE_AFTER)
    load: EngineLoad = EngineLoad()  # its engine's queue and KV cache, as the gateway last read them


class KeyRow(Fact):
    key: str
    requests_hour: int
    tokens_hour: int
    requests_day: int
    tokens_day: int
    models: tuple[str, ...]  # used today


class Summary(Fact):
    nodes: tuple[NodeRow, ...]
    classes: tuple[ClassRow, ...]
    fabrics: tuple[FabricRow, ...]
    models: tuple[ModelRow, ...]
    replicas: tuple[ReplicaRow, ...] = ()
    health: tuple[HealthRow, ...] = ()
    keys: tuple[KeyRow, ...] = ()
    scope: tuple[str, ...] | None = None  # the nodes summarised; None: every node
    # engine program -> its engine (`vllm`), to name the versions of the nodes' rows
    programs: dict[str, str] = Field(default_factory=dict)


def _used_uuids(facts: NodeFacts) -> set[str]:
    """UUIDs of the cards that running llmgw units hold."""
    return {g for u in replica_units(facts) if u.up for g in u.gpus}


def _nvlink_peers(facts: NodeFacts) -> int | None:
    if facts.topology is None:
        return None
    return max((facts.topology.nvlink_peers(g) for g in facts.topology.gpus), default=0)


def _topology(peers: int | None) -> str:
    if peers is None:
        return "unknown"
    return f"NVLink ({peers} peers)" if peers else "PCIe only"


MISSING_CARDS = (
    "a card the driver does not list has fallen off the bus (XID 79) or is disabled; "
    "drain the node and reboot it, reseat or replace the card if it recurs"
)


def _node_row(node: Node, facts: NodeFacts) -> NodeRow:
    fabric = fabric_status(node, facts)
    used_uuids = _used_uuids(facts)
    cards = faulty_cards(facts)
    classes = sorted({gpu_class(g.name) for g in facts.gpus})
    expected = None
    if node.gpus and facts.reachable:
        found = f"{len(facts.gpus)} x {'/'.join(classes) or 'none'}"
        if len(facts.gpus) != node.gpus.count or [c.upper() for c in classes] != [
            node.gpus.gpu_class.upper()
        ]:
            expected = f"declared {node.gpus.count} x {node.gpus.gpu_class}, found {found}"
            if len(facts.gpus) < node.gpus.count:
                expected += f": {MISSING_CARDS}"
    warnings = []
    if facts.cpu and facts.cpu.flags_missing:
        warnings.append(f"CPU lacks {', '.join(facts.cpu.flags_missing)} (a VM on the kvm64 model?)")
    warnings += [f"engine {e.path} not installed" for e in facts.engines if not e.found]
    warnings += [
        f"engine {e.path} cannot load {', '.join(e.missing_libraries)}"
        for e in facts.engines
        if e.missing_libraries
    ]
    warnings += [f"weights folder {w.path} is missing" for w in facts.weights if not w.present]
    warnings += xid_notes(facts)
    if facts.kernel_log == "unreadable":
        warnings.append("the kernel log cannot be read: NVIDIA's XID reports are not seen (`llmgw doctor`)")
    if facts.reachable and facts.gpu_tool != "ok":
        warnings.append(f"nvidia-smi {facts.gpu_tool}")
    return NodeRow(
        name=node.name,
        address=node.address,
        reachable=facts.reachable,
        error=facts.error,
        gpu_class=classes[0] if len(classes) == 1 else ("/".join(classes) or None),
        gpus=len(facts.gpus) + len(facts.lost_gpus),
        used=sum(1 for g in facts.gpus if g.uuid in used_uuids and g.health is GpuHealth.healthy),
        faulty=len(cards),
        faulty_reasons=tuple(f"GPU {c.gpu}: {'; '.join(c.reasons)}" for c in cards),
        faulty_cards=tuple(cards),
        expected=expected,
        topology=_topology(_nvlink_peers(facts)),
        nvlink_peers=_nvlink_peers(facts),
        fabric=node.fabric,
        fabric_ok=fabric.advertises,
        fabric_reason=fabric.reason,
        rate_gbps=fabric.rate_gbps,
        memory_gib=round(facts.memory_total_kib / 2**20, 1) if facts.memory_total_kib else None,
        models=tuple(sorted({m.name for w in facts.weights for m in w.models if m.complete})),
        warnings=tuple(warnings),
        engines={e.path: e.version for e in facts.engines if e.found},
    )


def _replica_rows(spec: ClusterSpec, live: Live) -> tuple[ReplicaRow, ...]:
    models = {m.name: m for m in spec.models}
    rows = []
    for r in sorted(live.replicas, key=lambda r: (r.model, r.address)):
        model = models.get(r.model)
        limit = model.scaling.idle_timeout if model and model.scaling and model.scaling.idle_timeout else None
        after = limit if limit is not None else IDLE_AFTER
        rows.append(
            ReplicaRow(
                model=r.model,
                address=r.address,
                health=r.health,
                in_flight=r.in_flight,
                idle_seconds=r.idle_seconds,
                idle=r.idle_seconds is not None and r.in_flight == 0 and r.idle_seconds >= after,
                load=r.load,
            )
        )
    return tuple(rows)


def _key_rows(usage: tuple[UseRow, ...]) -> tuple[KeyRow, ...]:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    models: dict[str, set[str]] = defaultdict(set)
    for u in usage:
        c = counts[u.key]
        at = 0 if u.window == "hour" else 2
        c[at] += u.requests
        c[at + 1] += u.tokens
        if u.window == "day":
            models[u.key].add(u.model)
    return tuple(
        KeyRow(
            key=k,
            requests_hour=c[0],
            tokens_hour=c[1],
            requests_day=c[2],
            tokens_day=c[3],
            models=tuple(sorted(models[k])),
        )
        for k, c in sorted(counts.items())
    )


def _answers(spec: ClusterSpec, facts: dict[str, NodeFacts], live: Live | None) -> Answers:
    """The gateway's health checks (``live``) as answers by replica: ready, or loading
    (not ready yet), for each replica whose head's address the gateway checks."""
    if live is None:
        return {}
    health = {(r.model, r.address): r.health for r in live.replicas}
    hosts = {n.name: n.engine_host for n in spec.nodes}
    out = {}
    for r in running_replicas(facts):
        head = r.members[0] if r.members else ""
        said = health.get((r.model, serving_address(hosts.get(head, ""), r.port)))
        # loading: it never answered ready yet; failing (ready before) is not a start
        if said in (Health.ready.value, Health.loading.value):
            out[(r.model, r.replica)] = said == Health.ready.value
    return out


def _state(replica: Running, scope: set[str] | None, healthy: bool | None) -> ReplicaState:
    """``replica.health``; within ``scope``, that of its members there (members left out of
    it were not looked at)."""
    if scope is None:
        return replica.health(healthy)
    seen = replica.model_copy(update={"members": tuple(n for n in replica.members if n in scope)})
    return (
        seen.health(healthy if seen.members[:1] == replica.members[:1] else None)
        if seen.members
        else worst([])
    )


def _health_row(replica: Running, state: ReplicaState, journal: str, load: EngineLoad | None) -> HealthRow:
    units = [u.state for u in replica.units.values() if u.state is not None]
    worst_unit = max(units, key=lambda u: u.n_restarts, default=None)
    return HealthRow(
        model=replica.model,
        replica=replica.replica,
        nodes=replica.members,
        port=replica.port,
        state=state.value,
        restarts=worst_unit.n_restarts if worst_unit else 0,
        exit_status=worst_unit.exec_main_status if worst_unit else None,
        journal="" if state is ReplicaState.ready else journal,
        load=load or EngineLoad(),
    )


def summarize(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    live: Live | None = None,
    *,
    scope: Sequence[str] | None = None,
    answers: Answers | None = None,
    journal: Mapping[tuple[str, int], str] | None = None,
    loads: Mapping[tuple[str, int], EngineLoad] | None = None,
) -> Summary:
    """The fleet's numbers from the spec and one snapshot of facts, plus the gateway's
    view (replica health and use, usage by key) when ``live`` is given. ``scope``: only
    those nodes (declared ones, in the file's order) and what is on them; None: every node.
    ``answers``: replicas' health checks, (model, replica) -> ready; ``journal``: the last
    journal line of replicas not ready, when read; ``loads``: what the engines of replicas
    said of their load, when read (the others' stays unknown)."""
    nodes = [n for n in spec.nodes if scope is None or n.name in scope]
    rows = [_node_row(n, facts.get(n.name) or NodeFacts(node=n.name, error="not probed")) for n in nodes]
    classes: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for node in nodes:
        f = facts.get(node.name)
        if f is None or not f.reachable:
            continue
        used = _used_uuids(f)
        for g in f.gpus:
            counts = classes[gpu_class(g.name)]
            counts[0] += 1
            if g.health is GpuHealth.faulty:
                counts[2] += 1
            elif g.uuid in used:
                counts[1] += 1
        if node.gpus is not None and f.lost_gpus:  # cards off the bus: of the declared class
            counts = classes[node.gpus.gpu_class]
            counts[0] += len(f.lost_gpus)
            counts[2] += len(f.lost_gpus)
    class_rows = tuple(
        ClassRow(gpu_class=c, total=t, used=u, faulty=x, free=t - u - x)
        for c, (t, u, x) in sorted(classes.items())
    )
    fabric_rows = []
    for name, fabric in spec.fabrics.items():
        members = [r for r in rows if r.fabric == name]
        if scope is not None and not members:
            continue
        rates = [r.rate_gbps for r in members if r.fabric_ok and r.rate_gbps is not None]
        fabric_rows.append(
            FabricRow(
                name=name,
                kind=fabric.kind,
                nodes=len(members),
                advertising=sum(1 for r in members if r.fabric_ok),
                free_nodes=sum(1 for r in members if r.fabric_ok and r.gpus and not r.used and not r.faulty),
                rate_gbps=min(rates) if rates else None,
                models_held=tuple(sorted({m for r in members for m in r.models})),
            )
        )
    declared = {n.name for n in nodes}
    pool: dict[str, list[RoutedReplica]] = defaultdict(list)
    for r in live.replicas if live else ():
        pool[r.model].append(RoutedReplica(r.model, r.address, health=Health(r.health)))
    answers = answers if answers is not None else _answers(spec, facts, live)
    running: dict[str, list[Running]] = defaultdict(list)
    not_ready: dict[str, Counter[str]] = defaultdict(Counter)
    found: set[str] = set()  # models with a unit on these nodes, running or not
    health_rows = []
    for replica in running_replicas({name: f for name, f in facts.items() if name in declared}):
        found.add(replica.model)
        key = (replica.model, replica.replica)
        state = _state(replica, declared if scope is not None else None, (answers or {}).get(key))
        health_rows.append(_health_row(replica, state, (journal or {}).get(key, ""), (loads or {}).get(key)))
        if state is ReplicaState.ready:
            running[replica.model].append(replica)
        else:
            not_ready[replica.model][state.value] += 1
    model_rows = tuple(
        ModelRow(
            name=m.name,
            mode=m.mode.value,
            desired=m.scaling.min if m.scaling else 0,
            maximum=m.scaling.max if m.scaling else 0,
            running=len(running[m.name]),
            where=tuple(sorted({node for replica in running[m.name] for node in replica.members})),
            state=live.phases.get(m.name) if live else None,
            progress=live.progress.get(m.name, "") if live else "",
            ready=sum(1 for r in pool[m.name] if r.health is Health.ready) if live else None,
            not_ready=dict(sorted(not_ready[m.name].items())),
        )
        for m in spec.models
        if scope is None or m.name in found
    )
    return Summary(
        nodes=tuple(rows),
        classes=class_rows,
        fabrics=tuple(fabric_rows),
        models=model_rows,
        replicas=_replica_rows(spec, live) if live else (),
        health=tuple(health_rows),
        keys=_key_rows(live.usage) if live else (),
        scope=None if scope is None else tuple(n.name for n in nodes),
        programs={p.argv0[0]: p.engine.value for p in spec.profiles.values()},
    )
