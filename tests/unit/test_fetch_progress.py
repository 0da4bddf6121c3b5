"""How far a fetch is, as text: the pure formatting (``core/weights/fetch_progress.py``), the lines
fetch events become (``_progress_lines``, by node for apply and by model for the gateway)
and the events a snapshot's job reports (files and bytes as numbers, bounded by the
snapshot's own counts whatever the node says)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmgw_cli.cli import fetch_steps
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.weights.fetch_progress import NodeProgress, amounts, least_advanced, progress_text
from llmgw_cli.core.weights.snapshot import Digest, Snapshot, SnapshotFile
from llmgw_cli.progress import FetchEvent, Phase
from llmgw_cli.remote import snapshot_fetch
from llmgw_cli.remote.fetch import _progress_lines

GB, MB = 10**9, 10**6


@pytest.mark.parametrize(
    ("done", "total", "text"),
    [
        (512 * GB, 810 * GB, "512 of 810 GB"),
        (1_200_000_000, 4 * GB, "1.2 of 4.0 GB"),
        (0, 4 * GB, "0.0 of 4.0 GB"),
        (512 * MB, 810 * MB, "512 of 810 MB"),  # below 1 GB: MB
        (300_000, 5 * MB, "0.3 of 5.0 MB"),
        (999 * MB, 1 * GB, "1.0 of 1.0 GB"),  # the total picks the unit for both
        (5 * MB, 200 * GB, "0 of 200 GB"),
        (512 * GB, None, "512 GB"),  # no total known: the bytes done pick it
        (3 * MB, 0, "3.0 MB"),
    ],
)
def test_amounts_use_one_unit_and_one_precision_for_both_numbers(
    done: int, total: int | None, text: str
) -> None:
    assert amounts(done, total) == text


def test_progress_text_of_a_snapshot_a_single_file_and_a_start() -> None:
    snapshot = NodeProgress("fetching", 512 * GB, 810 * GB, files=142, files_total=191)
    assert progress_text(snapshot) == "fetching 142/191 files, 512 of 810 GB"
    assert progress_text(NodeProgress("fetching", 512 * MB, 810 * MB)) == "fetching 512 of 810 MB"
    assert progress_text(NodeProgress("fetching", 0, 810 * MB)) == "fetching 0 of 810 MB"
    assert progress_text(NodeProgress("waiting")) == "waiting"
    assert progress_text(NodeProgress("fetching", files=0, files_total=7)) == "fetching 0/7 files"


def test_the_least_advanced_node_is_the_one_with_the_smallest_share_done() -> None:
    nodes = {
        "a": NodeProgress("fetching", 500, 1000),
        "b": NodeProgress("fetching", 100, 1000),  # 10%: the least advanced
        "c": NodeProgress("fetching", 200, 200),
    }
    assert least_advanced(nodes) == "b"
    assert least_advanced({"x": NodeProgress("fetching", 5, 10), "w": NodeProgress("fetching", 5, 10)}) == "w"
    assert least_advanced({"a": NodeProgress("fetching", 0, None, 3, 4), "b": NodeProgress("waiting")}) == "b"
    assert least_advanced({}) is None


Line = tuple[str, str, Phase]


def lines(by_model: bool) -> tuple[list[Line], Any]:
    got: list[Line] = []

    def report(subject: str, message: str, phase: Phase = Phase.working, /) -> None:
        got.append((subject, message, phase))

    return got, _progress_lines(report, by_model=by_model)


def snap_event(
    node: str, done: int, files: int, source: str = "origin", state: str = "fetching"
) -> FetchEvent:
    return FetchEvent("qwen", node, state, source, done * GB, 810 * GB, files=files, files_total=191)


def test_by_node_each_node_has_its_lines_at_most_one_per_tenth() -> None:
    got, on_event = lines(by_model=False)
    on_event(snap_event("n1", 0, 0))
    on_event(snap_event("n1", 10, 2))  # still under 10%: not said
    on_event(snap_event("n1", 512, 142))
    on_event(FetchEvent("qwen", "n2", "fetching", "n1", 512 * MB, 810 * MB))
    on_event(snap_event("n1", 810, 191, state="done"))
    assert got == [
        ("qwen@n1", "fetching 0/191 files, 0 of 810 GB from origin", Phase.working),
        ("qwen@n1", "fetching 142/191 files, 512 of 810 GB from origin", Phase.working),
        ("qwen@n2", "fetching 512 of 810 MB from peer n1", Phase.working),
        ("qwen@n1", "weights done from origin, 810 GB", Phase.done),
    ]


def test_by_model_the_least_advanced_node_is_said_and_said_again_when_another_ends() -> None:
    got, on_event = lines(by_model=True)
    on_event(snap_event("n1", 400, 100))
    on_event(snap_event("n2", 100, 20, source="n1"))  # now n2 is the least advanced
    on_event(snap_event("n1", 500, 120))  # n2 is still the least advanced: nothing new
    on_event(snap_event("n1", 810, 191, state="done"))
    on_event(FetchEvent("qwen", "n2", "fetching", "origin", 100 * GB, 810 * GB, "peer n1: gone", 20, 191))
    assert got == [
        ("qwen@n1", "fetching 100/191 files, 400 of 810 GB from origin", Phase.working),
        (
            "qwen@n2",
            "fetching 20/191 files, 100 of 810 GB from peer n1 (the least advanced of 2 nodes)",
            Phase.working,
        ),
        ("qwen@n1", "weights done from origin, 810 GB", Phase.done),
        ("qwen@n2", "fetching 20/191 files, 100 of 810 GB from peer n1", Phase.working),  # said again
        ("qwen@n2", "fetching 20/191 files, 100 of 810 GB from origin: peer n1: gone", Phase.working),
    ]


SPEC = parse_cluster(
    """\
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1, weights: [/w]}
profiles:
  vllm: {engine: vllm, ports: 8100-8199}
