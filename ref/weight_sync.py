"""Weight sync: the reference (readable PyTorch, the specification of the transfer plan).

Example::

    # weight_sync.py, copied next to this script
    import torch
    import weight_sync as ws

    weights = {"w": torch.randn(32, 16), "b": torch.randn(32)}        # the trainer's tensors, fp32, whole
    rows = lambda name, tp, rank: (0, ((rank * 16, rank * 16 + 16),))  # each generator rank: 16 of the 32 rows
    source = ws.layout(weights)
    destination = ws.layout(weights, dtype=torch.bfloat16, tp=2, shard_spec=rows)
    plan = ws.plan(source, destination, bucket_bytes=256)            # buckets both sides enumerate alike
    received = [ws.allocate(destination, r) for r in range(2)]
    ws.transfer(plan, [weights], received)                           # checksummed, cast, unpacked
    print(len(plan.buckets), torch.equal(received[1]["w"], weights["w"][16:].bfloat16()))

What it computes
    After each optimizer step an RL trainer pushes its weights to every generator.  The trainer holds
    each tensor whole or as its tensor-parallel shard (the *source layout*); each generator rank holds
    its own shard, in its own dtype (the *destination layout*).  ``plan(source, destination)`` says
    which bytes of which tensor go from which source rank to which destination rank, cast to the
    destination's dtype (fp32 master -> bf16 weights), packed into buckets of at most
    ``bucket_bytes`` in an order both sides compute alike, each bucket with a checksum.  A destination
    rank receives exactly the bytes of its shard: shard to shard, for every tensor.  This file runs the
    plan in one process (``pack`` -> ``checksum`` -> ``unpack``: ``transfer``); fast/weight_sync.py
    moves the same buckets between processes (torch.distributed, pipelined, verified).

The math (a box is a region of the full tensor: one half-open range [start, stop) per dim)
    layout      rank r holds boxes P_r,0 .. P_r,k of tensor n, concatenated along ``dim`` in that order
                (decoder_lm.py's ``shard_spec`` gives them: rows or columns, three pieces for Gated
                DeltaNet's fused in_proj_qkv / conv1d); replicated = one box, the whole tensor
    local       piece j sits at offset o_j = sum_{i<j} (P_i.stop - P_i.start)[dim] of the rank's local
                tensor along ``dim``; a region X inside P_j has local coordinates X - P_j.start on every
                dim, plus o_j on ``dim``
    owners      the source's boxes, rank by rank; a box equal to one an earlier rank holds (a replicated
                tensor, a replicated KV head) is sent by the earlier rank only; distinct boxes must not
                overlap, and together they must cover every destination box
    regions     X = P ∩ Q (per dim: [max(starts), min(stops))) for every destination piece P and owned
                source box Q that meet; each goes from Q's rank to P's rank
    order       per channel (source rank q -> destination rank r): tensors by sorted name, then the
                destination's pieces in order, then the source's ranks and pieces in order
    buckets     a region larger than ``bucket_bytes`` is cut along dim 0 (a single row too large: along
                dim 1, and so on); a region (or part) of at least min(1 MiB, bucket_bytes / 4) is a bucket of
                its own (packing it would only add a copy: fast sends and receives such a region in place
                where a side holds it contiguously); smaller ones are laid out at 16-byte aligned offsets, a
                new bucket starting where the next would not fit; a bucket's size is rounded up to 16 bytes
                (zero padding)
    cast        a region travels in the destination's dtype: torch's round-to-nearest-even cast, done by
                the sender (so the wire carries the destination's bytes)
    checksum    s_i = the bucket's bytes as native (little-endian) int32 words, i = 0 .. n/4 - 1;
                A = sum s_i mod 2^32,  B = sum (1 + i mod 65521) s_i mod 2^32,  checksum = A * 2^32 + B
                (an int in [0, 2^64)).  Sums modulo 2^32 are what 32-bit integer adds give in any order,
                wrapping or not, so a GPU's reduction and a CPU's agree.  A changed word always changes A;
                two swapped words change B unless (w_i - w_j)(s_j - s_i) is a multiple of 2^32 (w: the
                weights).  It catches corruption, not an adversary.
    digest      a 63-bit hash of the whole plan: two sides that computed different plans (other layouts,
                another bucket size) find out before a byte is unpacked

Tensors and types
    Box             tuple of (start, stop) per dim, in the full tensor's coordinates
    TensorLayout    shape (the full tensor's), dtype (what this side holds), pieces (per rank: its boxes),
                    dim (the boxes of a rank are concatenated along it)
    layout          {name: TensorLayout}: ``layout(tensors_or_shapes, dtype=, tp=, shard_spec=)``
    Plan            buckets (ordered by source rank, destination rank, index), bucket_bytes, ranks on each
                    side, digest;  Bucket (source_rank, dest_rank, index, nbytes, items);  Item (name,
                    box, source / dest local boxes, byte offset, dtype)
    bucket data     uint8 [nbytes] on the tensors' device
    state dicts     {name: local tensor} per rank: what ``local_tensors`` gives (the trainer's
                    ``state_dict()``, a generator rank's weights)

Supported, and what raises
    Any floating dtype on either side, any number of ranks on either side, tensors of any rank (0-dim:
    one box; tensors with no elements are left out of a layout).  ValueError for a destination tensor
    the source lacks or has in another shape, source boxes that overlap without being equal, a
    destination box the source does not cover, boxes out of range or that cannot be concatenated,
    ``bucket_bytes`` < 256 or not a multiple of 16, a state dict that lacks a tensor or has it in too
    small a local shape; TypeError for a non-floating dtype or a non-tensor.  Source tensors the
    destination does not hold are not sent.

References
    checkpoint-engine (MoonshotAI, 2025: bucketed, double-buffered broadcast of a 1T model); NeMo-RL
    (shard-to-shard resharding, overlapped packing); slime (per-tensor checksums); Fletcher,
    "An Arithmetic Checksum for Serial Transmissions" (1982); Megatron-LM's tensor-parallel layout.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence

import torch

__all__ = ["TensorLayout", "Item", "Bucket", "Plan", "layout", "plan", "pack", "unpack", "checksum",
           "transfer", "local_tensors", "allocate", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 64 << 20
ALIGN = 16                    # every region starts at a multiple of this many bytes; buckets are padded to it
_W = 65521                    # the position weights' period


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ----------------------------------------------------------------------------- layouts

@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one side holds one tensor: ``pieces[r]`` are the boxes of the full tensor (``shape``) rank r
    holds, concatenated along ``dim`` into its local tensor of ``dtype`` (no boxes: r holds none of it)."""

    shape: tuple
    dtype: torch.dtype
    pieces: tuple
    dim: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "pieces", tuple(tuple(tuple(tuple(r) for r in box) for box in boxes)
                                                 for boxes in self.pieces))
        _check_tensor_layout(self)

    def local_shape(self, rank: int) -> tuple | None:
        """The shape of rank ``rank``'s local tensor (None when it holds none of this tensor)."""
        boxes = self.pieces[rank]
        if not boxes:
            return None
        shape = [b - a for a, b in boxes[0]]
        if shape:
            shape[self.dim] = sum(box[self.dim][1] - box[self.dim][0] for box in boxes)
        return tuple(shape)


