"""A plan's command lines against the flags of the engine version each node has.

Every member a plan starts or keeps is rendered as its unit runs it, and each word that is
a flag its node's engine version does not accept (``core/engine/engine_flags.py``) is a problem:
the engine would exit at once with a usage error, and every restart would do the same.
The version is the one the probe read on the node; when it could not be read, the one the
profile declares. A version llmgw has no table for is a warning (its flags go unchecked),
and so is a node whose version is not the one the profile is written for.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Engine, Model
from llmgw_cli.core.engine.engine_flags import has_tables, release, table, unknown_flags
from llmgw_cli.core.engine.engines import Member, engine_args
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Action, Plan

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class FlagProblem:
    """A flag the engine on ``node`` refuses. ``source``: the ``args`` entry of the cluster
    file it came from (None: llmgw put it there)."""

    node: str
    model: str
    engine: str
    version: str
    flag: str
    source: Loc | None

    @property
    def message(self) -> str:
        return (
            f"{self.engine} {self.version} on {self.node} does not accept {self.flag} "
            f"(model {self.model}): the engine would exit with a usage error"
        )


@dataclass(frozen=True)
class FlagReport:
    problems: tuple[FlagProblem, ...]
    warnings: tuple[str, ...]


def check_flags(spec: ClusterSpec, facts: dict[str, NodeFacts], plan: Plan) -> FlagReport:
    """The problems and warnings of every member ``plan`` starts (``+``, ``~``) or keeps (``=``)."""
    problems: dict[FlagProblem, None] = {}
    warnings: dict[str, None] = {}
    models = {m.name: m for m in spec.models}
    for action in plan.actions:
        model = models.get(action.model)
        if action.op == "-" or model is None:
            continue
        for rank, node in enumerate(action.nodes):
            found, said = _member(spec, facts.get(node), model, action, rank)
            problems.update(dict.fromkeys(found))
            warnings.update(dict.fromkeys(said))
    return FlagReport(tuple(problems), tuple(warnings))


def _member(
    spec: ClusterSpec, facts: NodeFacts | None, model: Model, action: Action, rank: int
) -> tuple[list[FlagProblem], list[str]]:
    profile = spec.profiles[model.profile]
    engine = profile.engine.value
    node = action.nodes[rank]
    ray_worker = profile.engine is Engine.vllm and profile.multi_node == "ray" and rank > 0
    declared = {n.name for n in spec.nodes}
    if ray_worker or not has_tables(engine) or not set(action.nodes) <= declared:
        return [], []  # a Ray worker runs `ray start`; llama-server's flags have no table
    probed = _probed(facts, profile.argv0[0])
    version = probed or profile.version
    warnings = []
    if probed and profile.version and release(probed) != release(profile.version):
        warnings.append(
            f"{node} has {engine} {probed}; profile {model.profile} is written for {profile.version}"
        )
    if version is None:
        return [], [*warnings, f"flags not checked: the {engine} version on {node} is not known"]
    flags = table(engine, version)
    if flags is None:
        return [], [*warnings, f"flags not checked: no table for {engine} {release(version)}"]
    argv = _argv(spec, model, action, rank)
    start = len(argv) - len(profile.args) - len(model.args)
    found = [
        FlagProblem(node, model.name, engine, flags.version, word, _source(spec, model, start, i))
        for i, word in unknown_flags(flags, argv)
    ]
    return found, warnings


def _probed(facts: NodeFacts | None, program: str) -> str | None:
    """The version the probe read of ``program`` on the node; None when it could not."""
    engines = facts.engines if facts is not None else ()
    version = next((e.version for e in engines if e.path == program), "unknown")
    return None if version == "unknown" else version


def _argv(spec: ClusterSpec, model: Model, action: Action, rank: int) -> list[str]:
    """The member's command line after the program and its leading words (``vllm serve``)."""
    nodes = {n.name: n for n in spec.nodes}
    member = Member(nodes[action.nodes[rank]], rank, ())
    port = action.port or 0
    full = engine_args(spec, model, member, port=port, head=nodes[action.nodes[0]], dist_port=port + 1)
    return full[len(spec.profiles[model.profile].argv0) :]


def _source(spec: ClusterSpec, model: Model, start: int, index: int) -> Loc | None:
    """Where the argv word ``index`` was written: the profile's ``args`` from ``start``,
    then the model's."""
    profile_args = len(spec.profiles[model.profile].args)
    if index >= start + profile_args:
        return ("models", spec.models.index(model), "args", index - start - profile_args)
    if index >= start:
        return ("profiles", model.profile, "args", index - start)
    return None
