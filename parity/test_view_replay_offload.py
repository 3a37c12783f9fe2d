"""Parity tests for view-replay activation offloading (ref/ and fast/view_replay_offload.py).

Every test runs both files.  Gradients must be bitwise equal to running without offloading,
so the comparisons use ``torch.equal``, not a tolerance.  The stats are checked against
counts made here independently: a recording hook keeps every tensor autograd saves, and the
test classifies them (parameters, leaf inputs, buffers, small storages), identifies storages
while they are all alive, and measures each view's byte span by indexing an ``arange``
through the view's own strides.

CPU tier: all of it, fp32 and bf16 (no Triton here, so bf16 runs on CPU).  The fast file's
CUDA machinery (side stream, events, FIFO of in-flight copies, pinned pool, prefetch) also
runs on CPU here through ``FakeCuda``, a stand-in for the few ``torch.cuda`` names it uses,
whose events complete only when the test says so; copies are synchronous there, so these
tests check the scheduling and lifetime decisions, not overlap.  GPU tier (skipped without
CUDA): the same checks on real streams, pinned memory, no host synchronization, and peak
memory measured with ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import re
import weakref

import pytest
import torch
import torch.nn.functional as F

import fast.view_replay_offload as fast_mod
import ref.view_replay_offload as ref_mod
from conftest import make_generator, randn, requires_gpu

CPU = torch.device("cpu")
IMPLS = [pytest.param(ref_mod, id="ref"), pytest.param(fast_mod, id="fast")]
# The CPU path and the CUDA path are different code paths: tests parametrized over both run
# the CPU one everywhere and the CUDA one in the GPU tier.
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, requires_gpu])]
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]
COMMON_STATS = ("packed", "kept", "offloaded_storages", "offloaded_bytes", "replayed_views",
                "reloaded_storages", "reloaded_bytes")
INPLACE_ERROR = re.compile(r"one of the variables needed for gradient computation has been modified by an "
                           r"inplace operation.*is at version (\d+); expected version (\d+) instead", re.S)


# ----------------------------------------------------------------------------- models

def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class Block(torch.nn.Module):
    """A pre-norm transformer block written with elementwise ops where matmuls would copy their
    operands, so that autograd saves views of every kind as they are: view + permute + select
    (q, k, v: three views of one base) and unsqueeze, transpose (k^T), narrow (chunk: two views
    of one base), view (the 2-D input a matmul saves), expand (stride 0), select of a tensor
    that is not itself saved; plus a plain buffer, an ``nn.Buffer`` and parameter views."""

    def __init__(self, d, heads, ff, *, gen, dtype, device):
        super().__init__()
        self.heads = heads

        def p(*shape, scale):
            return torch.nn.Parameter(randn(*shape, gen=gen, dtype=dtype, device=device, scale=scale))

        self.norm1 = p(d, scale=0.1)
        self.qkv = p(3 * d, d, scale=d ** -0.5)
        self.proj = p(d, d, scale=d ** -0.5)
        self.up = p(2 * ff, d, scale=d ** -0.5)
        self.down = p(d, ff, scale=ff ** -0.5)
        self.register_buffer("head_scale", randn(d // heads, gen=gen, dtype=dtype, device=device, shift=1.0))
        self.ff_scale = torch.nn.Buffer(randn(ff, gen=gen, dtype=dtype, device=device, shift=1.0))

    def forward(self, x):                                       # x [B, T, D]
        B, T, D = x.shape
        H = self.heads
        h = _rms(x) * self.norm1
        qkv = h @ self.qkv.t()                                  # [B, T, 3D]
        q, k, v = qkv.view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [B, H, T, Dh]
        kt = k.transpose(-1, -2)                                # [B, H, Dh, T]
        s = (q.unsqueeze(-1) * kt.unsqueeze(-3)).sum(-2)        # saves q and k^T: views of qkv
        p = (s * (D // H) ** -0.5).softmax(-1)                  # [B, H, T, T]
        o = (p.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)         # saves p (twice now) and v, a view of qkv
        o = o * self.head_scale                                 # saves the plain buffer
        z = o.transpose(1, 2).reshape(B, T, D) @ self.proj.t()  # [B, T, D]
        side = torch.sin(z.select(1, 0))                        # saves z[:, 0]; z itself is not saved
        x = x + z + side.unsqueeze(1)
        g, u = (_rms(x) @ self.up.t()).chunk(2, -1)             # 2 x [B, T, F], views of one base
        a = F.silu(g) * u
        a = a * a.mean(1, keepdim=True).expand_as(a)            # saves an expand [B, 1, F] -> [B, T, F]
        a = a * self.ff_scale                                   # saves the nn.Buffer
        return x + a @ self.down.t()


def make_stack(n_layers, *, d=24, heads=3, ff=40, dtype=torch.float32, device=CPU, seed=0):
    gen = make_generator(seed)
    return torch.nn.Sequential(*[Block(d, heads, ff, gen=gen, dtype=dtype, device=device)
                                 for _ in range(n_layers)])


def make_input(shape, *, dtype=torch.float32, device=CPU, seed=1, requires_grad=True):
    return randn(*shape, gen=make_generator(seed), dtype=dtype, device=device).requires_grad_(requires_grad)


def loss_of(out):
    return out.float().square().mean()


def grads(model, x=None):
    gs = [p.grad.clone() for p in model.parameters()]
    if x is not None and x.requires_grad:
        gs.append(x.grad.clone())
    return gs


def clear_grads(model, x=None):
    model.zero_grad(set_to_none=True)
    if x is not None:
        x.grad = None


def assert_bitwise(got, want, what="gradient"):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, \
            f"{what} {i}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        if not torch.equal(g, w):
            diff = (g.double() - w.double()).abs().max().item()
            raise AssertionError(f"{what} {i} differs from the run without offloading (max |diff| {diff:.3e})")


# ----------------------------------------------------------------------------- independent expected stats

def _byte_runs(t):
    """The bytes ``t`` reads in its storage as sorted disjoint runs ``((start, length), ...)``,
    found by indexing an arange through t's own strides."""
    item = t.element_size()
    n = t.untyped_storage().nbytes() // item
    starts = torch.arange(n).as_strided(t.shape, t.stride(), t.storage_offset()).flatten().unique() * item
    breaks = (torch.nonzero(starts.diff() != item).flatten() + 1).tolist()
    bounds = [0, *breaks, len(starts)]
    return tuple((int(starts[a]), (b - a) * item) for a, b in zip(bounds, bounds[1:]))


