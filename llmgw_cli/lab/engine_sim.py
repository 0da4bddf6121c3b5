"""A simulated vLLM / SGLang engine for the lab cluster.

Run as the lab's engine wrappers do::

    python -m llmgw_cli.lab.engine_sim vllm serve MODEL [vLLM flags]
    python -m llmgw_cli.lab.engine_sim sglang -m sglang.launch_server --model-path P [SGLang flags]

It behaves like the real engine where llmgw can observe it: the same flags (unknown
ones exit 2), CUDA_VISIBLE_DEVICES checked against the node's ``/etc/lab/gpus.csv``,
model directories checked for completeness, connections refused while "loading" (the
socket is bound only afterwards), SGLang's 503 warm-up, the OpenAI endpoints with
deterministic text at a set token rate, the key (``--api-key``, ``$VLLM_API_KEY``,
SGLang's ``--config`` file; vLLM checks it only under ``/v1``), headless multi-node
workers that join rank 0's rendezvous port (vLLM's ``--master-port``, SGLang's
``--dist-init-addr``; rank 0 listens there on the given address), and a prompt exit 0 on
SIGTERM.

Environment: LLMGW_LAB_GPUS (GPU list, default /etc/lab/gpus.csv), LLMGW_LAB_LOAD_SECONDS
(2), LLMGW_LAB_WARMUP_SECONDS (SGLang, 1), LLMGW_LAB_TOKENS_PER_SECOND (200, 0 = no
pacing), LLMGW_LAB_OFFLINE=1 (hub ids are cache misses).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from llmgw_cli.errors import EngineStartError
from llmgw_cli.lab.engine_app import READY_BANNER, EngineApp, Timing
from llmgw_cli.lab.engine_args import EngineConfig, parse_argv
from llmgw_cli.lab.engine_checks import (
    SimGpu,
    check_model_source,
    parse_gpus_csv,
    select_gpus,
)
from llmgw_cli.lab.engine_http import serve_connection
from llmgw_cli.polling import wait_event

DEFAULT_GPUS_FILE = "/etc/lab/gpus.csv"
DEFAULT_MAX_MODEL_LEN = 4096


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise EngineStartError(f"ValueError: {name}={raw!r} is not a number") from exc
    if value < 0:
        raise EngineStartError(f"ValueError: {name}={raw!r} must not be negative")
    return value


def timing_from_env() -> Timing:
    return Timing(
        load_s=_env_float("LLMGW_LAB_LOAD_SECONDS", 2.0),
        warmup_s=_env_float("LLMGW_LAB_WARMUP_SECONDS", 1.0),
        tokens_per_s=_env_float("LLMGW_LAB_TOKENS_PER_SECOND", 200.0),
    )


def log(cfg_kind: str, level: str, message: str) -> None:
    """A log line in the engine's own style, on stdout like vLLM and SGLang."""
    now = time.strftime("%m-%d %H:%M:%S")
    if cfg_kind == "vllm":
        line = f"{level} {now} [engine_sim.py] {message}"
    else:
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}"
    print(line, flush=True)


