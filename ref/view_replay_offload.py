"""View-replay activation offloading: the reference (readable PyTorch, the specification).

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
    ``OffloadActivations`` is a context manager over ``torch.autograd.graph.saved_tensors_hooks``.
    Under it, every tensor autograd saves for backward (an "activation") is copied to host
    memory in the forward pass and copied back when backward needs it, so the device memory
    it occupied is freed as soon as the forward code drops its own references::

        offload = OffloadActivations(min_offload_bytes=1 << 20)
        with offload:
            loss = model(x)
        loss.backward()                      # outside the context: see "checkpoint" below

    Gradients are bitwise identical to running without it: backward reads the same bytes,
    through tensors of the same dtype, size and stride.

The idea: offload storages, replay views
    A saved tensor is very often a view (transpose, reshape, permute, narrow, select,
    expand, split) of another tensor.  ``torch.autograd.graph.save_on_cpu`` copies each saved
    tensor separately: a base and its three views are copied four times, an ``expand`` is
    materialized at full size.  Here the unit of offloading is the *storage*:

        pack(t):   storage S = t.untyped_storage(), identified by a weak reference to S
                   footprint(t): the bytes t reads, as off + sum_k i_k * pitch_k + [0, run)
                   (expanded and size-1 dims dropped, dims that tile merged), its span
                   [off, off + sum_k (count_k - 1) * pitch_k + run)
                   dense t (reads >= half its span): copy the bytes of the span not yet on
                   the host for S (none for a second view of an offloaded base; the base's
                   bytes only for an expand)
                   sparse t (v of an interleaved qkv): copy just its bytes, gathered, unless
                   the same footprint or the whole span is already on the host
                   keep (dtype, size, stride, storage offset) of t
        unpack(t): copy S's host bytes back once per backward pass into one device buffer
                   (ranges copied, gathered footprints scattered back to their places) and
                   rebuild t on it with exactly its dtype, size and stride (``Tensor.set_``)

    Storage identity is a weak reference to the storage object (PyTorch keeps one Python
    object per live storage), compared with ``is``: a data pointer would be wrong because
    the caching allocator hands the same address to the next tensor as soon as this one
    dies.  A dense view costs at most its span, a sparse one exactly its bytes, and a second
    view of bytes already on the host nothing: ``offloaded_bytes`` stays within the distinct
    storages' total unless sparse footprints of one storage overlap each other or a later
    dense span (each is copied whole).

Tensors and objects (per saved tensor t)
    t                       any dtype, any strides, on "cuda" (host copy in plain pageable
                            memory here; pinned, asynchronous in fast/) or "cpu" (a separate
                            host copy, so every code path runs without a GPU)
    host ranges             uint8 [hi - lo] per copied byte range of a storage
    host footprints         uint8 [count_0, ..., run] per gathered sparse footprint
    reloaded buffer         uint8 [hi - lo] on t's device covering everything copied of the
                            storage, lo rounded down to 512 bytes so that every replayed
                            view keeps its address alignment modulo 512
    replayed view           t's dtype, size and stride; storage offset relative to that buffer
    stats                   dict of ints, counted over the life of the object:
        packed              saved tensors seen by the pack hook
        kept                saved tensors left where they are (see below)
        offloaded_storages  distinct storages copied to host (a storage modified in place
                            after a save and saved again counts again)
        offloaded_bytes     bytes copied device -> host
        replayed_views      offloaded saved tensors that needed no new copy (their bytes
                            were already on the host through another view of the storage)
        reloaded_storages   storages copied host -> device in backward (once per pass)
        reloaded_bytes      bytes copied host -> device

Supported, and what raises
    Kept in place (``stats["kept"]``): parameters and views of them; leaf tensors that
    require grad (leaf inputs) and views of them; tensors flagged as buffers
    (``torch.nn.Buffer``); every parameter and buffer of ``module`` when one is given
    (plain ``register_buffer`` tensors carry no flag, so pass the model to keep them);
    tensors whose storage is smaller than ``min_offload_bytes`` (tested on the storage, not
    the view: keeping a small view of a large storage would pin the large storage on the
    device); empty tensors; tensor subclasses, non-strided layouts, conj/neg-bit views and
    devices other than cpu/cuda.
    In-place change after save: autograd's own check is skipped when saved-tensor hooks
    are active, so unpack repeats it: if the saved tensor (or its base) is still alive and
    its version counter moved since the save, unpack raises the same RuntimeError autograd
    raises ("one of the variables needed for gradient computation has been modified by an
    inplace operation ... is at version 2; expected version 1 instead").  When neither the
    saved tensor nor its base is alive any more, nothing is left to tell; the host copy holds
    the bytes of the moment of the save.
    ``retain_graph=True`` and repeated backward passes work: the host copy lives as long as
    autograd holds a saved tensor of it; the reloaded device buffer is dropped once every
    live saved view of the storage was unpacked in the pass.  Nothing outlives the graph.
    ``min_offload_bytes`` must be an int >= 0, ``module`` an ``nn.Module`` or None
    (TypeError / ValueError naming the argument otherwise).

    torch.utils.checkpoint: only the innermost saved-tensor hooks are active.  Non-reentrant
    checkpoint (``use_reentrant=False``) installs its own hooks inside the checkpointed
    region, so tensors saved there never reach this class (checkpoint stores nothing and
    recomputes them in backward, under its own hooks, so the recomputed ones stay on the
    device); the region's inputs are saved outside those hooks and are offloaded here.
    Reentrant checkpoint saves the region's inputs with ``save_for_backward`` (offloaded
    here) and recomputes the region during backward under whatever hooks are active then:
    call ``backward()`` outside the ``with`` block, or the recomputed activations are
    offloaded and immediately reloaded.  To exempt a region from offloading, nest
    ``saved_tensors_hooks(lambda t: t, lambda t: t)`` inside it (innermost wins).

    torch.compile: dynamo and AOTAutograd disable saved-tensor hooks while they trace and
    inline only hooks that are themselves fx GraphModules, which these Python hooks are
    not.  A compiled model called inside the ``with`` block runs its compiled forward as one
    autograd Function whose ``save_for_backward`` goes through these hooks at run time: the
    tensors the partitioner chose to save are offloaded like any others (fresh buffers,
    rarely views); no recompilation, no graph break.  Entering the context manager inside a
    function being compiled works, but dynamo cannot trace the hook push and breaks the
    graph there; once torch._dynamo is loaded the hooks are wrapped in
    ``torch.compiler.disable`` so that frames dynamo evaluates run them as Python instead of
    tracing them.  Enter it outside compiled code to keep the model in one graph.

References
    PyTorch saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu);
    torchtune OffloadActivations (2024); Rhu et al., vDNN: virtualized deep neural
    networks (2016); Ren et al., ZeRO-Offload (2021).
"""
from __future__ import annotations