def _span_by_indexing(t):
    runs = _byte_runs(t)
    return runs[0][0], runs[-1][0] + runs[-1][1]


def _merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _covered(intervals, lo, hi):
    return any(a <= lo and hi <= b for a, b in _merge(intervals))


def expected_stats(run, *, min_offload_bytes, module=None):
    """Run ``run()`` under a hook that keeps every saved tensor, then count what OffloadActivations
    should do with them, by the documented rule.  Returns (stats, total bytes of the offloaded
    storages, bytes of the offloaded tensors copied one by one as save_on_cpu does)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    module_ptrs = set()
    if module is not None:
        module_ptrs = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    kept, spans, sparse, sizes, replayed, sparse_bytes, one_by_one = 0, {}, {}, {}, 0, 0, 0
    for t in saved:  # all alive: data pointers identify storages here
        base = t if t._base is None else t._base
        storage = t.untyped_storage()
        if (t.numel() == 0 or isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)
                or getattr(base, "_is_buffer", False) or storage.data_ptr() in module_ptrs
                or storage.nbytes() < min_offload_bytes):
            kept += 1
            continue
        runs = _byte_runs(t)
        lo, hi = runs[0][0], runs[-1][0] + runs[-1][1]
        have, have_sparse = spans.setdefault(storage.data_ptr(), []), sparse.setdefault(storage.data_ptr(), set())
        if runs in have_sparse or _covered(have, lo, hi):
            replayed += 1                                 # its bytes are on the host already
        elif 2 * sum(n for _, n in runs) >= hi - lo:
            have.append((lo, hi))                         # dense: the missing part of its span
        else:
            have_sparse.add(runs)                         # sparse: exactly its bytes
            sparse_bytes += sum(n for _, n in runs)
        sizes[storage.data_ptr()] = storage.nbytes()
        one_by_one += t.numel() * t.element_size()
    union = sum(b - a for ivs in spans.values() for a, b in _merge(ivs)) + sparse_bytes
    total = sum(sizes.values())
    stats = dict(packed=len(saved), kept=kept, offloaded_storages=len(spans), offloaded_bytes=union,
                 replayed_views=replayed)
    del out
    return stats, total, one_by_one


# ----------------------------------------------------------------------------- a stand-in for torch.cuda

class FakeEvent:
    _ids = itertools.count()

    def __init__(self, stream):
        self.id, self.stream, self.done = next(self._ids), stream, False

    def query(self):
        return self.done

    def __repr__(self):
        return f"E{self.id}@{self.stream.name}"


class FakeStream:
    def __init__(self, backend, name):
        self.backend, self.name = backend, name

    def wait_stream(self, other):
        self.backend.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.backend.log.append(("wait_event", self.name, event))

    def record_event(self):
        event = FakeEvent(self)
        self.backend.events.append(event)
        self.backend.log.append(("record", self.name, event))
        return event


class FakeCuda:
    """The names of ``torch.cuda`` the fast file uses (Stream, current_stream, stream,
    is_current_stream_capturing), on CPU; events complete when ``complete()`` is called."""

    def __init__(self):
        self.log, self.events = [], []
        self.compute = FakeStream(self, "compute")
        self.current = self.compute

    def Stream(self, device):  # noqa: N802 (torch.cuda's name)
        return FakeStream(self, "side")

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    def is_current_stream_capturing(self):
        return False

    def complete(self):
        for e in self.events:
            e.done = True

    def waits(self, stream="compute"):
        return [e for kind, name, e in self.log if kind == "wait_event" and name == stream]


def fake_async(**kw):
    """A fast OffloadActivations whose CPU tensors take the CUDA path through FakeCuda."""
    ctx = fast_mod.OffloadActivations(**kw)
    backend = FakeCuda()
    ctx._async_device_type, ctx._backend = "cpu", backend
    return ctx, backend


# ----------------------------------------------------------------------------- gradients and stats

def _baseline(model, x):
    clear_grads(model, x)
    loss_of(model(x)).backward()
    out = grads(model, x)
    clear_grads(model, x)
    return out


def _in_flight_reuse(impl, device):
    """fast on CUDA replays views on storages whose copy is still in flight instead of reloading."""
    return impl is fast_mod and device == "cuda"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_bitwise_and_stats(impl, dtype, device):
    model = make_stack(2, dtype=dtype, device=device)
    x = make_input((2, 7, 24), dtype=dtype, device=device)
    want = _baseline(model, x)
    exp, total, one_by_one = expected_stats(lambda: loss_of(model(x)), min_offload_bytes=0, module=model)

    ctx = impl.OffloadActivations(min_offload_bytes=0, module=model)
    with ctx:
        loss = loss_of(model(x))
    loss.backward()
    assert_bitwise(grads(model, x), want)
    got = {k: ctx.stats[k] for k in exp}
    assert got == exp, f"stats {got} != independently counted {exp}"
    assert ctx.stats["offloaded_bytes"] <= total
    assert ctx.stats["offloaded_bytes"] < one_by_one, "no saving over copying each saved tensor (save_on_cpu)"
    if _in_flight_reuse(impl, device):
        assert ctx.stats["reloaded_storages"] <= ctx.stats["offloaded_storages"]
    else:
        assert ctx.stats["reloaded_storages"] == ctx.stats["offloaded_storages"], "one reload per storage per pass"
        assert ctx.stats["reloaded_bytes"] == ctx.stats["offloaded_bytes"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_retain_graph_second_backward(impl, device):
    model = make_stack(2, device=device)
    x = make_input((2, 7, 24), device=device)
    clear_grads(model, x)
    loss = loss_of(model(x))
    loss.backward(retain_graph=True)
    loss.backward()
    want = grads(model, x)
    clear_grads(model, x)

    ctx = impl.OffloadActivations(min_offload_bytes=0)
    with ctx:
        loss = loss_of(model(x))
    loss.backward(retain_graph=True)
    first = ctx.stats["reloaded_storages"]
    assert first <= ctx.stats["offloaded_storages"]
    loss.backward()
    assert_bitwise(grads(model, x), want)
    # The second pass reloads each storage exactly once: each reload is dropped after the last
    # unpack of its views in the first pass, and nothing is still in flight by then.
    assert ctx.stats["reloaded_storages"] - first == ctx.stats["offloaded_storages"]
    if not _in_flight_reuse(impl, device):
        assert first == ctx.stats["offloaded_storages"]
        assert ctx.stats["reloaded_bytes"] == 2 * ctx.stats["offloaded_bytes"]


def _host_bytes(rec):
    """A storage record's host buffers: its byte ranges and its gathered sparse footprints."""
    return [host for _, _, host in rec.ranges] + list(rec.footprints.values())