def layout(tensors: Mapping, *, dtype: torch.dtype | None = None, tp: int = 1, shard_spec=None) -> dict:
    """{name: TensorLayout} for ``tp`` ranks.  ``tensors`` maps names to tensors or full shapes;
    ``dtype`` is what this side holds them in (default: each tensor's own; needed with shapes);
    ``shard_spec(name, tp=tp, rank=r) -> (dim, ((start, stop), ...))`` gives rank r's rows (dim 0) or
    columns (dim 1) of each tensor, ``(None, ())`` = the whole tensor (decoder_lm.py's ``shard_spec``:
    ``functools.partial(decoder_lm.shard_spec, c=config)``); without it every rank holds every tensor
    whole.  A tensor whose storage an earlier name already holds (a tied lm_head) is listed once, under
    the first name."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to tensors or shapes, got {type(tensors).__name__}")
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if shard_spec is not None and not callable(shard_spec):
        raise TypeError(f"shard_spec must be None or a callable (name, tp=, rank=) -> (dim, ranges), "
                        f"got {type(shard_spec).__name__}")
    out, seen = {}, set()
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if t.numel() and key in seen:          # the same memory under a second name: a tied weight
                continue
            seen.add(key)
            shape, held = tuple(t.shape), dtype or t.dtype
        elif isinstance(t, (tuple, list, torch.Size)) and all(_is_int(s) and s >= 0 for s in t):
            if dtype is None:
                raise ValueError(f"layout: {name!r} is given as a shape, so dtype= must say what it is held in")
            shape, held = tuple(t), dtype
        else:
            raise TypeError(f"tensors[{name!r}] must be a tensor or a shape (tuple of ints), got {type(t).__name__}")
        if math.prod(shape) == 0:                 # nothing to hold, nothing to send
            continue
        whole = tuple((0, s) for s in shape)
        dim, pieces = 0, []
        for rank in range(tp):
            spec = (None, ()) if shard_spec is None or tp == 1 else shard_spec(name, tp=tp, rank=rank)
            d, ranges = spec
            if d is None:
                pieces.append((whole,))
                continue
            dim = d
            pieces.append(tuple(tuple((a, b) if i == d else (0, s) for i, s in enumerate(shape)) for a, b in ranges))
        out[name] = TensorLayout(shape, held, tuple(pieces), dim)
    return out


# ----------------------------------------------------------------------------- the plan

@dataclasses.dataclass(frozen=True)
class Item:
    """One region of one tensor inside a bucket: ``box`` in the full tensor, ``source`` / ``dest`` the same
    region in the source / destination rank's local tensor, at byte ``offset`` of the bucket, in ``dtype``."""

    name: str
    box: tuple
    source: tuple
    dest: tuple
    offset: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple:
        return tuple(b - a for a, b in self.box)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What goes over the wire at once, from ``source_rank`` to ``dest_rank``: ``nbytes`` (a multiple of
    16) holding ``items``; ``index`` counts the buckets of that channel from 0."""

    source_rank: int
    dest_rank: int
    index: int
    nbytes: int
    items: tuple


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every bucket of a transfer, ordered by (source_rank, dest_rank, index); ``digest`` identifies it."""

    buckets: tuple
    bucket_bytes: int
    source_ranks: int
    dest_ranks: int
    digest: int

    def channel(self, source_rank: int, dest_rank: int) -> tuple:
        """The buckets source rank ``source_rank`` sends to destination rank ``dest_rank``, in order."""
        return tuple(b for b in self.buckets if b.source_rank == source_rank and b.dest_rank == dest_rank)

    def bytes_to(self, dest_rank: int) -> int:
        """Payload bytes destination rank ``dest_rank`` receives (its shard, in its dtype; no padding)."""
        return sum(item.nbytes for b in self.buckets if b.dest_rank == dest_rank for item in b.items)


