#!/usr/bin/env python3
"""Measure the cached llama-server build serving SmolLM2-135M on 127.0.0.1.

    .venv/bin/python bench/llama_server.py

Start to healthy (first 200 on /health), RSS when idle, and one streamed chat request:
time to first token and tokens/s. Uses scripts/build-llama-server --no-build and
scripts/fetch-smollm2 --no-install, so run those first.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_llama_server import server_argv  # noqa: E402


def path_from(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    binary = path_from(str(ROOT / "scripts/build-llama-server"), "--print-path", "--no-build")
    model = path_from(sys.executable, str(ROOT / "scripts/fetch-smollm2"), "--no-install")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = server_argv(binary, model, port)  # the same server the tests start
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.005)
        print(f"start to healthy: {time.monotonic() - t0:.2f} s")
        rss = next(
            int(line.split()[1])
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        print(f"idle RSS: {rss / 1024:.0f} MiB")
        body = {
            "model": "smollm2-135m",
            "temperature": 0,
            "max_tokens": 128,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Write a short story about a lighthouse."}],
        }
        start = time.monotonic()
        first = None
        tokens = 0
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.monotonic() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        total = time.monotonic() - start
        assert first is not None
        print(
            f"one stream: {tokens} tokens, first token {first * 1000:.0f} ms, "
            f"{(tokens - 1) / (total - first):.0f} tokens/s after the first"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        t1 = time.monotonic()
        print(f"SIGTERM: exit {proc.wait(10)} after {(time.monotonic() - t1) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
