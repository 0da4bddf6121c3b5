"""``/proc/cpuinfo``: the CPU model and the flags that decide whether CPU inference is usable."""

from __future__ import annotations

from llmgw_cli.core.observe.facts import Fact

REQUIRED_FLAGS = ("avx2", "fma")


class CpuInfo(Fact):
    model: str
    flags: frozenset[str]

    @property
    def missing(self) -> list[str]:
        """Required flags this CPU lacks (a VM on QEMU's kvm64 model lacks both)."""
        return [f for f in REQUIRED_FLAGS if f not in self.flags]

    @property
    def virtual(self) -> bool:
        return "hypervisor" in self.flags


def parse_cpuinfo(text: str) -> CpuInfo | None:
    """Model name and flags of the first processor block; None when neither is present."""
    model, flags = "", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value.strip()
        elif not line.strip() and (model or flags):
            break
    if not model and not flags:
        return None
    return CpuInfo(model=model, flags=frozenset(flags.split()))
