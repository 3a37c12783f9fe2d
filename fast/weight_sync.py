"""Weight sync: the fast version.  The reference's transfer plan (ref/weight_sync.py, the specification:
read its docstring for layouts, the plan's order and the checksum) moved between processes with
torch.distributed: bucketed, pipelined, shard to shard, verified, overlapped with decoding.

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
    The same ``plan``, ``pack``, ``unpack``, ``checksum`` and ``transfer`` as the reference (the same
    buckets, bytes and digests; parity/ compares them), and the transport between a trainer and its
    generators: ``WeightSender`` (one per trainer rank) pushes a state dict to named destinations (a
    generator: every one of its tensor-parallel ranks), ``WeightReceiver`` (what the sender's
    ``receiver(name)`` returns; picklable) is what a generator connects on each of its ranks
    (fast/generator_engine.py's ``Generator.connect_weights`` / ``receive_weights``), and
    ``WeightSender.attach(generator)`` puts a local generator behind the router's protocol with its
    ``load_weights`` going through the transport (fast/routed_generator.py's ``ray_generators(...,
    weight_transport=sender)`` does the same for a Ray fleet).

The transport
    channels     one process group of two ranks (0: the sender, 1: the receiver) per (source rank,
                 destination, destination rank) pair that the plan gives bytes: gloo on CPUs, NCCL on
                 GPUs, formed through the trainer's TCPStore (rendezvous under a key per destination and
                 generation).  Point to point, not a broadcast group: a member of a broadcast that dies or
                 stalls blocks every other member until the timeout and breaks the group for all, while a
                 dead receiver here only fails its own channel.  The price: the trainer's egress carries
                 a replicated tensor once per destination that needs it (a broadcast tree would not).
    control      one message per sync per generator: ``header(name, version)`` (the version and the
                 plan's digest), which the caller delivers (a Ray call, a thread); both sides compute the
                 plan from the layouts, so no tensor name, shape or offset is ever sent.  Each bucket is
                 followed by a 32-byte trailer: its checksum, the version, its index and the digest.
    pipeline     the sender packs bucket i + 1 (slice, cast, checksum) while bucket i is on the wire, in
                 two staging buffers; the receiver posts the receive of bucket i + 1 before checking and
                 copying bucket i into the shadow weights, in two buffers.  A bucket holding one large
                 region (the plan gives those a bucket each) moves in place where a side holds it
                 contiguously in the wire's dtype: sent from the trainer's tensor, received into the shadow
                 weights themselves (then checked there).  Extra memory per side: at most two buckets
                 (plus 65521 words for a checksum), never the model.  The buckets of a destination's ranks
                 are interleaved, so its ranks finish together.  ``send`` given several destinations with
                 the same layout packs each bucket once for all of them; the trainer's tensors must not
                 change until ``send`` returns.
    verify       every receiver checks every bucket's trailer and checksum before copying it; a bad
                 bucket refuses the sync whole (the receiver drains the rest, so the channel stays
                 usable, and raises: the generator keeps its old weights and version; the router's fault
                 policy re-syncs it).  A generator swaps only when every rank received every bucket.
    faults       every operation waits at most ``timeout_s``: a receiver that dies or stalls fails its own
                 channels (the sender goes on with the others, so they lose at most one timeout); a
                 trainer that dies mid-sync fails the receivers' waits (each keeps its last complete
                 version); a store that cannot be reached or a group that cannot form raises
                 RuntimeError naming the address, the channel and the timeout.  A failed channel, or a
                 receiver that (re)connects (a restarted process), bumps the destination's generation
                 in the store: both sides form new channels at the next sync.

Tensors and types
    As the reference (layouts, Plan, Bucket, Item, state dicts), plus ``WeightSender(source, *,
    destination=None, source_rank=0, bucket_bytes=, address="127.0.0.1", port=0, timeout_s=60,
    backend=None)`` (source rank 0 hosts the store at address:port; port 0 = any free port, ``.port``
    says which) and ``WeightReceiver`` (name, the store's address and port, both layouts, bucket_bytes,
    timeout_s, backend).  The generator's side of the protocol (what Generator.connect_weights calls):
    ``receiver.connect(rank, size, tensors) -> endpoint`` on every rank (``tensors``: that rank's
    weights by name), ``endpoint.receive(version, header, tensors)`` into the shadow weights
    (version None: only (re)form the channels), ``endpoint.timeout_s``, ``endpoint.close()``.

Supported, and what raises
    As the reference, plus: RuntimeError for a store that cannot be reached, a channel that cannot form,
    a wait past ``timeout_s``, a bucket whose trailer or checksum is wrong (the sync refused whole); its
    ``failed`` attribute maps each destination that failed to why.  ValueError for a header whose digest
    is not this receiver's plan (layouts or bucket size differ between the sides), a receiver connected
    on a rank whose weights do not match its layout (names, local shapes, dtypes), a state dict that does
    not match the source layout.  Limits: no RDMA (NCCL or gloo sockets only), no fp8 or delta
    transfer (every sync moves every byte of each shard), the NCCL path has not run on a GPU yet.

References
    As the reference; torch.distributed (ProcessGroupGloo / ProcessGroupNCCL, TCPStore); checkpoint-engine
    (double-buffered buckets); open-instruct (per-tensor calls cost more than the wire: one message per
    sync here).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import math
import socket
import threading
import time
from collections.abc import Mapping, Sequence

import torch

__all__ = ["TensorLayout", "Item", "Bucket", "Plan", "layout", "plan", "pack", "unpack", "checksum",
           "transfer", "local_tensors", "allocate", "DEFAULT_BUCKET_BYTES", "WeightSender", "WeightReceiver"]

DEFAULT_BUCKET_BYTES = 64 << 20
ALIGN = 16                    # every region starts at a multiple of this many bytes; buckets are padded to it
_W = 65521                    # the position weights' period
TRAILER_WORDS = 4             # int64 sent after each bucket: checksum, version, index, digest


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
    out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    _pack_into(bucket, tensors, out)
    return out


def _pack_into(bucket: Bucket, tensors: Mapping, out: torch.Tensor) -> None:
    """pack into ``out`` (uint8 [nbytes], any device: the copy casts and moves at once); the padding
    between items is zeroed, so a reused buffer gives the same bytes as a fresh one."""
    end = 0
    for it in bucket.items:
        out[end:it.offset].zero_()
        view = out[it.offset:it.offset + it.nbytes].view(it.dtype).view(it.shape)
        view.copy_(_region(_tensor(tensors, it.name), it.source))      # the cast happens here
        end = it.offset + it.nbytes
    out[end:bucket.nbytes].zero_()


def checksum(data: torch.Tensor) -> int:
    """A*2^32 + B over the bytes' int32 words s_i: A = sum s_i, B = sum (1 + i mod 65521) s_i, both mod 2^32
    (the reference's formula).  One pass: the words viewed [n // 65521, 65521] are summed down the columns
    in int32 (c_j, wrapping: exact mod 2^32, and no widened copy of the data), then A = sum c_j and
    B = sum (1 + j) c_j over 65521 columns (the weights repeat every 65521 words), plus the last partial
    row.  Temporaries: 65521 words.  On the data's own device; CPU and GPU give the same value."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 4:
        raise ValueError(f"checksum takes a 1-D uint8 tensor of a multiple of 4 bytes, got "
                         f"{getattr(data, 'dtype', type(data).__name__)} of shape {tuple(getattr(data, 'shape', ()))}")
    words = data.view(torch.int32)
    full = words.numel() // _W * _W
    w = _position_weights(data.device)
    cols = words[:full].view(-1, _W).sum(0, dtype=torch.int32).to(torch.int64)        # [65521], wrapped
    tail = words[full:].to(torch.int64)                                                  # [< 65521]
    a = int(cols.sum() + tail.sum()) % 2 ** 32                       # |.| < 2^47: exact in int64
    b = int((cols * w).sum() + (tail * w[:tail.numel()]).sum()) % 2 ** 32   # |each sum| < 2^63
    return a * 2 ** 32 + b


@functools.lru_cache(maxsize=8)
def _position_weights(device: torch.device) -> torch.Tensor:
    """1 .. 65521 (int64) on ``device``: the checksum's weights, made once per device."""
    return torch.arange(1, _W + 1, dtype=torch.int64, device=device)


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


# ============================================================================= the transport

class WeightSender:
    """The trainer's side of the transport, one per source rank (module docstring, "The transport").

    ``receiver(name, destination=None)`` registers a destination (a generator; its layout, or the
    constructor's ``destination``) and returns the picklable ``WeightReceiver`` it connects on every
    rank; ``header(name, version)`` is the control message its ``receive_weights`` takes;
    ``send(names, state_dict, version)`` pushes this rank's part of ``state_dict`` (its local tensors,
    under the source layout's names) to each named destination and returns what it moved;
    ``attach(generator)`` does all of it for a local generator behind the router's protocol."""

    def __init__(self, source: Mapping, *, destination: Mapping | None = None, source_rank: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, address: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 60.0, backend: str | None = None):
        import torch.distributed as dist
        _check_layouts(source, destination or {}, bucket_bytes)
        ranks = _ranks(source)
        if not _is_int(source_rank) or not 0 <= source_rank < ranks:
            raise ValueError(f"source_rank must be an int in [0, {ranks}) (the source layout's ranks), "
                             f"got {source_rank!r}")
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self.backend = _backend(backend)
        self.source, self.default_destination, self.source_rank = dict(source), destination, source_rank
        self.bucket_bytes, self.address = bucket_bytes, address
        if source_rank == 0:                              # rank 0 hosts the store every side meets in
            self._store = dist.TCPStore(address, port, None, True, _delta(self.timeout_s), wait_for_workers=False)
            self.port = self._store.port
        else:
            self._store, self.port = _store_client(address, port, self.timeout_s, f"source rank {source_rank}"), port
        self._device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                        else torch.device("cpu"))           # where buckets are staged
        self._plans: dict = {}                            # name -> (destination layout, Plan)
        self._channels: dict = {}                         # name -> (generation, {dest rank: process group})
        self._locks: dict = {}                            # name -> Lock: one send at a time per destination
        self._lock = threading.Lock()
        self._buffer_bytes = self.peak_buffer_bytes = 0
        self._corrupt = None   # test hook: fn(name, bucket, data) -> None or the bytes to send that destination

    def receiver(self, name: str, destination: Mapping | None = None) -> WeightReceiver:
        """Register destination ``name`` (every rank of one generator) with its layout; what it connects."""
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty str without '/', got {name!r}")
        destination = destination if destination is not None else self.default_destination
        if destination is None:
            raise ValueError("receiver needs the destination's layout (or WeightSender(..., destination=layout))")
        p = plan(self.source, destination, bucket_bytes=self.bucket_bytes)
        with self._lock:
            self._plans[name] = (dict(destination), p)
            self._locks.setdefault(name, threading.Lock())
        return WeightReceiver(name, self.address, self.port, self.source, dict(destination), self.bucket_bytes,
                              self.timeout_s, self.backend)

    def header(self, name: str, version: int) -> dict:
        """The control message of one sync to ``name``: its version and the plan's digest."""
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        return dict(name=name, version=version, digest=self._plan_of(name).digest)

    def send(self, names, state_dict: Mapping, version: int) -> dict:
        """Push this rank's tensors to every destination in ``names`` (a name or a list); returns bytes,
        buckets, seconds, peak_buffer_bytes.  RuntimeError (``failed``: name -> why) when a destination
        failed; the others received everything."""
        names = [names] if isinstance(names, str) else list(names)
        plans = {n: self._plan_of(n) for n in names}
        if not _is_int(version):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        tensors = self._checked(state_dict)
        start, failed, moved = time.perf_counter(), {}, dict(bytes=0, buckets=0)
        locks = [self._locks[n] for n in sorted(set(names))]
        for lock in locks:                                 # (sorted: two sends never wait on each other)
            lock.acquire()
        try:
            channels = self._connect(names, failed)
            streams: dict = {}                             # (digest, dest rank) -> [buckets, [(name, pg)]]
            for name in names:
                for r, pg in channels.get(name, {}).items():
                    key = (plans[name].digest, r)
                    streams.setdefault(key, [plans[name].channel(self.source_rank, r), []])[1].append((name, pg))
            self._pipeline(list(streams.values()), tensors, version, failed, moved)
            for name in failed:
                self._drop(name)
        finally:
            for lock in locks:
                lock.release()
        if failed:
            error = RuntimeError(f"weight sync of version {version} failed for {sorted(failed)} (the others received "
                                 f"it): " + "; ".join(f"{n}: {why}" for n, why in sorted(failed.items())))
            error.failed = failed
            raise error
        return dict(moved, seconds=time.perf_counter() - start, peak_buffer_bytes=self.peak_buffer_bytes)

    def attach(self, generator, name: str | None = None, destination: Mapping | None = None):
        """Connect a local generator (fast/generator_engine.py's, with ``connect_weights`` and
        ``receive_weights``) and return it behind the router's protocol, ``load_weights`` going through
        this sender (the receive in a thread, the send in the caller's)."""
        name = name or generator.name
        generator.connect_weights(self.receiver(name, destination))
        return _Attached(self, generator, name)

    def stats(self) -> dict:
        """destinations, connected (those with channels formed), peak_buffer_bytes (staging, all sends)."""
        with self._lock:
            return dict(destinations=sorted(self._plans), connected=sorted(self._channels),
                        peak_buffer_bytes=self.peak_buffer_bytes)

    def close(self) -> None:
        """Drop every channel (the store goes with this object)."""
        with self._lock:
            self._channels.clear()

    # ------------------------------------------------------------------ internals

    def _plan_of(self, name: str) -> Plan:
        with self._lock:
            if name not in self._plans:
                raise ValueError(f"no destination named {name!r}: receiver(name, layout) registers one "
                                 f"(registered: {sorted(self._plans)})")
            return self._plans[name][1]

    def _checked(self, state_dict: Mapping) -> dict:
        """This rank's tensors of the source layout, or a ValueError naming every problem."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
        missing, shaped = [], []
        for name, tl in self.source.items():
            want = tl.local_shape(self.source_rank)
            if want is None:
                continue
            t = state_dict.get(name)
            if not isinstance(t, torch.Tensor):
                missing.append(name)
            elif tuple(t.shape) != want:
                shaped.append(f"{name}: got {tuple(t.shape)}, the layout says {want}")
        if missing or shaped:
            raise ValueError(f"state_dict does not match source rank {self.source_rank}'s layout: "
                             + "; ".join(([f"missing {missing[:5]}"] if missing else []) + shaped[:5]))
        return dict(state_dict)

    def _connect(self, names: list, failed: dict) -> dict:
        """{name: {dest rank: process group}} at each destination's current generation, forming what is
        missing (every channel in its own thread: each rendezvous waits for its receiver)."""
        out, todo = {}, []
        for name in names:
            gen = _generation(self._store, name)
            with self._lock:
                have = self._channels.get(name)
            if have is not None and have[0] == gen:
                out[name] = have[1]
                continue
            p = self._plan_of(name)
            for r in range(p.dest_ranks):
                if p.channel(self.source_rank, r):
                    todo.append((name, gen, r))
        formed = _in_threads([(lambda n=n, g=g, r=r: _pair(self._store, _key(n, g, self.source_rank, r), 0,
                                                             self.backend, self._device, self.address, self.timeout_s))
                              for n, g, r in todo])
        fresh: dict = {}
        for (name, gen, r), (pg, exc) in zip(todo, formed):
            if exc is not None:
                failed.setdefault(name, f"rank {r}: {exc}")
                _bump(self._store, name, gen)
            fresh.setdefault((name, gen), {})[r] = pg
        for (name, gen), pgs in fresh.items():
            if name not in failed:
                with self._lock:
                    self._channels[name] = (gen, pgs)
                out[name] = pgs
        return out

    def _drop(self, name: str) -> None:
        with self._lock:
            have = self._channels.pop(name, None)
        if have is not None:
            _bump(self._store, name, have[0])

    def _pipeline(self, streams: list, tensors: dict, version: int, failed: dict, moved: dict) -> None:
        """Bucket i + 1 packed while bucket i is on the wire; the streams' buckets interleaved.  Each bucket
        is two messages: its bytes (straight from the source tensor when it holds them contiguously in the
        wire's dtype and place, else packed into one of two staging buffers) and its trailer."""
        order = [(targets, buckets[i]) for i in range(max((len(s[0]) for s in streams), default=0))
                 for buckets, targets in streams if i < len(buckets)]
        packed = [b.nbytes for _, b in order if _in_place(b, tensors, self._device, "source") is None]
        buffers = [self._buffer(max(packed)) for _ in range(min(2, len(packed)))]
        pending: list = [[], []]
        try:
            for step, (targets, bucket) in enumerate(order):
                slot = step % 2
                self._settle(pending[slot], failed)     # (the sends two steps back: their buffer is free again)
                pending[slot] = []
                live = [(name, pg) for name, pg in targets if name not in failed]
                if not live:
                    continue
                data = _in_place(bucket, tensors, self._device, "source")
                if data is None:
                    data = buffers[step % len(buffers)][:bucket.nbytes]
                    _pack_into(bucket, tensors, data)
                trailer = torch.tensor([_signed(checksum(data)), version, bucket.index,
                                        self._plan_of(live[0][0]).digest], dtype=torch.int64, device=self._device)
                for name, pg in live:
                    payload = self._corrupt(name, bucket, data) if self._corrupt is not None else None
                    try:
                        works = [pg.send([data if payload is None else payload], 1, 0), pg.send([trailer], 1, 0)]
                        pending[slot].append((name, bucket.dest_rank, works, trailer))
                        moved["bytes"] += data.numel() + trailer.numel() * 8
                        moved["buckets"] += 1
                    except Exception as exc:  # noqa: BLE001 - a channel that broke: its destination fails
                        failed.setdefault(name, f"rank {bucket.dest_rank}: {_brief(exc)}")
            for slot in (0, 1):
                self._settle(pending[slot], failed)
        finally:
            with self._lock:
                self._buffer_bytes -= sum(b.numel() for b in buffers)

    def _settle(self, pending: list, failed: dict) -> None:
        for name, r, works, _ in pending:
            if name in failed:
                continue
            try:
                for work in works:
                    work.wait(_delta(self.timeout_s))
            except Exception as exc:  # noqa: BLE001 - timed out, or the receiver is gone
                failed[name] = f"rank {r}: {_brief(exc)}"

    def _buffer(self, size: int) -> torch.Tensor:
        with self._lock:
            self._buffer_bytes += size
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._buffer_bytes)
        return torch.empty(size, dtype=torch.uint8, device=self._device)


