"""Where each model replica goes: spec + facts + running replicas -> desired replicas.

Pure and deterministic: the same inputs give the same placement. Rules, in order:

- only healthy cards of the model's class with enough memory; a faulty card is never used;
- a tensor-parallel group is a set of cards fully connected by NVLink where one exists
  (on bridged PCIe boxes that is a bridged pair); otherwise the closest set, never across
  ``SYS`` when avoidable; unknown topology takes the lowest free indices, with a warning;
- a multi-node replica takes whole nodes, all in one fabric, only nodes that advertise it;
- nodes that already hold the weights come first (a preference, never a filter), then
  nodes with fewer replicas of the same model (spread), then the fullest node that fits
  (whole nodes stay free for multi-node replicas), then the name;
- running replicas are given first and keep their cards;
- a replacement may name the nodes it prefers (its predecessor's): the first of them that
  fits wins, before every rule above but the card rules;
- a cordoned node (out for maintenance: ``core/planning/cordon.py``) takes no new replica;
  those it runs keep their cards;
- every replica that cannot be placed comes back with a sentence saying why.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model, Node
from llmgw_cli.core.observe.facts import GpuHealth, NodeFacts, Topology
from llmgw_cli.core.observe.hardware import fabric_status, gpu_class, same_class
from llmgw_cli.core.weights.snapshot import snapshot_name

# Closeness of a link for tensor parallelism, best first, as `nvidia-smi topo -m` names them:
# one PCIe switch, several switches, a host bridge, host bridges of one NUMA node, across NUMA nodes.
_LINK_RANK = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}


def link_rank(kind: str) -> int:
    """0 for any NVLink bond, then PIX < PXB < PHB < NODE < SYS; unknown ranks last."""
    return 0 if kind.startswith("NV") else _LINK_RANK.get(kind, 6)


@dataclass(frozen=True)
class Slot:
    """One node's share of a replica."""

    node: str
    gpus: tuple[int, ...]
    uuids: tuple[str, ...]


@dataclass(frozen=True)
class PlacedReplica:
    """Where one replica of a model runs: its GPUs on each of its nodes."""

    model: str
    slots: tuple[Slot, ...]  # one per node; the first is rank 0 (serves HTTP)
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Unplaced:
    model: str
    reason: str


@dataclass(frozen=True)
class Placement:
    replicas: tuple[PlacedReplica, ...]
    unplaced: tuple[Unplaced, ...]


@dataclass
class _NodeState:
    node: Node
    facts: NodeFacts
    free: list[int]  # healthy, unused GPU indices
    uuid: dict[int, str]
    memory: dict[int, int | None]
    cls: str | None
    faulty: list[int]
    holds: frozenset[str]  # names of complete models in its weights folders
    replicas: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def whole(self) -> bool:
        return bool(self.uuid) and len(self.free) == len(self.uuid) - len(self.faulty) and not self.faulty


def _weights_name(model: Model) -> str:
    """The name a model's weights have in a weights directory: a fetched repository's
    snapshot ``hf/<org>--<name>/<commit>`` ("" before its revision is pinned: nobody holds
    it yet), else the folder or file name."""
    ref = model.repo_ref
    if ref is not None and model.selection is not None:
        return snapshot_name(ref.repo, ref.revision) if ref.pinned else ""
    return model.source.rstrip("/").rsplit("/", 1)[-1]


def _holds_weights(state: _NodeState, model: Model) -> bool:
    return _weights_name(model) in state.holds


def _group(free: list[int], size: int, topo: Topology | None) -> tuple[tuple[int, ...], str | None] | None:
    """The best set of ``size`` free cards, and a warning when it is not what one would want."""
    if len(free) < size:
        return None
    if size == 1 or topo is None or not set(free) <= set(topo.gpus):
        warning = None if size == 1 else "topology unknown: took the lowest free GPU indices"
        return tuple(sorted(free)[:size]), warning
    best: tuple[int, tuple[int, ...]] | None = None
    for combo in itertools.combinations(sorted(free), size):
        worst = max(link_rank(topo.link(a, b)) for a, b in itertools.combinations(combo, 2))
        if best is None or worst < best[0]:
            best = (worst, combo)
            if worst == 0:
                break
    assert best is not None
    worst, combo = best
    warning = None if worst == 0 else f"no NVLink-connected set of {size} GPUs free; the group spans PCIe"
    if worst >= _LINK_RANK["SYS"]:
        warning = f"no set of {size} GPUs without a SYS (cross-socket) link is free"
    return combo, warning


