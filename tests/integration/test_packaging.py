"""A non-editable install in a fresh venv works from another directory, templates included."""

import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.integration.wheel import build_wheel, install_wheel

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


def test_wheel_carries_the_templates(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "llmgw_cli/templates/llmgw-gateway.service.j2" in names
    assert not [n for n in names if n.startswith(("tests/", "inventories/"))]


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_wheel(wheel, tmp_path_factory.mktemp("fresh-venv"))


def run(llmgw: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(llmgw), *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def test_installed_llmgw_validates_and_prints_schema(installed: Path, tmp_path: Path) -> None:
    for name in ("lab.yaml", "hgx-two-fabrics.yaml", "single-box.yaml"):
        result = run(installed, "validate", "-f", str(ROOT / "inventories" / name), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    schema = run(installed, "schema", cwd=tmp_path)
    assert schema.returncode == 0
    assert schema.stdout == (ROOT / "docs/cluster.schema.json").read_text()


def test_installed_llmgw_renders_templates_from_the_package(installed: Path, tmp_path: Path) -> None:
    result = run(
        installed, "render", "gateway-unit", "-f", str(ROOT / "inventories/single-box.yaml"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    # the installed copy is found, not the source checkout's templates/ folder
    where = subprocess.run(
        [
            str(installed.parent / "python"),
            "-c",
            "from llmgw_cli.core.engine.templates import template_dirs; print(template_dirs()[0])",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert "site-packages/llmgw_cli/templates" in where.stdout
    assert f"ExecStart={installed.absolute()} gateway run -f /etc/llmgw/gateway/cluster.yaml" in result.stdout
