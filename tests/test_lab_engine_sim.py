"""The simulated engine as the lab runs it: a process on 127.0.0.1, the official client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.harness import free_port
from tests.waiting import connects, wait_until

pytestmark = pytest.mark.integration

KEY = "sk-lab-test"


def model_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    (root / "model.safetensors").write_bytes(b"x")
    return root


class Engine:
    """One engine_sim process; stdout and stderr go to a file the test can read."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        full_env = {
            **os.environ,
            "LLMGW_LAB_LOAD_SECONDS": "0.2",
            "LLMGW_LAB_WARMUP_SECONDS": "0",
            "LLMGW_LAB_TOKENS_PER_SECOND": "0",
            "LLMGW_LAB_GPUS": str(log.parent / "no-gpus.csv"),
        }
        full_env.pop("CUDA_VISIBLE_DEVICES", None)
        full_env.update(env or {})
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw_cli.lab.engine_sim", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )

    def text(self) -> str:
        return self.log_path.read_text()

    def still_running(self) -> bool:
        """False, or fails the test if the engine has exited: a wait's "not yet"."""
        assert self.proc.poll() is None, f"engine exited {self.proc.returncode}:\n{self.text()}"
        return False

    def wait_for_log(self, needle: str, timeout: float = 10) -> None:
        wait_until(
            lambda: needle in self.text() or self.still_running(),
            timeout=timeout,
            interval=0.01,
            what=lambda: f"{needle!r} in the engine's log:\n{self.text()}",
        )

    def wait_listening(self, port: int, timeout: float = 10) -> float:
        start = time.monotonic()
        wait_until(
            lambda: connects("127.0.0.1", port, timeout=1) or self.still_running(),
            timeout=timeout,
            interval=0.01,
            what=lambda: f"the engine to listen on port {port}:\n{self.text()}",
        )
        return time.monotonic() - start

    def exit_code(self, timeout: float = 10) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def vllm(tmp_path: Path) -> Iterator[tuple[Engine, int]]:
    port = free_port()
    engine = Engine(
        [
            "vllm",
            "serve",
            str(model_dir(tmp_path / "Qwen3-1.7B")),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "qwen3",
            "--api-key",
            KEY,
            "--max-model-len",
            "4096",
        ],
        tmp_path / "engine.log",
    )
    try:
        engine.wait_listening(port)
        yield engine, port
    finally:
        engine.stop()


def client(port: int, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=10)


MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello"}]


