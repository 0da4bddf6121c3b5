"""The probe against names chosen by whoever can write a weights folder.

Every name on a node is hostile data: a folder ``x|e;#`` once turned the probe's ``sed``
program into one that ran index-file text as root, and a file name holding a newline once
printed probe sections of its own (units and labels the gateway routed to). The parser
tests feed what the script prints for such names; the script test runs the real rendered
script with sh, find and coreutils against a crafted folder tree.
"""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.parse.probe import (
    BAD_OUTPUT,
    DRAINING_SH,
    MARKER_BYTES,
    parse_probe,
    probe_script,
    split_sections,
)
from llmgw_cli.core.planning.drain import DRAIN_DIR

FORGED_UNITS = (
    "\n@@ units\nId=llmgw-forged-0.service\nLoadState=loaded\nActiveState=active\nSubState=running\n"
    "MainPID=4242\n@@ labels\nllmgw-forged-0.service:X-Llmgw-Model=llama\n"
)


def spec_for(weights: str, engine: str = "/opt/vllm/bin/vllm") -> ClusterSpec:
    return parse_cluster(
        f"""\
cluster: {{name: t}}
nodes:
  - {{name: a, address: 10.0.0.1, weights: [{weights}]}}
profiles:
  vllm: {{engine: vllm, command: [{engine}, serve]}}
models: []
"""
    )


SPEC = spec_for("/data/models")
NODE = SPEC.nodes[0]


def b64(*fields: str | bytes) -> str:
    """Fields as the probe prints names: each NUL-terminated, base64 on one line."""
    raw = b"".join((f if isinstance(f, bytes) else f.encode()) + b"\0" for f in fields)
    return base64.b64encode(raw).decode()


def probe_output(weights: str, engines: str = "@engine /opt/vllm/bin/vllm found") -> str:
    return (
        "@@ host\nclock 1700000000.5\nMemTotal: 1000 kB\n@@ gpus\n"
        "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559, 0, 00000000:18:00.0\n@rc 0\n"
        f"@@ weights\n@dir /data/models\n@free_kib 100\n{weights}\n@@ engines\n{engines}\n"
        "@@ units\nId=llmgw-llama-0.service\nLoadState=loaded\nActiveState=active\nSubState=running\nMainPID=77\n"
        "@@ labels\n/etc/systemd/system/llmgw-llama-0.service:X-Llmgw-Model=llama\n@@ end\n"
    )


def assert_real_facts_only(facts: NodeFacts) -> None:
    assert facts.error is None
    assert [u.name for u in facts.units] == ["llmgw-llama-0.service"]
    assert facts.units[0].main_pid == 77
    assert facts.unit_labels == {"llmgw-llama-0.service": {"Model": "llama"}}
    assert [g.uuid for g in facts.gpus] == ["GPU-aaaa"]
    assert facts.clock == 1700000000.5


def test_file_name_with_a_newline_and_a_section_marker_stays_one_name() -> None:
    hostile = "m" + FORGED_UNITS
    entries = "@entries " + b64(
        f"d\t4096\t{hostile}", "d\t4096\tllama", "f\t9\tllama/a.safetensors", f"f\t1\tllama/x{FORGED_UNITS}"
    )
    facts = parse_probe(NODE, probe_output(entries))
    assert_real_facts_only(facts)
    models = {m.name: m for m in facts.weights[0].models}
    assert set(models) == {hostile, "llama"}
    assert models[hostile].reason == "empty folder"
    assert models["llama"].complete


def test_shard_names_with_pipes_tabs_and_line_separators_are_data() -> None:
    odd = "x|e;#\tb\x85c\u2028d\x0ce"
    lines = "\n".join(
        [
            "@entries " + b64("d\t4096\tx|e;#", "f\t9\tx|e;#/a.safetensors"),
            "@shards "
            + b64("x|e;#", "a.safetensors", f"{odd}.safetensors", "|touch /tmp/CANARY #.safetensors"),
        ]
    )
    facts = parse_probe(NODE, probe_output(lines))
    assert_real_facts_only(facts)
    (model,) = facts.weights[0].models
    assert model.name == "x|e;#"
    assert model.reason == f"2 shard(s) named in the index are missing (e.g. {odd}.safetensors)"


def test_line_separators_python_knows_but_sh_does_not_split_nothing() -> None:
    # str.splitlines splits on \x85, \u2028, \x1c..\x1e and \x0c; the shell does not
    for sep in ("\x85", "\u2028", "\x1e", "\x0c", "\r"):
        engines = "@engine /opt/vllm/bin/vllm found" + FORGED_UNITS.replace("\n", sep)
        facts = parse_probe(NODE, probe_output("", engines=engines))
        assert_real_facts_only(facts)


