"""LoRA adapters as names, files and load requests (pure: no I/O, no clock).

A catalog model may list *adapters* (``models[].adapters``), each served under its own
name by the model's replicas: vLLM starts with LoRA on (``engines.lora_flags``) and no
adapter loaded; the gateway loads one onto a ready replica the first time a request for
it goes there (``POST /v1/load_lora_adapter`` with ``{lora_name, lora_path}``, vLLM's
runtime loading, allowed by ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), and routing prefers
replicas that have it loaded (``routing.Pool.choose``'s ``prefer``).

The path vLLM is given is built here from the cluster file and the replica's node
(``engines.adapter_path``), never taken from a request: a request names the adapter, and
only an adapter the catalog lists is ever loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import Adapter, ClusterSpec, Model, Node
from llmgw_cli.core.engine.engines import adapter_path
from llmgw_cli.core.planning.plan import Plan

LOAD_PATH = "/v1/load_lora_adapter"
# vLLM's answer (400) to a load of a name it holds already: loaded all the same
ALREADY_LOADED = "has already been loaded"


@dataclass(frozen=True)
class Served:
    """An adapter and the catalog model whose replicas serve it."""

    base: str
    adapter: Adapter


def adapter_table(models: Iterable[Model]) -> dict[str, Served]:
    """Each adapter's name -> its base model and itself. A name that is a model's, or an
    adapter's given before, keeps its first meaning (the cluster file refuses both)."""
    models = list(models)
    names = {m.name for m in models}
    table: dict[str, Served] = {}
    for model in models:
        for adapter in model.adapters:
            if adapter.name not in names:
                table.setdefault(adapter.name, Served(model.name, adapter))
    return table


def node_at(spec: ClusterSpec, address: str) -> Node | None:
    """The node whose engine address serves ``host:port`` (IPv6 in brackets), or None."""
    host = address.rsplit(":", 1)[0].removeprefix("[").removesuffix("]")
    return next((n for n in spec.nodes if n.engine_host == host), None)


def load_body(adapter: Adapter, node: Node) -> bytes:
    """The body of vLLM's ``/v1/load_lora_adapter`` for ``adapter`` on ``node``."""
    return json.dumps({"lora_name": adapter.name, "lora_path": adapter_path(adapter, node)}).encode()


def loaded_by_answer(status: int, body: bytes) -> bool:
    """Whether vLLM's answer to a load means the adapter is loaded: 200, or its 400 for a
    name already loaded (a load by another gateway process, or before this one started)."""
    return status == 200 or (status == 400 and ALREADY_LOADED.encode() in body)


def adapter_needs(spec: ClusterSpec, plan: Plan) -> dict[str, tuple[Adapter, list[str]]]:
    """The repo id adapters to bring onto the nodes of the replicas ``plan`` keeps or
    starts (every action but ``-``), each adapter name -> (adapter, nodes). Kept replicas
    count too: an adapter added to a running model replaces none of its replicas, and its
    files go to the nodes that hold the model all the same. Path adapters are not brought."""
    needs: dict[str, tuple[Adapter, list[str]]] = {}
    catalog = {m.name: m for m in spec.models}
    for action in plan.actions:
        model = catalog.get(action.model)
        if action.op == "-" or model is None:
            continue
        for adapter in model.adapters:
            if adapter.repo_ref is None:
                continue
            _, nodes = needs.setdefault(adapter.name, (adapter, []))
            nodes += [n for n in action.nodes if n not in nodes]
    return needs
