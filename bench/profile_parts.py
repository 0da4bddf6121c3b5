"""Where a gateway's CPU goes, by part, from py-spy's raw collapsed stacks.

    .venv/bin/python bench/profile_parts.py STACKS.txt [--cpu-us 140]

``bench/gateway.py --profile DIR`` writes the stacks (``py-spy record --format raw``: one
line per distinct stack, ``frame;frame;...;frame COUNT``, the outermost frame first, each
frame ``function (file:line)``) and prints this table for them.

Samples of a thread that only waits for work (the executor's idle threads, the access
log's writer between flushes, which py-spy does not always see as idle) are left out. Each other sample goes to one part: the innermost frame that a rule below names decides. Time in
C code (the HTTP parser, ``json.loads``, SHA-256, socket writes, uvloop) goes to the
Python function that called it, since py-spy records Python frames only (no ``--native``):
``transport.write`` in the aiohttp server's writer is "aiohttp response writing", the
system call included. Samples whose innermost Python frame is the event loop itself (its
scheduling, its callbacks' C parts, uvloop's reads) are "event loop".
"""

from __future__ import annotations

import argparse
import functools
import linecache
import re
import site
import sysconfig
from collections import Counter
from pathlib import Path

# (part, a piece of the frame's file path, the function or None for any): the first rule
# that matches the innermost frame it can decide for wins. The order matters where rules
# overlap: specific functions first.
RULES: tuple[tuple[str, str, str | None], ...] = (
    ("request id (x-request-id)", "llmgw_cli/gateway/serving/openai_error.py", "request_id"),
    ("request id (x-request-id)", "llmgw_cli/gateway/serving/openai_error.py", "add_request_id"),
    ("HTTP parsing (aiohttp's C parser)", "aiohttp/web_protocol.py", "data_received"),
    ("HTTP parsing (aiohttp's C parser)", "aiohttp/http_parser.py", None),
    ("aiohttp response writing (head, body, chunks)", "aiohttp/http_writer.py", None),
    ("aiohttp response writing (head, body, chunks)", "aiohttp/web_response.py", "_write_headers"),
    ("aiohttp response writing (head, body, chunks)", "aiohttp/web_response.py", "_start"),
    ("aiohttp response writing (head, body, chunks)", "aiohttp/web_response.py", "prepare"),
    ("aiohttp response writing (head, body, chunks)", "aiohttp/web_response.py", "write"),
    ("aiohttp response writing (head, body, chunks)", "aiohttp/web_response.py", "write_eof"),
    ("aiohttp request/response objects", "aiohttp/web_request.py", None),
    ("aiohttp request/response objects", "aiohttp/web_response.py", None),
    ("aiohttp request/response objects", "aiohttp/helpers.py", None),
    ("aiohttp request/response objects", "aiohttp/streams.py", None),
    ("aiohttp request/response objects", "multidict/", None),
    ("aiohttp request/response objects", "yarl/", None),
    ("aiohttp routing and middlewares", "aiohttp/web_urldispatcher.py", None),
    ("aiohttp routing and middlewares", "aiohttp/web_app.py", None),
    ("aiohttp routing and middlewares", "aiohttp/web_middlewares.py", None),
    ("llmgw middlewares (request id, headers)", "llmgw_cli/gateway/serving/server.py", None),
    ("aiohttp request handling (web_protocol)", "aiohttp/web_protocol.py", None),
    ("aiohttp request handling (web_protocol)", "aiohttp/", None),
    ("JSON (body check, parse, encode)", "llmgw_cli/gateway/serving/request_body.py", None),
    ("JSON (body check, parse, encode)", "json/", None),
    ("auth (key lookup, SHA-256)", "llmgw_cli/core/serving/keys.py", None),
    ("auth (key lookup, SHA-256)", "llmgw_cli/gateway/control/state.py", "authenticate"),
    ("admission", "llmgw_cli/gateway/serving/admission.py", None),
    ("admission", "llmgw_cli/gateway/serving/proxy.py", "_enter"),
    ("admission", "llmgw_cli/core/serving/limits.py", None),
    ("per-key limits", "llmgw_cli/gateway/serving/limiting.py", None),
    ("per-key limits", "llmgw_cli/core/serving/ratelimit.py", None),
    ("routing (replica choice)", "llmgw_cli/core/serving/routing.py", None),
    ("routing (replica choice)", "llmgw_cli/core/serving/affinity.py", None),
    ("routing (replica choice)", "llmgw_cli/gateway/serving/proxy.py", "_choose"),
    ("routing (replica choice)", "llmgw_cli/gateway/control/state.py", "signals_stale_after"),
    ("metering (usage)", "llmgw_cli/gateway/store/usage.py", None),
    ("metering (usage)", "llmgw_cli/gateway/store/", None),  # its batched writes, in a thread
    ("access log", "llmgw_cli/gateway/serving/accesslog.py", None),
    ("metrics", "llmgw_cli/gateway/serving/metrics.py", None),
    ("metrics", "llmgw_cli/gateway/serving/recent.py", None),
    ("metrics", "prometheus_client/", None),
    ("usage from the answer (sse.py)", "llmgw_cli/gateway/serving/sse.py", None),
    ("upstream client (own, httptools)", "llmgw_cli/gateway/serving/upstream.py", None),
    ("proxy's own code (RequestRecord, the path)", "llmgw_cli/gateway/serving/proxy.py", None),
    (
        "lean HTTP server (http1.py: parsing callbacks, requests, answers)",
        "llmgw_cli/gateway/serving/http1.py",
        None,
    ),
    (
        "lean HTTP server (http1.py: parsing callbacks, requests, answers)",
        "llmgw_cli/gateway/serving/exchange.py",
        None,
    ),
    ("the raw proxy's own code (bench/raw_proxy.py)", "raw_proxy.py", None),
    ("event loop", "asyncio/", None),
    ("event loop", "uvloop/", None),
    ("garbage collection", "<gc>", None),
)
# Parts that own all they call: json.dumps of the log line is the access log's, a header
# read for the metrics' labels is the metrics'. The innermost frame of one of these decides
# before any other rule is looked at.
OWNERS = frozenset({"access log", "metrics", "metering (usage)", "auth (key lookup, SHA-256)"})
OTHER = "other"
# The innermost frame's line writes to a socket: the send system call, loopback delivery
# included, is most of such a sample. The raw proxy pays it too: what the protocol costs.
SEND = "socket writes (send system call)"
SEND_CALLS = ("transport.write(", "transport.writelines(", "transport.write ")
ROOT = Path(__file__).resolve().parent.parent
IDLE = "idle"  # a thread blocked waiting for work: not counted (py-spy may still sample it)
# function, file: the executor's idle workers, and any thread blocked on a condition (the
# access log's writer between its flushes)
IDLE_LEAVES = (("_worker", "concurrent/futures/thread.py"), ("Condition.wait", "threading.py"))
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]*):(?P<line>\d+)\)$")