def test_a_section_printed_twice_is_the_nodes_error_not_a_second_source_of_units() -> None:
    text = probe_output("").replace("@@ engines", FORGED_UNITS.strip("\n") + "\n@@ engines")
    facts = parse_probe(NODE, text)
    assert facts.error_kind == BAD_OUTPUT
    assert facts.error is not None and "units" in facts.error
    assert facts.units == () and facts.unit_labels == {}


def test_truncated_and_garbage_weights_lines_are_skipped() -> None:
    good = "@entries " + b64("d\t4096\tllama", "f\t9\tllama/a.safetensors")
    lines = "\n".join(
        [
            good,
            "@entries !!not base64!!",
            "@entries " + b64("d\t4096\tcut")[:-6],  # cut mid-line
            "@entries " + b64("only-one-field", "x\ty", "f\tnot-a-size\tz", "f\t\u00b2\tsq", "f\t1\t"),
            "@entries " + base64.b64encode(b"d\t1\t\xff\xfe-latin1\0").decode(),
            "@shards ",
            "@shards " + b64("../escape", "s.safetensors"),
            "@shards =====",
            "@free_kib \u00b2",
            "@shard\tllama\tmissing.safetensors",  # the old line format is no longer read
            "garbage\twith\ttabs",
        ]
    )
    facts = parse_probe(NODE, probe_output(lines).replace("MemTotal: 1000 kB", "MemTotal: \u00b2 kB"))
    assert_real_facts_only(facts)
    assert facts.memory_total_kib is None
    weights = facts.weights[0]
    assert weights.free_bytes is None
    assert {m.name: m.complete for m in weights.models} == {"llama": True, "\ufffd\ufffd-latin1": False}


PREFIXES = [
    "",
    "@@ ",
    "@dir ",
    "@shard\t",
    "@entries ",
    "@shards ",
    "@free_kib ",
    "@absent",
    "clock ",
    "MemTotal: ",
    "@engine ",
    "@lib ",
    "@rc ",
    "Id=",
    "MainPID=",
    "NRestarts=",
    "/etc/systemd/system/",
    "@marker ",
]
SECTIONS = [
    "host",
    "cpu",
    "gpus",
    "gpuhealth",
    "topo",
    "ib",
    "weights",
    "engines",
    "units",
    "labels",
    "draining",
    "end",
]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(SECTIONS),
            st.lists(st.tuples(st.sampled_from(PREFIXES), st.text(max_size=30)).map("".join), max_size=8),
        ),
        max_size=12,
    )
)
def test_any_output_is_facts_or_the_nodes_error_never_an_exception(
    sections: list[tuple[str, list[str]]],
) -> None:
    facts = parse_probe(
        NODE, "".join(f"@@ {name}\n" + "".join(f"{line}\n" for line in lines) for name, lines in sections)
    )
    assert facts.node == "a"
    assert facts.error is None or facts.error_kind == BAD_OUTPUT


# --- the real script, run by sh --------------------------------------------------------


def hostile_tree(root: Path, canary: Path) -> tuple[Path, str]:
    """A weights folder as an attacker who can write it would leave it."""
    weights = root / "weights"
    evil = weights / "x|e;#"
    evil.mkdir(parents=True)
    # The old probe built `sed "s|^|@shard\t$m\t|"` from the folder name: with this folder
    # the s command got sed's e flag, which runs the line (this shard name) as a command.
    (evil / "model.safetensors.index.json").write_text(
        f'{{"weight_map": {{"a": ";touch {canary};#.safetensors", "b": "a.safetensors"}}}}'
    )
    (evil / "a.safetensors").write_bytes(b"w")
    forged = "m" + FORGED_UNITS.rstrip("\n")
    (weights / forged).mkdir()
    (weights / forged / f"f{FORGED_UNITS.rstrip()}").write_bytes(b"")
    # an index that is a symlink to a root-only file, and a model folder that is a symlink out
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret").write_text('{"k": "SECRET.safetensors"}')
    (outside / "model.safetensors.index.json").write_text('{"k": "SECRET2.safetensors"}')
    peek = weights / "peek"
    peek.mkdir()
    (peek / "a.safetensors").write_bytes(b"w")
    (peek / "model.safetensors.index.json").symlink_to(outside / "secret")
    (weights / "linked").symlink_to(outside)
    # a FIFO as index file: reading it the plain way blocks the probe until its timeout
    stuck = weights / "stuck"
    stuck.mkdir()
    (stuck / "a.safetensors").write_bytes(b"w")
    os.mkfifo(stuck / "model.safetensors.index.json")
    return weights, forged


