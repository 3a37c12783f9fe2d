"""The kernel observatory's instrument: memory traffic, tensor-core FLOPs and a bounds sanitizer for
Triton kernels run by the interpreter (``TRITON_INTERPRET=1``, CPU tensors).

What it measures, per kernel launch
    issued bytes   bytes loaded and stored by active (unmasked) lanes, one count per lane and
                   access: no cache anywhere, so an upper bound on a GPU's DRAM traffic.
    unique bytes   distinct bytes read plus distinct bytes written: every byte crosses the DRAM
                   bus once, as with an infinite L2, so a lower bound.
    dot FLOPs      2 M N K for every ``tl.dot`` executed, masked rows and columns included (a
                   tensor core multiplies the padding too).
    per program    the issued bytes of each program, by its linear id x + nx (y + ny z) (the
                   interpreter runs the programs one after another, so each access is the current
                   program's), for the latency model below.
    the launch     kernel, grid, and its exact specialization as the JIT would see it on a GPU
                   (constexprs, int arguments divisible by 16 or equal to 1, dtypes, warps,
                   stages), so parity/aot_compile.py can build that very launch for sm_90.
    An atomic counts as a read and a write of its lanes.
    torch ops (``observe(torch_ops=True)``): the PyTorch work between the kernels (a dtype cast, a
    sum over heads, a zero fill), which a GPU runs as kernels of its own, as pseudo-launches named
    ``torch.<op>``: each reads its tensor inputs and writes its outputs once (issued = unique).
    Views, allocations and the interpreter's own host copies cost nothing.

The latency model (``LatencyModel``, ``H100``): a model, never a measurement
    Bytes are not latency: four programs streaming 2 MB leave 128 SMs idle, a launch of 112 programs
    re-reading a prompt that fits in L2 many times over may not.  Each kernel launch gets

        modeled_us = launch_us + max(busiest_sm_bytes / (hbm / sms),
                                     unique_bytes / hbm + reread_bytes / l2)

    - busiest_sm_bytes: the programs are dealt out in launch order (linear id) to whichever SM has
      the fewest bytes so far, as the block scheduler hands a free SM the next program; for a launch
      of at most ``sms`` programs this is the busiest program's issued bytes.  An SM is credited
      with its 1 / sms share of HBM bandwidth: the rate at which all SMs together saturate HBM.
    - unique_bytes / hbm + reread_bytes / l2: the memory system's time for the whole launch, the
      distinct bytes from HBM and the rest of the issued bytes (reread = issued - unique) from L2;
      when the unique bytes exceed the L2 (50 MB) the rereads are charged at HBM bandwidth too.
    - max, not sum: the two are bounds on the same transfer seen from two sides (one SM's share of
      the bandwidth, the memory system's total), which overlap in time; their sum would count the
      busiest program's bytes twice.  A launch that fills every SM evenly is priced by the memory
      system; one that leaves SMs idle, by its busiest SM.
    - launch_us: a fixed cost per kernel launch (the gap between dependent launches in one stream).
    An op's modeled time is the sum over its kernel launches (they run one after another).  The
    PyTorch ops between kernels are priced apart (``torch_op_us``: launch_us + bytes / hbm each):
    most are host-side input checks that a CUDA-graph replay would not run.
    The constants, H100 SXM5 (``H100``): 132 SMs and 3.35 TB/s of HBM3 from NVIDIA's H100 data sheet;
    50 MB of L2 (the data sheet / Hopper whitepaper); L2 bandwidth 5.5 TB/s and a launch cost of
    2 us are assumptions, not data-sheet figures (NVIDIA publishes no L2 bandwidth): 5.5 TB/s is the
    low end of the 5.5-7 TB/s range quoted from microbenchmarks of H100's L2 (for instance Chips and
    Cheese, "Nvidia's H100: Funny L2, and Tons of Bandwidth", 2023, on the 114-SM PCIe card), 2 us a
    typical gap between back-to-back kernels in one stream.  What the model leaves out: compute (these kernels
    are memory-bound), latency of the first bytes, occupancy limits on bytes in flight, an SM
    drawing more than its share when others idle, and the partials' L2 residency (bytes written,
    then read back, count as unique).

The sanitizer
    Every active lane's bytes must lie inside the storage of a tensor argument of the launch
    (any view of it: the storage, not the view, is what a GPU could legally touch).  Anything
    else raises ``OutOfBounds`` before the access happens, naming the kernel, the nearest
    argument, the offset from its storage and the program id.  Index arithmetic that overflows
    int32 shows up here: the interpreter computes indices in numpy int32 where Triton does, so a
    wrapped offset points outside every argument.

How: it wraps, at run time and reversibly, the interpreter's launch (``InterpretedFunction.run``)
and its builder's masked load / store, atomic and dot entry points (triton 3.9's
``triton/runtime/interpreter.py``); loads, stores and tensor-descriptor accesses all pass through
them.  Use::

    with observe() as obs:          # full: counts, unique bytes, specialization, bounds check
        run_something()
    obs.launches                    # [Launch, ...]
    with observe(unique=False):     # cheap: bounds check and issued counts only (CI's sanitizer)
        ...
    with observe(programs=both_ends(4)):   # run only the programs within 4 of either end of
        ...                                # each grid axis (tests over huge, sparse tensors);
                                           # any programs(kernel, pid, grid) -> bool will do
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import heapq
import inspect
import threading
from typing import Optional
from collections.abc import Callable

import numpy as np
import torch
import torch.utils._python_dispatch
import triton  # noqa: F401  (the interpreter patches triton.language in the globals it finds here)
import triton.language as tl
from triton.runtime import interpreter as _interp

__all__ = ["H100", "LatencyModel", "Launch", "OutOfBounds", "observe", "both_ends", "active"]


class OutOfBounds(AssertionError):
    """An active lane addressed memory outside every tensor argument of its launch."""


@dataclasses.dataclass
class Launch:
    kernel: str                     # the @triton.jit function's name
    module: str                     # its module and source file (the static side imports it)
    file: str
    grid: tuple = ()
    programs_run: int = 0           # fewer than prod(grid) under a program filter
    num_warps: int = 4
    num_stages: int = 3
    signature: dict = dataclasses.field(default_factory=dict)    # runtime args, aot_compile's format
    constexprs: dict = dataclasses.field(default_factory=dict)
    read_bytes: int = 0             # issued by active lanes
    write_bytes: int = 0
    unique_read_bytes: Optional[int] = None      # None in the cheap (sanitizer-only) mode
    unique_write_bytes: Optional[int] = None
    dot_flops: int = 0
    atomics: int = 0                # active atomic lanes
    args: dict = dataclasses.field(default_factory=dict)         # tensor arg name -> (dtype, storage bytes)
    program_bytes: dict = dataclasses.field(default_factory=dict)   # linear program id -> issued bytes

    @property
    def issued_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    @property
    def unique_bytes(self) -> Optional[int]:
        if self.unique_read_bytes is None:
            return None
        return self.unique_read_bytes + self.unique_write_bytes

    def spec(self) -> dict:
        """What parity/aot_compile.py's ``build_launch`` needs to build this launch (JSON-able)."""
        return dict(kernel=self.kernel, module=self.module, file=self.file, signature=self.signature,
                    constexprs={k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
                                for k, v in self.constexprs.items()},
                    num_warps=self.num_warps, num_stages=self.num_stages, programs=int(np.prod(self.grid or (0,))))