@pytest.fixture
def track_records(monkeypatch):
    """Weak references to every storage record the implementation creates."""
    made = []

    def track(impl):
        class Tracked(impl._Storage):
            __slots__ = ()

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                made.append(weakref.ref(self))

        monkeypatch.setattr(impl, "_Storage", Tracked)
        return made

    return track


@pytest.mark.parametrize("impl", IMPLS)
def test_offloading_frees_activations_and_nothing_leaks(impl, track_records):
    """An activation dies once the forward code drops it (it is offloaded, not held by autograd),
    and after backward the host copies die with the graph."""
    model = make_stack(1)
    x = make_input((2, 7, 24))

    def forward():
        out = model(x)
        return torch.sin(out), weakref.ref(out)  # sin saves out

    y_plain, out_plain = forward()
    gc.collect()
    assert out_plain() is not None  # without offloading, the graph keeps it
    made = track_records(impl)
    ctx = impl.OffloadActivations(min_offload_bytes=0)
    with ctx:
        y, out_ref = forward()
    gc.collect()
    assert out_ref() is None, "an offloaded activation is still alive after the forward dropped it"
    records = [r() for r in made]
    assert len(records) == ctx.stats["offloaded_storages"] > 0 and None not in records
    hosts = [weakref.ref(host) for rec in records for host in _host_bytes(rec)]
    rec_refs = [weakref.ref(rec) for rec in records]
    del records
    y.sum().backward()
    del y
    gc.collect()
    assert all(r() is None for r in rec_refs), "storage records outlived the graph"
    assert all(h() is None for h in hosts), "host copies outlived the graph"


@pytest.mark.parametrize("impl", IMPLS)
def test_graph_dropped_without_backward_frees_host_copies(impl, track_records):
    model = make_stack(1)
    x = make_input((2, 5, 24))
    made = track_records(impl)
    ctx = impl.OffloadActivations(min_offload_bytes=0)
    with ctx:
        loss = loss_of(model(x))
    hosts = [weakref.ref(host) for r in made for host in _host_bytes(r())]
    assert len(made) == ctx.stats["offloaded_storages"] and hosts
    del loss
    gc.collect()
    assert all(h() is None for h in hosts)


# ----------------------------------------------------------------------------- view replay

class SaveViews(torch.autograd.Function):
    """Saves the given tensors; backward records (dtype, shape, stride, storage offset, storage
    pointer, storage bytes, value) of what it got back in ``SaveViews.meta``."""

    meta: list = []

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        SaveViews.meta = [(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(),
                           t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.clone())
                          for t in saved]
        return (grad,) + (None,) * len(saved)


@pytest.mark.parametrize("impl", IMPLS)
def test_views_are_replayed_exactly(impl):
    gen = make_generator(3)
    anchor = randn(3, gen=gen, device=CPU).requires_grad_()
    ctx = impl.OffloadActivations(min_offload_bytes=0)
    with ctx:
        base = randn(6, 5, 4, gen=gen, device=CPU)               # 480 bytes, never saved itself
        other = randn(3, 1, 8, gen=gen, device=CPU)              # 96 bytes, saved expanded
        ints = torch.arange(40, dtype=torch.int64).view(5, 8)    # 320 bytes
        views = [base.transpose(0, 2),                           # transpose: copies all 480 bytes
                 base.view(30, 4),                               # view       } already on the host:
                 base.permute(2, 0, 1),                          # permute    } replayed, no copy
                 base.narrow(1, 1, 3),                           # narrow     }
                 base[2],                                        # select     }
                 other.expand(3, 7, 8),                          # expand: 96 bytes, not 672
                 ints[1:4, ::2],                                 # strided slice: bytes [64, 248)
                 ints.view(torch.float64)[1]]                    # another dtype, bytes [64, 128): replayed
        originals = [v.clone() for v in views]
        layout = [(v.dtype, tuple(v.shape), v.stride(), v.storage_offset()) for v in views]
        out = SaveViews.apply(anchor, *views)
        del views, base, other, ints
    out.sum().backward()
    meta = SaveViews.meta
    assert ctx.stats["packed"] == 8 and ctx.stats["kept"] == 0
    assert ctx.stats["offloaded_storages"] == 3
    assert ctx.stats["offloaded_bytes"] == 480 + 96 + 184
    assert ctx.stats["replayed_views"] == 5
    for (dtype, shape, stride, _), got, want in zip(layout, meta, originals):
        assert got[:3] == (dtype, shape, stride)
        assert torch.equal(got[-1], want)
    # Views of one storage come back on one reloaded storage, at the same relative offsets.
    for group in ([0, 1, 2, 3, 4], [6, 7]):
        assert len({meta[i][4] for i in group}) == 1, f"views {group} of one base came back on several storages"
        orig = [layout[i][3] * layout[i][0].itemsize for i in group]
        back = [meta[i][3] * meta[i][0].itemsize for i in group]
        assert [b - back[0] for b in back] == [o - orig[0] for o in orig]
    assert meta[5][2] == (8, 0, 1) and meta[5][5] == 96, "the expand was materialized"


