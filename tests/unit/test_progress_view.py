"""apply's live view and the probe/doctor progress bar: each subject's line is coloured by
the phase its reporter gave (never by what the message says) and timed from its first
report, the clock running while it is worked on and stopping once it is done or failed."""

from __future__ import annotations

import asyncio
import io

import pytest
from rich.console import Console, RenderableType

from llmgw_cli.cli import apply_steps
from llmgw_cli.cli.common import node_progress
from llmgw_cli.cli.views import progress_line, progress_view
from llmgw_cli.core.clusterfile.quantities import clock
from llmgw_cli.progress import Board, Phase, Report

YELLOW, GREEN, RED = "\x1b[33m", "\x1b[32m", "\x1b[31m"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def coloured(view: RenderableType) -> str:
    console = Console(file=io.StringIO(), width=200, color_system="standard", force_terminal=True)
    console.print(view)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_a_subject_is_timed_from_its_first_report_until_it_is_done() -> None:
    clock = Clock()
    board = Board(clock)
    board("qwen#0", "starting")
    clock.now += 40
    board("qwen#0", "loading (503)")
    clock.now += 50
    assert board.rows["qwen#0"].elapsed(clock.now) == 90  # still loading: the clock runs
    board("qwen#0", "ready", Phase.done)
    clock.now += 300
    assert board.rows["qwen#0"].elapsed(clock.now) == 90  # done: it stopped at "ready"
    board("node01", "units in place", Phase.done)
    assert list(board.rows) == ["qwen#0", "node01"]  # in the order they first reported


def test_the_colour_follows_the_phase_not_the_words() -> None:
    rows = Board(Clock())
    rows("a", "failed to look failed", Phase.working)  # text that says failed, still working
    rows("b", "ready", Phase.failed)  # text that says ready, but it failed
    rows("c", "whatever it said", Phase.done)
    out = coloured(progress_view(rows.rows, 100.0))
    assert f"{YELLOW}failed to look failed" in out, out
    assert f"{RED}ready" in out, out
    assert f"{GREEN}whatever it said" in out, out


def test_the_live_view_shows_the_time_each_subject_has_taken() -> None:
    clock = Clock()
    board = Board(clock)
    board("llama-70b#0", "starting")
    board("node01", "units in place", Phase.done)
    clock.now += 612
    out = coloured(progress_view(board.rows, clock.now))
    assert "10m12s" in out and "0s" in out, out


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "0s"), (59.9, "59s"), (65, "1m05s"), (3599, "59m59s"), (3725, "1h02m")]
)
def test_elapsed_is_short_and_whole(seconds: float, text: str) -> None:
    assert clock(seconds) == text


def test_a_line_gets_its_time_once_the_subject_is_done() -> None:
    clock = Clock()
    board = Board(clock)
    board("m#1", "starting")
    assert progress_line("m#1", board.rows["m#1"]).plain == "  m#1: starting"
    clock.now += 75
    board("m#1", "failed: exited 1", Phase.failed)
    assert progress_line("m#1", board.rows["m#1"]).plain == "  m#1: failed: exited 1 (1m15s)"


def run_with_progress(monkeypatch: pytest.MonkeyPatch, *, terminal: bool) -> str:
    console = Console(file=io.StringIO(), width=200, color_system="standard", force_terminal=terminal)
    monkeypatch.setattr(apply_steps, "err", console)

    async def work(report: Report) -> str:
        report("m#0", "starting")
        report("node01", "failed: disk full", Phase.failed)
        report("m#0", "ready", Phase.done)
        return "finished"

    assert asyncio.run(apply_steps._with_progress(work)) == "finished"
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_apply_draws_the_table_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out = run_with_progress(monkeypatch, terminal=True)
    assert f"{GREEN}ready" in out and f"{RED}failed: disk full" in out, out


def test_apply_prints_one_line_per_report_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out = run_with_progress(monkeypatch, terminal=False)
    assert out.splitlines() == ["  m#0: starting", "  node01: failed: disk full (0s)", "  m#0: ready (0s)"]


def test_the_node_progress_bar_counts_nodes_done_or_failed() -> None:
    console = Console(file=io.StringIO(), width=120, force_terminal=True)
    with node_progress(console, "checking", 3) as update:
        update("node01", "connecting")
        update("node01", "done", Phase.done)
        update("node02", "failed", Phase.failed)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "checking" in out and "2/3" in out and "node02 failed" in out, out


def test_the_node_progress_bar_stays_out_of_scripts() -> None:
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    with node_progress(console, "checking", 1) as update:
        update("node01", "done", Phase.done)
    assert console.file.getvalue() == ""  # type: ignore[attr-defined]
