"""The call trace of one `llmgw` command, run in this process under sys.setprofile (and
threading.setprofile for threads it starts), reduced to a few figures:

places   distinct llmgw_cli functions entered (module:qualname). Module bodies (import
         time) and comprehensions/generator expressions are not places: they belong to
         the function or module around them. Lambdas are places.
modules  distinct llmgw_cli modules a place was entered in.
returns  "returns to a module already left": take the modules of the places in the order
         they are first entered, with repeats in a row merged (a step within one module
         is no move); count each element whose module stands earlier in that sequence.
         Also given over all calls, per thread (this one grows with loops over nodes and
         replicas, the first one does not). A coroutine or generator resumed is not a
         call: only its first entry counts, so a resumed `await` is no move.
climbs   distinct caller -> callee function pairs where the caller's layer is lower than
         the callee's (layers: see architecture_report.py); also given as the number of
         such calls. The caller is the nearest llmgw_cli frame on the
         frame.f_back chain, across frames of other code (typer, asyncio, functools): a
         coroutine started by the event loop is attributed to the llmgw_cli function that
         runs the loop (asyncio.run's caller); a thread's first frames have no caller.
lab      calls between lab (tooling) and the layers, each way, counted apart from climbs.
"""

from __future__ import annotations

import contextlib
import dis
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from architecture_report import LAYER_NAMES, PACKAGE, TOOLING, layer_of, top_of

_NOT_PLACES = ("<module>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
_RESUMABLE = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


@dataclass
class _Moves:
    """A sequence of modules entered, repeats in a row merged, and the modules in it."""

    path: list[str] = field(default_factory=list)  # modules entered, repeats in a row merged
    seen: set[str] = field(default_factory=set)


@dataclass
class Tracer:
    root: str  # the package's folder, with a trailing separator
    start: str | None = None  # module:qualname; None: count everything
    places: Counter[str] = field(default_factory=Counter)
    returns: Counter[str] = field(default_factory=Counter)  # "first" visits, "all" calls
    first_visits: _Moves = field(default_factory=_Moves)
    climbs: Counter[str] = field(default_factory=Counter)
    lab_calls: Counter[str] = field(default_factory=Counter)
    threads: dict[int, _Moves] = field(default_factory=dict)
    _modules: dict[str, str | None] = field(default_factory=dict)
    _first_resume: dict[CodeType, int] = field(default_factory=dict)
    _inside: int = 0  # depth of `start` frames on the stack (all threads)

    def module(self, code: CodeType) -> str | None:
        """The llmgw_cli module a code object belongs to, or None."""
        name = self._modules.get(code.co_filename, "")
        if name == "":
            path = code.co_filename
            name = None
            if path.startswith(self.root) and path.endswith(".py"):
                parts = [PACKAGE, *Path(path[len(self.root) :]).with_suffix("").parts]
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self._modules[code.co_filename] = name
        return name

    def _resumed(self, frame: FrameType) -> bool:
        """A coroutine or generator taken up again after a yield/await, not a new call."""
        code = frame.f_code
        if not code.co_flags & _RESUMABLE:
            return False
        if code not in self._first_resume:
            resumes = (i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")
            self._first_resume[code] = next(resumes, 0)
        return frame.f_lasti > self._first_resume[code]

    def _caller(self, frame: FrameType) -> str | None:
        """The nearest llmgw_cli function below the frame, as module:qualname."""
        back = frame.f_back
        while back is not None:
            if (name := self.module(back.f_code)) is not None:
                return f"{name}:{back.f_code.co_qualname}"
            back = back.f_back
        return None

    def hook(self, frame: FrameType, event: str, _arg: object) -> None:
        if event not in ("call", "return"):
            return
        callee = self.module(frame.f_code)
        if callee is None or frame.f_code.co_name in _NOT_PLACES:
            return
        place = f"{callee}:{frame.f_code.co_qualname}"
        if self.start is not None and place == self.start and not self._resumed(frame):
            self._inside += 1 if event == "call" else -1
            if event == "return":
                return
        if event == "call" and (self.start is None or self._inside > 0) and not self._resumed(frame):
            self._count(frame, callee, place)

    def _count(self, frame: FrameType, callee: str, place: str) -> None:
        first = place not in self.places
        self.places[place] += 1
        moves = [self.threads.setdefault(threading.get_ident(), _Moves())]
        if first:
            moves.append(self.first_visits)
        for seq, name in zip(moves, ("all", "first"), strict=False):
            if not seq.path or seq.path[-1] != callee:
                self.returns[name] += callee in seq.seen
                seq.path.append(callee)
                seq.seen.add(callee)
        caller = self._caller(frame)
        if caller is None:
            return
        caller_module = caller.split(":")[0]
        if TOOLING in (top_of(caller_module), top_of(callee)):
            if top_of(caller_module) != top_of(callee):
                self.lab_calls[f"{_layer_name(caller_module)} -> {_layer_name(callee)}"] += 1
            return
        low, high = layer_of(caller_module), layer_of(callee)
        if low is not None and high is not None and low < high:
            self.climbs[f"{caller} -> {place}"] += 1


def _layer_name(module: str) -> str:
    layer = layer_of(module)
    return TOOLING if layer is None else LAYER_NAMES[layer]


def trace_command(args: list[str], start: str | None = None) -> dict[str, Any]:
    """Run `llmgw ARGS` here, traced; its own output goes to stderr."""
    import llmgw_cli  # noqa: PLC0415  (the checkout's, first on the path)
    from llmgw_cli.cli.main import main  # noqa: PLC0415

    tracer = Tracer(str(Path(llmgw_cli.__file__).parent) + "/", start)
    sys.argv = ["llmgw", *args]
    code: object = 0
    with contextlib.redirect_stdout(sys.stderr):
        threading.setprofile(tracer.hook)
        sys.setprofile(tracer.hook)
        try:
            main()
        except SystemExit as exc:
            code = exc.code
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    modules = {p.split(":")[0] for p in tracer.places}
    return {
        "command": ["llmgw", *args],
        "counted_inside": start or "the whole command",
        "exit": code,
        "places": len(tracer.places),
        "calls": sum(tracer.places.values()),
        "modules": len(modules),
        "returns_to_a_module_left": tracer.returns["first"],
        "returns_over_all_calls": tracer.returns["all"],
        "climbs": len(tracer.climbs),
        "climbing_calls": sum(tracer.climbs.values()),
        "climbs_by_edge": dict(tracer.climbs.most_common()),
        "lab_calls": dict(tracer.lab_calls),
        "threads": len(tracer.threads),
        "modules_entered": sorted(modules),
    }


def print_trace(r: dict[str, Any]) -> None:
    print(f"== trace of `{' '.join(r['command'])}` (exit {r['exit']}), counted inside {r['counted_inside']}")
    print(
        f"visits {r['places']} places in {r['modules']} modules, "
        f"returns {r['returns_to_a_module_left']} times to a module it had left, "
        f"climbs {r['climbs']} times from a lower layer back to a higher one"
    )
    print(
        f"  over all {r['calls']} calls ({r['threads']} threads): {r['returns_over_all_calls']} returns "
        f"to a module left, {r['climbing_calls']} climbing calls"
    )
    print("== climbs (caller function -> callee function: calls)")
    for edge, n in r["climbs_by_edge"].items():
        print(f"  {n:6d}  {edge}")
    print(f"== calls between lab (tooling) and the layers: {r['lab_calls'] or 'none'}")
    print("== modules entered")
    for m in r["modules_entered"]:
        print(f"  {m}")
    print((__doc__ or "").strip())
