"""Bucketed weight sync from the sending ranks of a process group to all the others.

The pattern of RL weight sync (verl's disaggregated GRPO): after every training step the trainer
ranks push fresh weights to rollout workers over a *private* process group (for example one
made by :func:`xccl_rs.new_group`), beside the trainers' default world. One trainer rank can send
everything (the *single sender*), or every trainer rank its share (*several senders*).

Terms used below (plan.py adds sender, round, whole and sharded tensor, footprint):

* **bucket** -- a 1-D ``uint8`` buffer of ``bucket_bytes`` bytes. Tensors are packed into it one
  after another, each at an offset aligned to ``max(element size, 256)`` bytes (plan.py).
* **chunk** -- a piece of a tensor too large for the room left in a bucket. A tensor is split
  along its flat (row-major) bytes, every chunk a whole number of elements; the receiver
  reassembles the chunks into one tensor.
* **shard** -- a DTensor's local tensor on one sender; each sender sends its own, and every
  receiver writes it straight into its place in the full tensor (a block of rows is a run of
  the tensor's flat bytes; any other shard travels with its *box*, format.py).
* **header** and **metadata** -- broadcast by its sender before every bucket: a fixed
  ``int64[8]`` (sizes, bucket index, last-bucket flag) and the bucket's entries (name, dtype,
  shape, where its bytes are) as JSON. format.py defines them and checks every field a
  receiver reads.

Everything travels through the same group, in the same order on every rank: first, once per
sync, the *hello* (agreement.py: who sends, and which senders' memory every receiver can share,
window.py step 1); then, round by round, with several senders an agreement that every sender
planned the same round (agreement.py); then per bucket ``k``, from its sender ``k % N``, the
header, the metadata, and the first ``used_bytes`` bytes of the bucket (skipped when 0). With
one sender those bytes are broadcast; with several they go point to point from the sender to
each receiver (a broadcast would make the other senders take them too). With several senders
and no shared window (below) a round goes *batched*: the headers and metadata of all its
buckets first, then every sender's bytes at once, each sender sending to every receiver in one
coalesced operation and each receiver taking every sender's in one, so that every link carries
data at the same time. The headers, metadata, votes and barriers are the group's collectives:
every sender takes part in every other sender's, so it sees an abort or a failure when the
receivers do.

A sender packs into two buffers in turn: while its bucket of round ``r`` is sent (async), it
packs its bucket of round ``r + 1`` into the other buffer; before packing round ``r + 1`` it
waits for the transfers of round ``r - 1`` (the last users of that buffer). A receiver posts
the receive of bucket ``k`` (batched: of round ``r``'s buckets) and, while it is in flight,
unpacks bucket ``k - 1`` (round ``r - 1``'s). A sender whose producer fails gives up: a single sender sends an abort notice in place of its next
header; with several, it says so in the next round's agreement and the first such sender sends
its notice there. Every rank then raises.

Memory: a rank allocates nothing until its first ``send``/``receive``; then a sender at most
two buckets, only once it has bytes to pack, and a receiver two (batched: two per sender;
sized from the headers: a single last bucket gets only its used bytes), the small
header/metadata tensors, the tensors it hands out, and the tensors being assembled from
pieces (with several senders, those of about one round).

**Shared window** (window.py). When the group is an xccl_rs group, the buckets are on the CPU
and the hello found every receiver on a sender's host, that sender's two buckets live in a
shared-memory file that it announces in its first bucket's metadata. Every receiver maps it if
it can, and the group votes (a MIN all-reduce) right after that metadata. If all mapped it,
none of that sender's buckets is sent: receivers read each in place, and a barrier per bucket
tells the sender a buffer is free again. In order on every rank, with one sender (``H_k`` =
header and metadata of bucket k, ``C_k`` = the barrier "every receiver is done with bucket
k"): ``H_0, vote, H_1, C_0, H_2, C_1, ..., H_L, C_(L-1), C_L``; with several, the same with
each sender's vote after its first bucket's ``H``, and ``C_k`` only for the buckets read in
place. The sender packs a bucket while the receivers unpack the ones before. A tensor that fills
the end of an even-numbered bucket (the window's first half) and ends within the next lies back
to back there: receivers read it whole after ``H_(k+1)`` and join ``C_k`` only once its consumer
is done with it (the order of the ops is unchanged); the sender starts such a tensor, of up to
two buckets, in the first half (plan.py). If some rank could
not map it, that sender's buckets are sent from the window as above. Either way the file is
unlinked right after the vote. The window saves the transfer's copies: the sender's bytes are
copied once (packing) and each receiver's once (unpacking). A window every receiver mapped is
kept, mapped, for the next sync with the same bucket size, so that steady-state syncs fault in
no new memory (the announcement says it was ``reused``). A receiver that did not take part in
the sync that made a kept window cannot map it (its file is gone): when the vote fails on a
reused window, the sender offers a fresh window that already holds its first bucket (broadcast:
its length, then its JSON announcement; empty if it could not make one), and a second vote
decides (no vote when the offer is empty).

**Payloads** (``WeightSender(payload=...)``; every sender of a group passes the same, and the
hello tells the receivers, which take no option for it): ``"full"`` sends every tensor as it is;
``"fp8"`` (fp8.py) sends the selected 2-D weights as float8_e4m3fn values and float32 scales,
in the layout of vLLM's block-fp8 checkpoints (``<name>_scale_inv``), as two tensors through the
same buckets; ``"delta"`` (delta.py) sends, after a tensor's first full sync, only what changed
since the version every receiver holds. A delta sync adds three steps to the order above: right
after the hello, each sender's base list and a MIN all-reduce of every rank's flags (which
copies every receiver holds); and after the last bucket, the confirmation (an all-gather: did
every receiver apply everything). Its entries carry an encoding (format.py) and are packed one
after another in a sender's bucket: the plan is still computed on the full sizes (so every
sender plans alike without knowing the others' deltas), and an encoded range never takes more
room than the plan gave it.

Modules: format.py (the wire format), plan.py (the packing plan), agreement.py (the hello and
the round agreement), window.py (the shared window and its protocol), sender.py and
receiver.py (the two roles), fp8.py and delta.py (the payloads).
"""

from __future__ import annotations

from ._common import SyncStats, WeightSyncError
from .format import DEFAULT_BUCKET_BYTES, MIN_BUCKET_BYTES
from .plan import plan_buckets
from .receiver import WeightReceiver
from .sender import SendStream, WeightSender

__all__ = ["SendStream", "SyncStats", "WeightReceiver", "WeightSender", "WeightSyncError", "plan_buckets"]
