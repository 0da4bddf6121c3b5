from collections.abc import Callable
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"  # copies of recorded real outputs


@pytest.fixture
def fixture_text() -> Callable[[str], str]:
    """A recorded real output with the fixture's own '#' comment lines stripped."""

    def read(name: str) -> str:
        path = FIXTURES / name
        if not path.exists():
            pytest.fail(f"fixture {path} is missing")
        return "\n".join(line for line in path.read_text().splitlines() if not line.startswith("#"))

    return read
