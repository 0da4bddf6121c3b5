"""From probe output to facts to the Summary and the status view (pure parts, no SSH)."""

import asyncio
import base64
import io
from pathlib import Path

import pytest
from rich.console import Console

from llmgw_cli.cli.views import status_view
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import Node
from llmgw_cli.core.observe.facts import GpuHealth, NodeFacts
from llmgw_cli.core.observe.hardware import fabric_status, gpu_class
from llmgw_cli.core.observe.parse.probe import parse_probe, probe_script, split_sections
from llmgw_cli.core.observe.parse.weights import judge
from llmgw_cli.core.views.summary import summarize
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.probe import Snapshot, gather

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

SPEC = parse_cluster(
    """\
cluster: {name: t}
fabrics: {ib: {kind: infiniband}}
nodes:
  - {name: a, address: 10.0.0.1, fabric: ib, hcas: [mlx5_0, mlx5_1], weights: [/data/models],
     gpus: {class: H100-80GB, count: 8}}
  - {name: b, address: 10.0.0.2, fabric: ib, hcas: [mlx5_0, mlx5_1], weights: [/data/models]}
  - {name: c, address: 10.0.0.3, fabric: ib}
profiles:
  vllm: {engine: vllm, command: [/opt/vllm/bin/vllm, serve]}
models:
  - {name: llama, source: /data/models/llama, profile: vllm, scaling: {min: 1, max: 2}}
  - {name: big, source: /data/models/big, profile: vllm, tensor_parallel: 8, nodes: 2,
     scaling: {min: 0, max: 1}}
"""
)


def strip(name: str) -> str:
    return "\n".join(line for line in (FIXTURES / name).read_text().splitlines() if not line.startswith("#"))


def csv_rows(faulty: int | None = None) -> str:
    rows = []
    for line in strip("nvidia-smi_query-gpu_h100-sxm-x8.csv").splitlines():
        i, uuid, name, total, used, _util, bus = line.split(", ")
        if faulty is not None and int(i) == faulty:
            total = used = "[GPU requires reset]"
        rows.append(", ".join([i, uuid, name, total, used, bus]))
    return "\n".join(rows)


def ib(state1: str = "4: ACTIVE") -> str:
    base = "/sys/class/infiniband"
    return "\n".join(
        [
            f"{base}/mlx5_0/ports/1/state:4: ACTIVE",
            f"{base}/mlx5_1/ports/1/state:{state1}",
            f"{base}/mlx5_0/ports/1/phys_state:5: LinkUp",
            f"{base}/mlx5_1/ports/1/phys_state:5: LinkUp",
            f"{base}/mlx5_0/ports/1/rate:400 Gb/sec (4X NDR)",
            f"{base}/mlx5_1/ports/1/rate:200 Gb/sec (4X HDR)",
            f"{base}/mlx5_0/ports/1/link_layer:InfiniBand",
            f"{base}/mlx5_1/ports/1/link_layer:InfiniBand",
        ]
    )


def b64(*fields: str) -> str:
    """Fields as the probe prints names: NUL-terminated, base64 on one line."""
    return base64.b64encode("".join(f + "\0" for f in fields).encode()).decode()