def both_ends(k: int, axes: tuple = (0, 1, 2), kernels: Optional[tuple] = None) -> Callable[[str, tuple, tuple], bool]:
    """A program filter: run program (x, y, z) only if its coordinate on each of ``axes`` is within
    ``k`` of either end of that grid axis (an axis of at most 2k programs runs whole).  With
    ``kernels``, only those kernels are filtered; the others run whole."""
    def keep(kernel, pid, grid):
        if kernels is not None and kernel not in kernels:
            return True
        return all(pid[a] < k or pid[a] >= grid[a] - k for a in axes)
    return keep


# ----------------------------------------------------------------------------- the latency model

@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """A stated latency model of a kernel launch from its counted bytes (module docstring: the
    formula, the constants and their sources).  A model, never a measurement."""
    name: str
    sms: int                    # streaming multiprocessors
    hbm_bytes_per_s: float      # DRAM bandwidth
    l2_bytes_per_s: float       # L2 bandwidth (an assumption: see the module docstring)
    l2_bytes: float             # L2 capacity: rereads beyond it come from HBM
    launch_us: float            # fixed cost per launch (an assumption)

    def busiest_sm_bytes(self, program_bytes: dict, programs: int) -> int:
        """The bytes of the busiest SM when ``programs`` programs (linear ids 0 .. programs - 1, bytes
        ``program_bytes[id]``, 0 where absent) are dealt out in order, each to the SM with the fewest
        bytes so far (the lowest-numbered on a tie)."""
        if programs <= self.sms:
            return max(program_bytes.values(), default=0)
        loads = [(0, sm) for sm in range(self.sms)]
        for pid in range(programs):
            load, sm = heapq.heappop(loads)
            heapq.heappush(loads, (load + program_bytes.get(pid, 0), sm))
        return max(load for load, _ in loads)

    def launch(self, record: Launch) -> dict:
        """The modeled time of one kernel launch, in microseconds, with its terms:
        ``us = fixed_us + max(sm_us, memory_us)``."""
        if record.unique_bytes is None:
            raise ValueError(f"{record.kernel}: the latency model needs unique bytes (observe(unique=True))")
        programs = int(np.prod(record.grid or (1,)))
        busiest = self.busiest_sm_bytes(record.program_bytes, programs)
        reread = max(0, record.issued_bytes - record.unique_bytes)
        reread_bw = self.l2_bytes_per_s if record.unique_bytes <= self.l2_bytes else self.hbm_bytes_per_s
        sm_us = busiest / (self.hbm_bytes_per_s / self.sms) * 1e6
        memory_us = (record.unique_bytes / self.hbm_bytes_per_s + reread / reread_bw) * 1e6
        return dict(us=self.launch_us + max(sm_us, memory_us), fixed_us=self.launch_us, sm_us=sm_us,
                    memory_us=memory_us, busiest_sm_bytes=busiest, programs=programs)

    def torch_op_us(self, record: Launch) -> float:
        """A PyTorch op between kernels (no program ids): a launch of its own that streams its bytes at
        HBM bandwidth."""
        return self.launch_us + record.issued_bytes / self.hbm_bytes_per_s * 1e6

    def total(self, launches) -> dict:
        """An op's modeled time: its kernel launches one after another (``us``), and apart the PyTorch
        ops between them (``torch_ops_us``, ``torch_ops``: their number)."""
        kernels = [r for r in launches if r.module != "torch"]
        ops = [r for r in launches if r.module == "torch"]
        return dict(us=sum(self.launch(r)["us"] for r in kernels), launches=len(kernels),
                    torch_ops_us=sum(self.torch_op_us(r) for r in ops), torch_ops=len(ops))

    def describe(self) -> str:
        return (f"{self.name}: {self.sms} SMs, HBM {self.hbm_bytes_per_s / 1e12:.2f} TB/s (per SM "
                f"{self.hbm_bytes_per_s / self.sms / 1e9:.1f} GB/s), L2 {self.l2_bytes / 1e6:.0f} MB at "
                f"{self.l2_bytes_per_s / 1e12:.1f} TB/s (assumed), {self.launch_us:g} us per launch (assumed)")


