"""View-replay activation offloading: the fast version (CUDA streams, pinned pool, prefetch).

Example::

    # view_replay_offload.py, copied next to this script
    import torch
    from view_replay_offload import OffloadActivations

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    offload = OffloadActivations(module=model, min_offload_bytes=0)   # on a GPU: .cuda() the model and x
    with offload:
        loss = model(torch.randn(32, 64)).square().mean()
    loss.backward()                                                   # the activations come back for it
    print(offload.stats)

What it computes
    Exactly what ref/view_replay_offload.py computes (read its docstring first): a context
    manager over ``torch.autograd.graph.saved_tensors_hooks`` that copies every saved
    activation storage to host memory once, whatever number of views of it autograd saves,
    and replays each view with its dtype, size and stride on the storage reloaded in backward.
    Gradients are bitwise identical to running without it.  What this file adds is the
    machinery that hides the copies behind compute on a GPU; on CPU tensors it falls back to
    the reference's synchronous behaviour (a separate host copy), so every keyword, stat and
    error is shared and tested on machines without a GPU.

The CUDA machinery (per device, per OffloadActivations object)
    forward   pack(t): the side stream waits on an event of the compute stream (the bytes of
              t exist), copies the missing byte ranges of t's storage into pinned host
              buffers with ``non_blocking=True``, and records a copy event.  The compute stream
              never waits for it.  A detached alias of t stays in a FIFO until its copy event
              has completed (``Event.query``), so the caching allocator cannot hand t's memory
              to a new tensor while the copy still reads it; no ``record_stream``.  When the
              FIFO holds more than ``max_inflight_bytes``, the compute stream waits on the
              oldest copy event and the alias is dropped (later compute work, the only work
              that can reuse the memory, is then ordered after the copy).
    pool      pinned buffers come from a pool keyed by size class (8 classes per power of two,
              at most 12.5% over the request; 512-byte steps up to 4 KiB): pinning memory per
              tensor costs milliseconds.  A storage's host buffers return to the pool when
              autograd frees its last saved view; every copy touching them runs on the one side
              stream, so a buffer handed out again is ordered after its previous copies.
              ``max_pool_bytes`` caps what the free pool retains (None: unbounded).
    backward  unpack(view): if the storage is still held in the FIFO (its copy not finished
              yet, typical for the last layers), the view is replayed on it directly.
              Otherwise its reload buffer is allocated on the compute stream (the stream that
              will use and free it), the side stream waits on an event of the compute stream
              and copies the host bytes into it (byte ranges copied, gathered footprints
              scattered through a side-stream temporary), and the compute stream waits on that load
              event before first use.  After each unpack, the next ``prefetch`` storages in
              reverse save order (of the same forward) are reloaded the same way, ahead of use.
              At the end of each backward pass (an autograd engine callback) the FIFO is
              drained with stream waits, so no device memory outlives the pass.
    The compute stream is the current stream when a tensor is saved (the stream that
    allocated it) and when it is unpacked (the autograd engine runs a node's backward on the
    stream its forward ran on).  A prefetched buffer is allocated on the stream of the unpack
    that triggered it: a model whose backward nodes run on several streams should use
    ``prefetch=0`` (demand reloads are allocated on the stream that uses them).  CUDA graph
    capture is not supported (RuntimeError).

FLOPs and bytes (per forward + backward, S = distinct offloaded storages)
    FLOPs: 0.  Bytes moved each way (device->host in forward, host->device in backward, once
    per pass): for each storage in S, the union of its dense views' spans plus the bytes of
    its sparse views' distinct footprints (see the reference), at most the storage's size
    when those do not overlap.  ``save_on_cpu`` moves sum over saved tensors of numel *
    itemsize each way: every view again, every expand at its full expanded size, parameters
    too.  The bound is PCIe: bytes moved / (host<->device bandwidth, ~50 GB/s per direction on
    PCIe Gen5 x16) against step time; gathered footprints also cost a device copy each way.

Tensors and objects
    As in the reference: saved tensors of any dtype and strides on cuda (pinned host copy,
    asynchronous) or cpu (separate host copy, synchronous); host ranges and gathered
    footprints uint8 (size-class buffers, the first bytes used); reloaded buffer uint8 [hi - lo]
    on the device, lo
    rounded down to 512 bytes.  ``stats`` has the reference's keys (same counts on the same
    inputs) plus ``prefetched_storages`` (reloads issued ahead of use), ``pinned_allocations``
    and ``pinned_reuses`` (pool misses and hits).

Supported, and what raises
    Everything the reference supports and raises, with the same keywords ``min_offload_bytes``
    and ``module``; fast-only keywords ``prefetch`` (int >= 0), ``max_inflight_bytes`` (int
    >= 0), ``max_pool_bytes`` (int >= 0 or None), checked with TypeError / ValueError naming
    the argument.  In-place change after save: besides the reference's check through live
    weak references, the FIFO's alias shares the saved tensor's version counter, so a storage
    modified while its asynchronous copy was in flight raises autograd's error when a view of
    it is unpacked, whether it is replayed on the still-held device storage or was released
    (and marked stale) first, even if the tensor itself died in between (autograd, holding
    the tensor, would raise too).  torch.utils.checkpoint and torch.compile interact as described in the
    reference: only the innermost saved-tensor hooks run; a compiled model called inside the
    ``with`` block offloads the tensors its compiled graph saves.

References
    PyTorch CUDA semantics (streams, events, pinned memory, caching allocator);
    torch.autograd.graph.save_on_cpu; torchtune OffloadActivations (2024); Rhu et al., vDNN
    (2016); Ren et al., ZeRO-Offload (2021).
"""
from __future__ import annotations

