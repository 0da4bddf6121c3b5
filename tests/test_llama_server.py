"""The real llama.cpp llama-server serving SmolLM2-135M on 127.0.0.1, via the openai client.

The binary comes from scripts/build-llama-server (cached outside the repository; the
first run builds it, about 5 minutes on 2 cores) and the model from scripts/fetch-smollm2.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.harness import free_port, stop, wait_http

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-llama-test"
ALIAS = "smollm2-135m"


def server_argv(binary: str, model: str, port: int, key: str | None = None) -> list[str]:
    """SmolLM2 on the CPU as the tests and bench/llama_server.py serve it: a 2,048-token
    context, one slot, two threads, no layers on a GPU."""
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", "2048", "-np", "1", "-t", "2", "-ngl", "0", "-a", ALIAS]
    return argv + (["--api-key", key] if key else [])


def _script(name: str, *args: str) -> str:
    # PYTHON: pip runs in the test's own environment, whatever python3 is on PATH.
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = [sys.executable] if name == "fetch-smollm2" else []
    done = subprocess.run(
        [*cmd, str(ROOT / "scripts" / name), *args], capture_output=True, text=True, check=False, env=env
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/{name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def llama_paths() -> tuple[str, str]:
    """The llama-server binary and the SmolLM2 model file: built and fetched on first
    use. Skips where the binary is not built and the tools to build it are missing."""
    missing = [tool for tool in ("cmake", "ninja", "c++") if shutil.which(tool) is None]
    built = subprocess.run(
        [str(ROOT / "scripts/build-llama-server"), "--print-path", "--no-build"],
        check=False,
        capture_output=True,
        text=True,
    )
    if built.returncode != 0 and missing:
        pytest.skip(f"llama-server not built and {', '.join(missing)} missing (scripts/engine-packages.txt)")
    return _script("build-llama-server", "--print-path"), _script("fetch-smollm2")


def start_llama_server(binary: str, model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """llama-server (``server_argv``, the key ``KEY``) on 127.0.0.1:``port``, its output
    added to ``log``, returned once /health answers 200 (the model is loaded). One that
    never answers is stopped, and the wait fails with the log's tail."""
    with log.open("ab") as out:
        proc = subprocess.Popen(server_argv(binary, model, port, KEY), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log, seconds=60)
    except BaseException:
        stop(proc, signal.SIGKILL)
        raise
    return proc


def stop_llama_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, which llama-server answers by exiting 0 within 10 seconds (else it is
    killed and this fails)."""
    assert stop(proc, wait=10) == 0


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    binary, model = llama_paths()
    port = free_port()
    proc = start_llama_server(binary, model, port, tmp_path_factory.mktemp("llama") / "server.log")
    try:
        yield port
    finally:
        stop_llama_server(proc)


def _client(port: int, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France? Answer in one word."}
]


def test_chat_answers_with_text(llama_server: int) -> None:
    reply = _client(llama_server).chat.completions.create(
        model=ALIAS, messages=MESSAGES, max_tokens=24, temperature=0
    )
    text = reply.choices[0].message.content
    assert text is not None and text.strip()
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 24


def test_stream_puts_usage_in_the_last_chunk(llama_server: int) -> None:
    chunks = list(
        _client(llama_server).chat.completions.create(
            model=ALIAS,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    last = chunks[-1]
    assert last.usage is not None and last.usage.completion_tokens > 0 and last.usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_api_key_and_alias(llama_server: int) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(llama_server, key="wrong").models.list()
    assert [m.id for m in _client(llama_server).models.list().data] == [ALIAS]
