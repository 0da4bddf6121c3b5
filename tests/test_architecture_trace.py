"""scripts/architecture_trace.py's figures on a made-up package of two layers: a cli
function that hands a core function its callback, directly and through asyncio."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent

CORE = """
import asyncio
def run_with(cb):
    return cb()
async def work(cb):
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return cb()
def go(cb):
    return asyncio.run(work(cb))
"""
CLI = """
def cb():
    return 1
def main():
    run_with(cb)
    go(cb)
    run_with(cb)
"""


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_trace_counts_places_returns_and_climbs() -> None:
    _load("architecture_report")
    trace = _load("architecture_trace")
    root = "/made-up/llmgw_cli/"
    names: dict[str, object] = {}
    exec(compile(CORE, root + "core/a.py", "exec"), names)
    exec(compile(CLI, root + "cli/b.py", "exec"), names)
    tracer = trace.Tracer(root)
    sys.setprofile(tracer.hook)
    try:
        names["main"]()  # type: ignore[operator]
    finally:
        sys.setprofile(None)
    # the coroutine resumed twice by the loop is entered once
    assert tracer.places == {
        "llmgw_cli.cli.b:main": 1, "llmgw_cli.core.a:run_with": 2, "llmgw_cli.cli.b:cb": 3,
        "llmgw_cli.core.a:go": 1, "llmgw_cli.core.a:work": 1,
    }  # fmt: skip
    # first entries: cli, core, cli (back), core (back), core; all calls: cb and run_with alternate
    assert tracer.returns == {"first": 2, "all": 5}
    # the coroutine's callback is charged to the coroutine, the loop's frames skipped
    assert tracer.climbs == {
        "llmgw_cli.core.a:run_with -> llmgw_cli.cli.b:cb": 2,
        "llmgw_cli.core.a:work -> llmgw_cli.cli.b:cb": 1,
    }
