"""The lab's nvidia-smi replays answers to exactly the calls llmgw's probe makes."""

import re
from pathlib import Path

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe.parse.probe import probe_script
from llmgw_cli.lab import nodefs, shapes, smi
from llmgw_cli.lab.shapes import ShapeKind

ROOT = Path(__file__).resolve().parent.parent


def test_replayed_calls_are_the_probes_calls() -> None:
    spec = parse_cluster((ROOT / "inventories/lab.yaml").read_text())
    script = probe_script(spec, spec.nodes[0])
    probe_calls = {
        m.group(1) for m in re.finditer(r"nvidia-smi ((?:--query-gpu=|topo)\S*(?: \S+)*?) 2>", script)
    }
    front = nodefs.smi_front()
    replayed = set(re.findall(r'^  "(.*)"\) n=\d+;;$', front, flags=re.M))
    assert replayed == probe_calls


def test_replay_files_hold_what_the_python_fake_answers(tmp_path: Path) -> None:
    shape = shapes.node_shape(ShapeKind.hgx, 1)
    lab = tmp_path / "etc/lab"
    lab.mkdir(parents=True)
    doc = shapes.gpu_state(shape, "node01")
    doc["gpus"][3]["state"] = "reset-required"
    (lab / "gpus.json").write_text(__import__("json").dumps(doc))
    (lab / "topo.txt").write_text(shapes.topo_matrix(shape))
    nodefs.write_smi_replay(tmp_path)
    for i, argv in enumerate(nodefs._replayed()):
        out, err, code = smi.run(argv, str(lab / "gpus.json"), str(lab / "topo.txt"))
        assert (lab / f"smi-replay/{i}.out").read_text() == out
        assert (lab / f"smi-replay/{i}.err").read_text() == err
        assert (lab / f"smi-replay/{i}.rc").read_text() == f"{code}\n"
    # the health query (call 1) is where a reset-required card shows itself
    assert "3, Yes," in (lab / "smi-replay/1.out").read_text()
