"""The delta payload (``WeightSender(payload="delta")``): after a tensor's first full sync, a sender
sends only the elements that changed since the version every receiver holds.

**Versions.** Every delta sync brings the tensors it sends to a new *version*, a random 63-bit
number its first sender draws (the hello carries it). A receiver keeps, per tensor, the version
it holds and the tensor itself (its *base*: the tensor it handed out, which later syncs update in
place); only a tensor received completely changes version. A sender keeps, per tensor it sent
(a DTensor: per shard), a copy of what it sent and that version (:class:`SenderBases`).

**The check** (before anything is packed, after the hello): each sender lists the versions of its
copies (format.py's base list); every receiver says, per listed tensor, whether it holds exactly
that version; a MIN all-reduce of these flags tells every sender which of its copies *every*
receiver holds. The others are dropped, and their tensors travel in full. So a receiver that
restarted (holds nothing), missed a round or failed halfway (holds an older version), or joined
late, gets the full tensors it lacks; a sender that restarted has no copies and sends everything
in full; a tensor whose shape or dtype changed travels in full. A delta entry names its base
version, and a receiver applies it only to a tensor it holds at that version: anything else is
refused, and the sync's confirmation (format.py) makes every rank raise, naming the rank.

**The encoding** of a range (a tensor, a chunk of one, or a shard's piece), chosen per range by
its exact size (format.py gives the layouts): ``"idx"`` -- the changed values and their int32
indices, ``(s + 4)`` bytes per changed element of ``s`` bytes; ``"bits"`` -- the values and a
bitmap of the range, ``s`` bytes per changed element plus 1/8 byte per element; ``"full"`` --
the range itself, when neither is smaller. For bf16 (``s = 2``) ``idx`` wins below 3.1% of
elements changed, ``bits`` up to 93.75%. Elements are compared by their bits (a NaN that stays
the same is unchanged; ``-0.0`` and ``0.0`` differ), so every received tensor equals the
trainer's bit for bit.

**Memory.** ``delta_base="copy"`` (default): a copy of every tensor (shard) the sender sends,
where the tensor lives; ``delta_base="cpu"``: the same copy in host memory, which leaves the
accelerator's memory alone at the price of a device-to-host copy of each tensor per sync (to
compare). Per-block hashes instead of a copy would cost less memory, but at an RL learning rate
the changed elements are spread evenly (docs/perf.md measures it): a changed block is almost
every block, so a hash per block would send nearly the whole model.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ._common import WeightSyncError, all_gather, broadcast
from .format import MAX_BASE_LIST_BYTES, BaseList, Encoding, check_length

#: ``WeightSender(delta_base=...)``: where a sender keeps its copies.
BASES = ("copy", "cpu")
#: Where an encoding's values start and each entry starts in a bucket (indices need 4 bytes).
ALIGN = 16
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_IDX = (1 << 31) - 1


def new_version() -> int:
    return secrets.randbits(63) or 1


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


def _changed(new: torch.Tensor, old: torch.Tensor) -> Optional[torch.Tensor]:
    """Which elements of two 1-D tensors of one dtype differ in their bits (None: a dtype that
    cannot be compared so, whose ranges then travel in full)."""
    size = new.element_size()
    try:
        if size in _INT_VIEWS:
            return new.view(_INT_VIEWS[size]) != old.view(_INT_VIEWS[size])
        if size % 8 == 0:
            return (new.view(torch.int64).view(-1, size // 8) != old.view(torch.int64).view(-1, size // 8)).any(1)
    except RuntimeError:
        return None
    return None


def choose(count: int, elements: int, elsize: int) -> str:
    """The cheapest encoding of a range of ``elements`` with ``count`` changed (module docstring)."""
    dense = elements * elsize
    idx = _align4(count * elsize) + 4 * count if elements <= _MAX_IDX else dense + 1
    bits = count * elsize + (elements + 7) // 8
    if dense <= min(idx, bits):
        return "full"
    return "idx" if idx <= bits else "bits"


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as a bitmap (bit ``j % 8`` of byte ``j // 8``)."""
    pad = (-mask.numel()) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (m * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(bitmap: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    return ((bitmap.view(-1, 1) >> shifts) & 1).view(-1).bool()


# --------------------------------------------------------------------------------------
# the sender's side
# --------------------------------------------------------------------------------------


@dataclass
class _Base:
    version: int
    tensor: torch.Tensor  # contiguous


class SenderBases:
    """A sender's copies of what it sent, by tensor name (module docstring)."""

    def __init__(self, where: str = "copy"):
        if where not in BASES:
            raise ValueError(f"WeightSender: delta_base must be one of {BASES}, got {where!r}")
        self.where = where
        self.bases: dict[str, _Base] = {}

    def base_list(self) -> BaseList:
        names = tuple(self.bases)
        return BaseList(names, tuple(self.bases[n].version for n in names))

    def keep_only(self, names: list[str], flags: list[int]) -> None:
        """Drops the copies whose flag says some receiver does not hold their version."""
        for n, ok in zip(names, flags):
            if not ok:
                self.bases.pop(n, None)

    def usable(self, name: str, piece: torch.Tensor) -> Optional[_Base]:
        base = self.bases.get(name)
        if base is None or base.tensor.shape != piece.shape or base.tensor.dtype != piece.dtype:
            return None
        return base

    def encode(self, name: str, piece: torch.Tensor, e0: int, e1: int, version: int, base: Optional[_Base]):
        """The encoding of elements ``[e0, e1)`` of ``piece`` (flat, row-major) against ``base``,
        and a function that writes its bytes into a uint8 bucket slice."""
        from ._common import read_flat_range

        elsize = piece.element_size()
        n_el = e1 - e0
        if piece.is_contiguous():
            new = piece.reshape(-1)[e0:e1]
        else:
            new = torch.empty(n_el, dtype=piece.dtype, device=piece.device)
            read_flat_range(new, piece, e0, e1)
        changed = None
        if base is not None and n_el:
            old = base.tensor.view(-1)[e0:e1]
            new = new.to(old.device)  # delta_base="cpu": compared (and gathered) in host memory
            changed = _changed(new, old)
        if changed is None:
            enc = Encoding("full", version, 0, n_el, n_el * elsize)
            return enc, lambda dst: dst.view(piece.dtype).copy_(new)
        where = changed.nonzero().view(-1)  # (a bool tensor's sum() is many times slower)
        count = where.numel()
        kind = choose(count, n_el, elsize)
        if kind == "full":
            return Encoding("full", version, 0, n_el, n_el * elsize), lambda dst: dst.view(piece.dtype).copy_(new)
        enc = Encoding(kind, version, base.version, count, n_el * elsize)
        values = new.index_select(0, where)
        if kind == "idx":
            idx = where.to(torch.int32)

            def write(dst):
                dst[: count * elsize].view(piece.dtype).copy_(values)
                dst[_align4(count * elsize) :].view(torch.int32).copy_(idx)
        else:
            bitmap = _pack_bits(changed)

            def write(dst):
                dst[: count * elsize].view(piece.dtype).copy_(values)
                dst[count * elsize :].copy_(bitmap)

        return enc, write

    def update(self, name: str, piece: torch.Tensor, version: int, old: Optional[_Base]) -> None:
        """After every range of ``piece`` this sender sends was packed: its copy is now ``piece``
        at ``version`` (in the memory of ``old``, its previous copy, when it has one)."""
        base = self.bases[name] = old
        if base is None or base.tensor.shape != piece.shape or base.tensor.dtype != piece.dtype:
            device = torch.device("cpu") if self.where == "cpu" else piece.device
            base = self.bases[name] = _Base(version, torch.empty(piece.shape, dtype=piece.dtype, device=device))
        base.tensor.copy_(piece)
        base.version = version

    def forget(self, name: str) -> None:
        self.bases.pop(name, None)

    @property
    def nbytes(self) -> int:
        """What the copies take."""
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self.bases.values())


# --------------------------------------------------------------------------------------
# the check (every rank)
# --------------------------------------------------------------------------------------


def check_bases(group, senders: list[int], mine: Optional[BaseList], holds, device: torch.device) -> list[int]:
    """The check of the module docstring, on every rank: each sender's base list in turn (``mine``
    on a sender, None on a receiver), every rank's flags (``holds(name, version)`` on a receiver),
    their MIN. Returns the flags of this sender's own list (empty on a receiver)."""
    rank = group.rank()
    lists: list[BaseList] = []
    for s in senders:
        where = f"the base list from rank {s}"
        raw = mine.encode() if s == rank else b""
        length = torch.tensor([len(raw)], dtype=torch.int64, device=device)
        broadcast(group, length, s).wait()
        n = check_length(int(length.item()), where, "length", MAX_BASE_LIST_BYTES)
        buf = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
            if s == rank
            else torch.empty(n, dtype=torch.uint8, device=device)
        )
        if n:
            broadcast(group, buf, s).wait()
        if s == rank:
            lists.append(mine)
        else:
            from ._common import tensor_bytes

            lists.append(BaseList.decode(tensor_bytes(buf), where) if n else BaseList((), ()))
    flags = []
    for bl in lists:
        if rank in senders:
            flags.extend([1] * len(bl.names))
        else:
            flags.extend(1 if holds(n, v) else 0 for n, v in zip(bl.names, bl.versions))
    total = len(flags)
    if total:
        t = torch.tensor(flags, dtype=torch.int32, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        group.allreduce([t], opts).wait()
        flags = t.cpu().tolist()
    if rank not in senders:
        return []
    start = sum(len(bl.names) for bl in lists[: senders.index(rank)])
    return flags[start : start + len(mine.names)]


def confirm(group, failed: int, device: torch.device, first_error: str = "") -> None:
    """The confirmation at the end of a delta sync (format.py): raises on every rank when some
    receiver could not apply ``failed`` tensors."""
    values = all_gather(group, torch.tensor([1 if failed else 0, failed], dtype=torch.int64, device=device))
    bad = []
    for r, v in enumerate(values):
        if len(v) != 2 or v[0] not in (0, 1) or not 0 <= v[1] < (1 << 40):
            raise WeightSyncError(f"weight sync: the confirmation from rank {r} is {v}, expected [0 or 1, a count]")
        if v[0]:
            bad.append((r, v[1]))
    if bad:
        shown = ", ".join(f"rank {r} ({n} tensor(s))" for r, n in bad)
        mine = f": {first_error}" if first_error else ""
        raise WeightSyncError(
            f"weight sync: the delta sync was not applied everywhere: {shown} could not apply what it received; "
            f"those tensors keep their previous version, and the next sync sends them in full{mine}"
        )


# --------------------------------------------------------------------------------------
# the receiver's side
# --------------------------------------------------------------------------------------


def apply(target: torch.Tensor, enc: Encoding, wire: torch.Tensor, where: str) -> None:
    """Writes an encoded range into ``target`` (1-D, the range's elements), checking the indices
    or the bitmap first: nothing is written when they are bad."""
    dtype = target.dtype
    elsize = dtype.itemsize
    if enc.kind == "full":
        target.copy_(wire.view(dtype))
        return
    n, elements = enc.count, enc.dense // elsize
    values = wire[: n * elsize].view(dtype).to(target.device)
    if enc.kind == "idx":
        idx = wire[_align4(n * elsize) : _align4(n * elsize) + 4 * n].view(torch.int32).to(target.device).long()
        if n and (int(idx[0]) < 0 or int(idx[-1]) >= elements or not bool((idx[1:] > idx[:-1]).all())):
            raise WeightSyncError(
                f"weight sync: {where}: the delta's indices are not strictly increasing in [0, {elements})"
            )
        target.index_copy_(0, idx, values)
        return
    mask = _unpack_bits(wire[n * elsize :].to(target.device))
    if bool(mask[elements:].any()) or int(mask.count_nonzero()) != n:
        raise WeightSyncError(
            f"weight sync: {where}: the delta's bitmap has {int(mask.count_nonzero())} bits set (expected {n}), "
            f"or bits past the range's {elements} elements"
        )
    target[mask[:elements]] = values
