"""Secrets taken out of text before it leaves the gateway: an answer's message, a log line.

What a start failure, a fetch's progress or an engine's journal says is hostile data that
may quote a secret: a peer's URL (``http://<node>:<port>/<secret>/<path>``: the secret is
the whole of its access control), a URL's ``user:password@``, an ``Authorization`` value,
an engine key (64 hex digits), a Hugging Face token (``hf_...``), an API key of the gateway
(``llmgw-`` and 43 characters), the value of a secret environment variable or command-line
flag (``HF_TOKEN=...``, ``--api-key ...``, ``"secret": "..."``), or a secret the caller
knows by value. ``redact`` replaces each with ``***``.

The rules match runs, not words: text glued to either side of a secret (a hostile engine
can print anything around it) is taken out with it, never left as a partial secret.
Some things that are not secrets go too (a sha256 digest, a long first path segment of a
URL): a log line loses a detail, never a secret.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"

# Environment names whose values are secrets, besides any name ending as SECRET_NAME says.
SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "LLMGW_ENGINE_KEY", "VLLM_API_KEY", "LLAMA_API_KEY")
SECRET_NAME = r"[A-Za-z0-9_.-]*(?:token|secret|password|passwd|api[_-]?key|engine[_-]?key)"
SHORTEST_KNOWN = 8  # a known secret shorter than this is not looked for (it would eat words)

_URL = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/\s@]*@)?(?P<host>[^/\s?#@]*)"
    r"(?:/(?P<first>[A-Za-z0-9_~%.-]{16,}))?"
)
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?i)(bearer)(\s+)[^\s\"',;]+"), rf"\1\2{MASK}"),
    (re.compile(r"\b(Basic)(\s+)[A-Za-z0-9+/=]{8,}"), rf"\1\2{MASK}"),
    (re.compile(r"(?i)hf_[A-Za-z0-9]{8,}"), f"hf_{MASK}"),
    (re.compile(r"llmgw-[A-Za-z0-9_-]{43,}"), f"llmgw-{MASK}"),
    (re.compile(r"[0-9a-fA-F]{64,}"), MASK),
    # NAME=value, NAME: value, "name": "value" (an env file, a journal, JSON, YAML)
    (
        re.compile(
            rf"(?i)((?:{'|'.join(SECRET_ENV)}|{SECRET_NAME})[\"']?\s*[=:]\s*)"
            r"(\"[^\"]*\"?|'[^']*'?|[^\s\"',;}]+)"
        ),
        rf"\1{MASK}",
    ),
    # a command line: --api-key VALUE, --hf-token VALUE
    (re.compile(rf"(?i)(--{SECRET_NAME})(\s+)[^\s\"',;]+"), rf"\1\2{MASK}"),
)


def _url(match: re.Match[str]) -> str:
    userinfo = f"{MASK}@" if match["userinfo"] else ""
    first = f"/{MASK}" if match["first"] else ""
    return f"{match['scheme']}{userinfo}{match['host']}{first}"


def redact(text: str, known: Iterable[str] = ()) -> str:
    """``text`` with every secret it holds replaced by ``***`` (the module docstring lists
    them); ``known``: secrets the caller holds by value (the engine keys), also taken out."""
    for secret in sorted({s for s in known if len(s) >= SHORTEST_KNOWN}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = _URL.sub(_url, text)
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text
