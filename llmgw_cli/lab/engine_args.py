"""Command lines of the simulated engines: vLLM's and SGLang's flags, one config.

They accept exactly the flags of the real parsers of vLLM 0.32.0 and SGLang 0.5.23 (the
tables in ``core/engine/engine_flags/``, dumped from those parsers), each with what it takes; the
few the simulation reads are declared here with their types and defaults.

Pure apart from the key: argv (and the environment or a ``--config`` file for the key)
in, ``EngineConfig`` out; bad flags exit 2 with argparse's error line, as the real
engines do. The key is taken where the real engines take it: vLLM from ``--api-key``,
else ``$VLLM_API_KEY``; SGLang from ``--api-key``, else its ``--config`` YAML/JSON file
(SGLang has no key variable).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Literal, NoReturn

import yaml  # the lab's engines run on llmgw's own interpreter, which has PyYAML

from llmgw_cli.core.engine.engine_flags import FlagTable, table, vllm_flag_name

Kind = Literal["vllm", "sglang"]

SGLANG_MODULE = "sglang.launch_server"


@dataclass(frozen=True)
class EngineConfig:
    """What the simulated engine was asked to serve, normalised across vLLM and SGLang."""

    kind: Kind
    model: str
    served_names: tuple[str, ...]
    host: str
    port: int
    tp: int
    pp: int
    dp: int
    nnodes: int
    node_rank: int
    headless: bool
    api_key: str | None
    max_model_len: int | None
    executor_backend: str | None
    enable_metrics: bool
    # The multi-node rendezvous: rank 0 listens there, the other ranks connect to it
    # (vLLM's --master-addr/--master-port, SGLang's --dist-init-addr).
    control_addr: str | None = None
    control_port: int | None = None
    # vLLM's --enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: adapters may be
    # loaded at run time (POST /v1/load_lora_adapter)
    runtime_lora: bool = False

    @property
    def serves_api(self) -> bool:
        """Workers of a multi-node engine run no HTTP server."""
        return not self.headless and self.node_rank == 0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def gpus_per_node(self) -> int | None:
        """GPUs this process drives on its own node.

        With Ray the head's world spans the Ray cluster, whose size the command does not
        say, so the share is unknown: ``None``, and only the devices themselves are checked.
        """
        if self.executor_backend == "ray" and self.nnodes == 1:
            return None
        return max(1, self.world_size // max(1, self.nnodes))


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with the usual ``prog: error:`` line, as vLLM and SGLang do:
    the usage, then that line, both on stderr (in that order in the journal)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _max_len(text: str) -> int:
    # vLLM accepts human-readable lengths such as 32k.
    match = re.fullmatch(r"(\d+)([kKmM]?)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid length {text!r}")
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1_000_000, "M": 1024 * 1024}[match.group(2)]
    return int(match.group(1)) * scale


VLLM_VERSION = "0.32.0"
SGLANG_VERSION = "0.5.23"
"""The versions whose flags the simulated engines accept (``core/engine/engine_flags/``)."""


def _table(engine: str, version: str) -> FlagTable:
    found = table(engine, version)
    if found is None:
        raise SystemExit(f"no flag table for {engine} {version} in llmgw_cli/core/engine/engine_flags")
    return found


def _accept_the_rest(p: _Parser, flags: FlagTable) -> _Parser:
    """Every flag of the real parser that ``p`` does not read itself, with what it takes:
    the simulation ignores them, and refuses what the real engine refuses."""
    known = p._option_string_actions
    for i, (flag, takes) in enumerate(sorted(flags.flags.items())):
        if flag in known:
            continue
        dest = f"_ignored_{i}"
        if takes == "switch":
            p.add_argument(flag, dest=dest, action="store_true")
        else:
            p.add_argument(flag, dest=dest, nargs=_NARGS[takes])
    return p


_NARGS: dict[str, str | None] = {"value": None, "optional": "?", "list": "+"}


def _vllm_parser() -> _Parser:
    # vLLM's serve subcommand states its usage in one line instead of its 400 flags
    p = _Parser(prog="vllm serve", usage="vllm serve [model_tag] [options]", add_help=True)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--host")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=_max_len)
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray", "uni", "external_launcher"])
    p.add_argument("--api-key", nargs="+")  # vLLM takes several; any of them lets a request in
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    return _accept_the_rest(p, _table("vllm", VLLM_VERSION))


def _sglang_parser() -> _Parser:
    p = _Parser(prog="launch_server.py", add_help=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    # `--tp` and `--dp` are argparse's abbreviations of these, as in SGLang
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp", type=int, default=1)
    p.add_argument("--served-model-name")
    p.add_argument("--context-length", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr")
    p.add_argument("--api-key")
    p.add_argument("--config")
    p.add_argument("--enable-metrics", action="store_true")
    return _accept_the_rest(p, _table("sglang", SGLANG_VERSION))


def _vllm_spelling(argv: list[str]) -> list[str]:
    """vLLM's own spellings in argparse's: ``--flag_name`` is ``--flag-name``, and
    ``--flag.key`` sets a key of ``--flag`` (the simulation reads no such key)."""
    out = []
    for word in argv:
        name, eq, value = word.partition("=")
        out.append(vllm_flag_name(name) + eq + value if word.startswith("--") else word)
    return out


def parse_argv(argv: list[str]) -> EngineConfig:
    """Parse ``vllm serve ...`` or ``sglang [-m sglang.launch_server] ...`` after the kind.

    The lab's wrappers call ``engine_sim vllm "$@"`` for ``/opt/vllm/bin/vllm`` and
    ``engine_sim sglang "$@"`` for the SGLang interpreter, so the SGLang form arrives
    with the interpreter's ``-m sglang.launch_server`` in front. Bad flags exit 2.
    """
    if not argv or argv[0] not in ("vllm", "sglang"):
        raise SystemExit(
            "usage: python -m llmgw_cli.lab.engine_sim {vllm serve|sglang -m sglang.launch_server} ..."
        )
    if argv[0] == "vllm":
        return _parse_vllm(argv[1:])
    return _parse_sglang(argv[1:])


def _parse_vllm(argv: list[str]) -> EngineConfig:
    if argv == ["--version"]:
        print(VLLM_VERSION)
        raise SystemExit(0)
    if not argv or argv[0] != "serve":
        top = _Parser(prog="vllm")
        top.add_argument("subparser", choices=["serve"])
        top.parse_args(argv[:1])
    ns = _vllm_parser().parse_args(_vllm_spelling(argv[1:]))
    model = ns.model_tag or ns.model
    if not model:
        _vllm_parser().error("the following arguments are required: model_tag")
    if ns.node_rank > 0 and not ns.headless:
        _vllm_parser().error("--node-rank > 0 requires --headless (the API server runs on node rank 0)")
    return EngineConfig(
        kind="vllm",
        model=model,
        served_names=tuple(ns.served_model_name or [model]),
        host=ns.host or "0.0.0.0",  # vLLM's default None means all interfaces
        port=ns.port,
        tp=ns.tensor_parallel_size,
        pp=ns.pipeline_parallel_size,
        dp=ns.data_parallel_size,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        headless=ns.headless,
        api_key=(ns.api_key or [None])[0] or os.environ.get("VLLM_API_KEY") or None,
        max_model_len=ns.max_model_len,
        executor_backend=ns.distributed_executor_backend,
        enable_metrics=True,
        control_addr=ns.master_addr if ns.nnodes > 1 else None,
        control_port=ns.master_port if ns.nnodes > 1 else None,
        runtime_lora=ns.enable_lora
        and os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1"),
    )


def _parse_sglang(argv: list[str]) -> EngineConfig:
    # The interpreter wrapper passes "-m sglang.launch_server ..."; a wrapper that also
    # names the module itself would pass it twice, which is harmless here.
    while argv[:1] == ["-m"]:
        module = argv[1] if len(argv) > 1 else ""
        if module != SGLANG_MODULE:
            raise SystemExit(f"python3: No module named {module or '(none)'}")
        argv = argv[2:]
    ns = _sglang_parser().parse_args(argv)
    api_key = ns.api_key or (_config_key(ns.config) if ns.config else None)
    control_addr, control_port = None, None
    if ns.nnodes > 1 and ns.dist_init_addr:
        host, _, port = ns.dist_init_addr.rpartition(":")
        control_addr, control_port = host.strip("[]"), int(port)
    return EngineConfig(
        kind="sglang",
        model=ns.model_path,
        served_names=(ns.served_model_name or ns.model_path,),
        host=ns.host,
        port=ns.port,
        tp=ns.tp,
        pp=1,
        dp=ns.dp,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        headless=False,
        api_key=api_key,
        max_model_len=ns.context_length,
        executor_backend=None,
        enable_metrics=ns.enable_metrics,
        control_addr=control_addr,
        control_port=control_port,
    )


def _config_key(path: str) -> str | None:
    """``api-key`` (or ``api_key``) from SGLang's ``--config`` file, which must be YAML or
    JSON by its suffix, as SGLang requires."""
    if not path.endswith((".yaml", ".yml", ".json")):
        raise SystemExit(f"ValueError: Config file must be YAML or JSON format, got: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except OSError as exc:
        raise SystemExit(f"ValueError: Config file not found: {path} ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise SystemExit("ValueError: Config file must contain a dictionary at root level")
    value = {str(k).replace("-", "_"): v for k, v in data.items()}.get("api_key")
    return str(value) if value is not None else None