def _load_gpus() -> list[SimGpu] | None:
    path = Path(os.environ.get("LLMGW_LAB_GPUS") or DEFAULT_GPUS_FILE)
    if not path.is_file():
        return None
    return parse_gpus_csv(path.read_text(encoding="utf-8"))


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless stopped first; True when stopped."""
    return await wait_event(stop, seconds)


async def run(cfg: EngineConfig, max_model_len: int, timing: Timing) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log(cfg.kind, "INFO", f"Loading weights of {cfg.model} (simulated, {timing.load_s:g} s)")
    if await _wait(stop, timing.load_s):
        return 0
    log(cfg.kind, "INFO", f"Loading weights took {timing.load_s:.2f} seconds")
    rendezvous = await _rendezvous(cfg, stop)
    if rendezvous is False:
        return 1
    if not cfg.serves_api:
        log(
            cfg.kind,
            "INFO",
            f"Headless worker node rank {cfg.node_rank} of {cfg.nnodes} is up; serving no API",
        )
        await stop.wait()
        return 0
    app = EngineApp(cfg, max_model_len, timing)
    try:
        server = await asyncio.start_server(
            lambda r, w: serve_connection(r, w, app.handle), cfg.host, cfg.port, reuse_address=True
        )
    except OSError as exc:
        # asyncio words it as uvicorn does: "error while attempting to bind on address ..."
        print(f"ERROR:    [Errno {exc.errno}] {exc.strerror}", flush=True)
        return 1
    if cfg.kind == "vllm":
        log(cfg.kind, "INFO", f"Starting vLLM API server 0 on http://{cfg.host}:{cfg.port}")
        print("INFO:     Application startup complete.", flush=True)
    else:
        print(f"INFO:     Uvicorn running on http://{cfg.host}:{cfg.port} (Press CTRL+C to quit)", flush=True)
        if not await _wait(stop, timing.warmup_s):
            app.ready = True
            log(cfg.kind, "INFO", READY_BANNER)
    await stop.wait()
    server.close()
    if isinstance(rendezvous, asyncio.Server):
        rendezvous.close()
    log(cfg.kind, "INFO", "Shutting down")
    return 0


async def _answer_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"llmgw-lab-rendezvous\n")
    writer.close()


async def _rendezvous(cfg: EngineConfig, stop: asyncio.Event) -> asyncio.Server | bool:
    """Rank 0 of a multi-node replica listens on its control port (torch's TCPStore for
    vLLM, SGLang's dist-init port); the other ranks connect to it before they report up.
    True when there is nothing to do or the peer answered, False on failure."""
    if cfg.control_addr is None or cfg.control_port is None:
        return True
    if cfg.node_rank == 0:
        try:
            return await asyncio.start_server(_answer_peer, cfg.control_addr, cfg.control_port)
        except OSError as exc:
            log(cfg.kind, "ERROR", f"rendezvous on {cfg.control_addr}:{cfg.control_port}: {exc.strerror}")
            return False
    log(
        cfg.kind,
        "INFO",
        f"Headless worker node rank {cfg.node_rank} of {cfg.nnodes}: joining rank 0 at {cfg.control_addr}:{cfg.control_port}",
    )
    deadline = time.monotonic() + 60
    while not stop.is_set():
        try:
            async with asyncio.timeout(2):
                _, writer = await asyncio.open_connection(cfg.control_addr, cfg.control_port)
            writer.close()
            log(cfg.kind, "INFO", f"Joined rank 0 at {cfg.control_addr}:{cfg.control_port}")
            return True
        except (OSError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                log(
                    cfg.kind,
                    "ERROR",
                    f"could not reach rank 0 at {cfg.control_addr}:{cfg.control_port}: {exc}",
                )
                return False
            await _wait(stop, 0.5)
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cfg = parse_argv(args)
    # Like the real engines (vLLM's "non-default args", SGLang's server_args), the command
    # line goes to the log, and so to the journal: a key given in argv would be there.
    log(cfg.kind, "INFO", f"non-default args: {args[1:]}")
    try:
        timing = timing_from_env()
        gpus = _load_gpus()
        if gpus is not None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            chosen = select_gpus(visible, gpus, cfg.gpus_per_node)
            log(
                cfg.kind,
                "INFO",
                f"Using GPUs {','.join(str(g.index) for g in chosen)} (CUDA_VISIBLE_DEVICES={visible})",
            )
        context = check_model_source(cfg.model, cfg.kind, os.environ.get("LLMGW_LAB_OFFLINE") == "1")
    except EngineStartError as exc:
        log(cfg.kind, "ERROR", f"Engine failed to start: {exc}")
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    max_model_len = cfg.max_model_len or context or DEFAULT_MAX_MODEL_LEN
    return asyncio.run(run(cfg, max_model_len, timing))


if __name__ == "__main__":
    sys.exit(main())