# H100 SXM5: SM count, HBM3 bandwidth and L2 size from NVIDIA's data sheet; L2 bandwidth and launch cost
# are assumptions (module docstring).
H100 = LatencyModel(name="H100 SXM5", sms=132, hbm_bytes_per_s=3.35e12, l2_bytes_per_s=5.5e12, l2_bytes=50e6,
                    launch_us=2.0)


# ----------------------------------------------------------------------------- per-launch state

class _Storage:
    """One tensor storage the launch may touch: its byte range and the arguments that view it."""

    def __init__(self, start: int, nbytes: int):
        self.start, self.end = start, start + nbytes
        self.names: list[str] = []
        self.elt = 1
        self.read = self.written = None      # byte bitmaps, allocated on first touch (full mode)


class _LaunchState:
    def __init__(self, record: Launch, unique: bool):
        self.record, self.unique = record, unique
        self.storages: dict[int, _Storage] = {}
        self._starts: list[int] = []
        self._sorted: list[_Storage] = []

    def add_tensor(self, name: str, t: torch.Tensor):
        storage = t.untyped_storage()
        start = storage.data_ptr()
        s = self.storages.get(start)
        if s is None:
            s = self.storages[start] = _Storage(start, storage.nbytes())
        s.names.append(name)
        s.elt = t.element_size()
        self.record.args[name] = (str(t.dtype).removeprefix("torch."), storage.nbytes())
        self._sorted = sorted(self.storages.values(), key=lambda x: x.start)
        self._starts = [x.start for x in self._sorted]

    def locate(self, addr: np.ndarray, elt: int, what: str) -> list:
        """Checks every address and returns [(storage, addresses)] grouped by storage."""
        lo, hi = int(addr.min()), int(addr.max()) + elt
        i = bisect.bisect_right(self._starts, lo) - 1
        if i >= 0 and hi <= self._sorted[i].end:       # the usual case: one access, one tensor
            return [(self._sorted[i], addr)]
        starts = np.array(self._starts, dtype=np.uint64)
        ends = np.array([s.end for s in self._sorted], dtype=np.uint64)
        idx = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
        inside = (idx >= 0) & (addr + np.uint64(elt) <= ends[np.maximum(idx, 0)])
        if not inside.all():
            self.fail(int(addr[~inside][0]), int((~inside).sum()), elt, what)
        return [(self._sorted[j], addr[idx == j]) for j in np.unique(idx)]

    def fail(self, bad: int, count: int, elt: int, what: str):
        r = self.record
        pid = tuple(int(v) for v in _interp.interpreter_builder.grid_idx)
        if not self._sorted:
            message = f"{r.kernel}: {what} at 0x{bad:x} in a launch with no tensor argument, program id {pid}"
            _SESSIONS[-1].violations.append(message)
            raise OutOfBounds(message)

        def distance(s):
            return 0 if s.start <= bad < s.end else min(abs(bad - s.start), abs(bad - s.end))
        near = min(self._sorted, key=distance)
        offset = bad - near.start
        where = "before its start" if offset < 0 else f"past its end ({near.end - near.start} bytes)"
        message = (
            f"{r.kernel}: {what} of {count} active lane(s) ({elt}-byte elements) outside every tensor argument; "
            f"first at argument {'/'.join(near.names)!r} byte offset {offset:+d} (element {offset // near.elt:+d}), "
            f"{where}; program id {pid}, grid {r.grid}")
        _SESSIONS[-1].violations.append(message)   # kept even if a caller swallows the exception
        raise OutOfBounds(message)

    def account(self, addr: np.ndarray, elt: int, *, read: bool, write: bool, what: str):
        if addr.size == 0:
            return
        groups = self.locate(addr, elt, what)
        nbytes = int(addr.size) * elt
        self.record.read_bytes += nbytes if read else 0
        self.record.write_bytes += nbytes if write else 0
        x, y, z = _interp.interpreter_builder.grid_idx           # the program running now
        nx, ny, _ = self.record.grid or (1, 1, 1)
        pid = int(x) + nx * (int(y) + ny * int(z))
        self.record.program_bytes[pid] = self.record.program_bytes.get(pid, 0) + nbytes * (read + write)
        if not self.unique:
            return
        for s, a in groups:
            offs = (a - np.uint64(s.start)).astype(np.int64)
            offs = (offs[:, None] + np.arange(elt)).ravel()
            for flag, attr in ((read, "read"), (write, "written")):
                if flag:
                    if getattr(s, attr) is None:   # calloc'd: untouched pages cost no memory
                        setattr(s, attr, np.zeros(s.end - s.start, dtype=bool))
                    getattr(s, attr)[offs] = True

    def finish(self):
        if self.unique:
            self.record.unique_read_bytes = sum(int(s.read.sum()) for s in self.storages.values() if s.read is not None)
            self.record.unique_write_bytes = sum(int(s.written.sum()) for s in self.storages.values()
                                                 if s.written is not None)
        self.storages.clear()