def plan(source: Mapping, destination: Mapping, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """The transfer from ``source`` to ``destination`` (layouts: {name: TensorLayout}) in buckets of at most
    ``bucket_bytes`` (module docstring: owners, regions, order, buckets)."""
    _check_layouts(source, destination, bucket_bytes)
    ns, nd = _ranks(source), _ranks(destination)
    channels = {(q, r): [] for q in range(ns) for r in range(nd)}     # (q, r) -> [(name, X, local in q, local in r)]
    for name in sorted(destination):
        src, dst = source[name], destination[name]
        owned = _owners(name, src)                                     # [(q, j, Q)]
        for r in range(nd):
            for j, p in enumerate(dst.pieces[r]):
                covered = 0
                for q, i, box in owned:
                    x = _intersect(p, box)
                    if x is None:
                        continue
                    covered += _volume(x)
                    channels[(q, r)].append((name, x, _to_local(src, q, i, x), _to_local(dst, r, j, x)))
                if covered != _volume(p):
                    raise ValueError(f"plan: the source holds {covered} of the {_volume(p)} elements of {name!r} "
                                     f"that destination rank {r} needs (its piece {p})")
    buckets = []
    for (q, r), regions in channels.items():
        buckets += _pack_regions(q, r, regions, destination, bucket_bytes)
    return Plan(tuple(buckets), bucket_bytes, ns, nd, _digest(buckets, bucket_bytes, ns, nd))


def _owners(name: str, src: TensorLayout) -> list:
    """The source boxes that are sent, as (rank, piece index, box): a box equal to an earlier rank's is
    left to that rank; distinct boxes must not overlap."""
    owned = []
    for q, boxes in enumerate(src.pieces):
        for i, box in enumerate(boxes):
            if any(box == other for _, _, other in owned):
                continue
            clash = next((oq for oq, _, other in owned if _intersect(box, other) is not None), None)
            if clash is not None:
                raise ValueError(f"plan: source ranks {clash} and {q} hold overlapping but different boxes of "
                                 f"{name!r} ({box}); a replicated region must be the same box on every rank")
            owned.append((q, i, box))
    return owned


def _intersect(a: tuple, b: tuple) -> tuple | None:
    """a ∩ b, per dim [max(starts), min(stops)); None when empty.  (A 0-dim box: ())."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _volume(box: tuple) -> int:
    return math.prod(b - a for a, b in box)


def _to_local(tl: TensorLayout, rank: int, j: int, x: tuple) -> tuple:
    """Region x (full coordinates, inside piece j of ``rank``) in that rank's local tensor: x - piece start
    on every dim, plus the piece's offset along ``dim`` (the extents of the pieces before it)."""
    boxes = tl.pieces[rank]
    piece = boxes[j]
    offset = sum(b[tl.dim][1] - b[tl.dim][0] for b in boxes[:j])
    return tuple((a - p0 + (offset if d == tl.dim else 0), b - p0 + (offset if d == tl.dim else 0))
                 for d, ((a, b), (p0, _)) in enumerate(zip(x, piece)))


def _split(region: tuple, itemsize: int, limit: int) -> list:
    """A region (name, box, source box, dest box) cut into parts of at most ``limit`` bytes: along dim 0 in
    runs of whole rows; a single row that is still too large is cut along the next dim, and so on."""
    name, box, sbox, dbox = region
    if _volume(box) * itemsize <= limit:
        return [region]
    inner = math.prod(b - a for a, b in box[1:]) * itemsize        # bytes of one step along dim 0
    rows = max(1, limit // inner)
    parts = []
    for lo in range(box[0][0], box[0][1], rows):
        n = min(rows, box[0][1] - lo)
        shift = lo - box[0][0]

        def cut(b):
            return ((b[0][0] + shift, b[0][0] + shift + n),) + b[1:]
        part = (name, cut(box), cut(sbox), cut(dbox))
        if n == 1 and inner > limit:                               # one row too large: cut its remaining dims
            head = lambda b: b[:1]                                 # noqa: E731
            parts += [(name, head(part[1]) + s[1], head(part[2]) + s[2], head(part[3]) + s[3])
                      for s in _split((name, part[1][1:], part[2][1:], part[3][1:]), itemsize, limit)]
        else:
            parts.append(part)
    return parts


def _pack_regions(q: int, r: int, regions: list, destination: Mapping, bucket_bytes: int) -> list:
    """A channel's regions laid out in buckets: a large region (at least ``_alone(bucket_bytes)``) is a bucket of
    its own; smaller ones share buckets at 16-byte aligned offsets, a new bucket where the next would not fit."""
    buckets, items, end = [], [], 0

    def close():
        if items:
            buckets.append(Bucket(q, r, len(buckets), -(-end // ALIGN) * ALIGN, tuple(items)))
    for region in regions:
        dtype = destination[region[0]].dtype
        for name, box, sbox, dbox in _split(region, dtype.itemsize, bucket_bytes):
            nbytes = _volume(box) * dtype.itemsize
            if nbytes >= _alone(bucket_bytes):
                close()
                items, end = [Item(name, box, sbox, dbox, 0, dtype)], nbytes
                close()
                items, end = [], 0
                continue
            offset = -(-end // ALIGN) * ALIGN
            if items and offset + nbytes > bucket_bytes:
                close()
                items, offset = [], 0
            items.append(Item(name, box, sbox, dbox, offset, dtype))
            end = offset + nbytes
    close()
    return buckets


def _alone(bucket_bytes: int) -> int:
    """Regions of at least this many bytes travel in a bucket of their own: packing them with others would
    only add a copy (a side that holds one contiguously sends or receives it in place)."""
    return min(1 << 20, bucket_bytes // 4)


def _digest(buckets: list, bucket_bytes: int, ns: int, nd: int) -> int:
    h = hashlib.sha256(repr((bucket_bytes, ns, nd)).encode())
    for b in buckets:
        h.update(repr((b.source_rank, b.dest_rank, b.index, b.nbytes)).encode())
        for it in b.items:
            h.update(repr((it.name, it.box, it.source, it.dest, it.offset, str(it.dtype))).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


# ----------------------------------------------------------------------------- pack, checksum, unpack

def _region(t: torch.Tensor, box: tuple) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


def pack(bucket: Bucket, tensors: Mapping) -> torch.Tensor:
    """The bucket's bytes (uint8 [nbytes], zero padded) from the source rank's local ``tensors``: each
    item's region, cast to its dtype, at its offset."""
    device = next((tensors[it.name].device for it in bucket.items if it.name in tensors), None)
    out = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    for it in bucket.items:
        view = out[it.offset:it.offset + it.nbytes].view(it.dtype).view(it.shape)
        view.copy_(_region(_tensor(tensors, it.name), it.source))      # the cast happens here
    return out


def checksum(data: torch.Tensor) -> int:
    """A*2^32 + B over the bytes' int32 words s_i: A = sum s_i, B = sum (1 + i mod 65521) s_i, both mod 2^32
    (module docstring)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 4:
        raise ValueError(f"checksum takes a 1-D uint8 tensor of a multiple of 4 bytes, got "
                         f"{getattr(data, 'dtype', type(data).__name__)} of shape {tuple(getattr(data, 'shape', ()))}")
    s = data.view(torch.int32).to(torch.int64)                        # [n / 4], each in [-2^31, 2^31)
    w = torch.arange(s.numel(), dtype=torch.int64, device=s.device) % _W + 1
    return _sum_mod(s) * 2 ** 32 + _sum_mod(s * w)                     # each |product| < 2^47


def _sum_mod(x: torch.Tensor) -> int:
    """sum(x) mod 2^32 for int64 values of magnitude < 2^48, exactly: rows of 4096 sum to < 2^60, reduced mod
    2^32 (torch's % is floor division's: into [0, 2^32)), and again until one value is left."""
    while x.numel() > 1:
        x = torch.nn.functional.pad(x, (0, -x.numel() % 4096)).view(-1, 4096).sum(1) % 2 ** 32
    return int(x.sum()) % 2 ** 32


def unpack(bucket: Bucket, data: torch.Tensor, tensors: Mapping) -> None:
    """Write the bucket's items into the destination rank's local ``tensors`` (in place)."""
    for it in bucket.items:
        view = data[it.offset:it.offset + it.nbytes].view(it.dtype).view(it.shape)
        _region(_tensor(tensors, it.name), it.dest).copy_(view)


def transfer(plan: Plan, sources: Sequence, destinations: Sequence, *, corrupt=None) -> None:
    """The plan in one process: every bucket packed from ``sources[q]`` (rank q's local tensors), its
    checksum taken, checked again on arrival, and unpacked into ``destinations[r]``.  ``corrupt(bucket,
    data)`` (a test hook) may alter the bytes between the two.  A destination rank with a bucket that fails
    its check is refused whole: ValueError naming the bucket (its tensors may hold part of the transfer:
    they are the shadow, never the weights in use)."""
    _check_sides(plan, sources, destinations)
    for bucket in plan.buckets:
        data = pack(bucket, sources[bucket.source_rank])
        sent = checksum(data)
        if corrupt is not None:
            corrupt(bucket, data)
        got = checksum(data)
        if got != sent:
            raise ValueError(f"transfer: bucket {bucket.index} from source rank {bucket.source_rank} to destination "
                             f"rank {bucket.dest_rank} fails its checksum ({got} != {sent}): refused whole")
        unpack(bucket, data, destinations[bucket.dest_rank])


def local_tensors(full: Mapping, layout: Mapping, rank: int) -> dict:
    """What rank ``rank`` of ``layout`` holds of the full tensors: its boxes of each, concatenated along the
    layout's dim, in the layout's dtype (the oracle ``transfer`` must reproduce, bit for bit)."""
    out = {}
    for name, tl in layout.items():
        boxes = tl.pieces[rank]
        if boxes:
            t = _tensor(full, name)
            parts = [_region(t, box).to(tl.dtype) for box in boxes]
            out[name] = parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=tl.dim)
    return out


def allocate(layout: Mapping, rank: int, *, device=None) -> dict:
    """Empty local tensors for rank ``rank`` of ``layout`` (a receiver's buffers in tests and benchmarks)."""
    return {name: torch.empty(tl.local_shape(rank), dtype=tl.dtype, device=device)
            for name, tl in layout.items() if tl.pieces[rank]}


# ----------------------------------------------------------------------------- checks

def _check_tensor_layout(tl: TensorLayout) -> None:
    if not all(_is_int(s) and s >= 0 for s in tl.shape):
        raise ValueError(f"TensorLayout.shape must hold ints >= 0, got {tl.shape}")
    if not isinstance(tl.dtype, torch.dtype) or not tl.dtype.is_floating_point:
        raise TypeError(f"TensorLayout.dtype must be a floating torch.dtype, got {tl.dtype!r}")
    if not _is_int(tl.dim) or not 0 <= tl.dim < max(len(tl.shape), 1):
        raise ValueError(f"TensorLayout.dim must index the shape {tl.shape}, got {tl.dim!r}")
    if not tl.pieces:
        raise ValueError("TensorLayout.pieces must list at least one rank")
    for r, boxes in enumerate(tl.pieces):
        for box in boxes:
            if len(box) != len(tl.shape) or any(not (_is_int(a) and _is_int(b) and 0 <= a < b <= s)
                                                 for (a, b), s in zip(box, tl.shape)):
                raise ValueError(f"TensorLayout: rank {r}'s box {box} is not a non-empty region of shape {tl.shape}")
        if len(boxes) > 1 and (not tl.shape or any(box[d] != boxes[0][d] for box in boxes
                                                    for d in range(len(tl.shape)) if d != tl.dim)):
            raise ValueError(f"TensorLayout: rank {r}'s boxes {boxes} cannot be concatenated along dim {tl.dim} "
                             f"(they must agree on every other dim)")


def _ranks(lay: Mapping) -> int:
    counts = {len(tl.pieces) for tl in lay.values()}
    if len(counts) > 1:
        raise ValueError(f"a layout's tensors must list the same number of ranks, got {sorted(counts)}")
    return counts.pop() if counts else 1


def _check_layouts(source: Mapping, destination: Mapping, bucket_bytes: int) -> None:
    for side, lay in (("source", source), ("destination", destination)):
        if not isinstance(lay, Mapping) or not all(isinstance(tl, TensorLayout) for tl in lay.values()):
            raise TypeError(f"{side} must be a layout: a mapping of names to TensorLayout (layout(...) makes one)")
    if not _is_int(bucket_bytes) or bucket_bytes < 256 or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be an int >= 256 and a multiple of {ALIGN}, got {bucket_bytes!r}")
    missing = sorted(set(destination) - set(source))
    shaped = [f"{n}: source {source[n].shape}, destination {tl.shape}" for n, tl in destination.items()
              if n in source and source[n].shape != tl.shape]
    if missing or shaped:
        raise ValueError("plan: the destination needs tensors the source does not have as such: "
                         + "; ".join(([f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}"] if missing else [])
                                     + shaped[:5]))


def _tensor(tensors: Mapping, name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"the state dict lacks {name!r}, which the plan moves")
    t = tensors[name]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"state dict entry {name!r} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_sides(plan: Plan, sources: Sequence, destinations: Sequence) -> None:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan (plan(...) makes one), got {type(plan).__name__}")
    for side, given, want in (("sources", sources, plan.source_ranks), ("destinations", destinations, plan.dest_ranks)):
        if not isinstance(given, Sequence) or len(given) != want:
            raise ValueError(f"{side} must be a sequence of {want} state dicts (one per rank), "
                             f"got {len(given) if isinstance(given, Sequence) else type(given).__name__}")
    for bucket in plan.buckets:
        for it in bucket.items:
            for side, tensors, box in (("source", sources[bucket.source_rank], it.source),
                                       ("destination", destinations[bucket.dest_rank], it.dest)):
                t = _tensor(tensors, it.name)
                if t.dim() != len(box) or any(b > s for (_, b), s in zip(box, t.shape)):
                    raise ValueError(f"{side} rank's {it.name!r} has shape {tuple(t.shape)}, too small for the "
                                     f"plan's region {box}: another layout than the plan's?")