ENTRIES = "@entries " + b64(
    "d\t4096\tllama",
    "f\t10\tllama/config.json",
    "f\t1000\tllama/model-00001-of-00002.safetensors",
    "f\t1000\tllama/model-00002-of-00002.safetensors",
    "f\t100\tllama/model.safetensors.index.json",
    "d\t4096\tbig",
    "f\t1000\tbig/model-00001-of-00002.safetensors.incomplete",
)
SHARDS = "@shards " + b64("llama", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def output(*, faulty: int | None = None, ib_state: str = "4: ACTIVE", unit_active: bool = False) -> str:
    uuids = [line.split(", ")[1] for line in strip("nvidia-smi_query-gpu_h100-sxm-x8.csv").splitlines()]
    unit = "llmgw-llama-0.service"
    return f"""\
@@ host
clock 1700000000.5
MemTotal:       2113511424 kB
MemAvailable:   2000000000 kB
@@ cpu
processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx avx2 fma
@@ gpus
{csv_rows(faulty)}
@rc 0
@@ topo
{strip("topo_hgx-h100_8gpu_nv18_1nic_TABS.txt")}
@@ ib
{ib(ib_state)}
@@ weights
@dir /data/models
@free_kib 1048576
{ENTRIES}
{SHARDS}
@@ engines
@engine /opt/vllm/bin/vllm found
@@ units
Id={unit}
LoadState=loaded
ActiveState={"active" if unit_active else "inactive"}
SubState=running
MainPID=77
NRestarts=0
@@ labels
/etc/systemd/system/{unit}:X-Llmgw-Model=llama
/etc/systemd/system/{unit}:X-Llmgw-Replica=0
/etc/systemd/system/{unit}:X-Llmgw-Gpus={uuids[0]},{uuids[1]}
@@ end
"""


def test_probe_script_names_every_weights_dir_and_engine() -> None:
    script = probe_script(SPEC, SPEC.nodes[0])
    assert "d=/data/models\n" in script
    assert "b=/opt/vllm/bin/vllm\n" in script
    assert "--query-gpu=index,uuid,name,memory.total,memory.used,pci.bus_id" in script


def test_sections_keep_empty_ones() -> None:
    assert split_sections("@@ a\nx\n@@ b\n@@ c\ny\n") == {"a": "x", "b": "", "c": "y"}


def test_parse_probe_reads_every_section() -> None:
    facts = parse_probe(SPEC.nodes[0], output(faulty=3))
    assert len(facts.gpus) == 8
    assert facts.gpus[3].health is GpuHealth.faulty
    assert facts.topology is not None
    assert facts.topology.nvlink_peers(0) == 7
    assert facts.cpu is not None
    assert facts.cpu.flags_missing == ()
    assert facts.memory_total_kib == 2113511424
    (weights,) = facts.weights
    assert weights.free_bytes == 2**30
    assert {m.name: m.complete for m in weights.models} == {"big": False, "llama": True}
    assert facts.units[0].main_pid == 77
    assert facts.unit_labels["llmgw-llama-0.service"]["Model"] == "llama"
    assert facts.engines[0].usable
    assert facts.clock == 1700000000.5


def test_weights_judging() -> None:
    entries = [
        ("d", 0, "empty"),
        ("d", 0, "conf-only"),
        ("f", 5, "conf-only/config.json"),
        ("d", 0, "sharded"),
        ("f", 5, "sharded/a.safetensors"),
        ("f", 0, "x.gguf"),
        ("f", 9, "y.gguf"),
        ("f", 9, "z.gguf.part"),
        ("f", 9, "README.md"),
    ]
    found = {
        m.name: m.reason for m in judge("/d", False, entries, {"sharded": {"a.safetensors", "b.safetensors"}})
    }
    assert found == {
        "conf-only": "no weight files (*.safetensors, *.bin, *.gguf)",
        "empty": "empty folder",
        "sharded": "1 shard(s) named in the index are missing (e.g. b.safetensors)",
        "x.gguf": "empty file",
        "y.gguf": "",
        "z.gguf.part": "partial download",
    }


def test_fabric_status_rules() -> None:
    a = SPEC.nodes[0]
    ok = fabric_status(a, parse_probe(a, output()))
    assert ok.advertises
    assert ok.rate_gbps == 200.0  # the slowest active link
    init = fabric_status(a, parse_probe(a, output(ib_state="2: INIT")))
    assert not init.advertises
    assert init.reason == "mlx5_1 INIT: link up but no subnet manager has configured it"
    missing = fabric_status(a, parse_probe(a, output().replace("mlx5_1", "mlx5_7")))
    assert missing.reason == "declared adapter mlx5_1 not found"
    c = SPEC.nodes[2]  # no adapters declared: any active port will do
    assert fabric_status(c, parse_probe(c, output())).advertises
    unreachable = NodeFacts(node="c", error="no route", error_kind="unreachable")
    assert fabric_status(c, unreachable).reason == "not probed: no route"


def test_gpu_classes() -> None:
    assert gpu_class("NVIDIA H100 80GB HBM3") == "H100-80GB"
    assert gpu_class("NVIDIA A100 80GB PCIe") == "A100-80GB-PCIE"
    assert gpu_class("NVIDIA GeForce RTX 4090") == "RTX4090"
    assert gpu_class("NVIDIA H200") == "H200"


def test_summary_counts_faulty_as_neither_used_nor_free() -> None:
    facts = {
        "a": parse_probe(SPEC.nodes[0], output(faulty=3, unit_active=True)),
        "b": parse_probe(SPEC.nodes[1], output()),
        "c": NodeFacts(node="c", error="connection refused", error_kind="unreachable"),
    }
    summary = summarize(SPEC, facts)
    (h100,) = summary.classes
    assert (h100.total, h100.used, h100.faulty, h100.free) == (16, 2, 1, 13)
    (fabric,) = summary.fabrics
    assert (fabric.nodes, fabric.advertising, fabric.free_nodes, fabric.rate_gbps) == (3, 2, 1, 200.0)
    assert fabric.models_held == ("llama",)
    llama = summary.models[0]
    assert (llama.running, llama.desired, llama.where) == (1, 1, ("a",))
    node_a = summary.nodes[0]
    assert node_a.faulty_reasons == ("GPU 3: nvidia-smi reports [GPU requires reset]",)
    assert node_a.expected is None
    assert summary.nodes[1].expected is None  # b declares no GPUs: nothing to cross-check
    assert not summary.nodes[2].reachable


def test_status_view_shows_unreachable_nodes_and_reasons() -> None:
    facts = {
        "a": parse_probe(SPEC.nodes[0], output(ib_state="2: INIT")),
        "b": parse_probe(SPEC.nodes[1], output(faulty=5)),
        "c": NodeFacts(node="c", error="host key of 10.0.0.3 does not match", error_kind="hostkey-changed"),
    }
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(status_view(summarize(SPEC, facts), 0.42))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "Nodes (probed in 0.42s)" in text
    assert "unreachable" in text
    assert "host key of 10.0.0.3 does not match" in text
    assert "fabric ib not advertised: mlx5_1 INIT: link up but no subnet manager has configured it" in text
    assert "GPU 5: nvidia-smi reports [GPU requires reset]" in text
    assert "8 x H100-80GB (1 faulty)" in text


def test_a_fatal_xid_marks_its_card_and_a_program_fault_is_only_shown() -> None:
    xids = (
        "@@ xids\n@source dmesg\n"
        "@xid [  812.5] NVRM: Xid (PCI:0000:64:00): 79, pid=1, name=python3, GPU has fallen off the bus.\n"
        "@xid [  813.0] NVRM: Xid (PCI:0000:75:00): 31, pid=2, name=python3, MMU Fault: ENGINE GRAPHICS\n"
        "@xid [  814.0] NVRM: Xid (PCI:0000:ee:00): 48, pid=3, a bus no card is at\n"
    )
    facts = parse_probe(SPEC.nodes[0], output(unit_active=True).replace("@@ topo", xids + "@@ topo"))
    assert facts.kernel_log == "dmesg"
    faulty = {g.index: (g.reasons, g.causes) for g in facts.gpus if g.health is GpuHealth.faulty}
    assert faulty == {1: (("XID 79: GPU has fallen off the bus",), ("xid-79",))}
    assert [(r.gpu, r.code) for r in facts.xids] == [(1, 79), (2, 31), (None, 48)]
    (row, *_) = summarize(SPEC, {"a": facts}).nodes
    assert (row.gpus, row.faulty, row.used) == (8, 1, 1)  # llama's second card is the faulty one
    (card,) = row.faulty_cards
    assert (card.gpu, card.causes) == ("1", ("xid-79",)) and "reboot" in card.action
    assert row.faulty_reasons == ("GPU 1: XID 79: GPU has fallen off the bus",)
    notes = [w for w in row.warnings if "XID" in w]
    assert notes[0].startswith(
        "GPU 2: XID 31: GPU memory page fault (usually the program); action: none for the card"
    )
    assert notes[1].startswith("PCI 0000:ee:00 (no card nvidia-smi lists): XID 48: double-bit ECC error")
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(status_view(summarize(SPEC, {"a": facts}), 0.1))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "8 x H100-80GB (1 faulty)" in text and "GPU 1: XID 79: GPU has fallen off the bus" in text


def test_a_card_off_the_bus_counts_as_faulty_and_fewer_cards_than_declared_says_what_to_do() -> None:
    lost = "Unable to determine the device handle for GPU 0000:ca:00.0: Unknown Error"
    rows = "\n".join(csv_rows().splitlines()[:7])
    text = output().replace(csv_rows(), f"{rows}\n{lost}").replace("@rc 0", "@rc 15")
    facts = parse_probe(SPEC.nodes[0], text)
    assert facts.gpu_tool == "ok" and facts.lost_gpus == ("0000:ca:00.0",)
    summary = summarize(SPEC, {"a": facts})
    row = summary.nodes[0]
    assert (row.gpus, row.faulty) == (8, 1)
    assert row.faulty_reasons == ("GPU 0000:ca:00.0: nvidia-smi cannot open it: fallen off the bus",)
    assert (
        row.expected is not None
        and "fallen off the bus (XID 79)" in row.expected
        and "reboot" in row.expected
    )
    (h100,) = summary.classes
    assert (h100.total, h100.faulty, h100.free) == (8, 1, 7)


def test_optional_health_query_marks_cards_faulty() -> None:
    text = output().replace(
        "@@ topo",
        "@@ gpuhealth\n0, No, No, No, No, 0\n1, [N/A], [N/A], Yes, No, 0\n2, Yes, No, No, No, 0\n"
        "3, No, No, No, No, 7\n@@ topo",
    )
    facts = parse_probe(SPEC.nodes[0], text)
    faulty = {g.index: g.reasons for g in facts.gpus if g.health is GpuHealth.faulty}
    assert faulty == {
        1: ("row remapping pending (reset needed)",),
        2: ("reset required",),
        3: ("7 uncorrected ECC errors since boot",),
    }


def test_health_query_refused_by_old_driver_changes_nothing() -> None:
    text = output().replace(
        "@@ topo", '@@ gpuhealth\nField "remapped_rows.pending" is not a valid field to query.\n@@ topo'
    )
    assert all(g.health is GpuHealth.healthy for g in parse_probe(SPEC.nodes[0], text).gpus)


# --- one node's bad output is that node's error ---------------------------------------

LOCAL = parse_cluster(
    """\
cluster: {name: t}
nodes:
  - {name: a, address: 127.0.0.1, connection: local}
  - {name: b, address: 127.0.0.2, connection: local}
profiles:
  vllm: {engine: vllm, command: [/opt/vllm/bin/vllm, serve]}
models: []
"""
)


def gather_with_outputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, outputs: dict[str, str]) -> Snapshot:
    """Gather over real local shells, each node's script printing the given output."""
    for name, text in outputs.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(
        "llmgw_cli.remote.probe.probe_script", lambda _spec, node: f"cat {tmp_path / node.name}\n"
    )

    async def probe() -> Snapshot:
        async with Connections(LOCAL, tmp_path) as conns:
            return await gather(LOCAL, conns)

    return asyncio.run(probe())