class _Observation:
    def __init__(self, unique: bool, programs, torch_ops: bool):
        self.unique, self.programs, self.torch_ops = unique, programs, torch_ops
        self.launches: list[Launch] = []
        self.violations: list[str] = []


_SESSIONS: list[_Observation] = []      # innermost last; the innermost one records
_LOCAL = threading.local()              # .launch: the launch this thread is interpreting, or None


def _current() -> Optional[_LaunchState]:
    return getattr(_LOCAL, "launch", None)


def active() -> bool:
    """Whether an observation (and so the sanitizer) is on."""
    return bool(_SESSIONS)


# ----------------------------------------------------------------------------- specialization

def _specialization(fn, jit_kwargs: dict, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """(signature, constexprs) of a launch, as Triton's JIT specializes it for a GPU."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import _normalize_ty

    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    names = list(sig.parameters)
    no_spec = {names[i] if isinstance(i, int) else i for i in jit_kwargs.get("do_not_specialize") or ()}
    no_align = {names[i] if isinstance(i, int) else i for i in jit_kwargs.get("do_not_specialize_on_alignment") or ()}
    signature, constexprs = {}, {}
    for name, p in sig.parameters.items():
        value = bound.arguments.get(name)
        if p.annotation is not inspect.Parameter.empty and _normalize_ty(p.annotation) == "constexpr":
            constexprs[name] = value
            continue
        ty, key = native_specialize_impl(BaseBackend, value, False, name not in no_spec, name not in no_align)
        if ty == "constexpr":           # an int equal to 1, or None: the JIT folds it in
            signature[name] = "constexpr"
            constexprs[name] = key
        else:
            signature[name] = ty + (":16" if key == "D" else "")
    return signature, constexprs


# ----------------------------------------------------------------------------- the wrappers

_ORIGINAL: dict = {}


def _active_addresses(ptrs, mask) -> np.ndarray:
    addr = np.asarray(ptrs.data)
    if mask is None:
        return addr.ravel()
    m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
    return addr[m]


def _elt(ptrs) -> int:
    return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)


def _run(self, *args, grid, warmup, **kwargs):
    if warmup or not _SESSIONS:
        return _ORIGINAL["run"](self, *args, grid=grid, warmup=warmup, **kwargs)
    obs = _SESSIONS[-1]
    fn = self.fn
    record = Launch(kernel=fn.__name__, module=fn.__module__, file=inspect.getsourcefile(fn) or "",
                    num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))
    if obs.unique:   # the full mode also records what the static side needs to build this launch
        record.signature, record.constexprs = _specialization(fn, self.kwargs, args, kwargs)
    state = _LaunchState(record, obs.unique)
    _LOCAL.launch = state
    try:
        result = _ORIGINAL["run"](self, *args, grid=grid, warmup=warmup, **kwargs)
    except _interp.InterpreterError as e:
        if isinstance(e.__cause__, OutOfBounds):   # the interpreter wraps it; raise it as itself,
            raise e.__cause__ from None            # its traceback ends at the kernel's line
        raise
    finally:
        _LOCAL.launch = None
        state.finish()
        obs.launches.append(record)
    return result


def _grid_executor_init(self, fn, *rest, **kw):
    _ORIGINAL["GridExecutor.__init__"](self, fn, *rest, **kw)
    keep = _SESSIONS[-1].programs if _SESSIONS else None
    if keep is None:
        return
    builder = _interp.interpreter_builder
    name = fn.__name__

    def program(**args):                 # skips the programs the filter leaves out
        if keep(name, builder.grid_idx, builder.grid_dim):
            if _current():
                _current().record.programs_run += 1
            return fn(**args)
    program.__signature__ = inspect.signature(fn)   # GridExecutor binds the arguments by it
    self.fn = program


def _init_args_hst(self, args_dev, kwargs):
    args_hst, kwargs_hst = _ORIGINAL["GridExecutor._init_args_hst"](self, args_dev, kwargs)
    state = _current()
    if state:

        def add(name, value):
            if isinstance(value, torch.Tensor):
                state.add_tensor(name, value)
            elif isinstance(value, tuple):
                for i, v in enumerate(value):
                    add(f"{name}[{i}]", v)
            elif hasattr(value, "base") and isinstance(value.base, torch.Tensor):
                add(name, value.base)      # a TensorDescriptor (or a TensorWrapper)
        for name, value in zip(self.arg_names, args_hst):
            add(name, value)
        for name, value in kwargs_hst.items():
            add(name, value)
    return args_hst, kwargs_hst


def _set_grid_dim(self, nx, ny, nz):
    _ORIGINAL["set_grid_dim"](self, nx, ny, nz)
    if _current():
        record = _current().record
        record.grid = (nx, ny, nz)
        if not _SESSIONS[-1].programs:
            record.programs_run = nx * ny * nz


def _masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
    state = _current()
    if state:
        state.account(_active_addresses(ptrs, mask), _elt(ptrs), read=True, write=False, what="load")
    return _ORIGINAL["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)


def _masked_store(self, ptrs, value, mask, cache_policy):
    state = _current()
    if state:
        state.account(_active_addresses(ptrs, mask), _elt(ptrs), read=False, write=True, what="store")
    return _ORIGINAL["create_masked_store"](self, ptrs, value, mask, cache_policy)


def _atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
    state = _current()
    if state:
        addr = _active_addresses(ptr, mask)
        state.account(addr, _elt(ptr), read=True, write=True, what="atomic")
        state.record.atomics += int(addr.size)
    return _ORIGINAL["create_atomic_rmw"](self, rmw_op, ptr, val, mask, sem, scope)


def _atomic_cas(self, ptr, cmp, val, sem, scope):
    state = _current()
    if state:
        addr = _active_addresses(ptr, None)
        state.account(addr, _elt(ptr), read=True, write=True, what="atomic_cas")
        state.record.atomics += int(addr.size)
    return _ORIGINAL["create_atomic_cas"](self, ptr, cmp, val, sem, scope)


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    state = _current()
    if state:
        m_rows = int(np.prod(a.data.shape[:-1]))          # batch x M
        state.record.dot_flops += 2 * m_rows * int(a.data.shape[-1]) * int(b.data.shape[-1])
    return _ORIGINAL["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)


_PATCHES = [
    (_interp.InterpretedFunction, "run", "run", _run),
    (_interp.GridExecutor, "__init__", "GridExecutor.__init__", _grid_executor_init),
    (_interp.GridExecutor, "_init_args_hst", "GridExecutor._init_args_hst", _init_args_hst),
    (_interp.InterpreterBuilder, "set_grid_dim", "set_grid_dim", _set_grid_dim),
    (_interp.InterpreterBuilder, "create_masked_load", "create_masked_load", _masked_load),
    (_interp.InterpreterBuilder, "create_masked_store", "create_masked_store", _masked_store),
    (_interp.InterpreterBuilder, "create_atomic_rmw", "create_atomic_rmw", _atomic_rmw),
    (_interp.InterpreterBuilder, "create_atomic_cas", "create_atomic_cas", _atomic_cas),
    (_interp.InterpreterBuilder, "create_dot", "create_dot", _dot),
]


def _install():
    if _ORIGINAL:
        return
    for cls, attr, key, wrapper in _PATCHES:
        _ORIGINAL[key] = getattr(cls, attr)
        setattr(cls, attr, wrapper)


def _uninstall():
    for cls, attr, key, _ in _PATCHES:
        setattr(cls, attr, _ORIGINAL.pop(key))


def skip_interpreter_repeats() -> bool:
    """Speed only: the Triton interpreter's host work per launch, cut where it repeats itself, each change
    leaving what a launch patches and computes as it was.  A Triton without these internals runs unchanged
    (returns False).

    - Before every launch it swaps each builtin of triton.language (``tl.load``, ``tl.dot``, ...: about 200
      attributes) for its interpreted version and swaps them back after.  To find them it runs
      ``inspect.getmembers`` over four modules and classes each launch, about a quarter of a small launch's
      host time.  The names found the first time are kept (each is still patched only if it is a builtin at
      that moment, as the interpreter checks).  Measured on a 2-core Zen 1: test_prefix_cache.py and
      test_cascade_decode.py 149 -> 124 s.
    - It runs that whole patch again at every call of a ``@triton.jit`` helper from inside a kernel (a helper
      called per key block: thousands of times a launch), where it can change nothing: the launch's patch is
      in place and skips what is already patched, and the rest (``tl.range``, the reductions, the tensor's
      dunders) is the same functions again.  A helper whose module sees a triton.language module the launch
      did not patch still gets the full patch.
    - Its dtype lookup (``_get_np_dtype``, run per operand of every op) builds a table of 15 Triton dtypes,
      hashing each in Python, per call: its answers are kept per dtype."""
    if hasattr(_interp._patch_builtin, "uncached"):
        return True
    try:
        patch_builtin, patch_attr, is_builtin = _interp._patch_builtin, _interp._patch_attr, tl.core.is_builtin
        patch_lang, np_dtype, scope_class = _interp._patch_lang, _interp._get_np_dtype, _interp._LangPatchScope
        if (list(inspect.signature(patch_builtin).parameters) != ["pkg", "builder", "scope"]
                or list(inspect.signature(patch_lang).parameters) != ["fn"]
                or not hasattr(scope_class(), "restore")):
            return False
    except (AttributeError, TypeError, ValueError):
        return False
    names_of: dict = {}

    def cached_patch_builtin(pkg, builder, scope):
        names = names_of.get(id(pkg))
        if names is None:
            names = names_of[id(pkg)] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name in names:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    launch = threading.local()      # .langs: the triton.language modules the running launch patched

    def patch_lang_once_per_launch(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        patched = getattr(launch, "langs", None)
        if patched is not None and langs <= patched:
            return scope_class()                 # a helper inside the launch: nothing left to patch
        scope = patch_lang(fn)
        if patched is None:                      # the launch's own patch, in place until it restores it
            launch.langs = langs
            restore = scope.restore

            def restore_and_forget():
                launch.langs = None
                restore()
            scope.restore = restore_and_forget
        return scope

    dtypes: dict = {}

    def cached_np_dtype(tt_dtype):
        try:
            return dtypes[tt_dtype]
        except KeyError:
            found = dtypes[tt_dtype] = np_dtype(tt_dtype)
            return found
        except TypeError:                        # unhashable: not cached
            return np_dtype(tt_dtype)

    cached_patch_builtin.uncached = patch_builtin       # (parity/test_observatory.py compares the two)
    cached_np_dtype.uncached = np_dtype
    _interp._patch_builtin = cached_patch_builtin
    _interp._patch_lang = patch_lang_once_per_launch
    _interp._get_np_dtype = cached_np_dtype
    return True


# ----------------------------------------------------------------------------- torch ops between kernels

_FREE_OPS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "set_", "detach", "alias",
             "lift_fresh", "_local_scalar_dense", "is_nonzero", "equal", "resize_"}
_WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_"}   # overwrite self, never read it


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


class _TorchOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes of the PyTorch ops run outside any kernel launch, looking inside custom ops
    (``torch.library.custom_op``: their bodies run aten ops of their own)."""

    def __init__(self, obs: _Observation):
        super().__init__()
        self.obs = obs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten":     # a custom op: run its body under this mode, to see inside
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if _current() or name in _FREE_OPS:
            return out                    # inside a launch (the interpreter's host copies), or free
        inputs = list(_tensors(list(args) + list(kwargs.values())))
        outputs = list(_tensors(out if isinstance(out, (list, tuple)) else [out]))
        if func.is_view:                  # a view, or an op that may return its input (``to``)
            storages = {t.untyped_storage().data_ptr() for t in inputs}
            if all(t.untyped_storage().data_ptr() in storages for t in outputs):
                return out
        reads, writes = (inputs[1:], inputs[:1]) if name in _WRITE_ONLY else (inputs, outputs)
        nbytes = [sum(t.numel() * t.element_size() for t in ts) for ts in (reads, writes)]
        self.obs.launches.append(Launch(kernel=f"torch.{name}", module="torch", file="", read_bytes=nbytes[0],
                                        write_bytes=nbytes[1], unique_read_bytes=nbytes[0],
                                        unique_write_bytes=nbytes[1]))
        return out


@contextlib.contextmanager
def observe(*, unique: bool = True, programs: Optional[Callable[[str, tuple, tuple], bool]] = None,
            torch_ops: bool = False):
    """Observe every interpreted launch inside the block; yields an object whose ``launches`` lists
    them.  ``unique=False`` is the cheap mode (bounds check and issued counts, no unique-address
    bitmaps, no specialization).  ``programs(kernel, pid, grid) -> bool`` runs only the programs it keeps.
    ``torch_ops`` also records the PyTorch ops between the kernels (see the module docstring)."""
    _install()
    obs = _Observation(unique, programs, torch_ops)
    _SESSIONS.append(obs)
    try:
        with _TorchOps(obs) if torch_ops else contextlib.nullcontext():
            yield obs
    finally:
        _SESSIONS.remove(obs)
        if not _SESSIONS:
            _uninstall()