@dataclasses.dataclass(frozen=True, eq=False)
class WeightReceiver:
    """What a generator connects on each of its ranks (picklable: it crosses process boundaries to
    tensor-parallel workers and Ray actors).  ``WeightSender.receiver(name)`` makes it."""

    name: str
    address: str
    port: int
    source: dict
    destination: dict
    bucket_bytes: int
    timeout_s: float
    backend: str

    def connect(self, rank: int, size: int, tensors: Mapping) -> _Endpoint:
        """This rank's endpoint: its weights (``tensors``, by name) checked against the destination layout,
        the trainer's store reached (RuntimeError within timeout_s otherwise)."""
        return _Endpoint(self, rank, size, tensors)


class _Endpoint:
    """One generator rank's receiving side: channels from each source rank that sends it bytes."""

    def __init__(self, recipe: WeightReceiver, rank: int, size: int, tensors: Mapping):
        self.recipe, self.rank, self.timeout_s = recipe, rank, recipe.timeout_s
        self.plan = plan(recipe.source, recipe.destination, bucket_bytes=recipe.bucket_bytes)
        if size != self.plan.dest_ranks or not _is_int(rank) or not 0 <= rank < size:
            raise ValueError(f"weight receiver {recipe.name!r}: its layout has {self.plan.dest_ranks} rank(s); this "
                             f"generator connected rank {rank!r} of {size!r} (another tensor_parallel_size?)")
        self.device = _check_weights(recipe, rank, tensors)
        if recipe.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"weight receiver {recipe.name!r}: backend 'nccl' needs CUDA weights, rank {rank}'s are "
                             f"on {self.device}")
        self._wire = self.device if recipe.backend == "nccl" else torch.device("cpu")
        self._sources = [q for q in range(self.plan.source_ranks) if self.plan.channel(q, rank)]
        self._store = _store_client(recipe.address, recipe.port, self.timeout_s, f"{recipe.name} rank {rank}")
        self._own_address = _route_to(recipe.address, recipe.port)
        _bump(self._store, recipe.name)      # a (re)started receiver: every side forms new channels at the next sync
        self._gen, self._pgs = None, {}
        self._lock = threading.Lock()
        self._live = self.peak_buffer_bytes = 0         # wire buffers held now, and at most

    def receive(self, version: int | None, header: Mapping, tensors: Mapping | None) -> None:
        """Receive version ``version`` into ``tensors`` (this rank's shadow weights), every bucket checked;
        RuntimeError when anything failed (the caller must not use ``tensors`` then).  ``version`` None:
        only form the channels."""
        name = self.recipe.name
        if not isinstance(header, Mapping) or header.get("digest") != self.plan.digest or header.get("name") != name:
            raise ValueError(f"weight receiver {name!r} rank {self.rank}: the header {header!r} is not this "
                             f"receiver's plan (digest {self.plan.digest}): the sides' layouts or bucket sizes differ")
        gen = _generation(self._store, name)
        if gen != self._gen:
            self._form(gen)
        if version is None:
            return
        _check_weights(self.recipe, self.rank, tensors)
        results = _in_threads([(lambda q=q: self._drain(q, version, tensors)) for q in self._sources])
        broken = [f"from source rank {q}: {exc}" for q, (_, exc) in zip(self._sources, results) if exc is not None]
        refused = [f"from source rank {q}: {bad}" for q, (bad, _) in zip(self._sources, results) if bad]
        if broken:
            self._pgs = {}
            _bump(self._store, name, gen)
        if broken or refused:
            raise RuntimeError(f"weight receiver {name!r} rank {self.rank}: version {version} refused whole: "
                               + "; ".join(broken + refused))

    def close(self) -> None:
        self._pgs = {}

    def _form(self, gen: int) -> None:
        self._pgs, self._gen = {}, None
        key = self.recipe.name
        results = _in_threads([(lambda q=q: _pair(self._store, _key(key, gen, q, self.rank), 1, self.recipe.backend,
                                                  self.device, self._own_address, self.timeout_s))
                               for q in self._sources])
        errors = [f"source rank {q}: {exc}" for q, (_, exc) in zip(self._sources, results) if exc is not None]
        if errors:
            _bump(self._store, key, gen)
            raise RuntimeError(f"weight receiver {key!r} rank {self.rank}: " + "; ".join(errors))
        self._pgs = {q: pg for q, (pg, _) in zip(self._sources, results)}
        self._gen = gen

    def _drain(self, q: int, version: int, tensors: Mapping) -> str | None:
        """Every bucket from source rank q: receive i + 1 while i is checked and unpacked.  A bucket that this
        rank holds contiguously lands in the shadow weights themselves; the others in one of two staging
        buffers.  After a bad bucket the rest are still received (the channel stays in step) but not
        unpacked; returns what was bad, or None.  A wait past timeout_s or a trailer out of step raises."""
        buckets, pg = self.plan.channel(q, self.rank), self._pgs[q]
        packed = [b.nbytes for b in buckets if _in_place(b, tensors, self._wire, "dest") is None]
        buffers = [torch.empty(max(packed), dtype=torch.uint8, device=self._wire) for _ in range(min(2, len(packed)))]
        with self._lock:                  # (one thread per source rank: their buffers add up)
            self._live += sum(b.numel() for b in buffers)
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._live)
        try:
            return self._drain_into(version, tensors, buckets, pg, buffers)
        finally:
            with self._lock:
                self._live -= sum(b.numel() for b in buffers)

    def _drain_into(self, version: int, tensors: Mapping, buckets: tuple, pg, buffers: list) -> str | None:
        staged = iter(range(len(buckets) * 2))

        def post(i):
            bucket = buckets[i]
            data = _in_place(bucket, tensors, self._wire, "dest")
            direct = data is not None
            if not direct:
                data = buffers[next(staged) % len(buffers)][:bucket.nbytes]
            trailer = torch.empty(TRAILER_WORDS, dtype=torch.int64, device=self._wire)
            return data, direct, trailer, [pg.recv([data], 0, 0), pg.recv([trailer], 0, 0)]

        bad, current = None, post(0)
        for i, bucket in enumerate(buckets):
            following = post(i + 1) if i + 1 < len(buckets) else None
            data, direct, trailer, works = current
            for work in works:
                work.wait(_delta(self.timeout_s))
            total, got_version, index, digest = trailer.tolist()
            if (got_version, index, digest) != (version, bucket.index, self.plan.digest):
                raise RuntimeError(f"bucket {i} arrived as version {got_version}, bucket {index}, plan {digest}: "
                                   f"out of step with this sync (version {version}, plan {self.plan.digest})")
            if bad is None:
                got = _signed(checksum(data))
                if got != total:
                    bad = f"bucket {i} fails its checksum ({got} != {total})"
                elif not direct:
                    unpack(bucket, data, tensors)
            current = following
        return bad


