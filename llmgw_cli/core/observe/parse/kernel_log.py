"""NVIDIA's XID reports in the kernel log (``journalctl -k -b`` or ``dmesg``).

The driver writes one line a report, in one of these forms (the PCI domain is 4 hex
digits here, 8 in nvidia-smi's ``pci.bus_id``; older drivers leave out ``PCI:``)::

    [ 1234.567890] NVRM: Xid (PCI:0000:4e:00): 79, pid=..., GPU has fallen off the bus.
    [  269.517039] NVRM: Xid (0000:01:00): 13, pid='<unknown>', name=<unknown>, Graphics ...

The probe sends only the lines holding ``NVRM: Xid``, each behind ``@xid ``, at most
``MAX_LINES`` of them (the last ones) cut at ``LINE_BYTES`` (``XIDS_READ``). They are hostile data like
everything from a node: a line that does not match is skipped, a number is taken only
when it is a plain number of sane size, and the text kept is printable and cut short.
"""

from __future__ import annotations

import re

from llmgw_cli.core.observe.facts import XidReport

MAX_LINES = 256  # the last XID reports read
LINE_BYTES = 512  # of each
XIDS_READ = f"""\
# NVIDIA's XID reports of this boot: from the journal's kernel messages when it has any,
# else from the kernel's ring buffer; only their lines, the last {MAX_LINES}, each cut at
# {LINE_BYTES} bytes and behind "@xid " (so none can start a line of its own).
x='NVRM: Xid'
if command -v journalctl >/dev/null 2>&1 && [ -n "$(journalctl -k -b -q -n 1 --no-pager 2>/dev/null)" ]; then
  echo "@source journal"
  journalctl -k -b -q --no-pager -o short-monotonic 2>/dev/null | grep -a -F "$x" | tail -n {MAX_LINES} |
    cut -b 1-{LINE_BYTES} | tr -c '\\n[:print:]' '?' | sed 's/^/@xid /'
elif command -v dmesg >/dev/null 2>&1 && dmesg >/dev/null 2>&1; then
  echo "@source dmesg"
  dmesg 2>/dev/null | grep -a -F "$x" | tail -n {MAX_LINES} | cut -b 1-{LINE_BYTES} |
    tr -c '\\n[:print:]' '?' | sed 's/^/@xid /'
else
  echo "@source unreadable"
fi
"""
"""What the probe runs to read them (as root; unprivileged, the node helper's
``kernel-xids`` runs its copy of this text as root)."""
DETAIL_CHARS = 160
MAX_CODE = 9999

_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})(?:\.[0-7])?\): "
    r"([0-9]{1,5})\b,? ?(.*)"
)
_STAMP = re.compile(r"^\[\s*([0-9]{1,10}\.[0-9]{1,9})\]")
_BUS = re.compile(r"^([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})(?:\.[0-7])?$")


def bus_key(text: str) -> str | None:
    """A PCI bus id as one spelling, ``0000:4e:00`` (4-digit domain, lower case, no
    function), from nvidia-smi's ``00000000:4E:00.0``, the kernel's ``0000:4e:00`` or
    the ``0000:4e:00.0`` of a card nvidia-smi cannot open; None when it is not one."""
    m = _BUS.match(text.strip())
    if m is None:
        return None
    domain, bus, device = (int(part, 16) for part in m.groups())
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def parse_xids(text: str) -> list[XidReport]:
    """One ``XidReport`` per (bus, code), in the order first seen, with its count and the
    last report's text and time. Lines that are not XID reports are skipped."""
    found: dict[tuple[str, int], XidReport] = {}
    lines = [line[5 : 5 + LINE_BYTES] for line in text.split("\n") if line.startswith("@xid ")]
    for line in lines[-MAX_LINES:]:
        m = _XID.search(line)
        if m is None:
            continue
        bus = bus_key(m.group(1))
        code = int(m.group(2))
        if bus is None or code > MAX_CODE:
            continue
        stamp = _STAMP.match(line)
        seconds = float(stamp.group(1)) if stamp else None
        detail = _printable(m.group(3).strip())[:DETAIL_CHARS]
        before = found.get((bus, code))
        count = before.count + 1 if before else 1
        found[(bus, code)] = XidReport(bus=bus, code=code, count=count, detail=detail, seconds=seconds)
    return list(found.values())
