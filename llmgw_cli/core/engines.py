"""Engine command lines and systemd units for replicas (pure: spec and placement in, text out).

Per REFERENCE.md sections 4 and 5: the unit is ``Type=exec`` (a missing binary or user
fails the start), restarts on failure after a pause, kills the whole cgroup on stop so GPU
memory is freed, lifts the memlock limit for RDMA, selects cards by UUID in PCI order,
and passes the engine a key it reads from a root-only EnvironmentFile, so the engine
refuses traffic that did not come through the gateway.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from llmgw_cli.core.render import render
from llmgw_cli.core.spec import ClusterSpec, Engine, Model, Node, Profile, SourceKind

ENGINE_ENV_FILE = "/etc/llmgw/engine.env"
ENGINE_KEY_VAR = "LLMGW_ENGINE_KEY"
UNIT_DIR = "/etc/systemd/system"


@dataclass(frozen=True)
class Member:
    """One node's part of a replica: rank 0 serves the HTTP API."""

    node: Node
    rank: int
    gpu_uuids: tuple[str, ...]
    nccl_ib_hca: str = ""


@dataclass(frozen=True)
class ReplicaUnit:
    node: str
    name: str  # unit file name
    text: str


def slug(name: str) -> str:
    """A model name made safe for a unit name: ``Qwen/Qwen2.5-7B`` -> ``qwen-qwen2.5-7b``."""
    return re.sub(r"[^a-z0-9.-]+", "-", name.lower()).strip("-.")


def unit_name(model: str, replica: int) -> str:
    return f"llmgw-{slug(model)}-{replica}.service"


def spec_hash(spec: ClusterSpec, model: Model) -> str:
    """Digest of everything in the spec that shapes this model's units: a change means the
    running replicas are out of date (``~`` in the plan)."""
    payload = {
        "model": model.model_dump(mode="json", exclude={"scaling"}),
        "profile": spec.profiles[model.profile].model_dump(mode="json"),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_path(model: Model, node: Node) -> str:
    """What the engine is given as the model: a repo id untouched (the engine resolves it),
    an absolute path as is; ``./x`` and downloaded URLs live in the node's first weights
    folder."""
    kind = model.source_kind
    if kind is SourceKind.hf_repo or model.source.startswith("/"):
        return model.source
    base = node.weights[0].path if node.weights else "/var/lib/llmgw/models"
    name = model.source.removeprefix("./") if kind is SourceKind.path else model.source.rsplit("/", 1)[-1]
    return f"{base.rstrip('/')}/{name}"


def engine_args(
    spec: ClusterSpec, model: Model, member: Member, *, port: int, head: Node, dist_port: int
) -> list[str]:
    """The full argv of one member of a replica."""
    profile = spec.profiles[model.profile]
    key = "${" + ENGINE_KEY_VAR + "}"
    path = model_path(model, member.node)
    tp, count, rank = model.tensor_parallel, model.nodes, member.rank
    argv = profile.argv0
    if profile.engine is Engine.vllm and count > 1 and profile.multi_node == "ray":
        if rank > 0:  # a Ray worker node: joins the head's cluster and holds its GPUs
            return [ray_program(profile), "start", f"--address={head.address}:{dist_port}", "--block"]
        argv += [path, "--host", "0.0.0.0", "--port", str(port), "--served-model-name", model.name]
        argv += ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(count)]
        argv += ["--distributed-executor-backend", "ray", "--api-key", key]
    elif profile.engine is Engine.vllm:
        argv += [path, "--host", "0.0.0.0", "--port", str(port), "--served-model-name", model.name]
        argv += ["--tensor-parallel-size", str(tp), "--api-key", key]
        if count > 1:
            argv += ["--pipeline-parallel-size", str(count), "--nnodes", str(count), "--node-rank", str(rank)]
            argv += ["--master-addr", head.address, "--master-port", str(dist_port)]
            if rank > 0:
                argv.append("--headless")
    elif profile.engine is Engine.sglang:
        argv += ["--model-path", path, "--host", "0.0.0.0", "--port", str(port)]
        argv += ["--served-model-name", model.name, "--tp", str(tp * count), "--api-key", key]
        if count > 1:
            argv += ["--nnodes", str(count), "--node-rank", str(rank)]
            argv += ["--dist-init-addr", f"{head.address}:{dist_port}"]
    else:
        argv += ["-m", path, "--host", "0.0.0.0", "--port", str(port), "-a", model.name, "--api-key", key]
    return argv + list(profile.args) + list(model.args)


def ray_program(profile: Profile) -> str:
    """Ray's CLI from the same environment as the engine (``/opt/vllm/bin/ray`` beside
    ``/opt/vllm/bin/vllm``), else ``ray`` on PATH."""
    program = profile.argv0[0]
    return program.rsplit("/", 1)[0] + "/ray" if "/" in program else "ray"


def pre_start(spec: ClusterSpec, model: Model, member: Member, dist_port: int) -> list[str] | None:
    """What runs before the engine: the Ray head of a ``multi_node: ray`` replica."""
    profile = spec.profiles[model.profile]
    if profile.engine is Engine.vllm and model.nodes > 1 and profile.multi_node == "ray" and member.rank == 0:
        return [ray_program(profile), "start", "--head", f"--port={dist_port}"]
    return None


def systemd_quote(arg: str) -> str:
    """One ExecStart= word: ``%`` doubled, ``$`` doubled unless it is our key variable,
    quoted when it holds spaces or quotes."""
    keep = "${" + ENGINE_KEY_VAR + "}"
    text = arg.replace("%", "%%")
    if text != keep:
        text = text.replace("$", "$$")
    if re.search(r"[\s\"'\\;]", text) or not text:
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def environment(spec: ClusterSpec, model: Model, member: Member) -> dict[str, str]:
    profile: Profile = spec.profiles[model.profile]
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(member.gpu_uuids)}
    if model.nodes > 1:
        fabric = spec.fabrics.get(member.node.fabric or "")
        if member.nccl_ib_hca:
            env["NCCL_IB_HCA"] = member.nccl_ib_hca
        if fabric and fabric.socket_interface:
            env["NCCL_SOCKET_IFNAME"] = fabric.socket_interface
        if fabric and fabric.kind == "roce":
            env.setdefault("NCCL_IB_GID_INDEX", "3")
        env["VLLM_HOST_IP"] = member.node.address
    return {**env, **profile.env, **model.env}


def replica_unit(
    spec: ClusterSpec,
    model: Model,
    *,
    replica: int,
    member: Member,
    port: int,
    members: tuple[Member, ...],
    dist_port: int,
) -> ReplicaUnit:
    """The unit file of one member of one replica."""
    head = members[0].node
    profile = spec.profiles[model.profile]
    argv = engine_args(spec, model, member, port=port, head=head, dist_port=dist_port)
    pre = pre_start(spec, model, member, dist_port)
    env = environment(spec, model, member)
    text = render(
        "llmgw-replica.service.j2",
        model=model,
        replica=replica,
        rank=member.rank,
        members=",".join(m.node.name for m in members),
        gpus=",".join(member.gpu_uuids),
        port=port,
        engine=profile.engine.value,
        user=profile.user,
        spec_hash=spec_hash(spec, model),
        exec_start=" ".join(systemd_quote(a) for a in argv),
        exec_start_pre=" ".join(systemd_quote(a) for a in pre) if pre else "",
        environment=[systemd_quote(f"{k}={v}") for k, v in sorted(env.items())],
        env_file=ENGINE_ENV_FILE,
    )
    return ReplicaUnit(member.node.name, unit_name(model.name, replica), text)
