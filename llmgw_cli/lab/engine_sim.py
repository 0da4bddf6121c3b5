"""A simulated vLLM / SGLang engine for the lab cluster.

Run as the lab's engine wrappers do::

    python -m llmgw_cli.lab.engine_sim vllm serve MODEL [vLLM flags]
    python -m llmgw_cli.lab.engine_sim sglang -m sglang.launch_server --model-path P [SGLang flags]

It behaves like the real engine where llmgw can observe it: the same flags (unknown
ones exit 2), CUDA_VISIBLE_DEVICES checked against the node's ``/etc/lab/gpus.csv``,
model directories checked for completeness, connections refused while "loading" (the
socket is bound only afterwards), SGLang's 503 warm-up, the OpenAI endpoints with
deterministic text at a set token rate, ``--api-key``, headless multi-node workers, and
a prompt exit 0 on SIGTERM.

Environment: LLMGW_LAB_GPUS (GPU list, default /etc/lab/gpus.csv), LLMGW_LAB_LOAD_SECONDS
(2), LLMGW_LAB_WARMUP_SECONDS (SGLang, 1), LLMGW_LAB_TOKENS_PER_SECOND (200, 0 = no
pacing), LLMGW_LAB_OFFLINE=1 (hub ids are cache misses).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw_cli.lab import engine_openai as oai
from llmgw_cli.lab.engine_args import (
    EngineConfig,
    EngineStartError,
    check_model_source,
    parse_argv,
    parse_gpus_csv,
    select_gpus,
)
from llmgw_cli.lab.engine_http import Request, Response, serve_connection

DEFAULT_GPUS_FILE = "/etc/lab/gpus.csv"
DEFAULT_MAX_MODEL_LEN = 4096
READY_BANNER = "The server is fired up and ready to roll!"


@dataclass(frozen=True)
class Timing:
    load_s: float
    warmup_s: float
    tokens_per_s: float


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


class EngineApp:
    """Routes and counters of one engine process.

    Runs on one event loop: handlers never block, counters are only touched from it.
    """

    def __init__(self, cfg: EngineConfig, max_model_len: int, timing: Timing) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.timing = timing
        self.ready = cfg.kind == "vllm"  # vLLM is ready once it listens; SGLang warms up first
        self.created = int(time.time())
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.succeeded = 0

    def _log_access(self, req: Request, status: int) -> None:
        reason = {200: "OK", 401: "Unauthorized", 404: "Not Found", 503: "Service Unavailable"}.get(
            status, ""
        )
        print(
            f'INFO:     {req.peer} - "{req.method} {req.path} HTTP/1.1" {status} {reason}'.rstrip(),
            flush=True,
        )

    def _authorized(self, req: Request) -> bool:
        if self.cfg.api_key is None or req.method == "OPTIONS":
            return True
        if self.cfg.kind == "vllm":
            protected = req.path.startswith("/v1")
        else:
            protected = not req.path.startswith(("/health", "/metrics"))
        return not protected or req.headers.get("authorization") == f"Bearer {self.cfg.api_key}"

    async def handle(self, req: Request, resp: Response) -> None:
        try:
            await self._route(req, resp)
        except oai.RequestError as exc:
            await resp.send_json(exc.status, oai.error_body(exc.status, str(exc), exc.kind))
        except (ConnectionError, asyncio.CancelledError):
            resp.keep_alive = False
            raise
        self._log_access(req, resp.status)

    async def _route(self, req: Request, resp: Response) -> None:
        if not self._authorized(req):
            await resp.send_json(401, {"error": "Unauthorized"})
            return
        routes: dict[str, tuple[str, Any]] = {
            "/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/metrics": ("GET", self._metrics),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
        }
        if self.cfg.kind == "vllm":
            routes["/v1/embeddings"] = ("POST", self._embeddings)
            routes["/version"] = ("GET", self._version)
        else:
            routes["/health_generate"] = ("GET", self._health)
            routes["/get_model_info"] = ("GET", self._model_info)
            routes["/model_info"] = ("GET", self._model_info)
        route = routes.get(req.path)
        if route is None:
            await resp.send_json(404, {"detail": "Not Found"})
        elif req.method != route[0]:
            await resp.send_json(405, {"detail": "Method Not Allowed"})
        else:
            await route[1](req, resp)

    async def _health(self, req: Request, resp: Response) -> None:
        await resp.send(200 if self.ready else 503)

    async def _version(self, req: Request, resp: Response) -> None:
        await resp.send_json(200, {"version": "0.0.0+llmgw.lab"})

    async def _model_info(self, req: Request, resp: Response) -> None:
        await resp.send_json(
            200, {"model_path": self.cfg.model, "tokenizer_path": self.cfg.model, "is_generation": True}
        )

    async def _models(self, req: Request, resp: Response) -> None:
        await resp.send_json(200, oai.models_body(self.cfg, self.max_model_len, self.created))

    async def _metrics(self, req: Request, resp: Response) -> None:
        if self.cfg.kind == "sglang" and not self.cfg.enable_metrics:
            await resp.send_json(404, {"detail": "Not Found"})
            return
        prefix, name = (
            ("vllm", self.cfg.served_names[0]) if self.cfg.kind == "vllm" else ("sglang", self.cfg.model)
        )
        labels = f'{{engine="0",model_name="{name}"}}'
        lines = [
            f"# TYPE {prefix}:num_requests_running gauge",
            f"{prefix}:num_requests_running{labels} {self.running}.0",
            f"# TYPE {prefix}:num_requests_waiting gauge",
            f"{prefix}:num_requests_waiting{labels} 0.0",
            f"# TYPE {prefix}:kv_cache_usage_perc gauge",
            f"{prefix}:kv_cache_usage_perc{labels} {min(1.0, self.running / 64):.4f}",
            f"# TYPE {prefix}:prompt_tokens counter",
            f"{prefix}:prompt_tokens_total{labels} {self.prompt_tokens}.0",
            f"# TYPE {prefix}:generation_tokens counter",
            f"{prefix}:generation_tokens_total{labels} {self.generation_tokens}.0",
            f"# TYPE {prefix}:request_success counter",
            f"{prefix}:request_success_total{labels} {self.succeeded}.0",
        ]
        await resp.send(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _body(self, req: Request) -> dict[str, Any]:
        try:
            body = req.json()
        except ValueError as exc:
            raise oai.RequestError(400, f"JSON decode error: {exc}") from exc
        if not isinstance(body, dict):
            raise oai.RequestError(400, "Input should be a valid dictionary")
        return body

    def _model_name(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.cfg.served_names[0]
        if self.cfg.kind == "vllm" and model not in self.cfg.served_names:
            raise oai.RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
        return str(model)

    async def _embeddings(self, req: Request, resp: Response) -> None:
        body = self._body(req)
        await resp.send_json(200, oai.embeddings_body(self._model_name(body), body))

    async def _chat(self, req: Request, resp: Response) -> None:
        await self._generate(req, resp, chat=True)

    async def _completions(self, req: Request, resp: Response) -> None:
        await self._generate(req, resp, chat=False)

    async def _pace(self, tokens: int) -> None:
        if self.timing.tokens_per_s > 0 and tokens > 0:
            await asyncio.sleep(tokens / self.timing.tokens_per_s)

    async def _generate(self, req: Request, resp: Response, chat: bool) -> None:
        if not self.ready:
            raise oai.RequestError(503, "The server is starting up", "ServiceUnavailableError")
        body = self._body(req)
        model = self._model_name(body)
        prompt = oai.prompt_of(body, chat)
        max_tokens = oai.max_tokens_of(body)
        n_prompt = oai.count_tokens(prompt)
        if n_prompt + (max_tokens or 0) > self.max_model_len:
            raise oai.RequestError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n_prompt + (max_tokens or 0)} tokens ({n_prompt} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
            )
        tokens, finish = oai.reply_tokens(model, prompt, max_tokens)
        completion = oai.new_completion(chat, model, tokens, finish, n_prompt)
        self.running += 1
        self.prompt_tokens += n_prompt
        try:
            if body.get("stream"):
                options = body.get("stream_options") or {}
                include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
                await self._stream(resp, completion, include_usage)
            else:
                await self._pace(len(tokens))
                self.generation_tokens += len(tokens)
                await resp.send_json(200, oai.full_body(completion))
            self.succeeded += 1
        finally:
            self.running -= 1

    async def _stream(self, resp: Response, c: oai.Completion, include_usage: bool) -> None:
        async def event(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await resp.write(f"data: {data}\n\n".encode())

        await resp.start_stream()
        if c.chat:  # vLLM opens a chat stream with the role alone
            await event(oai.chunk(c, "", None, first=True))
        for token in c.tokens:
            await self._pace(1)
            self.generation_tokens += 1
            await event(oai.chunk(c, token, None))
        await event(oai.chunk(c, None if c.chat else "", c.finish))
        if include_usage:
            await event(oai.usage_chunk(c))
        await event("[DONE]")
        await resp.end_stream()


def _load_gpus() -> list[Any] | None:
    path = Path(os.environ.get("LLMGW_LAB_GPUS") or DEFAULT_GPUS_FILE)
    if not path.is_file():
        return None
    return parse_gpus_csv(path.read_text(encoding="utf-8"))


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless stopped first; True when stopped."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True


async def run(cfg: EngineConfig, max_model_len: int, timing: Timing) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log(cfg.kind, "INFO", f"Loading weights of {cfg.model} (simulated, {timing.load_s:g} s)")
    if await _wait(stop, timing.load_s):
        return 0
    log(cfg.kind, "INFO", f"Loading weights took {timing.load_s:.2f} seconds")
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
    log(cfg.kind, "INFO", "Shutting down")
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_argv(sys.argv[1:] if argv is None else argv)
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