def part_of(stack: str) -> str:
    """The part one collapsed stack's sample goes to."""
    frames = stack.split(";")
    leaf = FRAME.match(frames[-1])
    if leaf is not None and (leaf["function"], leaf["file"]) in IDLE_LEAVES:
        return IDLE
    if leaf is not None and _sends(leaf["file"], int(leaf["line"])):
        return SEND
    matches = [_match(frame) for frame in reversed(frames)]  # innermost first
    for part in matches:
        if part in OWNERS:
            return part
    return next((part for part in matches if part is not None), OTHER)


def _match(frame: str) -> str | None:
    m = FRAME.match(frame)
    if m is None:
        return None
    function = m["function"]  # qualified: Class.method, f.<locals>.g
    for part, piece, name in RULES:
        if piece in m["file"] and (name is None or function == name or function.endswith("." + name)):
            return part
    return None


@functools.cache
def _sends(file: str, line: int) -> bool:
    """Whether ``file``'s line ``line`` writes to a transport. py-spy names files relative to
    the import path: they are looked for in this checkout, site-packages and the stdlib."""
    folders = [
        ROOT,
        ROOT / "bench",
        *map(Path, site.getsitepackages()),
        Path(sysconfig.get_paths()["stdlib"]),
    ]
    for folder in folders:
        path = folder / file
        if path.is_file():
            text = linecache.getline(str(path), line)
            return any(call in text for call in SEND_CALLS)
    return False


def parts(collapsed: str) -> Counter[str]:
    """Samples per part, over every line of a raw collapsed-stack file."""
    counts: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and (part := part_of(stack)) != IDLE:
            counts[part] += int(count)
    return counts


def leaves(collapsed: str, part: str, top: int = 5) -> list[tuple[str, int]]:
    """The innermost frames of ``part``'s samples, most sampled first: what it is made of."""
    counts: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and part_of(stack) == part:
            counts[stack.rsplit(";", 1)[-1]] += int(count)
    return counts.most_common(top)


def table(counts: Counter[str], cpu_us: float = 0.0) -> str:
    """A Markdown table, largest part first; µs per request when ``cpu_us`` is given."""
    total = sum(counts.values()) or 1
    rows = ["| part | share | us per request |", "|---|---|---|"]
    for part, n in counts.most_common():
        us = f"{n / total * cpu_us:.1f}" if cpu_us else ""
        rows.append(f"| {part} | {100 * n / total:.1f} % | {us} |")
    rows.append(f"| total ({total} samples) | 100 % | {cpu_us:.0f} |" if cpu_us else f"| total | {total} | |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stacks", type=Path, help="py-spy's raw collapsed stacks (--format raw)")
    parser.add_argument("--cpu-us", type=float, default=0.0, help="CPU time per request, for the µs column")
    parser.add_argument(
        "--detail", type=int, default=0, help="Also the N most sampled innermost frames per part"
    )
    args = parser.parse_args()
    collapsed = args.stacks.read_text()
    counts = parts(collapsed)
    print(table(counts, args.cpu_us))
    for part, _ in counts.most_common() if args.detail else ():
        print(f"\n{part}:")
        for frame, n in leaves(collapsed, part, args.detail):
            print(f"  {n:6} {frame}")


if __name__ == "__main__":
    main()