class _Attached:
    """A local generator behind the router's protocol whose load_weights goes through a WeightSender."""

    def __init__(self, sender: WeightSender, generator, name: str):
        self._sender, self._gen, self.name = sender, generator, name

    @property
    def policy_version(self) -> int:
        return self._gen.policy_version

    @property
    def dead(self) -> bool:
        return bool(getattr(self._gen, "dead", False))

    def submit(self, request):
        return self._gen.submit(request)

    def load_weights(self, state_dict: Mapping, version: int) -> None:
        header = self._sender.header(self.name, version)
        box: dict = {}

        def receive():
            try:
                self._gen.receive_weights(version, header=header)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc
        thread = threading.Thread(target=receive, name=f"receive-{self.name}", daemon=True)
        thread.start()
        try:
            self._sender.send(self.name, state_dict, version)
        finally:
            thread.join()
        if "error" in box:
            raise box["error"]

    def __getattr__(self, attr):
        return getattr(self._gen, attr)


# ----------------------------------------------------------------------------- process groups, the store

def _key(name: str, gen: int, q: int, r: int) -> str:
    return f"twofold-weight-sync/{name}/{gen}/{q}-{r}"


def _generation(store, name: str) -> int:
    """The destination's current generation (0 the first time)."""
    return int(store.compare_set(f"twofold-weight-sync/{name}/generation", "", "0"))


