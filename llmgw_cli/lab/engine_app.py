"""Routes of one simulated engine: health, models, metrics, completions, embeddings.

Concurrency contract: everything runs on the engine's one event loop; handlers never
block, and the counters are only touched from that loop, so they need no lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

from llmgw_cli.errors import RequestError
from llmgw_cli.lab import engine_openai as oai
from llmgw_cli.lab.engine_args import EngineConfig
from llmgw_cli.lab.engine_http import Request, Response

READY_BANNER = "The server is fired up and ready to roll!"


@dataclass(frozen=True)
class Timing:
    load_s: float
    warmup_s: float
    tokens_per_s: float


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
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded at run time: name -> path

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
        except RequestError as exc:
            await resp.send_json(exc.status, oai.error_body(exc.status, str(exc), exc.kind))
        except (ConnectionError, asyncio.CancelledError):
            resp.keep_alive = False
            raise
        except Exception:  # a simulator bug: answer 500 as uvicorn does, keep serving
            traceback.print_exc()
            resp.keep_alive = False
            if not resp.status:
                await resp.send(500, b"Internal Server Error", "text/plain; charset=utf-8")
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
            # vLLM's SageMaker entry point: outside /v1, so it needs no key (the real
            # engine checks --api-key only under /v1).
            routes["/invocations"] = ("POST", self._invocations)
            if self.cfg.runtime_lora:  # vLLM mounts it only then
                routes["/v1/load_lora_adapter"] = ("POST", self._load_lora_adapter)
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

    async def _invocations(self, req: Request, resp: Response) -> None:
        """A chat answer for ``messages``, else a completion, as vLLM's ``/invocations``."""
        body = self._body(req)
        await (self._chat if "messages" in body else self._completions)(req, resp)

    async def _load_lora_adapter(self, req: Request, resp: Response) -> None:
        """vLLM 0.32's runtime load: a name taken already is its 400; a path that is no
        folder, its 404 (the real engine reads adapter_config.json there)."""
        body = self._body(req)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise RequestError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters:
            raise RequestError(400, f"The lora adapter '{name}' has already been loaded.")
        if not os.path.isdir(path):
            raise RequestError(404, f"No adapter found for {path}", "NotFoundError")
        await asyncio.sleep(0.2)  # reading the adapter's files: concurrent loads overlap
        self.adapters[name] = path
        await resp.send(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), "text/plain")

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
            raise RequestError(400, f"JSON decode error: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestError(400, "Input should be a valid dictionary")
        return body

    def _model_name(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.cfg.served_names[0]
        if self.cfg.kind == "vllm" and model not in self.cfg.served_names and model not in self.adapters:
            raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
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
            raise RequestError(503, "The server is starting up", "ServiceUnavailableError")
        body = self._body(req)
        model = self._model_name(body)
        prompt = oai.prompt_of(body, chat)
        max_tokens = oai.max_tokens_of(body)
        n_prompt = oai.count_tokens(prompt)
        if n_prompt + (max_tokens or 0) > self.max_model_len:
            raise RequestError(
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