import collections
import sys
import threading
import weakref

import torch

__all__ = ["OffloadActivations"]

_ALIGN = 512  # reload buffers keep every view's address modulo 512 (see the reference)


# ----------------------------------------------------------------------------- pure helpers

def _footprint(t: torch.Tensor) -> tuple[int, tuple[tuple[int, int], ...], int]:
    """The bytes ``t`` reads (``t.numel() > 0``), as ``(off, ((count, pitch), ...), run)``,
    outermost dim first: ``run`` contiguous bytes at ``off + sum_k i_k * pitch_k``.  Expanded
    (stride 0) and size-1 dims are dropped and a dim whose pitch is the extent of the dim inside
    it is merged into it, so views that read the same bytes (``k``, ``k.transpose(-1, -2)``)
    get the same footprint."""
    item = t.element_size()
    dims = sorted(((n, s * item) for n, s in zip(t.shape, t.stride()) if n > 1 and s != 0),
                  key=lambda d: d[1])  # strides are never negative
    run, merged = item, []  # merged: innermost first
    for n, pitch in dims:
        if not merged and pitch == run:
            run *= n
        elif merged and pitch == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0] * n, merged[-1][1])
        else:
            merged.append((n, pitch))
    return t.storage_offset() * item, tuple(reversed(merged)), run


def _span(fp) -> tuple[int, int]:
    """``[lo, hi)``: the bytes from the first to the last one a footprint reads."""
    off, dims, run = fp
    return off, off + sum((n - 1) * pitch for n, pitch in dims) + run


def _nbytes(fp) -> int:
    """How many bytes a footprint reads (counting overlaps twice)."""
    count = fp[2]
    for n, _ in fp[1]:
        count *= n
    return count


def _is_dense(fp) -> bool:
    """Reads at least half of its span: copying the span beats gathering its bytes."""
    lo, hi = _span(fp)
    return 2 * _nbytes(fp) >= hi - lo