def _bump(store, name: str, seen: int | None = None) -> None:
    """Move the generation past ``seen`` (default: the current one); a no-op when someone already did."""
    key = f"twofold-weight-sync/{name}/generation"
    while True:
        now = _generation(store, name)
        if seen is not None and now != seen:
            return
        if int(store.compare_set(key, str(now), str(now + 1))) == now + 1:
            return


def _pair(store, key: str, rank: int, backend: str, device: torch.device, address: str, timeout_s: float):
    """A process group of two (0: sender, 1: receiver) under its own prefix; RuntimeError naming the key
    and the timeout when the other side does not come."""
    import torch.distributed as dist
    prefixed = dist.PrefixStore(key, store)
    try:
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _delta(timeout_s)
            return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _delta(timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, options)
    except Exception as exc:  # noqa: BLE001 - the store's wait timed out, or the connection failed
        raise RuntimeError(f"the channel {key} could not form within timeout_s={timeout_s:g} s (the other side "
                           f"never came): {_brief(exc)}") from None


def _store_client(address: str, port: int, timeout_s: float, who: str):
    import torch.distributed as dist
    try:
        return dist.TCPStore(address, port, None, False, _delta(timeout_s))
    except Exception as exc:  # noqa: BLE001 - no store there, or it did not answer in time
        raise RuntimeError(f"weight sync ({who}): the trainer's store at {address}:{port} could not be reached "
                           f"within timeout_s={timeout_s:g} s: {_brief(exc)}") from None


