"""The lab's kernel log: each node's own, faked the way nvidia-smi is.

The lab's nodes share the host's kernel, so the real ring buffer (``dmesg``) in a node
would be the host's: ``llmgw lab up`` puts a ``dmesg`` of its own in every node
(``DMESG``, in the node's overlay, never on the host) that prints the node's
``/etc/lab/kmsg``, and ``llmgw lab fault NODE gpu N xid CODE`` appends a line to it as
NVIDIA's driver writes an XID report. As on a host with ``kernel.dmesg_restrict=1``, only
root may read it. The nodes' journals hold no kernel messages (no ``/dev/kmsg`` in a
node), so the probe falls back to ``dmesg`` there.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from llmgw_cli.core.observe.xid import xid

KMSG = "etc/lab/kmsg"  # under the node's /
MAX_LINES = 4096
DMESG = f"""#!/bin/sh
# The lab's dmesg: this node's simulated kernel ring buffer (/{KMSG}), never the
# host's (the lab's nodes share its kernel). Only root may read it (dmesg_restrict=1).
if [ "$(id -u)" != 0 ]; then
  echo "dmesg: read kernel buffer failed: Operation not permitted" >&2
  exit 1
fi
cat /{KMSG} 2>/dev/null
exit 0
"""


def uptime() -> float:
    """Seconds since boot (the host's kernel is the nodes' kernel)."""
    return float(Path("/proc/uptime").read_text().split()[0])


def kernel_bus(bus_id: str) -> str:
    """nvidia-smi's ``00000000:18:00.0`` as the driver writes it in the log: ``0000:18:00``."""
    return bus_id[-12:].rsplit(".", 1)[0].lower()


def xid_line(bus_id: str, code: int, seconds: float) -> str:
    """One XID report as NVIDIA's driver writes it to the kernel log."""
    meaning = xid(code)
    text = "GPU has fallen off the bus." if code == 79 else (meaning.mnemonic or "lab: injected XID")
    return f"[{seconds:12.6f}] NVRM: Xid (PCI:{kernel_bus(bus_id)}): {code}, pid='<unknown>', name=<unknown>, {text}"


def _write(root: Path, lines: list[str]) -> None:
    path = root / KMSG
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, prefix=".lab-") as f:
        f.write("".join(line + "\n" for line in lines[-MAX_LINES:]))
    tmp = Path(f.name)
    tmp.chmod(0o644)
    tmp.replace(path)


def _lines(root: Path) -> list[str]:
    path = root / KMSG
    return path.read_text().splitlines() if path.exists() else []


def append(root: Path, line: str) -> None:
    _write(root, [*_lines(root), line])


def forget(root: Path, bus_id: str) -> None:
    """The reports about one card gone, as after its reset."""
    mark = f"(PCI:{kernel_bus(bus_id)})"
    _write(root, [line for line in _lines(root) if mark not in line])


def clear(root: Path) -> None:
    _write(root, [])