def _missing_ranges(covered: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Parts of ``[lo, hi)`` not inside any range of ``covered`` (sorted, disjoint)."""
    gaps, cursor = [], lo
    for a, b in covered:
        if b <= cursor:
            continue
        if a >= hi:
            break
        if a > cursor:
            gaps.append((cursor, a))
        cursor = max(cursor, b)
        if cursor >= hi:
            break
    if cursor < hi:
        gaps.append((cursor, hi))
    return gaps


def _size_class(nbytes: int) -> int:
    """Pool bucket of a request: 512-byte steps up to 4 KiB, then 8 classes per power of two."""
    if nbytes <= 4096:
        return max(512, -(-nbytes // 512) * 512)
    step = 1 << (nbytes.bit_length() - 4)  # nbytes in [2^k, 2^(k+1)): step 2^(k-3)
    return -(-nbytes // step) * step


def _prefetch_plan(order: list, pos: int, depth: int) -> list:
    """Records to reload ahead of use: among the next ``depth`` live records before ``pos``
    in save order (``order`` holds weak references), those not reloaded, not still on the
    device (copy in flight) and not just unpacked (their last reload still in use)."""
    plan, seen, i = [], 0, pos - 1
    while i >= 0 and seen < depth:
        rec = order[i]()
        i -= 1
        if rec is None or rec.live == 0:
            continue
        seen += 1
        if rec.reloaded is None and rec.source is None and (rec.recent is None or rec.recent() is None):
            plan.append(rec)
    return plan


def _bytes_at(storage: torch.UntypedStorage, device: torch.device, fp, base: int = 0) -> torch.Tensor:
    """A uint8 tensor [count_0, ..., run] aliasing footprint ``fp``'s bytes in ``storage``, whose
    byte 0 is byte ``base`` of the original storage (no copy)."""
    off, dims, run = fp
    return torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, off - base, (*(n for n, _ in dims), run), (*(pitch for _, pitch in dims), 1))


def _host_view(host: torch.Tensor, fp) -> torch.Tensor:
    """The first bytes of a (pool, size-class) host buffer, shaped like ``_bytes_at(..., fp)``."""
    shape = (*(n for n, _ in fp[1]), fp[2])
    return host if host.shape == shape else host[:_nbytes(fp)].view(shape)


# ----------------------------------------------------------------------------- pinned pool, engine

class _HostPool:
    """Free host buffers by size class; thread-safe (records die on the autograd thread)."""

    def __init__(self, max_bytes: int | None, pin_memory: bool):
        self.max_bytes, self.pin_memory = max_bytes, pin_memory
        self.free: dict[int, list[torch.Tensor]] = {}
        self.free_bytes = self.allocations = self.reuses = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        size = _size_class(nbytes)
        with self.lock:
            bucket = self.free.get(size)
            if bucket:
                self.free_bytes -= size
                self.reuses += 1
                return bucket.pop()
            self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)

    def give(self, buf: torch.Tensor):
        size = buf.numel()
        with self.lock:
            if self.max_bytes is not None and self.free_bytes + size > self.max_bytes:
                return  # dropped: PyTorch's host allocator takes it back once its copies completed
            self.free.setdefault(size, []).append(buf)
            self.free_bytes += size


class _Engine:
    """One device's side stream, pinned pool and FIFO of device storages whose copy is in flight."""

    def __init__(self, device: torch.device, max_pool_bytes: int | None, backend):
        # backend: the torch.cuda module (Stream, current_stream, stream, ...); the CPU tests
        # pass a stand-in with those names to run this machinery without a GPU.
        self.device, self.backend = device, backend
        self.stream = backend.Stream(device)
        self.pool = _HostPool(max_pool_bytes, pin_memory=backend is torch.cuda)
        self.fifo: collections.deque = collections.deque()  # (event, stream, rec, alias, version, nbytes)
        self.inflight_bytes = 0
        self.graph_task = None  # the backward pass whose end callback is queued
        self.lock = threading.RLock()

    def release(self, limit: int | None):
        """Drop FIFO entries whose copy completed; while over ``limit`` bytes (None: drain all),
        make the entry's compute stream wait on its copy, then drop it too."""
        with self.lock:
            while self.fifo:
                event, compute, rec, alias, version, nbytes = self.fifo[0]
                if not event.query():
                    if limit is not None and self.inflight_bytes <= limit:
                        break
                    # The stream that allocated the storage is the one that reuses its memory once
                    # the alias is dropped: ordering it after the copy makes the reuse safe.
                    compute.wait_event(event)
                self.fifo.popleft()
                self.inflight_bytes -= nbytes
                if alias._version != version and rec.stale is None:
                    # modified in place while (or before) the copy read it: autograd would raise
                    rec.stale = (version, alias._version, alias.type(), list(alias.shape))
                rec.inflight -= 1
                if rec.inflight == 0:
                    rec.source = None

    def __del__(self):
        try:  # the FIFO's aliases must not be freed before their copies finished reading them
            self.release(None)
        except Exception:  # interpreter shutdown
            pass


# ----------------------------------------------------------------------------- records

class _Storage:
    """One offloaded device storage: its bytes on the host and, during backward, its reloaded copy."""

    __slots__ = ("device", "version", "ranges", "footprints", "lo", "hi", "live", "pending", "epoch", "reloaded",
                 "recent", "engine", "source", "inflight", "load_event", "load_stream", "stale", "order", "pos",
                 "__weakref__")

    def __init__(self, device: torch.device, version: int, engine: _Engine | None, order: list):
        self.device = device
        self.version = version          # version counter of the views when the bytes were copied
        self.ranges: list[tuple[int, int, torch.Tensor]] = []  # (lo, hi, host uint8 [>= hi - lo]), sorted
        self.footprints: dict[tuple, torch.Tensor] = {}        # sparse footprint -> gathered host bytes
        self.lo, self.hi = None, 0      # the bytes all of them span
        self.live = 0                   # saved views (handles) still held by autograd
        self.pending = 0                # live handles not yet unpacked in the current pass
        self.epoch = 0                  # backward pass counter for this storage
        self.reloaded: torch.UntypedStorage | None = None  # [end - base] bytes on the device
        self.recent: weakref.ref | None = None     # the last pass's reload, while its views live
        self.engine = engine            # side stream and pinned pool (None on CPU)
        self.source: torch.Tensor | None = None    # detached saved tensor while a copy is in flight
        self.inflight = 0               # FIFO entries of this storage
        self.load_event = None          # side-stream event after the reload copies
        self.load_stream = None         # the compute stream that allocated `reloaded`
        self.stale = None               # (saved, current, type, shape) once found modified in place
        self.order, self.pos = order, len(order)  # save order of this forward, for prefetch
        order.append(weakref.ref(self))

    def base(self) -> int:
        return self.lo // _ALIGN * _ALIGN

    def add(self, fp, host: torch.Tensor):
        """Bytes of footprint ``fp`` are on the host: a byte range (no dims) or a gathered footprint."""
        lo, hi = _span(fp)
        if fp[1]:
            self.footprints[fp] = host
        else:
            self.ranges.append((lo, hi, host))
            self.ranges.sort(key=lambda r: r[0])
        self.lo, self.hi = lo if self.lo is None else min(self.lo, lo), max(self.hi, hi)
        self.drop_reload()  # a reload made before these bytes were added lacks them
        self.recent = None

    def drop_reload(self):
        if self.load_event is not None:
            # A prefetched buffer may be dropped unused: the stream that reuses its memory must
            # first be ordered after the side-stream copy still writing into it.
            self.load_stream.wait_event(self.load_event)
            self.load_event = self.load_stream = None
        if self.reloaded is not None:
            self.recent = weakref.ref(self.reloaded)
        self.reloaded = None

    def pass_done(self):
        """Every live saved view was unpacked in this pass: drop the reload, start a new pass."""
        self.drop_reload()
        self.epoch += 1
        self.pending = self.live

    def __del__(self):
        if self.engine is not None:
            try:
                self.drop_reload()
            except Exception:  # interpreter shutdown
                pass
            for host in [*(host for _, _, host in self.ranges), *self.footprints.values()]:
                self.engine.pool.give(host)


class _Kept:
    """A saved tensor left in place (detached: no reference cycle through its grad_fn)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor = t.detach()  # shares storage and version counter with t
        self.version = t._version


class _Offloaded:
    """A saved tensor that lives on the host as (storage record, dtype, size, stride, offset)."""

    __slots__ = ("rec", "dtype", "size", "stride", "offset", "version", "witnesses", "epoch")

    def __init__(self, rec: _Storage, t: torch.Tensor, offset: int):
        self.rec = rec
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.shape, t.stride(), offset
        self.version = t._version
        # Weak references to the saved tensor and its base: their version counter (shared by a
        # base and its views) tells, while one is alive, whether it was modified in place.
        self.witnesses = (weakref.ref(t),) if t._base is None else (weakref.ref(t), weakref.ref(t._base))
        self.epoch = -1  # the rec.epoch in which this handle was last unpacked
        rec.live += 1
        rec.pending += 1

    def __del__(self):
        rec = self.rec
        rec.live -= 1
        if self.epoch != rec.epoch:
            rec.pending -= 1
            if rec.pending <= 0 and rec.live > 0:
                rec.pass_done()


def _version_error(saved: int, current: int, type_name: str, shape: list, which: str = "") -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{type_name} {shape}]{which} is at version {current}; expected version {saved} "
        "instead. Hint: the tensor was saved under OffloadActivations, which checks versions itself "
        "because autograd cannot check them through saved-tensor hooks; enable anomaly detection to "
        "find the operation, with torch.autograd.set_detect_anomaly(True).")


def _check_version(saved: int, witnesses) -> None:
    """Raise autograd's error if a live witness (tensor or None) was modified in place after the save."""
    for w in witnesses:
        if w is None or w._version == saved:
            continue
        which = f", which is output {w.output_nr} of {w.grad_fn.name()}," if w.grad_fn is not None else ""
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{w.type()} {list(w.shape)}]{which} is at version {w._version}; expected "
            f"version {saved} instead. Hint: the tensor was saved under OffloadActivations, which "
            "checks versions itself because autograd cannot check them through saved-tensor hooks; "
            "enable anomaly detection to find the operation, with torch.autograd.set_detect_anomaly(True).")


