"""The XID catalogue: what each XID asks the operator to do.

Source: NVIDIA's "XID Errors" catalogue in the GPU deployment and management
documentation (docs.nvidia.com/deploy/xid-errors, "Analyzing Xid Errors with the
Xid Catalog", Ampere and newer), column "Resolution Bucket (Immediate Action)".
Its buckets map onto ours as:

    RESTART_BM, RESTART_VM  -> reboot       (the node must be rebooted)
    RESET_GPU               -> reset_gpu    (every process off the GPU, then a GPU reset)
    RESTART_APP             -> restart_app  (the process that hit it must restart)
    IGNORE                  -> ignore       (informational, or a follow-on of another XID)

Codes the catalogue lists as unused ("CONTACT_SUPPORT"), codes whose bucket is a
check (CHECK_MECHANICALS, CHECK_UVM, UPDATE_SWFW) and codes newer than this table
are ``unknown``.  rankwatch records an unknown XID as a ``gpu_fault`` incident for
an operator to look at, but hands it to automation as a *risk*, not a fatal
fault: it asks for a checkpoint, never a restart or an exclusion, on a code it
cannot judge.

This table is the only place XIDs are classified.
"""

from __future__ import annotations

__all__ = ["ACTIONS", "FATAL_ACTIONS", "action_for", "describe"]

ACTIONS = ("reboot", "reset_gpu", "restart_app", "ignore", "unknown")
FATAL_ACTIONS = frozenset({"reboot", "reset_gpu", "restart_app"})


def _codes(*spec: int | range) -> set[int]:
    out: set[int] = set()
    for item in spec:
        out.update(item if isinstance(item, range) else (item,))
    return out


_CATALOGUE: dict[int, str] = {}
for _action, _spec in (
    ("reboot", _codes(79, 151, 160)),
    ("reset_gpu", _codes(46, 48, 62, 64, 74, 95, 109, 110, 119, 120, 136, 140, 143,
                         range(144, 151), 155, 156, 158, 162)),
    ("restart_app", _codes(8, 11, 13, 25, 31, 32, 39, 40, 41, 60, range(68, 73), 75, 76, 77,
                           80, range(82, 87), 88, 89, 94, range(96, 106), range(126, 136), 139)),
    ("ignore", _codes(14, 37, 38, 43, 44, 45, 63, 66, 67, 92, 93, 106, 107, 121, 137, 141,
                      152, 153, 154, 157, 161)),
):
    for _code in _spec:
        _CATALOGUE[_code] = _action

# Short descriptions of the XIDs a training cluster meets most, for incidents and logs.
_DESCRIPTIONS = {
    8: "GPU stopped processing (idle timeout)",
    13: "graphics engine exception (often an application fault)",
    31: "GPU memory page fault (often an application fault)",
    43: "GPU stopped processing; the channel was reset",
    45: "preemptive clean-up after an earlier error",
    46: "GPU timeout",
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained uncorrectable ECC error",
    95: "uncontained uncorrectable ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "uncorrectable ECC error escaped containment",
    154: "GPU recovery action changed",
}


def action_for(xid: int) -> str:
    """The catalogue's immediate action for an XID, one of ACTIONS."""
    return _CATALOGUE.get(xid, "unknown")


def describe(xid: int) -> str:
    """A one-line description: ``XID 79 (GPU has fallen off the bus)``."""
    text = _DESCRIPTIONS.get(xid)
    return f"XID {xid} ({text})" if text else f"XID {xid}"
