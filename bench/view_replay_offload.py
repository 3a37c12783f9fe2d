"""Benchmark of view-replay activation offloading (ref/ and fast/view_replay_offload.py).

GPU (the target case): a stack of pre-norm transformer blocks (bf16, d_model 2048, seq 4096,
8 layers, 16 heads, SwiGLU 5632, RoPE buffers, fused qkv and gate/up projections whose
outputs autograd saves through views), one forward + backward step, for
    none         no offloading
    save_on_cpu  torch.autograd.graph.save_on_cpu(pin_memory=True)
    ref          ref OffloadActivations (synchronous pageable copies)
    fast         fast OffloadActivations (side stream, pinned pool, prefetch), one object reused
rows: step time (ms, median), peak activation memory (MiB above params + grads), whether the
gradients equal the first no-offload step's bitwise (the ``none`` row shows whether the
attention backward is itself deterministic on that GPU), bytes moved
device->host per step (save_on_cpu: every saved tensor's numel * itemsize, counted with a
recording hook; ours: ``stats["offloaded_bytes"]``), the measured pinned copy bandwidth and the
PCIe lower bound of each row (bytes / bandwidth), and the ratios the targets are about
(fast vs none: peak cut, step-time overhead; fast vs save_on_cpu: speedup, bytes).

CPU (meaningful without a GPU): the cost of the hooks themselves, in microseconds per saved
tensor of a small block stack (tiny activations, so copies cost next to nothing), for
identity hooks (the floor of any Python saved-tensor hook), save_on_cpu (on CPU tensors its
``.cpu()`` is a no-op), ref, fast.  Each implementation's own pack and unpack hooks are called
on the tensors one real step saves (pack all, unpack in reverse order, as backward does), so
the number is the hooks' work (bookkeeping, the tiny host copies, the reloads) without the
model around it; autograd's own cost of calling into Python (a few microseconds per saved
tensor) comes on top for every hook alike.  The implementations run interleaved, round
after round, each keeping its fastest run: on a shared machine the minimum is the estimate
least disturbed by other work (a difference of two whole step times is not: it drowns in
the noise there).  Beside that cost, what it buys, measured on the same model: the activation
bytes one real step's autograd graph still holds in place between forward and backward (the
device memory that offloading frees on a GPU), found by weak references to the storage of every
tensor autograd saves (parameters, buffers and the input left out), and the bytes ref and fast
copied out.  On a CPU, save_on_cpu's ``.cpu()`` returns the tensor itself, so it holds everything.

    python bench/view_replay_offload.py              # GPU rows on CUDA, else the CPU rows
    python bench/view_replay_offload.py --no-save    # print only
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import ON_GPU, Recorder, run_bench, time_ms  # noqa: E402

import fast.view_replay_offload as fast_mod  # noqa: E402
import ref.view_replay_offload as ref_mod  # noqa: E402

FEATURE = "view_replay_offload"


# ----------------------------------------------------------------------------- the model

class Block(torch.nn.Module):
    """Pre-norm block: RMSNorm, fused qkv, RoPE, causal SDPA, output projection, RMSNorm,
    fused gate/up, SwiGLU, down projection."""

    def __init__(self, d, heads, ff, seq, *, dtype, device):
        super().__init__()
        self.heads, self.ff = heads, ff
        kw = dict(dtype=dtype, device=device)
        self.norm1 = torch.nn.Parameter(torch.ones(d, **kw))
        self.norm2 = torch.nn.Parameter(torch.ones(d, **kw))
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False, **kw)
        self.proj = torch.nn.Linear(d, d, bias=False, **kw)
        self.gate_up = torch.nn.Linear(d, 2 * ff, bias=False, **kw)
        self.down = torch.nn.Linear(ff, d, bias=False, **kw)
        dh = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, dh, 2, device=device, dtype=torch.float32) / dh))
        ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)   # [T, Dh/2]
        self.register_buffer("cos", ang.cos().repeat(1, 2).to(dtype), persistent=False)  # [T, Dh]
        self.register_buffer("sin", ang.sin().repeat(1, 2).to(dtype), persistent=False)

    def rope(self, x):                                   # x [B, H, T, Dh]
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos + rot * self.sin

    def forward(self, x):                                # x [B, T, D]
        B, T, D = x.shape
        h = F.rms_norm(x, (D,), self.norm1)
        q, k, v = self.qkv(h).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)  # [B, H, T, Dh]
        x = x + self.proj(o.transpose(1, 2).reshape(B, T, D))
        g, u = self.gate_up(F.rms_norm(x, (D,), self.norm2)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def make_model(layers, d, heads, ff, seq, *, dtype, device, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[Block(d, heads, ff, seq, dtype=dtype, device=device) for _ in range(layers)])
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


def contexts(model, fast_obj):
    """impl name -> a zero-argument factory of the context manager for one step."""
    return {
        "none": contextlib.nullcontext,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=ON_GPU),
        "ref": lambda: ref_mod.OffloadActivations(module=model),
        "fast": lambda: fast_obj,
    }


def saved_tensor_bytes(run) -> tuple[int, int]:
    """(number of saved tensors, sum of numel * itemsize): what save_on_cpu copies each way."""
    count, total = 0, 0

    def pack(t):
        nonlocal count, total
        count += 1
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return count, total


# ----------------------------------------------------------------------------- GPU

def pinned_bandwidth_gbps(nbytes=1 << 30) -> tuple[float, float]:
    """Measured device->host and host->device GB/s into / out of pinned memory."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = time_ms(lambda: host.copy_(dev, non_blocking=True), warmup=50, rep=500)
    h2d = time_ms(lambda: dev.copy_(host, non_blocking=True), warmup=50, rep=500)
    return nbytes / (d2h * 1e-3) / 1e9, nbytes / (h2d * 1e-3) / 1e9