GOOD = "@@ host\nclock 5.0\n@@ units\nId=llmgw-x-0.service\nActiveState=active\n@@ end\n"


def test_a_node_whose_output_stops_early_is_not_a_node_without_units(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    snap = gather_with_outputs(
        monkeypatch, tmp_path, {"a": "@@ host\nclock 5.0\n@@ weights\n@dir /d\n", "b": GOOD}
    )
    a, b = snap.node("a"), snap.node("b")
    assert a.error_kind == "bad-output" and a.error is not None and "ended early" in a.error
    assert b.error is None and [u.name for u in b.units] == ["llmgw-x-0.service"]


def test_forged_sections_on_one_node_fail_that_node_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    forged = GOOD.replace("@@ end", "@@ units\nId=llmgw-forged-0.service\nActiveState=active\n@@ end")
    snap = gather_with_outputs(monkeypatch, tmp_path, {"a": forged, "b": GOOD})
    a, b = snap.node("a"), snap.node("b")
    assert a.error_kind == "bad-output" and a.units == ()
    assert b.error is None and [u.name for u in b.units] == ["llmgw-x-0.service"]


def test_a_surprise_while_parsing_one_node_leaves_the_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = parse_probe

    def parse(node: Node, text: str) -> NodeFacts:
        if node.name == "a":
            raise RuntimeError("boom")
        return real(node, text)

    monkeypatch.setattr("llmgw_cli.remote.probe.parse_probe", parse)
    snap = gather_with_outputs(monkeypatch, tmp_path, {"a": GOOD, "b": GOOD})
    assert snap.node("a").error_kind == "bad-output" and "boom" in (snap.node("a").error or "")
    assert snap.node("b").error is None
