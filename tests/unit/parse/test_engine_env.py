"""The engine key file's one parser, and the probe's shell test that must agree with it."""

import subprocess
from pathlib import Path

import pytest

from llmgw_cli.core.engine.engine_access import ENGINE_ENV_FILE, engine_env_text
from llmgw_cli.core.observe.parse.engine_env import KEY_PRESENT_SH, engine_key, parse_env

CASES = [
    (engine_env_text("ab12"), "ab12"),  # what apply writes
    ("LLMGW_ENGINE_KEY=ab12\n", "ab12"),
    ("LLMGW_ENGINE_KEY='ab12'\n", "ab12"),
    ('LLMGW_ENGINE_KEY="ab12"\n', "ab12"),
    ("  LLMGW_ENGINE_KEY = ab12  \n", "ab12"),
    ("LLMGW_ENGINE_KEY=ab12\r\n", "ab12"),
    ("LLMGW_ENGINE_KEY=old\nLLMGW_ENGINE_KEY=new\n", "new"),  # systemd: the last one holds
    ("LLMGW_ENGINE_KEY=old\nLLMGW_ENGINE_KEY=\n", None),
    ("LLMGW_ENGINE_KEY=\n", None),
    ("LLMGW_ENGINE_KEY=''\n", None),
    ("LLMGW_ENGINE_KEY= \" ' \n", None),
    ("# LLMGW_ENGINE_KEY=commented\n", None),
    ("OTHER=1\nVLLM_API_KEY=ab12\n", None),
    ("LLMGW_ENGINE_KEY_OLD=ab12\n", None),
    ("XLLMGW_ENGINE_KEY=ab12\n", None),
    ("", None),
    ("LLMGW_ENGINE_KEY=a=b\n", "a=b"),
]


@pytest.mark.parametrize(("text", "key"), CASES)
def test_engine_key(text: str, key: str | None) -> None:
    assert engine_key(text) == key


def test_parse_env_skips_comments_and_lines_without_a_name() -> None:
    assert parse_env("# a=1\n\n=2\nB = 'x y' \nnoequals\n") == {"B": "x y"}


@pytest.mark.parametrize(("text", "key"), CASES)
def test_the_probe_says_present_exactly_when_the_parser_finds_a_key(
    tmp_path: Path, text: str, key: str | None
) -> None:
    path = tmp_path / "engine.env"
    path.write_bytes(text.encode())
    script = KEY_PRESENT_SH.replace(ENGINE_ENV_FILE, str(path))
    assert ENGINE_ENV_FILE not in script
    result = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}
    )
    assert result.stdout == ""  # nothing of the file is printed
    assert (result.returncode == 0) == (key is not None)


def test_the_probe_says_absent_for_a_missing_file(tmp_path: Path) -> None:
    script = KEY_PRESENT_SH.replace(ENGINE_ENV_FILE, str(tmp_path / "missing"))
    assert subprocess.run(["sh", "-c", script], env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}).returncode != 0