import sys
import weakref

import torch

__all__ = ["OffloadActivations"]

# Reloaded buffers start at the storage's byte 0 rounded down to this, so a replayed view has
# the same address modulo 512 as the original (the CUDA caching allocator's block alignment):
# kernels that pick a code path by alignment pick the same one, and gradients stay bitwise equal.
_ALIGN = 512


# ----------------------------------------------------------------------------- byte footprints

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


def _bytes_at(storage: torch.UntypedStorage, device: torch.device, fp, base: int = 0) -> torch.Tensor:
    """A uint8 tensor [count_0, ..., run] aliasing footprint ``fp``'s bytes in ``storage``, whose
    byte 0 is byte ``base`` of the original storage (no copy)."""
    off, dims, run = fp
    return torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, off - base, (*(n for n, _ in dims), run), (*(pitch for _, pitch in dims), 1))


# ----------------------------------------------------------------------------- records

class _Storage:
    """One offloaded device storage: its bytes on the host and, during backward, its reloaded copy."""

    __slots__ = ("device", "version", "ranges", "footprints", "lo", "hi", "live", "pending", "epoch",
                 "reloaded", "recent", "__weakref__")

    def __init__(self, device: torch.device, version: int):
        self.device = device
        self.version = version          # version counter of the views when the bytes were copied
        self.ranges: list[tuple[int, int, torch.Tensor]] = []  # (lo, hi, host uint8 [hi - lo]), sorted
        self.footprints: dict[tuple, torch.Tensor] = {}        # sparse footprint -> gathered host bytes
        self.lo, self.hi = None, 0      # the bytes all of them span
        self.live = 0                   # saved views (handles) still held by autograd
        self.pending = 0                # live handles not yet unpacked in the current pass
        self.epoch = 0                  # backward pass counter for this storage
        self.reloaded: torch.UntypedStorage | None = None  # [end - base] bytes on the device
        # The last pass's reload, weakly: while views replayed on it are alive (a node that reads
        # ctx.saved_tensors twice), unpacking again reuses it instead of copying again.
        self.recent: weakref.ref | None = None

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
        self.reloaded = self.recent = None  # a reload made before these bytes were added lacks them

    def pass_done(self):
        """Every live saved view was unpacked in this pass: drop the reload, start a new pass."""
        if self.reloaded is not None:
            self.recent = weakref.ref(self.reloaded)
        self.reloaded = None
        self.epoch += 1
        self.pending = self.live


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
        # Weak references to the saved tensor and its base: while one is alive, its version
        # counter (shared by a base and all its views) tells whether it was modified in place.
        self.witnesses = (weakref.ref(t),) if t._base is None else (weakref.ref(t), weakref.ref(t._base))
        self.epoch = -1  # the rec.epoch in which this handle was last unpacked
        rec.live += 1
        rec.pending += 1

    def __del__(self):
        # autograd frees the saved tensor: it no longer counts towards the pass.
        rec = self.rec
        rec.live -= 1
        if self.epoch != rec.epoch:
            rec.pending -= 1
            if rec.pending <= 0 and rec.live > 0:
                rec.pass_done()


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
    ``stats``: see the module docstring.  One object can be entered many times (one forward
    each); its stats accumulate.
    """

    def __init__(self, *, min_offload_bytes: int = 1 << 20, module: torch.nn.Module | None = None):
        if isinstance(min_offload_bytes, bool) or not isinstance(min_offload_bytes, int):
            raise TypeError(f"min_offload_bytes must be an int, got {type(min_offload_bytes).__name__}")
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0, got {min_offload_bytes}")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module or None, got {type(module).__name__}")
        self.min_offload_bytes = min_offload_bytes
        self.module = module
        self.stats = dict(packed=0, kept=0, offloaded_storages=0, offloaded_bytes=0, replayed_views=0,
                          reloaded_storages=0, reloaded_bytes=0)
        # id(storage object) -> (weakref to the storage, weakref to its record).  The storage
        # weakref, compared with `is`, makes a recycled id harmless; records belong to the saved
        # views that autograd holds.  Dead entries are swept when the dict grows.
        self._records: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._sweep_at = 1024
        self._module_storages: dict[int, weakref.ref] = {}
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
        return super().__enter__()

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

    def _record_for(self, storage: torch.UntypedStorage, t: torch.Tensor) -> _Storage:
        """The record of ``storage``; a new one if none, or if ``t`` was modified in place since."""
        entry = self._records.get(id(storage))
        if entry is not None and entry[0]() is storage:
            rec = entry[1]()
            if rec is not None and rec.version == t._version:
                return rec
        rec = _Storage(t.device, t._version)
        self._records[id(storage)] = (weakref.ref(storage), weakref.ref(rec))
        self.stats["offloaded_storages"] += 1
        if len(self._records) > self._sweep_at:
            self._records = {k: v for k, v in self._records.items() if v[0]() is not None and v[1]() is not None}
            self._sweep_at = 2 * len(self._records) + 1024
        return rec

    def _copy_out(self, src: torch.Tensor) -> torch.Tensor:
        """Device bytes -> a new contiguous host tensor (a separate copy for CPU tensors)."""
        return src.to("cpu", memory_format=torch.contiguous_format, copy=True)

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
        elif _is_dense(fp):
            for a, b in gaps:
                rec.add((a, (), b - a), self._copy_out(_bytes_at(storage, t.device, (a, (), b - a))))
                self.stats["offloaded_bytes"] += b - a
        else:
            host = self._copy_out(_bytes_at(storage, t.device, fp))
            rec.add(fp, host)
            self.stats["offloaded_bytes"] += host.numel()
        return _Offloaded(rec, t, fp[0])

    # --------------------------------------------------------------------- backward

    def _reload(self, rec: _Storage) -> torch.UntypedStorage:
        """Host bytes -> one device buffer covering them, each at its offset from rec.base()."""
        base = rec.base()
        storage = torch.empty(rec.hi - base, dtype=torch.uint8, device=rec.device).untyped_storage()
        pieces = [*(((lo, (), hi - lo), host) for lo, hi, host in rec.ranges), *rec.footprints.items()]
        for fp, host in pieces:  # a range is copied, a gathered footprint scattered back to its places
            _bytes_at(storage, rec.device, fp, base).copy_(host)
        self.stats["reloaded_storages"] += 1
        self.stats["reloaded_bytes"] += sum(_nbytes(fp) for fp, _ in pieces)
        return storage

    def _unpack(self, h) -> torch.Tensor:
        if isinstance(h, _Kept):
            _check_version(h.version, (h.tensor,))
            return h.tensor
        _check_version(h.version, [ref() for ref in h.witnesses])
        rec = h.rec
        if rec.reloaded is None:
            recent = rec.recent() if rec.recent is not None else None
            rec.reloaded = self._reload(rec) if recent is None else recent
        out = torch.empty(0, dtype=h.dtype, device=rec.device)
        out.set_(rec.reloaded, (h.offset - rec.base()) // h.dtype.itemsize, h.size, h.stride)
        if h.epoch != rec.epoch:  # first unpack of this saved view in this pass
            h.epoch = rec.epoch
            rec.pending -= 1
            if rec.pending <= 0:
                rec.pass_done()
        return out
