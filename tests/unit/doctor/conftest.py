"""Building one node's collected facts the way the doctor's script output would give them:
probe sections and doctor sections as text, parsed by the real parsers."""

from __future__ import annotations

from pathlib import Path

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.doctor import Collected
from llmgw_cli.core.doctor.collect import parse_doctor
from llmgw_cli.core.observe.parse.probe import parse_probe

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"

CLUSTER = """\
cluster: {{name: t}}
gateway: {{host: {gateway_host}, timeouts: {{first_byte: {first_byte}, idle: {idle}}}}}
fabrics: {{ib: {{kind: infiniband}}}}
nodes:
  - {{name: gpu1, address: 10.0.0.1, fabric: ib, hcas: [{hcas}], weights: [/data/models],
     gpus: {{class: H100-80GB, count: 1}}}}
  - {{name: cpu1, address: 10.0.0.2, weights: [/data/models]}}
  - {{name: gpu2, address: 10.0.0.3, fabric: ib}}
profiles:
  vllm: {{engine: vllm, command: [/opt/vllm/bin/vllm, serve], ports: 8100-8199}}
  llama: {{engine: llama-server, command: [/usr/local/bin/llama-server], ports: 8200-8299}}
models: {models}
"""
USED = (
    "[{name: a, source: /data/models/a, profile: vllm, scaling: {min: 1, max: 1}}, "
    "{name: b, source: /data/models/b.gguf, profile: llama, scaling: {min: 0, max: 1}}]"
)


def spec(
    *,
    hcas: str = "mlx5_0",
    first_byte: str = "600s",
    idle: str = "120s",
    gateway_host: str = "localhost",
    models: str = USED,
) -> ClusterSpec:
    return parse_cluster(
        CLUSTER.format(hcas=hcas, first_byte=first_byte, idle=idle, gateway_host=gateway_host, models=models)
    )


def fixture(name: str) -> str:
    return "\n".join(line for line in (FIXTURES / name).read_text().splitlines() if not line.startswith("#"))


def sysfs_lines(tree: Path) -> str:
    """What the probe's `grep -H . /sys/class/infiniband/*/ports/*/...` prints for a tree."""
    out = []
    for path in sorted(tree.glob("*/ports/*/*")):
        if path.name in ("state", "phys_state", "rate", "link_layer"):
            out.append(f"/sys/class/infiniband/{path.relative_to(tree)}:{path.read_text().strip()}")
    return "\n".join(out)


GOOD_CPU = (
    "model name\t: Intel(R) Xeon(R) Gold 6342 CPU @ 2.80GHz\nflags\t\t: fpu sse2 avx avx2 fma f16c avx512f\n"
)
ONE_GPU = "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559, 0, 00000000:18:00.0\n@rc 0"
ENGINES_OK = "@engine /opt/vllm/bin/vllm found\n@engine /usr/local/bin/llama-server found"
IB_ACTIVE = "/sys/class/infiniband/mlx5_0/ports/1/state:4: ACTIVE\n/sys/class/infiniband/mlx5_0/ports/1/phys_state:5: LinkUp"


def collected(
    s: ClusterSpec,
    node: str = "gpu1",
    *,
    sent: float = 1000.0,
    received: float = 1000.5,
    **sections: str,
) -> Collected:
    """One node's Collected from section texts; keyword names use ``_`` for ``-``.
    Sections left out are healthy defaults."""
    defaults = {
        "host": "clock 1000.1\nMemTotal: 1000 kB",
        "cpu": GOOD_CPU,
        "gpus": ONE_GPU,
        "ib": IB_ACTIVE,
        "weights": "@dir /data/models\n@free_kib 1000000",
        "engines": ENGINES_OK,
        "doctor-memlock": "soft unlimited\nhard unlimited",
        "doctor-listen": "",
        "doctor-disks": "/data/models\t100000000 50000000",
        "doctor-clock": "1000.3",
    }
    defaults.update({k.replace("_", "-"): v for k, v in sections.items()})
    text = "".join(f"@@ {name}\n{body}\n" for name, body in defaults.items())
    n = s.node(node)
    return Collected(parse_probe(n, text), parse_doctor(node, text), sent, received)
