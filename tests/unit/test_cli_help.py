"""`llmgw --help` as a user reads it (commands in panels), and shell completion."""

import os
import subprocess
import sys


def llmgw(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120", **env},
        timeout=60,
    )


def panels(help_text: str) -> dict[str, list[str]]:
    """Panel title -> the commands listed in it, from rich's boxes."""
    found: dict[str, list[str]] = {}
    title = None
    for line in help_text.splitlines():
        if line.startswith("╭─ "):
            title = line.removeprefix("╭─ ").rstrip("─╮ ")
            found[title] = []
        elif line.startswith("╰"):
            title = None
        elif title is not None and line.startswith("│ ") and line[2] != " ":
            found[title].append(line[2:].split()[0])
    return found


def test_help_lists_the_commands_by_what_they_do_with_the_lab_apart() -> None:
    done = llmgw("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.lstrip().startswith("Usage: llmgw ")
    listed = panels(done.stdout)
    assert listed["Inspect (changes nothing)"] == [
        "validate",
        "status",
        "doctor",
        "plan",
        "usage",
        "logs",
        "schema",
    ]
    assert listed["Change"] == ["apply", "fetch", "restart", "cordon", "drain", "uncordon", "keys", "store"]
    assert listed["Serve"] == ["gateway", "render"]
    assert listed["Try it without GPUs"] == ["lab"]
    assert {"--install-completion", "--show-completion", "--version"} <= set(listed["Options"])


def test_show_completion_prints_a_bash_script_for_llmgw() -> None:
    done = llmgw("--show-completion", "bash")
    assert done.returncode == 0, done.stderr
    assert "_LLMGW_COMPLETE=complete_bash" in done.stdout
    assert "complete -o default -F _llmgw_completion llmgw" in done.stdout


def test_the_completion_script_completes_commands_and_options() -> None:
    # what the script above runs at each TAB
    commands = llmgw(_LLMGW_COMPLETE="complete_bash", COMP_WORDS="llmgw st", COMP_CWORD="1")
    assert commands.stdout.split() == ["status", "store"]
    options = llmgw(_LLMGW_COMPLETE="complete_bash", COMP_WORDS="llmgw status --", COMP_CWORD="2")
    assert {"--file", "--nodes", "--json"} <= set(options.stdout.split())