def bench_gpu(rec: Recorder, args):
    dtype = torch.bfloat16
    model = make_model(args.layers, args.d_model, args.heads, args.ff, args.seq, dtype=dtype, device="cuda")
    x = torch.randn(args.batch, args.seq, args.d_model, dtype=dtype, device="cuda")
    case = f"bf16 L{args.layers} d{args.d_model} T{args.seq} B{args.batch}"

    def step():
        loss = model(x).float().square().mean()
        return loss

    fast_obj = fast_mod.OffloadActivations(module=model)
    d2h_gbps, h2d_gbps = pinned_bandwidth_gbps()
    rec.add(case, "device", "pinned_d2h_bw", d2h_gbps, "GB/s")
    rec.add(case, "device", "pinned_h2d_bw", h2d_gbps, "GB/s")
    n_saved, soc_bytes = saved_tensor_bytes(step)

    # Gradient buffers exist before every measurement: peaks count activations + temporaries.
    step().backward()
    torch.cuda.synchronize()
    want = [p.grad.clone() for p in model.parameters()]
    def copy_ms(nbytes):  # both directions at the measured pinned bandwidth
        return nbytes / (d2h_gbps * 1e9) * 1e3 + nbytes / (h2d_gbps * 1e9) * 1e3

    results = {}
    for impl, make_ctx in contexts(model, fast_obj).items():
        last = {}

        def fwd_bwd():
            ctx = make_ctx()
            with ctx:
                loss = step()
            loss.backward()
            last["ctx"] = ctx

        gc.collect()
        torch.cuda.empty_cache()
        model.zero_grad(set_to_none=False)
        fwd_bwd()  # warm-up (and fast's pinned pool fills here)
        torch.cuda.synchronize()
        same = all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
        before = dict(getattr(last["ctx"], "stats", {}))
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        moved = soc_bytes if impl == "save_on_cpu" else 0
        if impl in ("ref", "fast"):  # one step's bytes (fast's object is reused across steps)
            after = last["ctx"].stats
            moved = after["offloaded_bytes"] - (before["offloaded_bytes"] if last["ctx"] is fast_obj else 0)
        ms = time_ms(fwd_bwd, warmup=1, rep=max(200, 10 * args.rep_steps))
        results[impl] = dict(ms=ms, peak=peak, bytes=moved)
        rec.add(case, impl, "step_time", ms, "ms")
        rec.add(case, impl, "peak_activation_mem", peak, "MiB")
        rec.add(case, impl, "grads_bitwise_equal_to_none", float(same), "bool")
        if impl != "none":
            rec.add(case, impl, "d2h_bytes", moved / 2**20, "MiB/step")
            rec.add(case, impl, "pcie_lower_bound", copy_ms(moved), "ms")
    f, n, s = results["fast"], results["none"], results["save_on_cpu"]
    rec.add(case, "fast", "peak_cut_vs_none", 1 - f["peak"] / n["peak"], "fraction")
    rec.add(case, "fast", "overhead_vs_none", f["ms"] / n["ms"] - 1, "fraction")
    rec.add(case, "fast", "speedup_vs_save_on_cpu", s["ms"] / f["ms"], "x")
    rec.add(case, "fast", "bytes_vs_save_on_cpu", f["bytes"] / s["bytes"], "fraction")
    print(f"\n{n_saved} saved tensors per step.  Targets (fast): peak cut >= 50% "
          f"[{1 - f['peak'] / n['peak']:.0%}], step overhead <= 10% [{f['ms'] / n['ms'] - 1:+.0%}], "
          f">= 1.3x faster than save_on_cpu [{s['ms'] / f['ms']:.2f}x], fewer bytes "
          f"[{f['bytes'] / 2**20:.0f} vs {s['bytes'] / 2**20:.0f} MiB]")
    print(f"time to move fast's bytes both ways at the measured pinned bandwidth: {copy_ms(f['bytes']):.1f} ms "
          f"(no-offload step: {n['ms']:.1f} ms); the copies hide behind compute only up to that")


# ----------------------------------------------------------------------------- CPU

