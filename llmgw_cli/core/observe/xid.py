"""NVIDIA's XID errors: what each code means and whether it takes a card out.

The NVIDIA driver reports GPU errors to the kernel log as ``NVRM: Xid (PCI:0000:4e:00):
79, pid=..., GPU has fallen off the bus.`` (``core/observe/parse/kernel_log.py`` reads
them). The meanings and NVIDIA's first action for each code come from NVIDIA's XID
catalog, "Resolution Bucket (Immediate Action)" column:

    https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html
    (XID errors, NVIDIA: https://docs.nvidia.com/deploy/xid-errors/)

A code is **fatal** here when NVIDIA's first action is to reset the GPU (``RESET_GPU``),
restart the machine (``RESTART_BM``, ``RESTART_VM``) or follow its double-bit-ECC or
NVLink workflow (which start with a reset): the card cannot be trusted with a replica
until that is done, so placement leaves it out and the gateway replaces the replicas
on it. A code whose first action is to restart the application (``RESTART_APP``: a
fault of the program that ran on it, such as 13, 31, 43) or nothing (``IGNORE``) is
shown but leaves the card in use. A code not in this table is shown as unknown and
leaves the card in use too: look it up in the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass

CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

# NVIDIA's immediate actions (the catalog's resolution buckets), in operator words
RESET_GPU = "drain the node and reset the GPU (`nvidia-smi -r -i N`, or reboot); RMA if it recurs"
RESTART_BM = (
    "drain the node and reboot it (a GPU reset cannot reach a card off the bus); reseat or RMA if it recurs"
)
RESTART_VM = "drain the node and restart the VM"
ECC_DBE = (
    "drain the node and reset the GPU so the bad row is remapped; run NVIDIA's field "
    "diagnostics and RMA if it recurs"
)
NVLINK = "drain the node and reset the GPU; check the NVLink cabling/baseboard; RMA if it recurs"
RESTART_APP = "none for the card: the program that used it must restart (llmgw restarts a failing engine)"
IGNORE = "none: informational"


@dataclass(frozen=True)
class Xid:
    """One XID code: NVIDIA's mnemonic, what it means, whether it takes the card out,
    and what the operator does (NVIDIA's immediate action)."""

    code: int
    mnemonic: str
    meaning: str
    fatal: bool
    action: str


def _x(code: int, mnemonic: str, meaning: str, action: str) -> Xid:
    fatal = action not in (RESTART_APP, IGNORE)
    return Xid(code, mnemonic, meaning, fatal, action)


_NVLINK5 = (
    (144, "NVLINK_SAW_ERROR"),
    (145, "NVLINK_RLW_ERROR"),
    (146, "NVLINK_TLW_ERROR"),
    (147, "NVLINK_TREX_ERROR"),
    (148, "NVLINK_NVLPW_CTRL_ERROR"),
    (149, "NVLINK_NETIR_ERROR"),
    (150, "NVLINK_MSE_ERROR"),
)

TABLE: dict[int, Xid] = {
    x.code: x
    for x in (
        # a fault of the program that ran on the card: the card stays in use
        _x(8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", RESTART_APP),
        _x(11, "ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "invalid or corrupted push buffer stream", RESTART_APP),
        _x(13, "ROBUST_CHANNEL_GR_EXCEPTION", "graphics engine exception (usually the program)", RESTART_APP),
        _x(
            31,
            "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT",
            "GPU memory page fault (usually the program)",
            RESTART_APP,
        ),
        _x(32, "ROBUST_CHANNEL_PBDMA_ERROR", "invalid or corrupted push buffer stream (PBDMA)", RESTART_APP),
        _x(
            43,
            "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR",
            "GPU stopped processing (a channel was reset)",
            IGNORE,
        ),
        _x(45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "preemptive cleanup after an earlier error", IGNORE),
        _x(63, "INFOROM_DRAM_RETIREMENT_EVENT", "ECC page retirement or row remapping recorded", IGNORE),
        _x(68, "ROBUST_CHANNEL_NVDEC0_ERROR", "video decoder exception", RESTART_APP),
        _x(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "graphics engine class error", RESTART_APP),
        _x(92, "EXCESSIVE_SBE_INTERRUPTS", "high single-bit ECC error rate (corrected)", IGNORE),
        _x(
            94,
            "ROBUST_CHANNEL_CONTAINED_ERROR",
            "contained ECC error (only its program was hit)",
            RESTART_APP,
        ),
        _x(121, "C2C_ERROR", "C2C link corrected error", IGNORE),
        # the card needs a reset (or the machine a reboot) before it is used again
        _x(46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing (timeout)", RESET_GPU),
        _x(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "double-bit ECC error (uncorrectable memory error)", ECC_DBE),
        _x(62, "PMU_HALT_ERROR", "internal micro-controller halt", RESET_GPU),
        _x(64, "INFOROM_DRAM_RETIREMENT_FAILURE", "ECC page retirement or row remapping failed", RESET_GPU),
        _x(74, "NVLINK_ERROR", "NVLink error", NVLINK),
        _x(79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", RESTART_BM),
        _x(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "uncontained ECC error", RESET_GPU),
        _x(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "context switch timeout", RESET_GPU),
        _x(110, "SEC_FAULT_ERROR", "security fault", RESET_GPU),
        _x(119, "GSP_RPC_TIMEOUT", "GSP (GPU system processor) RPC timeout", RESET_GPU),
        _x(120, "GSP_ERROR", "GSP (GPU system processor) error", RESET_GPU),
        _x(136, "ALI_TRAINING_FAIL", "NVLink link training failed", RESET_GPU),
        _x(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "unrecovered ECC error", RESET_GPU),
        _x(143, "GPU_INIT_ERROR", "GPU initialization failure", RESET_GPU),
        *(_x(c, m, "NVLink error", NVLINK) for c, m in _NVLINK5),
        _x(
            151,
            "ROBUST_CHANNEL_KEY_ROTATION_ERROR",
            "key rotation error (confidential computing)",
            RESTART_VM,
        ),
        _x(155, "NVLINK_SW_DEFINED_ERROR", "NVLink software-defined error", RESET_GPU),
        _x(156, "RESOURCE_RETIREMENT_EVENT", "resource retirement event", RESET_GPU),
        _x(158, "GPU_FATAL_TIMEOUT", "GPU fatal timeout", RESET_GPU),
        _x(160, "CHANNEL_RETIREMENT_EVENT", "channel retirement event", RESTART_BM),
    )
}
"""The codes llmgw knows, from NVIDIA's catalog (``CATALOG_URL``)."""


def xid(code: int) -> Xid:
    """What ``code`` means; a code not in ``TABLE`` is unknown and not fatal."""
    return TABLE.get(code) or Xid(code, "", "not in llmgw's table", False, f"look it up in {CATALOG_URL}")