def test_rendered_probe_reads_a_hostile_folder_as_data(tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    weights, forged = hostile_tree(tmp_path, canary)
    engine = tmp_path / "engine"  # a FIFO where the engine's binary should be
    os.mkfifo(engine, 0o755)
    spec = spec_for(str(weights), str(engine))
    script = probe_script(spec, spec.nodes[0])
    assert "x|e;#" not in script  # names on the node are never in the script
    done = subprocess.run(
        ["sh", "-s"], input=script, capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
    )
    assert not canary.exists(), "a weights folder's name ran a command"
    facts = parse_probe(spec.nodes[0], done.stdout)
    assert facts.error is None
    assert "llmgw-forged-0.service" not in [u.name for u in facts.units]
    assert "llmgw-forged-0.service" not in facts.unit_labels
    assert "@@ units" not in split_sections(done.stdout)["weights"]
    models = {m.name: m for m in facts.weights[0].models}
    assert {"x|e;#", forged, "peek", "stuck"} <= set(models)
    # the index of x|e;# was read as data: its odd shard is listed as missing, by its text
    assert models["x|e;#"].reason.startswith("1 shard(s) named in the index are missing (e.g. ;touch ")
    shards = [line.split(" ", 1)[1] for line in done.stdout.split("\n") if line.startswith("@shards ")]
    assert shards and all(b"SECRET" not in base64.b64decode(s) for s in shards), "read through a symlink"
    assert models["peek"].complete and models["stuck"].complete
    assert [(e.path, e.found) for e in facts.engines] == [(str(engine), True)]


# --- drain markers: names and contents from the node ------------------------------------


def test_marker_names_with_newlines_and_section_markers_stay_names() -> None:
    forged = "llmgw-m-1.service" + FORGED_UNITS
    lines = "\n".join(
        [
            "@marker " + b64("llmgw-m-0.service", "1700000000.500\n"),
            "@marker " + b64(forged, "5\n"),
            "@marker " + b64("llmgw-m-2.service\n", "7"),  # a trailing newline is no unit name
            "@marker " + b64("llmgw-m-3.service", "5" + FORGED_UNITS),  # not one number
            "@marker " + b64("llmgw-m-4.service", "nan"),
            "@marker " + b64("llmgw-m-5.service"),  # empty
            "@marker " + b64("llmgw-m-6.service", "1", "2"),  # a field too many
            "@marker " + b64("../../etc/llmgw-m-7.service", "1"),
            "@marker !!not base64!!",
            "@marker " + b64("llmgw-m-8.service", "9")[:-4],  # cut mid-line
            "llmgw-m-9.service 1",  # not the probe's format
        ]
    )
    text = probe_output("").replace("@@ end\n", f"@@ draining\n{lines}\n@@ end\n")
    facts = parse_probe(NODE, text)
    assert_real_facts_only(facts)
    assert facts.draining == {"llmgw-m-0.service": 1700000000.5}


def test_rendered_marker_listing_reads_a_hostile_folder_as_data(tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    drain = tmp_path / "draining"
    drain.mkdir()
    (drain / "llmgw-m-0.service").write_text("1700000000.500\n")
    (drain / ("llmgw-m-1.service" + FORGED_UNITS)).write_text("5\n")
    (drain / "llmgw-m-2.service$(touch CANARY)").write_text("$(touch CANARY)")  # run in tmp_path
    (drain / "llmgw-m-3.service").write_text("`touch CANARY`")
    # only the first bytes are read: a huge file costs nothing, and its head is the number
    (drain / "llmgw-m-4.service").write_text("12" + " " * (MARKER_BYTES - 2) + "34" + "x" * 100_000)
    secret = tmp_path / "secret"
    secret.write_text("99\n")
    (drain / "llmgw-m-5.service").symlink_to(secret)  # read through a link: never
    os.mkfifo(drain / "llmgw-m-6.service")  # must not block the probe
    (drain / "llmgw-m-7.service").mkdir()
    (drain / "llmgw-m-8.service").write_bytes(b"\0\0" + b"8" + b"\0")
    script = DRAINING_SH.replace(DRAIN_DIR, str(drain))
    assert str(drain) in script
    env = {"LC_ALL": "C", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, timeout=30, cwd=tmp_path, env=env, check=True
    )
    assert not canary.exists(), "a marker's name or content ran a command"
    assert all(line.startswith("@marker ") for line in done.stdout.split("\n") if line)
    text = probe_output("").replace("@@ end\n", f"@@ draining\n{done.stdout}@@ end\n")
    facts = parse_probe(NODE, text)
    assert_real_facts_only(facts)
    assert facts.draining == {
        "llmgw-m-0.service": 1700000000.5,
        "llmgw-m-4.service": 12.0,
        "llmgw-m-8.service": 8.0,
    }
    # the folder itself a symlink (to the markers above): nothing is read through it
    linked = tmp_path / "linked"
    linked.symlink_to(drain)
    script = DRAINING_SH.replace(DRAIN_DIR, str(linked))
    done = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, timeout=30, env=env, check=True
    )
    assert done.stdout == ""
