"""What each model's engine would run, without asking any node (pure: spec in, values out).

``llmgw render commands`` shows the argv of a replica unit's ``ExecStart=`` and the
environment the engine starts with, rendered by the same functions ``apply`` renders units
with (``engines.py``). What only a probe or the Hub can tell is a placeholder:

- the node: the first node of the file the model fits (``stand_in_node``); a multi-node
  model is shown as its rank 0, the member that serves the API;
- the GPUs (``CUDA_VISIBLE_DEVICES``): one ``<gpu-uuid-N>`` per card; ``NCCL_IB_HCA``,
  which ``apply`` takes from the node's active fabric ports, is not set;
- the port: the profile's first one (``apply`` takes the first free one);
- a repository llmgw fetches whose revision is not a commit: its snapshot folder with
  ``<commit:REVISION>`` for the commit ``apply`` resolves it to then;
- every value from the root-only environment files (the node's engine key, the model's
  secret environment): ``<secret>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model, Node
from llmgw_cli.core.engine.engine_access import engine_env_text, key_flags, secret_env_text, split_env
from llmgw_cli.core.engine.engines import Member, engine_args, environment, pre_start
from llmgw_cli.core.observe.hardware import same_class

SECRET = "<secret>"
# An unpinned repository is rendered at this commit, then shown as COMMIT_PLACEHOLDER:
# apply resolves the revision when it plans, so no commit is known here.
STAND_IN_COMMIT = "0" * 40
COMMIT_PLACEHOLDER = "<commit:{revision}>"


@dataclass(frozen=True)
class EngineCommand:
    """One model's engine as its rank-0 unit on ``node`` would start it."""

    model: str
    engine: str
    node: str
    rank: int
    nodes: int  # members of one replica
    port: int
    argv: tuple[str, ...]  # ExecStart=
    pre_argv: tuple[str, ...] | None  # ExecStartPre= (a Ray head), if any
    env: dict[str, str]
    notes: tuple[str, ...]

    def as_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "engine": self.engine,
            "node": self.node,
            "rank": self.rank,
            "nodes": self.nodes,
            "port": self.port,
            "argv": list(self.argv),
            "pre_argv": list(self.pre_argv) if self.pre_argv is not None else None,
            "env": dict(self.env),
            "notes": list(self.notes),
        }


def fits(model: Model, node: Node) -> bool:
    """Whether the node's declared GPUs could hold one member of the model: its class
    when the model names one, and at least ``tensor_parallel`` cards. A node that declares
    no GPUs fits a model that names no class."""
    if node.gpus is None:
        return model.gpu_class is None
    if model.gpu_class is not None and not same_class(node.gpus.gpu_class, model.gpu_class):
        return False
    return node.gpus.count >= model.tensor_parallel


def stand_in_node(spec: ClusterSpec, model: Model) -> tuple[Node, str | None]:
    """The node the command is rendered for, and a note when none fits (the first node)."""
    for node in spec.nodes:
        if fits(model, node):
            return node, None
    first = spec.nodes[0]
    of_class = f" of class {model.gpu_class}" if model.gpu_class else ""
    wanted = f"{model.tensor_parallel} GPUs{of_class}"
    return first, f"no node declares {wanted}: rendered for the first node, {first.name}"


def stand_in_member(model: Model, node: Node) -> Member:
    """Rank 0 of a replica of ``model`` on ``node``, with placeholder GPU UUIDs."""
    return Member(node, 0, tuple(f"<gpu-uuid-{i}>" for i in range(model.tensor_parallel)))


def unpinned_revision(model: Model) -> str | None:
    """The revision of a fetched repository that is not yet a commit, else None."""
    ref = model.repo_ref
    if ref is None or model.selection is None or ref.pinned:
        return None
    return ref.revision


def renderable(model: Model) -> Model:
    """``model`` at the stand-in commit when its revision is not resolved: ``model_path``
    needs a commit for the snapshot folder."""
    ref = model.repo_ref
    if ref is None or unpinned_revision(model) is None:
        return model
    return model.model_copy(update={"source": f"{ref.repo}@{STAND_IN_COMMIT}"})


def file_env(spec: ClusterSpec, model: Model) -> dict[str, str]:
    """The variables the unit's ``EnvironmentFile=`` lines set, each value hidden: the
    node's engine key file, then the model's secret file (systemd reads them in order)."""
    texts = [engine_env_text(SECRET), secret_env_text(spec, model) or ""]
    names = [
        line.split("=", 1)[0]
        for text in texts
        for line in text.splitlines()
        if line and not line.startswith("#")
    ]
    return dict.fromkeys(names, SECRET)


def engine_command(spec: ClusterSpec, model: Model) -> EngineCommand:
    """What the rank-0 unit of one replica of ``model`` runs, as ``replica_unit`` writes it."""
    profile = spec.profiles[model.profile]
    node, misfit = stand_in_node(spec, model)
    member = stand_in_member(model, node)
    port, dist_port = profile.ports.first, profile.ports.first + 1
    shown = renderable(model)
    argv = engine_args(spec, shown, member, port=port, head=member.node, dist_port=dist_port)
    argv += key_flags(profile.engine, profile.user)
    pre = pre_start(spec, shown, member, dist_port)
    plain, _ = split_env(spec, shown, environment(spec, shown, member))
    # systemd: what an EnvironmentFile= sets overrides Environment=
    env = {**plain, **file_env(spec, shown)}
    return EngineCommand(
        model=model.name,
        engine=profile.engine.value,
        node=member.node.name,
        rank=member.rank,
        nodes=model.nodes,
        port=port,
        argv=tuple(_unstand(model, argv)),
        pre_argv=tuple(_unstand(model, pre)) if pre else None,
        env=dict(sorted(env.items())),
        notes=tuple(n for n in (misfit, _commit_note(model), _rank_note(model)) if n),
    )


def _unstand(model: Model, words: list[str]) -> list[str]:
    revision = unpinned_revision(model)
    if revision is None:
        return words
    placeholder = COMMIT_PLACEHOLDER.format(revision=revision)
    return [w.replace(STAND_IN_COMMIT, placeholder) for w in words]


def _commit_note(model: Model) -> str | None:
    revision = unpinned_revision(model)
    if revision is None:
        return None
    return (
        f"revision {revision} is resolved to a commit by apply: the snapshot folder's commit is a placeholder"
    )


def _rank_note(model: Model) -> str | None:
    if model.nodes == 1:
        return None
    return f"rank 0 of {model.nodes} nodes (serves the API); the other ranks run their own command"


def engine_commands(spec: ClusterSpec) -> list[EngineCommand]:
    """Every model's command, in the file's order."""
    return [engine_command(spec, m) for m in spec.models]
