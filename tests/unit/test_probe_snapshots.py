"""The probe's view of repository snapshots: the weights script run for real (bash, find,
dd, base64) over folders built here, then parsed. A snapshot counts as held only when its
manifest is there and every file it lists is on disk at its size; placement prefers the
nodes that hold it and treats a partial one as absent."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import Node
from llmgw_cli.core.engine.templates import render_text
from llmgw_cli.core.observe.facts import WeightsDir
from llmgw_cli.core.observe.parse.probe import WEIGHTS_SH, _weights
from llmgw_cli.core.planning.placement import place
from llmgw_cli.core.weights.snapshot import Digest, Snapshot, SnapshotFile, manifest_text

from .facts_factory import node_facts

A = "a" * 40
B = "b" * 40
FILES = {"config.json": b"{}", "model-1.safetensors": b"x" * 1000, "sub/tokenizer.json": b"tok"}


def write_snapshot(weights: Path, repo: str, commit: str, *, manifest: bool = True) -> Path:
    org, name = repo.split("/")
    folder = weights / "hf" / f"{org}--{name}" / commit
    for path, data in FILES.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    if manifest:
        sums = {p: hashlib.sha256(d).hexdigest() for p, d in FILES.items()}
        snap = Snapshot(
            repo, commit, tuple(SnapshotFile(p, len(d), sums[p], Digest.sha256) for p, d in FILES.items())
        )
        (folder.parent / f"{commit}.manifest.json").write_text(manifest_text(snap, sums))
    return folder


def probe(weights: Path) -> WeightsDir:
    script = render_text(WEIGHTS_SH, weight_dirs=[str(weights)])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    node = Node.model_validate({"name": "n", "address": "10.0.0.1", "weights": [str(weights)]})
    (found,) = _weights(out, node)
    return found


def test_complete_snapshot_is_held_and_partial_ones_say_why(tmp_path: Path) -> None:
    w = tmp_path / "models"
    write_snapshot(w, "acme/done", A)
    write_snapshot(w, "acme/killed", A, manifest=False)  # stopped before its manifest
    missing = write_snapshot(w, "acme/missing", A)
    (missing / "model-1.safetensors").unlink()
    short = write_snapshot(w, "acme/short", A)
    (short / "sub/tokenizer.json").write_bytes(b"t")
    write_snapshot(w, "acme/other", B)
    (w / "hf/acme--other" / f"{B}.manifest.json").rename(w / "hf/acme--other" / f"{A}.manifest.json")
    (w / "hf/acme--other" / A).mkdir()
    (w / "Llama").mkdir()
    (w / "Llama/model.safetensors").write_bytes(b"w")
    found = {m.name: m.reason for m in probe(w).models}
    assert found == {
        "Llama": "",  # a plain model folder beside the snapshots is judged as before
        f"hf/acme--done/{A}": "",
        f"hf/acme--killed/{A}": "partial snapshot: no manifest yet (still fetching, or stopped)",
        f"hf/acme--missing/{A}": "1 file(s) of the manifest missing (e.g. model-1.safetensors)",
        f"hf/acme--other/{A}": f"manifest is of acme/other@{B}",
        f"hf/acme--other/{B}": "partial snapshot: no manifest yet (still fetching, or stopped)",
        f"hf/acme--short/{A}": (
            "1 file(s) unlike the manifest (e.g. sub/tokenizer.json: 1 bytes, the manifest says 3)"
        ),
    }
    assert next(m for m in probe(w).models if m.name == f"hf/acme--done/{A}").size == 1005


def test_snapshots_behind_a_symlink_are_not_read(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    write_snapshot(elsewhere, "acme/done", A)
    w = tmp_path / "models"
    w.mkdir()
    (w / "hf").symlink_to(elsewhere / "hf")
    assert probe(w).models == ()
    (w / "hf").unlink()
    (w / "hf").mkdir()
    (w / "hf/acme--done").symlink_to(elsewhere / "hf/acme--done")
    assert probe(w).models == ()


SPEC = f"""\
cluster: {{name: t}}
nodes:
  - {{name: a, address: 10.0.0.1, weights: [/data/models]}}
  - {{name: b, address: 10.0.0.2, weights: [/data/models]}}
profiles: {{vllm: {{engine: vllm}}}}
models:
  - {{name: m, source: "acme/done@{A}", profile: vllm, fetch: {{}}, scaling: {{min: 1, max: 1}}}}
"""


def test_placement_prefers_a_complete_snapshot_and_ignores_a_partial_one(tmp_path: Path) -> None:
    spec = parse_cluster(SPEC)
    w = tmp_path / "models"
    write_snapshot(w, "acme/done", A)
    held = probe(w).models
    partial = tuple(m.model_copy(update={"complete": False, "reason": "x"}) for m in held)

    def facts(b_models: tuple) -> dict:
        out = {}
        for name, models in (("a", ()), ("b", b_models)):
            f = node_facts(name)
            out[name] = f.model_copy(
                update={
                    "weights": (
                        WeightsDir(
                            path="/data/models", shared=False, present=True, free_bytes=None, models=models
                        ),
                    )
                }
            )
        return out

    (replica,) = place(spec, facts(held), [], {"m": 1}).replicas
    assert replica.slots[0].node == "b"  # b holds the snapshot: a would have to fetch it
    for _ in range(3):  # without the preference the first node by name ("a") wins
        (replica,) = place(spec, facts(partial), [], {"m": 1}).replicas
        assert replica.slots[0].node == "a"
