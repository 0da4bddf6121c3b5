"""Engine command lines and systemd units for replicas (pure: spec and placement in, text out).

As systemd and the engines behave: the unit is ``Type=exec`` (a missing binary or user
fails the start), restarts on failure after a pause, kills the whole cgroup on stop so GPU
memory is freed, lifts the memlock limit for RDMA, and selects cards by UUID in PCI order.
What keeps the engine answering only the gateway (the listen address, the unit's
firewall, the key in the environment instead of argv) is in ``engine_access.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import (
    Adapter,
    ClusterSpec,
    Engine,
    Model,
    Node,
    Profile,
    SourceKind,
    download_name,
)
from llmgw_cli.core.engine.engine_access import (
    ENGINE_ENV_FILE,
    ENGINE_KEY_VAR,
    allowed_addresses,
    environment_quote,
    key_flags,
    secret_env_file,
    secret_env_text,
    split_env,
)
from llmgw_cli.core.engine.templates import render
from llmgw_cli.core.hosts.paths import DEFAULT_WEIGHTS
from llmgw_cli.core.weights.snapshot import snapshot_folder
from llmgw_cli.errors import Unpinned

__all__ = ["ENGINE_ENV_FILE", "ENGINE_KEY_VAR"]  # re-exported: where callers have always found them

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


# A model's keys that only the gateway reads: no unit depends on them.
GATEWAY_ONLY = {"scaling", "drain_timeout", "routing", "aliases", "fallbacks"}
# The adapters a model has are loaded by the gateway at run time: only whether it has any
# (and the limits, ``lora_flags``) shapes a unit.
ADAPTER_KEYS = {"adapters", "lora"}


def spec_hash(spec: ClusterSpec, model: Model) -> str:
    """Digest of everything in the spec that shapes this model's units: a change means the
    running replicas are out of date (``~`` in the plan)."""
    payload = {
        # neither the replica counts, the drain bound, the gateway's routing nor the names
        # and fallbacks it answers with shape a unit: changing them replaces nothing (and a
        # spec written before those keys existed keeps its hash)
        "model": model.model_dump(mode="json", exclude=GATEWAY_ONLY | ADAPTER_KEYS),
        "profile": spec.profiles[model.profile].model_dump(mode="json"),
    }
    if model.adapters:  # LoRA on or off and its limits shape the unit; which adapters, not
        payload["lora"] = model.lora.model_dump(mode="json")
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def weights_folder(node: Node) -> str:
    """Where a node keeps what llmgw fetches: its first weights folder."""
    return node.weights[0].path if node.weights else DEFAULT_WEIGHTS


def model_path(model: Model, node: Node) -> str:
    """What the engine is given as the model: for a fetched repository, its snapshot folder
    at the pinned commit in the node's first weights folder; with ``fetch: engine``, the
    repo id (the engine downloads it); an absolute path as is; ``./x`` and downloaded URLs
    live in the node's first weights folder."""
    kind = model.source_kind
    base = weights_folder(node)
    ref = model.repo_ref
    if ref is not None:
        if model.selection is None:
            return ref.repo
        if not ref.pinned:
            raise Unpinned(f"{model.name}: {model.source} is not resolved to a commit yet")
        return snapshot_folder(base, ref.repo, ref.revision)
    if model.source.startswith("/"):
        return model.source
    name = model.source.removeprefix("./") if kind is SourceKind.path else download_name(model.source)
    return f"{base.rstrip('/')}/{name}"


def engine_args(
    spec: ClusterSpec, model: Model, member: Member, *, port: int, head: Node, dist_port: int
) -> list[str]:
    """The full argv of one member of a replica. It holds no key: each engine reads its
    key from the environment or a credential file (``engine_access.key_flags``)."""
    profile = spec.profiles[model.profile]
    path = model_path(model, member.node)
    host = member.node.engine_host
    tp, count, rank = model.tensor_parallel, model.nodes, member.rank
    argv = profile.argv0
    if profile.engine is Engine.vllm and count > 1 and profile.multi_node == "ray":
        if rank > 0:  # a Ray worker node: joins the head's cluster and holds its GPUs
            return [
                ray_program(profile),
                "start",
                f"--address={head.engine_host}:{dist_port}",
                f"--node-ip-address={host}",
                "--block",
            ]
        argv += [path, "--host", host, "--port", str(port), "--served-model-name", model.name]
        argv += ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(count)]
        argv += ["--distributed-executor-backend", "ray"]
    elif profile.engine is Engine.vllm:
        argv += [path, "--host", host, "--port", str(port), "--served-model-name", model.name]
        argv += ["--tensor-parallel-size", str(tp)]
        if count > 1:
            argv += ["--pipeline-parallel-size", str(count), "--nnodes", str(count), "--node-rank", str(rank)]
            argv += ["--master-addr", head.engine_host, "--master-port", str(dist_port)]
            if rank > 0:
                argv.append("--headless")
    elif profile.engine is Engine.sglang:
        argv += ["--model-path", path, "--host", host, "--port", str(port)]
        argv += ["--served-model-name", model.name, "--tp-size", str(tp * count)]
        argv.append("--enable-metrics")  # /metrics: the gateway routes on its queue and KV cache
        if count > 1:
            argv += ["--nnodes", str(count), "--node-rank", str(rank)]
            argv += ["--dist-init-addr", f"{head.engine_host}:{dist_port}"]
    else:
        argv += ["-m", path, "--host", host, "--port", str(port), "-a", model.name]
        argv.append("--metrics")  # /metrics: the gateway routes on its queue
    return (
        argv + _revision(profile, model) + lora_flags(profile, model) + list(profile.args) + list(model.args)
    )