def _interleaved_min_ms(fns: dict, budget_s: float, min_rounds: int = 20) -> dict:
    """Fastest wall time of each zero-argument callable, run round-robin so that load from other
    work on a shared machine falls on all of them alike."""
    best = {name: float("inf") for name in fns}
    deadline, rounds = time.perf_counter() + budget_s, 0
    while rounds < min_rounds or (time.perf_counter() < deadline and rounds < 5000):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
        rounds += 1
    return best


def bench_cpu(rec: Recorder, args):
    torch.set_num_threads(1)  # the hook cost, not how a tiny matmul spreads over cores
    layers, d, heads, ff, seq = 4, 32, 2, 64, 8
    model = make_model(layers, d, heads, ff, seq, dtype=torch.float32, device="cpu")
    x = torch.randn(1, seq, d)
    case = f"cpu hooks fp32 L{layers} d{d} T{seq}"

    def step():
        return model(x).square().mean()

    fast_obj = fast_mod.OffloadActivations(min_offload_bytes=0, module=model)
    makers = {
        "identity_hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=False),
        "ref": lambda: ref_mod.OffloadActivations(min_offload_bytes=0, module=model),
        "fast": lambda: fast_obj,
    }

    # Pack every tensor one real step saves (held alive, as autograd would), then unpack them
    # in reverse, through each context manager's own pack/unpack hooks.
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t.detach())[1], lambda t: t):
        loss = step()
    del loss
    n_saved = len(saved)

    def hooks_only(make_ctx):
        def run():
            ctx = make_ctx()
            packed = [ctx.pack_hook(t) for t in saved]
            for h in reversed(packed):
                ctx.unpack_hook(h)
        return run

    budget_s = 0.3 if args.quick else args.cpu_budget_s
    best = _interleaved_min_ms({k: hooks_only(m) for k, m in makers.items()}, budget_s * len(makers))
    rec.add(case, "none", "saved_tensors", n_saved, "count/step")
    for impl, ms in best.items():
        rec.add(case, impl, "hook_time_per_saved_tensor", ms * 1e3 / n_saved, "us")

    # What the time buys: the activation bytes one real step leaves in place between forward and
    # backward, through each context manager (fresh objects, entered as in training).
    fresh = {**makers, "fast": lambda: fast_mod.OffloadActivations(min_offload_bytes=0, module=model)}
    in_place = {}
    for impl, make_ctx in fresh.items():
        held, ctx = activations_held(model, step, make_ctx, keep_alive=(x,))
        in_place[impl] = held
        rec.add(case, impl, "activations_in_place", held / 2**10, "KiB")
        if impl in ("ref", "fast"):
            rec.add(case, impl, "offloaded", ctx.stats["offloaded_bytes"] / 2**10, "KiB/step")
            for key in ("kept", "offloaded_storages", "replayed_views"):
                rec.add(case, impl, key, ctx.stats[key], "count/step")
    print("\nactivation bytes left in place between forward and backward: "
          + ", ".join(f"{k} {v / 2**10:.1f} KiB" for k, v in in_place.items())
          + "\n(on a CPU save_on_cpu's .cpu() is a no-op, so it leaves everything in place; on a GPU it moves "
          "every saved tensor, views included, to the host)")
    print("No kernel here: the CPU rows measure the hooks' Python overhead (CPU tensors copied to "
          "separate host buffers) and the activation bytes they free; step time, peak device memory and copy "
          "overlap need CUDA (run this on a GPU).")


def activations_held(model, step, make_ctx, keep_alive=()) -> tuple[int, object]:
    """Bytes of the activation storages that one forward's autograd graph still holds, in place,
    when the forward is done: what sits in the device's memory until backward.  Measured, not
    counted from a context manager's own stats: the context's pack hook is wrapped to take a weak
    reference to the storage of every tensor autograd saves; after the forward, with only the
    loss (and so the graph) alive, a storage whose weak reference still resolves is held.
    Parameters, buffers and ``keep_alive`` tensors (the input) are left out: they live anyway.
    Runs the backward afterwards.  Returns (bytes, the context manager)."""
    live_anyway = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers(), *keep_alive]}
    storages = {}                                      # id -> (weak reference, bytes)
    ctx = make_ctx()
    inner = ctx.pack_hook

    def recording_pack(t):
        s = t.untyped_storage()
        if id(s) not in live_anyway:
            storages.setdefault(id(s), (weakref.ref(s), s.nbytes()))
        return inner(t)

    ctx.pack_hook = recording_pack                     # pushed by __enter__ (saved_tensors_hooks)
    with ctx:
        loss = step()
    gc.collect()
    held = sum(nbytes for ref, nbytes in storages.values() if ref() is not None)
    loss.backward()
    return held, ctx


def _flags(ap):
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ff", type=int, default=5632)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rep-steps", type=int, default=20, help="GPU: about this many timed steps")
    ap.add_argument("--cpu-budget-s", type=float, default=2.0, help="CPU: seconds of timing per impl")


if __name__ == "__main__":
    sys.exit(run_bench(FEATURE, __doc__, gpu=bench_gpu, cpu=bench_cpu, configure=_flags))
