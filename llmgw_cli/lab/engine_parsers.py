"""vLLM's and SGLang's own argument parsers, asked from inside the engine's environment.

Run as a file by the engine's interpreter (it imports nothing of llmgw, only the engine):

    VENV/bin/python engine_parsers.py flags vllm      # the flag table, JSON, on stdout
    VENV/bin/python engine_parsers.py check sglang    # argvs (JSON list of lists) on stdin

``flags`` prints every option string ``vllm serve`` (or SGLang's server) accepts, with
what it takes: ``value`` (one word), ``switch`` (none), ``optional`` (zero or one) or
``list`` (one or more). llmgw keeps these tables in ``llmgw_cli/core/engine/engine_flags/`` (the
plan checks rendered command lines against them; the lab's simulated engines accept
exactly those flags), and a test compares the committed table with a fresh one.

``check`` parses each argv (the words after ``vllm`` / after ``-m sglang.launch_server``)
the way the engine does when it starts — vLLM: the ``serve`` subcommand's parser and its
``validate``; SGLang: ``prepare_server_args``, which also checks the values — and prints
one JSON object per argv: ``{"ok": true}`` or ``{"ok": false, "error": "..."}``.
Nothing is started: no model is loaded, no port opened.
"""

# The engine modules are imported where they are used: this file runs under the
# engine's interpreter, and llmgw's own never imports them.
# ruff: noqa: PLC0415
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from typing import Any


def _takes(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.nargs == "?":
        return "optional"
    if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
        return "list"
    return "value"


def _table(parser: argparse.ArgumentParser) -> dict[str, str]:
    flags: dict[str, str] = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                flags[option] = _takes(action)
    return dict(sorted(flags.items()))


def _vllm() -> tuple[argparse.ArgumentParser, Any, Any]:
    from vllm.entrypoints.cli.serve import ServeSubcommand  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found,import-untyped,unused-ignore]

    top = FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(required=False, dest="subparser")
    command = ServeSubcommand()
    serve = command.subparser_init(subparsers)
    return top, command, serve


def _sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found,import-untyped,unused-ignore]

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def _version(dist: str) -> str:
    """The release part: ``0.32.0+cpu`` is 0.32.0 (the local part names the build, not the flags)."""
    from importlib.metadata import version

    return version(dist).split("+", 1)[0]


def flags(engine: str) -> dict[str, Any]:
    if engine == "vllm":
        _, _, serve = _vllm()
        return {"engine": "vllm", "version": _version("vllm"), "flags": _table(serve)}
    return {"engine": "sglang", "version": _version("sglang"), "flags": _table(_sglang_parser())}


def _check_one(engine: str, argv: list[str], vllm: Any) -> dict[str, Any]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if engine == "vllm":
                top, command, _ = vllm
                command.validate(top.parse_args(argv))
            else:
                from sglang.srt.server_args import prepare_server_args  # type: ignore[import-not-found,import-untyped,unused-ignore]

                prepare_server_args(argv)
    except SystemExit as exc:
        return {"ok": False, "error": err.getvalue().strip() or f"exit {exc.code}"}
    except Exception as exc:  # the engines validate values by raising
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True}


def check(engine: str, argvs: list[list[str]]) -> list[dict[str, Any]]:
    vllm = _vllm() if engine == "vllm" else None
    return [_check_one(engine, argv, vllm) for argv in argvs]


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("flags", "check") or sys.argv[2] not in ("vllm", "sglang"):
        raise SystemExit("usage: engine_parsers.py {flags|check} {vllm|sglang}")
    verb, engine = sys.argv[1], sys.argv[2]
    out = flags(engine) if verb == "flags" else check(engine, json.load(sys.stdin))
    json.dump(out, sys.stdout, indent=1 if verb == "flags" else None)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