# --- adapters (LoRA) ------------------------------------------------------------------

LORA_RUNTIME_VAR = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's /v1/load_lora_adapter is off without it


def lora_flags(profile: Profile, model: Model) -> list[str]:
    """vLLM's LoRA switches for a model with adapters: on, with the adapters' limits. The
    adapters themselves are loaded by the gateway at run time, none at start."""
    if not model.adapters or profile.engine is not Engine.vllm:
        return []
    limits = model.lora
    return ["--enable-lora", "--max-loras", str(limits.max_loras), "--max-lora-rank", str(limits.max_rank)]


def adapter_path(adapter: Adapter, node: Node) -> str:
    """Where an adapter's folder is on a node, built from the node's first weights folder
    (never from a request): a repo id's snapshot folder at its commit, a ``./x`` path in
    that folder, an absolute path as the cluster file gives it."""
    ref = adapter.repo_ref
    if ref is not None:
        return snapshot_folder(weights_folder(node), ref.repo, ref.revision)
    if adapter.source.startswith("/"):
        return adapter.source
    return f"{weights_folder(node).rstrip('/')}/{adapter.source.removeprefix('./')}"


def _revision(profile: Profile, model: Model) -> list[str]:
    """``--revision`` for an engine that downloads a repository itself (``fetch: engine``)
    at a revision other than ``main``; vLLM and SGLang both take it."""
    ref = model.repo_ref
    if ref is None or model.selection is not None or ref.revision == "main":
        return []
    return ["--revision", ref.revision] if profile.engine in (Engine.vllm, Engine.sglang) else []


def ray_program(profile: Profile) -> str:
    """Ray's CLI from the same environment as the engine (``/opt/vllm/bin/ray`` beside
    ``/opt/vllm/bin/vllm``), else ``ray`` on PATH."""
    program = profile.argv0[0]
    return program.rsplit("/", 1)[0] + "/ray" if "/" in program else "ray"


def pre_start(spec: ClusterSpec, model: Model, member: Member, dist_port: int) -> list[str] | None:
    """What runs before the engine: the Ray head of a ``multi_node: ray`` replica."""
    profile = spec.profiles[model.profile]
    if profile.engine is Engine.vllm and model.nodes > 1 and profile.multi_node == "ray" and member.rank == 0:
        return [
            ray_program(profile),
            "start",
            "--head",
            f"--port={dist_port}",
            f"--node-ip-address={member.node.engine_host}",
        ]
    return None


def systemd_quote(arg: str) -> str:
    """One ExecStart= word: ``%`` and ``$`` doubled (systemd expands both there), quoted
    when it holds spaces or quotes."""
    text = arg.replace("%", "%%").replace("$", "$$")
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
        env["VLLM_HOST_IP"] = member.node.engine_host
    if model.selection is not None:
        # the engine runs from the snapshot on disk: it must not reach the Hub on its own
        env["HF_HUB_OFFLINE"] = "1"
    if lora_flags(profile, model):
        env[LORA_RUNTIME_VAR] = "True"
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
    plain, _ = split_env(spec, model, environment(spec, model, member))
    exec_start = " ".join(systemd_quote(a) for a in argv + key_flags(profile.engine, profile.user))
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
        start_timeout=f"{profile.readiness.start_timeout:g}",
        exec_start=exec_start,
        exec_start_pre=" ".join(systemd_quote(a) for a in pre) if pre else "",
        environment=[environment_quote(k, v) for k, v in sorted(plain.items())],
        env_file=ENGINE_ENV_FILE,
        secret_env_file=secret_env_file(model.name) if secret_env_text(spec, model) else "",
        ip_allow=" ".join(allowed_addresses(spec, model, [m.node for m in members])),
    )
    return ReplicaUnit(member.node.name, unit_name(model.name, replica), text)