models:
  - {name: qwen, source: org/qwen@main, profile: vllm, fetch: {}}
"""
)


class FakeFetcher:
    """A node whose snapshot job answers a queue of polls; the events it reports."""

    def __init__(self, polls: list[dict[str, Any]]) -> None:
        self.polls = polls
        self.events: list[FetchEvent] = []
        self.helper = False

    def report(self, e: FetchEvent) -> None:
        self.events.append(e)

    async def call(self, node: str, job: dict[str, Any]) -> dict[str, Any]:
        if job["mode"] == "snapshot":
            return {"state": "started"}
        return {"free": False, "status": self.polls.pop(0)}


def test_a_snapshot_job_reports_files_and_bytes_as_numbers_bounded_by_the_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(snapshot_fetch, "POLL_SECONDS", 0.0)
    files = tuple(SnapshotFile(f"model-{i}.safetensors", 100, f"{i}" * 64, Digest.sha256) for i in range(3))
    snap = Snapshot("org/qwen", "c" * 40, files)
    hostile = {
        "state": "running",
        "files_done": 99,
        "files_total": 99,
        "bytes_done": 10**12,
        "bytes_total": 10**12,
    }
    polls = [
        {"state": "running", "files_done": 1, "files_total": 3, "bytes_done": 150, "bytes_total": 300},
        hostile,  # a node that claims more than the snapshot has
        {"state": "done", "files_done": 3, "files_total": 3, "bytes_done": 300, "bytes_total": 300},
    ]
    fetcher = FakeFetcher(polls)
    run = snapshot_fetch._Run(fetcher, SPEC, "qwen", snap, None, None)  # type: ignore[arg-type]
    result = asyncio.run(run.from_hub("a"))
    assert result.ok
    assert [(e.state, e.bytes, e.total, e.files, e.files_total, e.message) for e in fetcher.events] == [
        ("fetching", 0, 300, 0, 3, ""),
        ("fetching", 150, 300, 1, 3, ""),
        ("fetching", 300, 300, 3, 3, ""),
        ("done", 300, 300, 3, 3, ""),
    ]


def test_llmgw_fetch_still_shows_a_snapshots_files_beside_its_bytes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, on_event = fetch_steps._progress()  # no terminal under the tests: one line per state change
    on_event(FetchEvent("qwen", "a", "fetching", "origin", 0, 300, files=0, files_total=3))
    on_event(FetchEvent("qwen", "a", "fetching", "origin", 150, 300, files=1, files_total=3))
    on_event(FetchEvent("qwen", "b", "fetching", "origin", 10, 300, "peer a: gone"))
    assert capsys.readouterr().err.splitlines() == [
        "  qwen -> a: fetching (origin): 0/3 files",
        "  qwen -> a: fetching (origin): 1/3 files",
        "  qwen -> b: fetching (origin): peer a: gone",
    ]
