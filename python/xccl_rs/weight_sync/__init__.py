"""Bucketed weight broadcast from one rank of a process group to all the others.

The pattern of RL weight sync (verl's disaggregated GRPO): after every training step a trainer
rank pushes fresh weights to rollout workers over a *private* process group (for example one
made by :func:`xccl_rs.new_group`), beside the trainers' default world.

Terms used below:

* **bucket** -- a 1-D ``uint8`` buffer of ``bucket_bytes`` bytes. Tensors are packed into it one
  after another, each at an offset aligned to ``max(element size, 256)`` bytes (plan.py).
* **chunk** -- a piece of a tensor too large for the room left in a bucket. A tensor is split
  along its flat (row-major) bytes, every chunk a whole number of elements; the receiver
  reassembles the chunks into one tensor.
* **header** and **metadata** -- broadcast before every bucket: a fixed ``int64[8]`` (sizes,
  bucket index, last-bucket flag) and the bucket's entries (name, dtype, shape, where its
  bytes are) as JSON. format.py defines them and checks every field a receiver reads.

Everything travels through the same group, in the same order on every rank: first, once per
sync, whether every rank can share the sender's memory (window.py, step 1); then per bucket
the header, the metadata, then the first ``used_bytes`` bytes of the bucket (skipped when 0).

The sender packs into two buffers in turn: while bucket ``k`` is being broadcast (async),
bucket ``k + 1`` is packed into the other buffer; before packing bucket ``k + 1`` the sender
waits for bucket ``k - 1``'s broadcast (the last user of that buffer). A receiver posts the
broadcast of bucket ``k`` and, while it is in flight, unpacks bucket ``k - 1``. A sender whose
producer fails sends an abort notice in place of the next header, and receivers raise.

Memory: a rank allocates nothing until its first ``send``/``receive``; then at most two
buckets (a receiver sizes them from the headers: a single last bucket gets only its used
bytes), the small header/metadata tensors, and the tensors it hands out.

**Shared window** (window.py). When the group is an xccl_rs group, the buckets are on the CPU
and the first step found every rank on the sender's host, the sender's two buckets live in a
shared-memory file that it announces in bucket 0's metadata. Every receiver maps it if it can,
and the group votes (a MIN all-reduce) right after bucket 0's metadata. If all mapped it, no
bucket is broadcast: receivers read each bucket in place, and a barrier per bucket tells the
sender a buffer is free again. In order on every rank (``H_k`` = header and metadata of bucket
k, ``C_k`` = the barrier "every receiver is done with bucket k"):
``H_0, vote, H_1, C_0, H_2, C_1, ..., H_L, C_(L-1), C_L``. The sender packs bucket k + 1 while
the receivers unpack bucket k. If some rank could not map it, the buckets are broadcast from
the window as above. Either way the file is unlinked right after the vote. The window saves
the broadcast's copies: the sender's bytes are copied once (packing) and each receiver's once
(unpacking), not three and four times. A window every receiver mapped is kept, mapped, for the
next sync with the same bucket size, so that steady-state syncs fault in no new memory (the
announcement says it was ``reused``). A receiver that did not take part in the sync that made a
kept window cannot map it (its file is gone): when the vote fails on a reused window, the
sender offers a fresh window that already holds bucket 0 (broadcast: its length, then its JSON
announcement; empty if it could not make one), and a second vote decides, before H_1 (no vote
when the offer is empty).

Modules: format.py (the wire format), plan.py (the packing plan), window.py (the shared window
and its protocol), sender.py and receiver.py (the two roles).
"""

from __future__ import annotations

from ._common import SyncStats, WeightSyncError
from .format import DEFAULT_BUCKET_BYTES, MIN_BUCKET_BYTES
from .plan import plan_buckets
from .receiver import WeightReceiver
from .sender import SendStream, WeightSender

__all__ = ["SendStream", "SyncStats", "WeightReceiver", "WeightSender", "WeightSyncError", "plan_buckets"]
