"""bench/profile_parts.py: py-spy's collapsed stacks sorted into the gateway's parts (the
table in bench/RESULTS.md is made by it, so its rules are checked here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_parts", ROOT / "bench" / "profile_parts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pp = load()
TOP = "<module> (llmgw_cli/__main__.py:3);Runner.run (asyncio/runners.py:118)"
FORWARD = f"{TOP};forward (llmgw_cli/gateway/serving/proxy.py:84)"


def test_the_innermost_frame_with_a_rule_decides() -> None:
    parse = f"{FORWARD};_forward (llmgw_cli/gateway/serving/proxy.py:180);parse_body (llmgw_cli/gateway/serving/request_body.py:71);JSONDecoder.decode (json/decoder.py:337)"
    choose = f"{FORWARD};_choose (llmgw_cli/gateway/serving/proxy.py:394);Pool.choose (llmgw_cli/core/serving/routing.py:158)"
    assert pp.part_of(parse) == "JSON (body check, parse, encode)"
    assert pp.part_of(choose) == "routing (replica choice)"
    assert pp.part_of(FORWARD) == "proxy's own code (RequestRecord, the path)"
    assert pp.part_of(TOP) == "event loop"
    assert pp.part_of("<module> (somewhere/else.py:1)") == pp.OTHER


def test_an_owner_part_keeps_what_it_calls() -> None:
    """json.dumps of the log line is the access log's cost, not JSON handling's."""
    log = f"{FORWARD};AccessLog.write (llmgw_cli/gateway/serving/accesslog.py:33);dumps (json/__init__.py:234);JSONEncoder.iterencode (json/encoder.py:258)"
    assert pp.part_of(log) == "access log"


def test_a_leaf_line_that_writes_to_a_transport_is_a_socket_write() -> None:
    lines = (ROOT / "bench" / "raw_proxy.py").read_text().splitlines()
    write = next(n for n, line in enumerate(lines, 1) if "self.transport.write(" in line)
    other = next(n for n, line in enumerate(lines, 1) if "self.body.append(" in line)
    assert pp.part_of(f"{TOP};Client.end (raw_proxy.py:{write})") == pp.SEND
    assert pp.part_of(f"{TOP};Client.on_body (raw_proxy.py:{other})") != pp.SEND


def test_idle_executor_threads_are_left_out_and_counts_add_up() -> None:
    idle = "Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81)"
    busy = "Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:83);_transaction (llmgw_cli/gateway/store/sqlite.py:110)"
    counts = pp.parts(f"{idle} 500\n{busy} 7\n{TOP} 3\n")
    assert counts == {"metering (usage)": 7, "event loop": 3}
    table = pp.table(counts, cpu_us=100.0)
    assert "| metering (usage) | 70.0 % | 70.0 |" in table
    assert "| total (10 samples) | 100 % | 100 |" in table


def test_the_access_log_writer_waiting_between_flushes_is_idle() -> None:
    """py-spy samples the writer thread blocked in its wait: counted, it made the access log
    look like a quarter of every request."""
    thread = "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982)"
    waiting = f"{thread};AccessLog._run (llmgw_cli/gateway/serving/accesslog.py:138);Event.wait (threading.py:629);Condition.wait (threading.py:331)"
    writing = f"{thread};AccessLog._run (llmgw_cli/gateway/serving/accesslog.py:140);AccessLog.flush (llmgw_cli/gateway/serving/accesslog.py:151)"
    assert pp.parts(f"{waiting} 600\n{writing} 4\n{TOP} 6\n") == {"access log": 4, "event loop": 6}


def test_the_lean_server_s_own_code_is_its_part() -> None:
    received = f"{TOP};Connection.data_received (llmgw_cli/gateway/serving/http1.py:453)"
    assert pp.part_of(received) == "lean HTTP server (http1.py: parsing callbacks, requests, answers)"
    answered = f"{TOP};Connection.write (llmgw_cli/gateway/serving/http1.py:1)"
    assert pp.part_of(answered) == pp.part_of(received)  # line 1 is no transport.write