def _sparse_views_case(impl_ctx):
    """v, k, k^T, q and a narrow of an interleaved qkv [B, T, 3, H, Dh], and the v alone of a
    second one; neither base saved itself."""
    gen = make_generator(13)
    anchor = randn(2, gen=gen, device=CPU).requires_grad_()
    B, T, H, Dh = 2, 5, 3, 4
    with impl_ctx:
        qkv = randn(B, T, 3 * H * Dh, gen=gen, device=CPU)
        q, k, v = qkv.view(B, T, 3, H, Dh).permute(2, 0, 3, 1, 4).unbind(0)   # [B, H, T, Dh] each
        v_alone = randn(B, T, 3 * H * Dh, gen=gen, device=CPU).view(B, T, 3, H, Dh)[:, :, 2].transpose(1, 2)
        views = [v, k, k.transpose(-1, -2), q, qkv[:, :, :H * Dh], v_alone]
        layout = [(tuple(t.shape), t.stride(), t.storage_offset()) for t in views]
        values = [t.clone() for t in views]
        out = SaveViews.apply(anchor, *views)
        del q, k, v, qkv, views, v_alone
    return out, layout, values, B * T * H * Dh * 4


@pytest.mark.parametrize("path", ["ref", "fast", "fast_async"])
def test_sparse_views_copy_only_their_bytes(path):
    """v of an interleaved qkv reads a third of its span: it is gathered (a third of the bytes,
    not the span), scattered back in backward and replayed with its strides.  k^T reads k's
    bytes and the narrow qkv[..., :D] reads q's: both cost nothing.  In all, the storage's
    bytes once, where copying each saved tensor moves 5/3 of them.  A v saved alone costs a
    third of its storage (its span would be almost all of it)."""
    if path == "fast_async":
        ctx, backend = fake_async(min_offload_bytes=0)
    else:
        ctx, backend = (ref_mod if path == "ref" else fast_mod).OffloadActivations(min_offload_bytes=0), None
    out, layout, values, third = _sparse_views_case(ctx)
    if backend is not None:
        backend.complete()
    assert ctx.stats["offloaded_storages"] == 2 and ctx.stats["replayed_views"] == 2
    assert ctx.stats["offloaded_bytes"] == 3 * third + third
    out.sum().backward()
    assert ctx.stats["reloaded_bytes"] == 4 * third
    for (shape, stride, _), got, want in zip(layout, SaveViews.meta, values):
        assert (got[1], got[2]) == (shape, stride)
        assert torch.equal(got[-1], want)
    assert len({m[4] for m in SaveViews.meta[:5]}) == 1, "views of one storage came back on several"


