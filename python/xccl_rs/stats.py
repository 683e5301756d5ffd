"""What a group's ops cost: ops, bytes and time per op and per path (the algorithm the
selection table chose), summed by the core for every group (src/stats.rs). Per-op lines go to
the file ``XCCL_RS_STATS`` names (docs/debugging.md).

torch's flight recorder (``xccl_rs.dump``) keeps the last N ops to explain a hang; these sums
cover every op of the group's life.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["stats"]


def stats(group: dist.ProcessGroup | None = None, device: str = "cpu") -> dict:
    """The statistics of ``group``'s backend for ``device`` (default: the default group, its
    CPU backend; a private group from ``xccl_rs.new_group`` works too)::

        {"ops": 12, "bytes": 4096, "seconds": 0.0021,
         "by_op": {"all_reduce": {"ops": 10, "bytes": 4000, "seconds": 0.0019}, ...},
         "by_path": {"AllReduceShm": {...}, ...},
         "rows": [{"op": "all_reduce", "path": "AllReduceShm", "ops": 10, ...}, ...]}

    ``bytes`` is nccl-tests' size of each op (the larger of its total input and total output),
    ``seconds`` the time from the op's start on the progress thread to its end. Ops that failed
    are not counted."""
    from . import _C

    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("xccl_rs.stats: no group given and the default group is not initialized")
    rows = _C.stats(group._get_backend(torch.device(device)))

    def total(selected) -> dict:
        return {
            "ops": sum(r["ops"] for r in selected),
            "bytes": sum(r["bytes"] for r in selected),
            "seconds": sum(r["seconds"] for r in selected),
        }

    out = total(rows)
    out["by_op"] = {op: total([r for r in rows if r["op"] == op]) for op in sorted({r["op"] for r in rows})}
    out["by_path"] = {p: total([r for r in rows if r["path"] == p]) for p in sorted({r["path"] for r in rows})}
    out["rows"] = rows
    return out
