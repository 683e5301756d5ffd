"""What a group has been doing, from torch's flight recorder.

torch (>= 2.15) records the ops of a backend without a recorder of its own through its
``FlightRecorderHook``, into the recorder named after the backend: ``xccl_rs``. xccl_rs reports
each successful op's completion to it (completion hooks), so an entry reads ``completed`` with
its duration, and one that never finished stays ``scheduled``; a timeout or an error runs the
abort hooks, which is where torch's hook writes the trace to disk (``TORCH_FR_DUMP_TEMP_FILE``).
"""

from __future__ import annotations

import json

import torch.distributed as dist

__all__ = ["dump"]


def dump(group: dist.ProcessGroup | None = None) -> list[dict]:
    """The flight recorder's entries for ``group`` (default: the default group), oldest first:
    the JSON form of ``torch._C._distributed_c10d._dump_fr_trace_json(backend="xccl_rs")``,
    filtered to the group. Each entry has ``profiling_name`` (e.g. ``xccl_rs:all_reduce``),
    ``collective_seq_id``, ``state`` (``scheduled`` or ``completed``), ``duration_ms``, the
    tensors' ``input_sizes``/``input_dtypes`` and ``output_sizes``/``output_dtypes``, and
    ``process_group`` (its name and description). Empty where torch has no such recorder
    (torch < 2.15, or ``TORCH_FR_BUFFER_SIZE=0``)."""
    from torch._C import _distributed_c10d as c10d

    if not hasattr(c10d, "_dump_fr_trace_json"):
        return []
    group = group if group is not None else dist.group.WORLD
    name = dist.distributed_c10d._get_process_group_name(group)
    trace = json.loads(c10d._dump_fr_trace_json(includeCollectives=True, backend="xccl_rs") or b"{}")
    entries = trace.get("entries", [])
    return [e for e in entries if (e.get("process_group") or [None])[0] == name]