def _route_to(address: str, port: int) -> str:
    """This host's address on the route to ``address`` (what the sender connects back to; loopback stays)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, port or 9))
            return s.getsockname()[0]
        except OSError:
            return address


def _signed(x: int) -> int:
    """A checksum in [0, 2^64) as the int64 the trailer holds (two's complement)."""
    return x - 2 ** 64 if x >= 2 ** 63 else x


def _in_place(bucket: Bucket, tensors: Mapping, device: torch.device, side: str) -> torch.Tensor | None:
    """The bucket's bytes as a view of the tensor that holds them, when the bucket is one region filling it
    exactly that this side holds contiguously, in the wire's dtype and on its device; else None (packed)."""
    if len(bucket.items) != 1 or bucket.items[0].nbytes != bucket.nbytes:
        return None
    item = bucket.items[0]
    t = tensors.get(item.name) if isinstance(tensors, Mapping) else None
    if not isinstance(t, torch.Tensor) or t.dtype != item.dtype or t.device != device:
        return None
    view = _region(t, item.source if side == "source" else item.dest)
    return view.reshape(-1).view(torch.uint8) if view.is_contiguous() else None


def _in_threads(fns: list) -> list:
    """Run each fn in its own thread (one alone: here); [(result, None) or (None, exception)] in order."""
    out = [(None, None)] * len(fns)

    def run(i):
        try:
            out[i] = (fns[i](), None)
        except Exception as exc:  # noqa: BLE001 - returned to the caller
            out[i] = (None, exc)
    if len(fns) == 1:
        run(0)
        return out
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _check_weights(recipe: WeightReceiver, rank: int, tensors) -> torch.device:
    """A rank's weights against its destination layout: the same names (a tied alias of a listed tensor may
    be left out of the layout), local shapes and dtypes."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}")
    want = {n: tl for n, tl in recipe.destination.items() if tl.pieces[rank]}
    listed = {tensors[n].data_ptr() for n in want if n in tensors}       # a tied alias shares one of these
    problems = [f"missing {n}" for n in sorted(set(want) - set(tensors))]
    problems += [f"not in the layout: {n}" for n in sorted(set(tensors) - set(want))
                 if tensors[n].data_ptr() not in listed]
    problems += [f"{n}: {tuple(tensors[n].shape)} {tensors[n].dtype}, the layout says {tl.local_shape(rank)} "
                 f"{tl.dtype}" for n, tl in want.items() if n in tensors
                 and (tuple(tensors[n].shape) != tl.local_shape(rank) or tensors[n].dtype != tl.dtype)]
    if problems:
        raise ValueError(f"weight receiver {recipe.name!r}: rank {rank}'s weights do not match the destination "
                         f"layout: " + "; ".join(problems[:6]) + (" ..." if len(problems) > 6 else ""))
    return next(iter(tensors.values())).device if tensors else torch.device("cpu")


def _backend(backend) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {backend!r}")
    return backend


def _seconds(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _brief(exc: BaseException) -> str:
    """An exception in one line (torch.distributed's carry C++ stack traces after the first)."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