# ----------------------------------------------------------------------------- the context manager

class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Offload saved activations to host memory, one copy per storage, views replayed in backward.

    ``min_offload_bytes``: saved tensors whose storage is smaller stay on the device.
    ``module``: its parameters and buffers stay where they are (matched by storage).
    ``prefetch``: storages reloaded ahead of use in backward.  ``max_inflight_bytes``: device
    bytes whose host copy may be in flight before the compute stream waits.  ``max_pool_bytes``:
    pinned bytes the free pool keeps.  Create it once and enter it every step: the side
    stream and the pinned pool live with this object.
    """

    def __init__(self, *, min_offload_bytes: int = 1 << 20, module: torch.nn.Module | None = None,
                 prefetch: int = 2, max_inflight_bytes: int = 1 << 29, max_pool_bytes: int | None = None):
        for name, value, allow_none in (("min_offload_bytes", min_offload_bytes, False),
                                        ("prefetch", prefetch, False),
                                        ("max_inflight_bytes", max_inflight_bytes, False),
                                        ("max_pool_bytes", max_pool_bytes, True)):
            if value is None and allow_none:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, "
                                f"got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module or None, got {type(module).__name__}")
        self.min_offload_bytes, self.module = min_offload_bytes, module
        self.prefetch, self.max_inflight_bytes, self.max_pool_bytes = prefetch, max_inflight_bytes, max_pool_bytes
        self.stats = dict(packed=0, kept=0, offloaded_storages=0, offloaded_bytes=0, replayed_views=0,
                          reloaded_storages=0, reloaded_bytes=0, prefetched_storages=0,
                          pinned_allocations=0, pinned_reuses=0)
        # id(storage object) -> (weakref to the storage, weakref to its record).  The storage
        # weakref, compared with `is`, makes a recycled id harmless; records belong to the saved
        # views that autograd holds.  Dead entries are swept when the dict grows.
        self._records: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._sweep_at = 1024
        self._module_storages: dict[int, weakref.ref] = {}
        self._engines: dict[torch.device, _Engine] = {}
        self._order: list = []  # weak references to this forward's records, in save order
        # Tensors on this device type take the asynchronous path through self._backend; the CPU
        # tests set ("cpu", a stand-in for torch.cuda) to run that path without a GPU.
        self._async_device_type, self._backend = "cuda", torch.cuda
        super().__init__(self._pack, self._unpack)
        self._shield_from_dynamo()

    def _shield_from_dynamo(self):
        """Hooks called from code torch.compile evaluates must run as plain Python, not be traced
        into a graph.  Wrapped only once torch._dynamo is loaded (then the wrapper costs ~2 us a
        call and no import), here and again at each entry."""
        if "torch._dynamo" in sys.modules and self.pack_hook == self._pack:
            self.pack_hook = torch.compiler.disable(self._pack)
            self.unpack_hook = torch.compiler.disable(self._unpack)

    def __enter__(self):
        self._module_storages = {}
        if self.module is not None:
            for t in [*self.module.parameters(), *self.module.buffers()]:
                s = t.untyped_storage()
                self._module_storages[id(s)] = weakref.ref(s)
        self._shield_from_dynamo()
        self._order = []  # prefetch never crosses into another forward's records
        return super().__enter__()

    def __exit__(self, *exc):
        for eng in self._engines.values():
            eng.release(self.max_inflight_bytes)  # completed copies only: no waiting here
        return super().__exit__(*exc)

    # --------------------------------------------------------------------- forward

    def _keep(self, t: torch.Tensor) -> bool:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return True  # subclasses (DTensor, FakeTensor, ...) and sparse/nested layouts
        if not (t.is_cuda or t.is_cpu) or t.numel() == 0 or t.is_conj() or t.is_neg():
            return True
        base = t if t._base is None else t._base
        # Parameters (frozen ones too), leaf inputs and flagged buffers are leaves; activations
        # mostly are not, so they skip the slower checks.
        if base.is_leaf and (base.requires_grad or isinstance(base, torch.nn.Parameter)
                             or getattr(base, "_is_buffer", False)):
            return True
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # functorch wrappers and other storage-less tensors
            return True
        ref = self._module_storages.get(id(storage))
        if ref is not None and ref() is storage:
            return True
        return storage.nbytes() < self.min_offload_bytes

    def _engine(self, device: torch.device) -> _Engine:
        eng = self._engines.get(device)
        if eng is None:
            eng = self._engines[device] = _Engine(device, self.max_pool_bytes, self._backend)
        return eng

    def _record_for(self, storage: torch.UntypedStorage, t: torch.Tensor) -> _Storage:
        """The record of ``storage``; a new one if none, or if ``t`` was modified in place since."""
        entry = self._records.get(id(storage))
        if entry is not None and entry[0]() is storage:
            rec = entry[1]()
            if rec is not None and rec.version == t._version:
                return rec
        async_copy = t.device.type == self._async_device_type
        rec = _Storage(t.device, t._version, self._engine(t.device) if async_copy else None, self._order)
        self._records[id(storage)] = (weakref.ref(storage), weakref.ref(rec))
        self.stats["offloaded_storages"] += 1
        if len(self._records) > self._sweep_at:
            self._records = {k: v for k, v in self._records.items() if v[0]() is not None and v[1]() is not None}
            self._sweep_at = 2 * len(self._records) + 1024
        return rec

    def _pack(self, t: torch.Tensor):
        self.stats["packed"] += 1
        if self._keep(t):
            self.stats["kept"] += 1
            return _Kept(t)
        storage = t.untyped_storage()
        rec = self._record_for(storage, t)
        fp = _footprint(t)
        lo, hi = _span(fp)
        gaps = [] if fp in rec.footprints else _missing_ranges([(a, b) for a, b, _ in rec.ranges], lo, hi)
        if not gaps:
            self.stats["replayed_views"] += 1
            return _Offloaded(rec, t, fp[0])
        # dense: the missing byte ranges of its span; sparse: its own bytes, gathered
        pieces = [(a, (), b - a) for a, b in gaps] if _is_dense(fp) else [fp]
        if rec.engine is not None:
            self._copy_out_async(rec, t, storage, pieces)
        else:  # the reference's synchronous path: a separate host copy
            for piece in pieces:
                host = _bytes_at(storage, t.device, piece).clone(memory_format=torch.contiguous_format)
                rec.add(piece, host)
                self.stats["offloaded_bytes"] += host.numel()
        return _Offloaded(rec, t, fp[0])

    def _copy_out_async(self, rec: _Storage, t: torch.Tensor, storage: torch.UntypedStorage, pieces):
        eng = rec.engine
        if eng.backend.is_current_stream_capturing():
            raise RuntimeError("OffloadActivations does not support CUDA graph capture: copies to host "
                               "memory and their events cannot be captured")
        with eng.lock:
            before = eng.pool.allocations, eng.pool.reuses
            compute = eng.backend.current_stream(t.device)
            eng.stream.wait_stream(compute)  # t's bytes are written
            nbytes = 0
            with eng.backend.stream(eng.stream):
                for piece in pieces:
                    src = _bytes_at(storage, t.device, piece)
                    host = eng.pool.take(src.numel())
                    # a gathered footprint is first made contiguous on the side stream, which alone
                    # uses (and frees) that temporary
                    _host_view(host, piece).copy_(src, non_blocking=True)
                    rec.add(piece, host)
                    nbytes += src.numel()
                event = eng.stream.record_event()
            # The alias keeps the device storage alive until the copy completed; it shares t's
            # version counter, so the release can tell whether t was modified meanwhile.
            alias = t.detach()
            eng.fifo.append((event, compute, rec, alias, t._version, nbytes))
            eng.inflight_bytes += nbytes
            rec.inflight += 1
            if rec.source is None:
                rec.source = alias
            self.stats["offloaded_bytes"] += nbytes
            self.stats["pinned_allocations"] += eng.pool.allocations - before[0]
            self.stats["pinned_reuses"] += eng.pool.reuses - before[1]
        eng.release(self.max_inflight_bytes)

    # --------------------------------------------------------------------- backward

    def _reload(self, rec: _Storage) -> torch.UntypedStorage:
        """Host bytes -> one device buffer covering them, each at its offset from rec.base()."""
        base = rec.base()
        storage = torch.empty(rec.hi - base, dtype=torch.uint8, device=rec.device).untyped_storage()
        pieces = [*(((lo, (), hi - lo), host) for lo, hi, host in rec.ranges), *rec.footprints.items()]
        if rec.engine is not None:
            # Allocated on the compute stream, which uses and frees it; the side stream writes it
            # after the compute work issued so far (the memory's previous owner) and the compute
            # stream waits on the load event before first use.
            compute = rec.engine.backend.current_stream(rec.device)
            rec.engine.stream.wait_stream(compute)
            with rec.engine.backend.stream(rec.engine.stream):
                for fp, host in pieces:  # a gathered footprint goes through a side-stream temporary
                    _bytes_at(storage, rec.device, fp, base).copy_(_host_view(host, fp), non_blocking=True)
                rec.load_event, rec.load_stream = rec.engine.stream.record_event(), compute
        else:
            for fp, host in pieces:
                _bytes_at(storage, rec.device, fp, base).copy_(_host_view(host, fp))
        self.stats["reloaded_storages"] += 1
        self.stats["reloaded_bytes"] += sum(_nbytes(fp) for fp, _ in pieces)
        return storage

    def _device_storage(self, rec: _Storage) -> tuple[torch.UntypedStorage, int]:
        """(device storage holding rec's bytes, byte offset of its byte 0 in the original storage)."""
        held = rec.source
        if held is not None:  # copy still in flight: the original storage is right here
            if held._version != rec.version:  # and it changed since the save: autograd would raise
                raise _version_error(rec.version, held._version, held.type(), list(held.shape))
            return held.untyped_storage(), 0
        if rec.reloaded is None:
            # A node reading ctx.saved_tensors twice finds the last reload still alive: reuse it
            # (its load event was waited on when it was dropped).
            recent = rec.recent() if rec.recent is not None else None
            rec.reloaded = self._reload(rec) if recent is None else recent
        if rec.load_event is not None:
            rec.engine.backend.current_stream(rec.device).wait_event(rec.load_event)
        return rec.reloaded, rec.base()

    def _end_of_backward(self, eng: _Engine):
        eng.graph_task = None
        eng.release(None)

    def _unpack(self, h) -> torch.Tensor:
        if isinstance(h, _Kept):
            _check_version(h.version, (h.tensor,))
            return h.tensor
        rec = h.rec
        _check_version(h.version, [ref() for ref in h.witnesses])
        eng = rec.engine
        if eng is not None:
            task = torch._C._current_graph_task_id()
            if task != eng.graph_task and task != -1:
                eng.graph_task = task
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._end_of_backward(eng))
            eng.release(self.max_inflight_bytes)
        if rec.stale is not None:
            saved, current, type_name, shape = rec.stale
            raise _version_error(saved, current, type_name, shape)
        storage, base = self._device_storage(rec)
        out = torch.empty(0, dtype=h.dtype, device=rec.device)
        out.set_(storage, (h.offset - base) // h.dtype.itemsize, h.size, h.stride)
        if eng is not None and self.prefetch:
            for ahead in _prefetch_plan(rec.order, rec.pos, self.prefetch):
                ahead.reloaded = self._reload(ahead)
                self.stats["prefetched_storages"] += 1
        if h.epoch != rec.epoch:  # first unpack of this saved view in this pass
            h.epoch = rec.epoch
            rec.pending -= 1
            if rec.pending <= 0:
                rec.pass_done()
        return out