def test_storage_identity_is_not_the_data_pointer():
    """Two distinct storages over the same memory (same data_ptr, same version): the second must
    not be deduplicated onto the first one's host copy, which holds older bytes."""
    for impl in (ref_mod, fast_mod):
        memory = bytearray(256)
        a = torch.frombuffer(memory, dtype=torch.float32)
        b = torch.frombuffer(memory, dtype=torch.float32)
        c = torch.frombuffer(memory, dtype=torch.float32)
        c.copy_(torch.arange(64, dtype=torch.float32))
        assert a.data_ptr() == b.data_ptr() and a.untyped_storage() is not b.untyped_storage()
        anchor = torch.ones(2, requires_grad=True)
        ctx = impl.OffloadActivations(min_offload_bytes=0)
        with ctx:
            out_a = SaveViews.apply(anchor, a)
            c.mul_(-1)                         # new bytes; a's and b's version counters do not move
            assert a._version == b._version
            out_b = SaveViews.apply(anchor, b)
        assert ctx.stats["offloaded_storages"] == 2 and ctx.stats["replayed_views"] == 0
        out_b.sum().backward()
        assert torch.equal(SaveViews.meta[0][-1], -torch.arange(64, dtype=torch.float32))
        out_a.sum().backward()  # the bytes of the moment a was saved
        assert torch.equal(SaveViews.meta[0][-1], torch.arange(64, dtype=torch.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_recycled_memory_is_a_new_storage(impl):
    """Save, free, allocate again (the allocator may hand out the same memory), save: every
    saved tensor comes back with its own values."""
    anchor = torch.ones(2, requires_grad=True)
    ctx = impl.OffloadActivations(min_offload_bytes=0)
    outs, ptrs = [], []
    with ctx:
        for i in range(4):
            t = torch.full((1024,), float(i))
            ptrs.append(t.data_ptr())
            outs.append(SaveViews.apply(anchor, t))
            del t
    assert ctx.stats["offloaded_storages"] == 4 and ctx.stats["replayed_views"] == 0
    for i, out in enumerate(outs):
        out.sum().backward()
        assert torch.equal(SaveViews.meta[0][-1], torch.full((1024,), float(i)))
    print(f"distinct addresses among 4 saved tensors: {len(set(ptrs))}")


# ----------------------------------------------------------------------------- what stays

@pytest.mark.parametrize("impl", IMPLS)
def test_threshold_is_on_the_storage(impl):
    gen = make_generator(4)
    anchor = torch.ones(2, requires_grad=True)
    ctx = impl.OffloadActivations(min_offload_bytes=1000)
    with ctx:
        small = randn(200, gen=gen, device=CPU)   # 800 bytes: stays
        big = randn(300, gen=gen, device=CPU)     # 1200 bytes: offloaded, even through a 40-byte view
        out = SaveViews.apply(anchor, small, big[:10])
    assert ctx.stats["kept"] == 1 and ctx.stats["offloaded_storages"] == 1
    assert ctx.stats["offloaded_bytes"] == 40
    out.sum().backward()
    meta = SaveViews.meta
    assert meta[0][4] == small.untyped_storage().data_ptr(), "a small tensor was copied"
    assert meta[1][1] == (10,) and meta[1][5] == 40 and torch.equal(meta[1][-1], big[:10])


@pytest.mark.parametrize("impl", IMPLS)
def test_params_buffers_and_leaf_inputs_stay(impl):
    gen = make_generator(5)
    model = torch.nn.Linear(8, 8)
    model.register_buffer("plain", randn(8, gen=gen, device=CPU))
    model.flagged = torch.nn.Buffer(randn(8, gen=gen, device=CPU))
    leaf = randn(4, 8, gen=gen, device=CPU).requires_grad_()
    data = randn(4, 8, gen=gen, device=CPU)      # an input that does not require grad: offloaded
    anchor = torch.ones(2, requires_grad=True)
    kept = (model.weight, model.weight.t(), model.plain, model.flagged, leaf, leaf.t())

    def run(ctx):
        with ctx:
            return SaveViews.apply(anchor, *kept, data)

    ctx = impl.OffloadActivations(min_offload_bytes=0, module=model)
    out = run(ctx)
    assert ctx.stats["kept"] == 6 and ctx.stats["offloaded_storages"] == 1
    out.sum().backward()
    ptrs = [m[4] for m in SaveViews.meta]
    assert ptrs[:6] == [t.untyped_storage().data_ptr() for t in kept]
    assert ptrs[6] != data.untyped_storage().data_ptr()
    ctx = impl.OffloadActivations(min_offload_bytes=0)  # without module= a plain buffer is an activation
    run(ctx)
    assert ctx.stats["kept"] == 5 and ctx.stats["offloaded_storages"] == 2


# ----------------------------------------------------------------------------- in-place after save

def _inplace_cases():
    def on_output(x):
        y = x.exp()              # saves its output
        out = y * 1.0
        y.add_(1)
        return out, y

    def on_base_of_saved_view(x):
        y = x * 2
        out = torch.sin(y.t())   # saves a view of y
        y.mul_(3)                # bumps the version counter y shares with its views
        return out, y

    def on_view_of_saved_base(x):
        y = x * 2
        out = torch.sin(y)
        y[0].zero_()
        return out, y

    return [pytest.param(f, id=f.__name__) for f in (on_output, on_base_of_saved_view, on_view_of_saved_base)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", _inplace_cases())
@pytest.mark.parametrize("impl", IMPLS)
def test_inplace_after_save_raises_like_autograd(impl, case, device):
    x = make_input((4, 6), seed=6, device=device)
    out, alive = case(x)
    with pytest.raises(RuntimeError) as plain:
        out.sum().backward()
    want = INPLACE_ERROR.search(str(plain.value))
    assert want, str(plain.value)
    with impl.OffloadActivations(min_offload_bytes=0):
        out, alive = case(x)
    with pytest.raises(RuntimeError, match=INPLACE_ERROR.pattern) as got:
        out.sum().backward()
    assert INPLACE_ERROR.search(str(got.value)).groups() == want.groups()


@pytest.mark.parametrize("impl", IMPLS)
def test_kept_tensor_inplace_raises(impl):
    x = make_input((4, 6), seed=7)
    with impl.OffloadActivations(min_offload_bytes=1 << 30):  # everything stays
        y = x.exp()
        out = y * 1.0
    y.add_(1)
    with pytest.raises(RuntimeError, match=INPLACE_ERROR.pattern):
        out.sum().backward()


# ----------------------------------------------------------------------------- checkpoint, compile

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoint_inner_hooks_win(impl, reentrant, device):
    from torch.utils.checkpoint import checkpoint

    model = make_stack(3, device=device)
    x = make_input((2, 7, 24), device=device)

    def run():
        h = model[0](x)
        h = checkpoint(model[1], h, use_reentrant=reentrant)
        return loss_of(model[2](h))

    clear_grads(model, x)
    run().backward()
    want = grads(model, x)
    clear_grads(model, x)
    exp, _, _ = expected_stats(run, min_offload_bytes=0)    # what outer hooks see: not block 1's insides
    full, _, _ = expected_stats(lambda: loss_of(model(x)), min_offload_bytes=0)
    ctx = impl.OffloadActivations(min_offload_bytes=0)
    with ctx:
        loss = run()
    assert ctx.stats["packed"] == exp["packed"] < full["packed"]
    assert ctx.stats["offloaded_storages"] == exp["offloaded_storages"]
    loss.backward()  # outside the context: the recomputation is not offloaded
    assert_bitwise(grads(model, x), want)
    assert ctx.stats["packed"] == exp["packed"]


def _tiny_mlp():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 24))
    return model, make_input((6, 24), requires_grad=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_model_inside_the_context(impl):
    """The compiled forward is one autograd Function: what its graph saves goes through the
    hooks at run time, with no graph break and no recompilation."""
    model, x = _tiny_mlp()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    want = _baseline(compiled, x)
    exp, _, _ = expected_stats(lambda: loss_of(compiled(x)), min_offload_bytes=0)
    ctx = impl.OffloadActivations(min_offload_bytes=0)
    with ctx:
        loss = loss_of(compiled(x))
    loss.backward()
    assert_bitwise(grads(model), want)
    assert {k: ctx.stats[k] for k in exp} == exp and exp["offloaded_storages"] > 0
    assert ctx.stats["reloaded_storages"] == ctx.stats["offloaded_storages"]


@pytest.mark.parametrize("impl", IMPLS)
def test_context_entered_inside_a_compiled_function(impl):
    """The push of the hooks breaks dynamo's graph; the hooks themselves must run as Python
    (not be traced by dynamo from the resumed frames) and offload as usual."""
    model, x = _tiny_mlp()
    want = _baseline(model, x)
    ctx = impl.OffloadActivations(min_offload_bytes=0)

    def step(x):
        with ctx:
            return loss_of(model(x))

    torch.compile(step, backend="aot_eager")(x).backward()
    assert_bitwise(grads(model), want)
    # x, the GELU input, the GELU output, the model output; the second weight's view stays
    assert (ctx.stats["packed"], ctx.stats["kept"], ctx.stats["offloaded_storages"]) == (5, 1, 4)


# ----------------------------------------------------------------------------- arguments

@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise(impl):
    with pytest.raises(TypeError, match="min_offload_bytes"):
        impl.OffloadActivations(min_offload_bytes=1.5)
    with pytest.raises(TypeError, match="min_offload_bytes"):
        impl.OffloadActivations(min_offload_bytes=True)
    with pytest.raises(ValueError, match="min_offload_bytes"):
        impl.OffloadActivations(min_offload_bytes=-1)
    with pytest.raises(TypeError, match="module"):
        impl.OffloadActivations(module=[torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError):
        impl.OffloadActivations(1024)  # keyword-only


def test_fast_only_arguments_raise():
    for name in ("prefetch", "max_inflight_bytes"):
        with pytest.raises(ValueError, match=name):
            fast_mod.OffloadActivations(**{name: -1})
        with pytest.raises(TypeError, match=name):
            fast_mod.OffloadActivations(**{name: None})
    with pytest.raises(ValueError, match="max_pool_bytes"):
        fast_mod.OffloadActivations(max_pool_bytes=-1)
    with pytest.raises(TypeError, match="max_pool_bytes"):
        fast_mod.OffloadActivations(max_pool_bytes=2.0)
    fast_mod.OffloadActivations(max_pool_bytes=None)


# ----------------------------------------------------------------------------- pure helpers of fast/

def test_size_classes():
    sizes = list(range(1, 5000, 37)) + [2 ** k + d for k in range(12, 34) for d in (-1, 0, 1, 12345)]
    for n in sizes:
        c = fast_mod._size_class(n)
        assert c >= n and c % 512 == 0, (n, c)
        assert c <= max(4096, n * 1.125) + 511, (n, c)
        assert fast_mod._size_class(c) == c, "a class is its own class"
    classes = [fast_mod._size_class(n) for n in sorted(sizes)]
    assert classes == sorted(classes), "classes are monotone in the request"
    assert len({fast_mod._size_class(n) for n in range(2 ** 20 + 1, 2 ** 21 + 1)}) == 8  # 12.5% steps


@pytest.mark.parametrize("impl", IMPLS)
def test_missing_ranges_and_footprints(impl):
    gen = torch.Generator().manual_seed(8)
    for _ in range(300):
        cuts = sorted(torch.randint(0, 64, (6,), generator=gen).tolist())
        covered = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
        lo, hi = sorted(torch.randint(0, 64, (2,), generator=gen).tolist())
        hi += 1
        gaps = impl._missing_ranges(covered, lo, hi)
        want = {i for i in range(lo, hi) if not any(a <= i < b for a, b in covered)}
        got = set()
        for a, b in gaps:
            assert lo <= a < b <= hi
            got |= set(range(a, b))
        assert got == want and len(got) == sum(b - a for a, b in gaps)
    t = torch.arange(240.0).view(12, 20)
    qkv = t.view(2, 2, 3, 2, 10)                              # [B, T, 3, H, Dh]
    k = qkv.permute(2, 0, 3, 1, 4)[1]
    for v in (t, t.t(), t[2:5, 3:17:3], t[4], t[:, 7], t[:1].expand(6, 20), t.view(4, 6, 10).permute(2, 0, 1),
              k, k.transpose(-1, -2).unsqueeze(-3), t[:, None, 5:9].expand(12, 3, 4), t.unfold(1, 4, 2)):
        fp = impl._footprint(v)
        assert impl._span(fp) == _span_by_indexing(v), v.shape
        off, dims, run = fp
        grid = torch.zeros(()) + off
        for n, pitch in dims:
            grid = grid[..., None] + torch.arange(n) * pitch
        read = {int(b) + j for b in grid.flatten() for j in range(run)}
        assert read == {a + j for a, n in _byte_runs(v) for j in range(n)}, f"footprint {fp} of {tuple(v.shape)}"
    assert impl._footprint(k) == impl._footprint(k.transpose(-1, -2).unsqueeze(-3))
    assert impl._is_dense(impl._footprint(t[2:5, 3:17:3])) is False and impl._is_dense(impl._footprint(t.t()))


class _FakeRecord:
    def __init__(self, live=1, reloaded=None, source=None, recent=None):
        self.live, self.reloaded, self.source, self.recent = live, reloaded, source, recent


def test_prefetch_plan_order():
    recs = [_FakeRecord() for _ in range(8)]
    order = [weakref.ref(r) for r in recs]
    plan = fast_mod._prefetch_plan
    assert plan(order, 7, 2) == [recs[6], recs[5]]            # reverse save order
    assert plan(order, 1, 3) == [recs[0]]                      # stops at the first record
    assert plan(order, 5, 0) == []
    recs[4].reloaded = object()                                # already loaded: in the window, not loaded again
    assert plan(order, 6, 2) == [recs[5]]
    recs[3].live = 0                                           # freed: skipped, the window reaches further
    recs[2].source = object()                                  # copy still in flight: used as is
    assert plan(order, 5, 3) == [recs[1]]
    in_use = torch.empty(1).untyped_storage()
    recs[1].recent = weakref.ref(in_use)                       # just unpacked, its views still alive
    assert plan(order, 5, 3) == []
    del in_use
    assert plan(order, 5, 3) == [recs[1]]                      # its views are gone: load it again
    dead = _FakeRecord()
    order.insert(1, weakref.ref(dead))
    del dead
    gc.collect()
    assert plan(order, 2, 2) == [recs[0]]                      # dead references are skipped


def test_host_pool_reuses_by_size_class():
    pool = fast_mod._HostPool(max_bytes=1 << 20, pin_memory=False)
    a = pool.take(5000)
    assert a.numel() == fast_mod._size_class(5000) and pool.allocations == 1
    pool.give(a)
    b = pool.take(5100)                       # same class: reused
    assert b is a and pool.reuses == 1
    c = pool.take(9000)                       # another class: allocated
    assert c is not a and pool.allocations == 2
    pool.give(b)
    pool.give(c)
    assert pool.free_bytes == b.numel() + c.numel()
    small = fast_mod._HostPool(max_bytes=4096, pin_memory=False)
    small.give(torch.empty(8192, dtype=torch.uint8))   # over the cap: not retained
    assert small.free_bytes == 0 and small.take(8192).numel() == 8192 and small.allocations == 1


# ----------------------------------------------------------------------------- fast's CUDA path on FakeCuda

def _fake_run(model, x, ctx, backend, *, complete_before_backward=True):
    with ctx:
        loss = loss_of(model(x))
    if complete_before_backward:
        backend.complete()
    loss.backward()
    return loss


def test_fake_async_gradients_stats_and_prefetch():
    model = make_stack(3)
    x = make_input((2, 7, 24))
    want = _baseline(model, x)
    ref_ctx = ref_mod.OffloadActivations(min_offload_bytes=0)
    with ref_ctx:
        loss = loss_of(model(x))
    loss.backward()
    clear_grads(model, x)
    ctx, backend = fake_async(min_offload_bytes=0, prefetch=2)
    with ctx:
        loss = loss_of(model(x))
    copies = [e for kind, _, e in backend.log if kind == "record"]
    # one copy event per saved tensor that brought new bytes
    assert len(copies) == ctx.stats["packed"] - ctx.stats["kept"] - ctx.stats["replayed_views"]
    assert all(entry == ("wait_stream", "side", "compute") for entry in backend.log if entry[0] != "record")
    backend.complete()
    loss.backward()
    assert_bitwise(grads(model, x), want)
    assert {k: ctx.stats[k] for k in COMMON_STATS} == ref_ctx.stats
    assert ctx.stats["pinned_allocations"] == len(copies)
    # The reloads: almost all issued ahead of use, and each waited on by the compute stream.
    loads = [e for kind, _, e in backend.log if kind == "record"][len(copies):]
    assert len(loads) == ctx.stats["reloaded_storages"]
    demand = ctx.stats["reloaded_storages"] - ctx.stats["prefetched_storages"]
    print(f"reloads {len(loads)}, prefetched {ctx.stats['prefetched_storages']}, on demand {demand}")
    assert demand == 1, "only the first reload of the pass should be on demand"
    assert set(loads) <= set(backend.waits("compute"))
    assert not ctx._engines[CPU].fifo


def test_fake_async_holds_device_storage_until_copy_completes():
    anchor = torch.ones(2, requires_grad=True)
    ctx, backend = fake_async(min_offload_bytes=0)
    with ctx:
        t = torch.arange(300.0) * 1
        storage = weakref.ref(t.untyped_storage())  # alive exactly as long as the storage
        out = SaveViews.apply(anchor, t[5:])
        del t
    gc.collect()
    eng = ctx._engines[CPU]
    assert storage() is not None and len(eng.fifo) == 1, "the device storage was released before its copy completed"
    backend.complete()
    with ctx:  # the next pack, unpack or exit polls the FIFO
        pass
    gc.collect()
    assert storage() is None and not eng.fifo
    assert not backend.waits("compute"), "the compute stream waited on a copy it did not need"
    out.sum().backward()
    assert torch.equal(SaveViews.meta[0][-1], torch.arange(5.0, 300.0))


def test_fake_async_inflight_limit_makes_compute_wait():
    model = make_stack(1)
    x = make_input((2, 7, 24))
    want = _baseline(model, x)
    ctx, backend = fake_async(min_offload_bytes=0, max_inflight_bytes=0)
    with ctx:
        loss = loss_of(model(x))
        assert not ctx._engines[CPU].fifo
    copies = [e for kind, name, e in backend.log if kind == "record"]
    assert backend.waits("compute") == copies, "with no in-flight budget every copy is waited on, in order"
    loss.backward()
    assert_bitwise(grads(model, x), want)


def test_fake_async_uses_inflight_storage_directly_and_drains_at_end_of_backward():
    model = make_stack(2)
    x = make_input((2, 7, 24))
    want = _baseline(model, x)
    ctx, backend = fake_async(min_offload_bytes=0)
    _fake_run(model, x, ctx, backend, complete_before_backward=False)  # no copy ever completes
    assert_bitwise(grads(model, x), want)
    assert ctx.stats["reloaded_storages"] == 0, "storages still on the device were reloaded"
    eng = ctx._engines[CPU]
    assert not eng.fifo and eng.inflight_bytes == 0, "the end-of-backward callback did not drain the FIFO"
    copies = [e for kind, name, e in backend.log if kind == "record"]
    assert backend.waits("compute") == copies  # drained with stream waits, not host synchronization


def test_fake_async_pool_reused_across_steps():
    model = make_stack(2)
    x = make_input((2, 7, 24))
    ctx, backend = fake_async(min_offload_bytes=0)
    _fake_run(model, x, ctx, backend)
    first = ctx.stats["pinned_allocations"]
    assert first > 0 and ctx.stats["pinned_reuses"] == 0
    _fake_run(model, x, ctx, backend)
    assert ctx.stats["pinned_allocations"] == first, "the second step allocated host buffers again"
    assert ctx.stats["pinned_reuses"] == first
    capped, backend2 = fake_async(min_offload_bytes=0, max_pool_bytes=0)
    _fake_run(model, x, capped, backend2)
    _fake_run(model, x, capped, backend2)
    assert capped.stats["pinned_reuses"] == 0 and capped.stats["pinned_allocations"] == 2 * first


@pytest.mark.parametrize("copied", [True, False], ids=["copy_completed", "copy_in_flight"])
def test_fake_async_inplace_raises_after_tensor_died(copied):
    """Modified in place while its asynchronous copy was in flight, then dropped: autograd (which
    would have held it) raises, so must we, whether the storage is then reloaded (the release
    saw the version move) or still on the device (replayed on it directly)."""
    x = make_input((4, 6), seed=9)
    ctx, backend = fake_async(min_offload_bytes=0)
    with ctx:
        y = x * 2
        out = torch.sin(y)
        y.add_(1)
        del y
    if copied:
        backend.complete()
    with pytest.raises(RuntimeError, match=INPLACE_ERROR.pattern) as err:
        out.sum().backward()
    assert INPLACE_ERROR.search(str(err.value)).groups() == ("1", "0")


def test_fake_async_unused_prefetch_is_ordered_before_reuse():
    """A prefetched reload that is dropped unused: the compute stream must wait on its copy
    before the allocator can hand its memory out again."""
    gen = make_generator(10)
    anchor = randn(2, gen=gen, device=CPU).requires_grad_()
    ctx, backend = fake_async(min_offload_bytes=0, prefetch=1)
    with ctx:
        a = randn(64, gen=gen, device=CPU)
        b = randn(64, gen=gen, device=CPU)
        out_a = SaveViews.apply(anchor, a)
        out_b = SaveViews.apply(anchor, b)
        del a, b
    backend.complete()
    out_b.sum().backward()          # unpacks b, prefetches a
    assert ctx.stats["prefetched_storages"] == 1
    prefetch_event = [e for kind, name, e in backend.log if kind == "record"][-1]
    assert prefetch_event not in backend.waits("compute")
    del out_a                       # a's graph goes away: the prefetched buffer is dropped unused
    gc.collect()
    assert prefetch_event in backend.waits("compute")


# ----------------------------------------------------------------------------- GPU tier

def _gpu_block_stack(dtype, n_layers=4):
    return make_stack(n_layers, d=256, heads=4, ff=640, dtype=dtype, device="cuda", seed=11)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_gradients_bitwise_and_stats(impl, dtype):
    model = _gpu_block_stack(dtype)
    x = make_input((2, 256, 256), dtype=dtype, device="cuda")
    want = _baseline(model, x)
    exp, total, _ = expected_stats(lambda: loss_of(model(x)), min_offload_bytes=1 << 16, module=model)
    for prefetch, inflight in ((2, 1 << 29), (0, 0), (4, 1 << 20)):
        kw = dict(prefetch=prefetch, max_inflight_bytes=inflight) if impl is fast_mod else {}
        ctx = impl.OffloadActivations(min_offload_bytes=1 << 16, module=model, **kw)
        for _ in range(2):
            clear_grads(model, x)
            with ctx:
                loss = loss_of(model(x))
            loss.backward()
            torch.cuda.synchronize()
            assert_bitwise(grads(model, x), want)
        got = {k: ctx.stats[k] for k in exp}
        assert got == {k: 2 * v for k, v in exp.items()}, f"stats {got} != 2 x {exp}"
        assert ctx.stats["offloaded_bytes"] <= 2 * total
    clear_grads(model, x)


@requires_gpu
@pytest.mark.gpu
def test_gpu_fast_machinery_no_sync_pool_prefetch():
    model = _gpu_block_stack(torch.bfloat16)
    x = make_input((2, 256, 256), dtype=torch.bfloat16, device="cuda")
    want = _baseline(model, x)
    ctx = fast_mod.OffloadActivations(min_offload_bytes=1 << 16, prefetch=2, max_inflight_bytes=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization raises
    try:
        for _ in range(2):
            clear_grads(model, x)
            with ctx:
                loss = loss_of(model(x))
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert_bitwise(grads(model, x), want)
    s = ctx.stats
    # max_inflight_bytes=0 releases every storage right after its copy: each is reloaded once per step
    assert s["reloaded_storages"] == s["offloaded_storages"] > 0
    assert s["reloaded_storages"] - s["prefetched_storages"] <= 2, "more than the first reload of each step on demand"
    assert s["pinned_allocations"] > 0 and s["pinned_reuses"] >= s["pinned_allocations"], \
        "the second step did not reuse the first step's pinned buffers"
    for eng in ctx._engines.values():
        assert not eng.fifo
        assert all(buf.is_pinned() for bufs in eng.pool.free.values() for buf in bufs)


def _mlp_stack(n_layers, d, dtype):
    gen = make_generator(12)
    layers = []
    for _ in range(n_layers):
        up, down = torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)
        with torch.no_grad():
            up.weight.copy_(randn(4 * d, d, gen=gen, device=CPU, scale=d ** -0.5))
            down.weight.copy_(randn(d, 4 * d, gen=gen, device=CPU, scale=(4 * d) ** -0.5))
        layers += [up, torch.nn.GELU(), down]
    return torch.nn.Sequential(*layers).to(device="cuda", dtype=dtype)


@requires_gpu
@pytest.mark.gpu
def test_gpu_peak_memory_and_no_leak():
    """Activations dominate (8 layers, 4096 tokens, d 1024, fp32: ~1.1 GiB saved, 256 MiB of
    weights): with no copy left in flight the forward keeps almost nothing on the device,
    the step's peak drops by at least 40% (gradients and the reload window remain), and
    nothing more than in the plain run is left after backward."""
    model = _mlp_stack(8, 1024, torch.float32)
    x = make_input((4096, 1024), device="cuda", requires_grad=False)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def step(ctx):
        clear_grads(model)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = loss_of(model(x))
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - start
        loss.backward()
        del loss
        gc.collect()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        leftover = torch.cuda.memory_allocated() - start - grad_bytes
        return peak, held, leftover, grads(model)

    step(None)  # warm-up
    peak_none, held_none, left_none, want = step(None)
    ctx = fast_mod.OffloadActivations(max_inflight_bytes=0, prefetch=1)
    step(ctx)
    peak_fast, held_fast, left_fast, got = step(ctx)
    assert_bitwise(got, want)
    print(f"peak: none {peak_none / 2**20:.0f} MiB, fast {peak_fast / 2**20:.0f} MiB; held after forward: "
          f"none {held_none / 2**20:.0f} MiB, fast {held_fast / 2**20:.0f} MiB")
    assert held_none > 2**30
    assert held_fast <= 0.2 * held_none, "activations stayed on the device after the forward"
    assert peak_fast <= 0.6 * peak_none
    assert left_fast == left_none, f"device bytes left after backward: {left_fast} (plain run: {left_none})"
    assert not any(eng.fifo for eng in ctx._engines.values())


def test_the_benchmarks_memory_measurement():
    """bench/view_replay_offload.py's CPU rows put the activation bytes a step holds in place beside the
    hooks' time; the measurement (weak references to the saved storages) sees what each context keeps:
    everything without offloading (and with save_on_cpu, whose .cpu() is a no-op on CPU tensors),
    nothing once ref or fast offloaded every activation."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "view_replay_offload.py"
    spec = importlib.util.spec_from_file_location("bench_view_replay_offload", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = bench.make_model(2, 32, 2, 64, 8, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 8, 32)

    def step():
        return model(x).square().mean()

    held = {name: bench.activations_held(model, step, make, keep_alive=(x,))[0] for name, make in dict(
        identity=lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        save_on_cpu=lambda: torch.autograd.graph.save_on_cpu(pin_memory=False),
        ref=lambda: ref_mod.OffloadActivations(min_offload_bytes=0, module=model),
        fast=lambda: fast_mod.OffloadActivations(min_offload_bytes=0, module=model)).items()}
    assert held["identity"] > 10_000 and held["save_on_cpu"] == held["identity"]
    assert held["ref"] == held["fast"] == 0, held