class Placer:
    """The cluster's free cards as replicas are placed, taken and given back (``place``
    runs one; ``make_plan`` steps one through a rolling replacement)."""

    def __init__(
        self,
        spec: ClusterSpec,
        facts: dict[str, NodeFacts],
        running: list[PlacedReplica],
        cordoned: frozenset[str] = frozenset(),
    ) -> None:
        self.spec = spec
        self.cordoned = cordoned  # node names: their running replicas are taken, nothing new goes there
        self.states: dict[str, _NodeState] = {}
        for node in spec.nodes:
            f = facts.get(node.name)
            if f is None or not f.reachable:
                continue
            healthy = [g for g in f.gpus if g.health is GpuHealth.healthy]
            classes = {gpu_class(g.name) for g in f.gpus}
            self.states[node.name] = _NodeState(
                node=node,
                facts=f,
                free=[g.index for g in healthy],
                uuid={g.index: g.uuid for g in f.gpus},
                memory={g.index: g.memory_total for g in f.gpus},
                cls=classes.pop() if len(classes) == 1 else None,
                faulty=[g.index for g in f.gpus if g.health is GpuHealth.faulty],
                holds=frozenset(m.name for w in f.weights for m in w.models if m.complete),
            )
        # Index for single-node search: class -> free GPU count -> node names, sorted.
        # Searching buckets instead of sorting every node keeps a 2,000-node placement fast.
        self.buckets: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
        self.holders: dict[str, list[str]] = defaultdict(list)
        for name, state in sorted(self.states.items()):
            self.buckets[(state.cls or "").upper()][len(state.free)].append(name)
            for held in state.holds:
                self.holders[held].append(name)
        for replica in running:
            self.take(replica)

    def take(self, replica: PlacedReplica) -> None:
        """``replica``'s cards are used from now on."""
        for slot in replica.slots:
            state = self.states.get(slot.node)
            if state is not None:
                self._resize(state, [i for i in state.free if i not in slot.gpus])
                state.replicas[replica.model] += 1

    def release(self, replica: PlacedReplica) -> None:
        """``replica``'s cards are free again (it stopped); faulty ones stay unusable."""
        for slot in replica.slots:
            state = self.states.get(slot.node)
            if state is not None:
                healthy = {g.index for g in state.facts.gpus if g.health is GpuHealth.healthy}
                self._resize(state, sorted(set(state.free) | (set(slot.gpus) & healthy)))
                state.replicas[replica.model] = max(state.replicas[replica.model] - 1, 0)

    def _resize(self, state: _NodeState, free: list[int]) -> None:
        bucket = self.buckets[(state.cls or "").upper()]
        bucket[len(state.free)].remove(state.node.name)
        state.free = free
        bisect.insort(bucket[len(state.free)], state.node.name)

    def one(self, model: Model, prefer: tuple[str, ...] = ()) -> PlacedReplica | Unplaced:
        """Place one replica of ``model`` (its cards are taken), on the nodes of ``prefer``
        when one fits (in that order), else by the usual rules."""
        return self.multi(model, prefer) if model.nodes > 1 else self.single(model, prefer)

    def _fits(self, state: _NodeState, model: Model) -> bool:
        if state.node.name in self.cordoned:
            return False
        if model.gpu_class and not (state.cls and same_class(state.cls, model.gpu_class)):
            return False
        return len(self._usable(state, model)) >= model.tensor_parallel

    def _usable(self, state: _NodeState, model: Model) -> list[int]:
        if not model.gpu_memory:
            return state.free
        need = model.gpu_memory / 2**20
        return [i for i in state.free if (state.memory.get(i) or 0) >= need]

    def _rank(self, state: _NodeState, model: Model) -> tuple[int, int, int, str]:
        return (
            0 if _holds_weights(state, model) else 1,
            state.replicas[model.name],
            len(state.free),
            state.node.name,
        )

    def _best_node(self, model: Model) -> _NodeState | None:
        """The fitting node that ranks first (see ``_rank``), found without a full sort:
        weight holders first; otherwise, per class, the first node of the fullest bucket
        that fits and holds no replica of this model yet (spread), else the least-loaded."""
        holders = [self.states[n] for n in self.holders.get(_weights_name(model), [])]
        fitting = [s for s in holders if self._fits(s, model)]
        if fitting:
            return min(fitting, key=lambda s: self._rank(s, model))
        classes = [model.gpu_class.upper()] if model.gpu_class else sorted(self.buckets)
        best: _NodeState | None = None
        for cls in classes:
            for free in sorted(k for k in self.buckets[cls] if k >= model.tensor_parallel):
                for name in self.buckets[cls][free]:
                    state = self.states[name]
                    if not self._fits(state, model):
                        continue
                    if best is None or self._rank(state, model) < self._rank(best, model):
                        best = state
                    if state.replicas[model.name] == 0:
                        break  # later names in this bucket rank lower
                if best is not None and best.replicas[model.name] == 0:
                    break  # larger buckets rank lower
        return best

    def single(self, model: Model, prefer: tuple[str, ...] = ()) -> PlacedReplica | Unplaced:
        preferred = (self.states[n] for n in prefer if n in self.states)
        state = next((s for s in preferred if self._fits(s, model)), None) or self._best_node(model)
        if state is not None:
            chosen = _group(self._usable(state, model), model.tensor_parallel, state.facts.topology)
            assert chosen is not None  # _fits guarantees enough usable cards
            gpus, warning = chosen
            replica = PlacedReplica(
                model.name,
                (Slot(state.node.name, gpus, tuple(state.uuid[i] for i in gpus)),),
                (warning,) if warning else (),
            )
            self.take(replica)
            return replica
        return Unplaced(model.name, self._why_single(model))

    def multi(self, model: Model, prefer: tuple[str, ...] = ()) -> PlacedReplica | Unplaced:
        by_fabric: dict[str, list[_NodeState]] = defaultdict(list)
        for state in self.states.values():
            status = fabric_status(state.node, state.facts)
            if status.advertises and status.fabric and state.whole and self._fits(state, model):
                by_fabric[status.fabric].append(state)
        options = []
        for fabric, states in sorted(by_fabric.items()):
            if len(states) >= model.nodes:
                chosen = sorted(states, key=lambda s: (s.node.name not in prefer, self._rank(s, model)))
                chosen = chosen[: model.nodes]
                preferred = sum(1 for s in chosen if s.node.name in prefer)
                holding = sum(1 for s in chosen if _holds_weights(s, model))
                options.append((-preferred, -holding, fabric, chosen))
        if not options:
            return Unplaced(model.name, self._why_multi(model, by_fabric))
        *_, chosen = min(options, key=lambda o: (o[0], o[1], o[2]))
        slots = []
        for state in chosen:
            gpus = tuple(sorted(self._usable(state, model))[: model.tensor_parallel])
            slots.append(Slot(state.node.name, gpus, tuple(state.uuid[i] for i in gpus)))
        replica = PlacedReplica(model.name, tuple(slots))
        self.take(replica)
        return replica

    def _what(self, model: Model) -> str:
        cls = f" {model.gpu_class}" if model.gpu_class else ""
        mem = f" with {model.gpu_memory / 2**30:g} GiB" if model.gpu_memory else ""
        return f"{model.tensor_parallel} free{cls} GPU{'s' if model.tensor_parallel > 1 else ''}{mem}"

    def _why_single(self, model: Model) -> str:
        best = max(
            (
                len(self._usable(s, model))
                for s in self.states.values()
                if (not model.gpu_class or (s.cls and same_class(s.cls, model.gpu_class)))
                and s.node.name not in self.cordoned
            ),
            default=0,
        )
        unreachable = len(self.spec.nodes) - len(self.states)
        tail = f"; {unreachable} node(s) unreachable" if unreachable else ""
        tail += self._cordoned_tail()
        return f"{model.name} needs {self._what(model)} on one node; the most any node has is {best}{tail}"

    def _cordoned_tail(self) -> str:
        shut = sorted(n for n in self.cordoned if n in self.states)
        return f"; cordoned: {', '.join(shut)}" if shut else ""

    def _why_multi(self, model: Model, ready: dict[str, list[_NodeState]]) -> str:
        cls = f" {model.gpu_class}" if model.gpu_class else ""
        parts = []
        for fabric in self.spec.fabrics:
            blocked = []
            for node in self.spec.nodes:
                if node.fabric != fabric:
                    continue
                state = self.states.get(node.name)
                if state is None:
                    blocked.append(f"{node.name}: unreachable")
                elif node.name in self.cordoned:
                    blocked.append(f"{node.name}: cordoned")
                elif state in ready.get(fabric, []):
                    continue
                elif not fabric_status(node, state.facts).advertises:
                    blocked.append(f"{node.name}: {fabric_status(node, state.facts).reason}")
                elif state.faulty:
                    blocked.append(f"{node.name}: GPU {', '.join(map(str, state.faulty))} faulty")
                elif not state.whole:
                    blocked.append(f"{node.name}: in use")
            note = f" ({'; '.join(blocked[:3])}{'; ...' if len(blocked) > 3 else ''})" if blocked else ""
            parts.append(f"{fabric} has {len(ready.get(fabric, []))} free{note}")
        where = ", ".join(parts) if parts else "no fabric is declared"
        return f"{model.name} needs {model.nodes} whole{cls} nodes in one fabric; {where}"


def place(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    running: list[PlacedReplica],
    want: dict[str, int],
    cordoned: frozenset[str] = frozenset(),
) -> Placement:
    """Place ``want[model]`` new replicas of each model around the ``running`` ones, on
    no node of ``cordoned``.

    Multi-node models go first (they need whole nodes), then larger groups, then spec order.
    """
    placer = Placer(spec, facts, running, cordoned)
    order = sorted(
        (m for m in spec.models if want.get(m.name, 0) > 0),
        key=lambda m: (-m.nodes, -m.tensor_parallel, spec.models.index(m)),
    )
    replicas: list[PlacedReplica] = []
    unplaced: list[Unplaced] = []
    for model in order:
        for _ in range(want[model.name]):
            result = placer.one(model)
            if isinstance(result, PlacedReplica):
                replicas.append(result)
            else:
                unplaced.append(result)
    return Placement(tuple(replicas), tuple(unplaced))