def test_chat_not_streaming_and_streaming_agree(vllm: tuple[Engine, int]) -> None:
    _, port = vllm
    c = client(port)
    whole = c.chat.completions.create(model="qwen3", messages=MESSAGES, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "stop" and whole.model == "qwen3"
    assert whole.usage is not None and whole.usage.completion_tokens == 16 and whole.usage.prompt_tokens > 0
    assert c.chat.completions.create(model="qwen3", messages=MESSAGES).choices[0].message.content == text

    chunks = list(
        c.chat.completions.create(
            model="qwen3", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert all(ch.usage is None for ch in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )

    plain = list(c.chat.completions.create(model="qwen3", messages=MESSAGES, stream=True))
    assert all(ch.usage is None for ch in plain)


def test_max_tokens_and_completions_endpoint(vllm: tuple[Engine, int]) -> None:
    _, port = vllm
    c = client(port)
    short = c.chat.completions.create(model="qwen3", messages=MESSAGES, max_tokens=3)
    assert short.usage is not None and short.usage.completion_tokens == 3
    assert short.choices[0].finish_reason == "length"
    chunks = list(
        c.completions.create(
            model="qwen3", prompt="Once", max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) == 5
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_embeddings_models_and_unknown_model(vllm: tuple[Engine, int]) -> None:
    _, port = vllm
    c = client(port)
    emb = c.embeddings.create(model="qwen3", input=["a", "b"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    models = c.models.list().data
    assert [m.id for m in models] == ["qwen3"]
    assert models[0].owned_by == "vllm" and models[0].model_extra is not None
    assert models[0].model_extra["max_model_len"] == 4096
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="other", messages=MESSAGES)


def test_api_key_enforced_on_v1_but_health_is_public(vllm: tuple[Engine, int]) -> None:
    _, port = vllm
    with pytest.raises(openai.AuthenticationError):
        client(port, key="wrong").chat.completions.create(model="qwen3", messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        client(port, key="wrong").models.list()
    health = httpx.get(f"http://127.0.0.1:{port}/health")
    assert (health.status_code, health.content) == (200, b"")
    assert "vllm:num_requests_running" in httpx.get(f"http://127.0.0.1:{port}/metrics").text


def test_refuses_connections_while_loading_then_healthy(tmp_path: Path) -> None:
    port = free_port()
    engine = Engine(
        ["vllm", "serve", str(model_dir(tmp_path / "m")), "--host", "127.0.0.1", "--port", str(port)],
        tmp_path / "engine.log",
        {"LLMGW_LAB_LOAD_SECONDS": "1.5"},
    )
    try:
        engine.wait_for_log("Loading weights of")
        loading_since = time.monotonic()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health")
        waited = engine.wait_listening(port)
        assert time.monotonic() - loading_since > 1.0 and waited > 0.5
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        engine.stop()


def test_sglang_warms_up_with_503_then_fires_up(tmp_path: Path) -> None:
    port = free_port()
    engine = Engine(
        [
            "sglang",
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_dir(tmp_path / "m")),
            "--port",
            str(port),
            "--tp",
            "1",
            "--enable-metrics",
        ],
        tmp_path / "engine.log",
        {"LLMGW_LAB_WARMUP_SECONDS": "1.0"},
    )
    try:
        engine.wait_listening(port)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
        assert "ready to roll" not in engine.text()
        engine.wait_for_log("The server is fired up and ready to roll!")
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        models = client(port).models.list().data
        assert models[0].id == str(tmp_path / "m") and models[0].owned_by == "sglang"
        reply = client(port).chat.completions.create(model="anything", messages=MESSAGES)
        assert reply.choices[0].message.content
    finally:
        engine.stop()


def test_sglang_api_key_covers_everything_but_health(tmp_path: Path) -> None:
    port = free_port()
    engine = Engine(
        ["sglang", "--model-path", "Qwen/Qwen2.5-7B-Instruct", "--port", str(port), "--api-key", KEY],
        tmp_path / "engine.log",
    )
    try:
        engine.wait_for_log("ready to roll")
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/get_model_info").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(port, key="wrong").models.list()
    finally:
        engine.stop()


def test_missing_weights_exit_1_with_the_reason(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    (model / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        )
    )
    engine = Engine(["vllm", "serve", str(model), "--port", str(free_port())], tmp_path / "engine.log")
    try:
        assert engine.exit_code() == 1
        assert (
            "No such file or directory" in engine.text()
            and "model-00001-of-00002.safetensors" in engine.text()
        )
    finally:
        engine.stop()


def test_wrong_cuda_visible_devices_exit_1(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.csv"
    gpus.write_text("".join(f"{k},NVIDIA H100 80GB HBM3,81559,GPU-01-{k}-5f1c,550.54.15\n" for k in range(4)))
    args = ["vllm", "serve", str(model_dir(tmp_path / "m")), "--port", str(free_port()), "-tp", "2"]
    env = {"LLMGW_LAB_GPUS": str(gpus)}
    bad = Engine(args, tmp_path / "bad.log", {**env, "CUDA_VISIBLE_DEVICES": "2,7"})
    short = Engine(args, tmp_path / "short.log", {**env, "CUDA_VISIBLE_DEVICES": "GPU-01-3-5f1c"})
    try:
        assert bad.exit_code() == 1 and "invalid device ordinal" in bad.text()
        assert short.exit_code() == 1 and "World size (2) is larger" in short.text()
    finally:
        bad.stop()
        short.stop()


def test_unknown_flag_exits_2_like_vllm(tmp_path: Path) -> None:
    engine = Engine(["vllm", "serve", "m", "--enable-magic"], tmp_path / "engine.log")
    try:
        assert engine.exit_code() == 2
        assert "vllm serve: error: unrecognized arguments: --enable-magic" in engine.text()
    finally:
        engine.stop()


def test_port_in_use_exits_1(vllm: tuple[Engine, int], tmp_path: Path) -> None:
    _, port = vllm
    engine = Engine(
        ["vllm", "serve", "m/x", "--host", "127.0.0.1", "--port", str(port)], tmp_path / "second.log"
    )
    try:
        assert engine.exit_code() == 1 and "address already in use" in engine.text()
    finally:
        engine.stop()


@pytest.mark.parametrize("phase", ["loading", "serving", "headless", "sglang-worker"])
def test_sigterm_exits_0_promptly(tmp_path: Path, phase: str) -> None:
    port = free_port()
    args = ["vllm", "serve", "org/m", "--host", "127.0.0.1", "--port", str(port)]
    if phase == "headless":
        args += ["--nnodes", "2", "--node-rank", "1", "--headless", "--master-addr", "127.0.0.1"]
    if phase == "sglang-worker":
        args = [
            "sglang",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "org/m",
            "--port",
            str(port),
            "--tp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            "127.0.0.1:5000",
        ]
    engine = Engine(
        args, tmp_path / "engine.log", {"LLMGW_LAB_LOAD_SECONDS": "30" if phase == "loading" else "0"}
    )
    try:
        if phase == "loading":
            engine.wait_for_log("Loading weights of")
        elif phase == "serving":
            engine.wait_listening(port)
        else:  # workers serve no API but stay up
            engine.wait_for_log("worker node rank 1 of 2")
            time.sleep(0.2)
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{port}/health")
            assert engine.proc.poll() is None
        start = time.monotonic()
        engine.proc.send_signal(signal.SIGTERM)
        assert engine.exit_code() == 0
        assert time.monotonic() - start < 1.0
    finally:
        engine.stop()


def test_errors_are_shaped_like_vllm(vllm: tuple[Engine, int]) -> None:
    _, port = vllm
    with pytest.raises(openai.BadRequestError, match="maximum context length is 4096 tokens"):
        client(port).chat.completions.create(model="qwen3", messages=MESSAGES, max_tokens=5000)
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=auth) as http:
        assert http.get("/v1/nothing").status_code == 404
        assert http.get("/v1/chat/completions").status_code == 405
        bad = http.post("/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
        no_model = http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert no_model.status_code == 200 and no_model.json()["model"] == "qwen3"
