"""Gated DeltaNet benchmark: the chunked forward (prefill), forward + backward (training), decode.

    python bench/gated_deltanet.py              # everything this device can run
    python bench/gated_deltanet.py --quick      # one forward, one training and two decode cases

Forward (bf16, K = V = 128, Qwen3.5 heads: H = 16 q/k heads, HV in {16, 32, 64} value heads,
use_qk_l2norm_in_kernel=True, no initial state): T in {2k, 8k, 32k} as one sequence, and varlen
mixes of 32k tokens.  Reported: ms; TFLOP/s with the algorithmic count of the chunk form, per
token per value head (C = 64):
    6 C K (K K^T, w, q K^T)  +  4 C V (u, scores x v_new)  +  6 K V (w h, K^T v_new, q h)  +  C^2 / 3 (solve)
(1.82e5 FLOP at K = V = 128; fast/gated_deltanet.py derives it); the fraction of the device's
measured bf16 matmul rate; speedup over the reference chunk form and over fla's
``chunk_gated_delta_rule`` (fla 0.6.0, its FlashQLA dispatch off: FLA_FLASH_QLA=0) when fla is
installed.  Target on H100 / H200: at least 1.0x fla.

Training (forward + backward; the same shapes; dq, dk, dv, dg, dbeta from a random output gradient
through torch.autograd.grad): ms; TFLOP/s with the forward's count plus the backward's as executed
(C = 64, per token per value head; fast/gated_deltanet.py derives it):
    20 C K (recompute w; K Q^T; Q K^T, dP K, dP^T Q; the WY terms)  +  10 C V  +  16 K V
(5.08e5 FLOP at K = V = 128; forward + backward 6.90e5); speedup over the reference's autograd
(T <= 2k: its chunk form keeps every substitution step for backward) and over fla's chunk
backward; peak device memory (torch.cuda.max_memory_allocated over one step, inputs included)
beside fla's (peak_MiB: max_memory_allocated, the rotated input sets included; step_MiB: that peak
above what was allocated before the step).  Targets on H100 / H200: at least 1.0x fla, peak memory
no more than fla's.

Decode (T = 1, HV = 32, H = 16, K = V = 128, batch 1 .. 256, initial state given, final state
returned): ms and GB/s of the minimum bytes (the fp32 state read and written, N HV K V 4 2, plus q,
k, v, g, beta, o) over the measured copy bandwidth; speedup over the reference recurrence and over
fla's ``fused_recurrent_gated_delta_rule``.  Target: >= 70% of bandwidth at batch >= 64.

Without CUDA only the reference runs (its CPU speed, small shapes); kernel timings need CUDA.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("FLA_FLASH_QLA", "0")   # fla 0.6.0 would dispatch to FlashQLA on Hopper otherwise

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import (DEVICE, copies_for_rotation, device_ceilings, optional_import,  # noqa: E402
                           peak_memory_mb, rotating, run_bench)
import ref.gated_deltanet as ref  # noqa: E402

C = 64


def chunk_flops(tokens: int, hv: int, dk: int, dv: int) -> float:
    """Algorithmic FLOPs of the chunk forward (see the module docstring)."""
    return tokens * hv * (6 * C * dk + 4 * C * dv + 6 * dk * dv + C * C / 3)


def chunk_bwd_flops(tokens: int, hv: int, dk: int, dv: int) -> float:
    """FLOPs of the chunk backward as executed, recomputation included (see the module docstring)."""
    return tokens * hv * (20 * C * dk + 10 * C * dv + 16 * dk * dv)


def decode_bytes(n: int, h: int, hv: int, dk: int, dv: int, elt: int = 2) -> int:
    """Minimum bytes of one decode step: state read + write (fp32), q, k, v, o, g (fp32), beta."""
    return n * hv * dk * dv * 4 * 2 + 2 * n * h * dk * elt + 2 * n * hv * dv * elt + n * hv * (4 + elt)


def make_inputs(b, t, h, hv, dk, dv, *, dtype=torch.bfloat16, state=False, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(b, t, h, dk, device=DEVICE, dtype=dtype, generator=gen)
    k = torch.randn(b, t, h, dk, device=DEVICE, dtype=dtype, generator=gen)
    v = torch.randn(b, t, hv, dv, device=DEVICE, dtype=dtype, generator=gen)
    g = F.logsigmoid(torch.randn(b, t, hv, device=DEVICE, dtype=torch.float32, generator=gen))
    beta = torch.rand(b, t, hv, device=DEVICE, dtype=dtype, generator=gen)
    h0 = torch.randn(b, hv, dk, dv, device=DEVICE, dtype=torch.float32, generator=gen) if state else None
    return q, k, v, g, beta, h0


def _fla():
    """fla's gated delta rule module and version, or (None, why)."""
    mod = optional_import("fla.ops.gated_delta_rule")
    if mod is None:
        return None, "fla (flash-linear-attention) not installed"
    version = getattr(optional_import("fla"), "__version__", "?")
    return mod, version


def _fla_chunk(fla, h, hv):
    """fla's chunk_gated_delta_rule.  Where its version rejects GVA (HV > H), q and k are repeated to
    HV heads inside the call (what fla's own GatedDeltaNet layer does), so their cost is counted;
    ``fn.label`` says which ran."""
    def fn(q, k, v, g, beta, **kw):
        if fn.native:
            try:
                return fla.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
            except Exception:
                if hv == h:
                    raise
                fn.native, fn.label = False, " (q/k repeated to HV)"
        q, k = (x.repeat_interleave(hv // h, dim=2) for x in (q, k))
        return fla.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    fn.native, fn.label = True, ""
    return fn


def bench_forward(rec, cases, fast, fla, fla_version, ceilings, *, with_ref=True):
    h, dk, dv = 16, 128, 128
    for name, hv, lengths in cases:
        t = sum(lengths)
        cu = None
        if len(lengths) > 1:
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        per_set = t * (2 * h * dk + hv * dv + hv) * 2
        sets = [make_inputs(1, t, h, hv, dk, dv, seed=i)[:5] for i in range(copies_for_rotation(per_set, max_sets=4))]
        kw = dict(output_final_state=False, use_qk_l2norm_in_kernel=True)
        flops = chunk_flops(t, hv, dk, dv)
        rec.time(name, "fast", rotating(lambda *x: fast.chunk_gated_delta_rule(*x, cu_seqlens=cu, **kw), sets),
                 flops=flops, ceilings=ceilings)
        if with_ref:
            rec.time(name, "ref", lambda: ref.chunk_gated_delta_rule(*sets[0], cu_seqlens=cu, **kw), warmup=1, rep=1)
        if fla is None:
            rec.missing(name, "fla chunk_gated_delta_rule", fla_version)
            rec.speedups(name)
            continue
        cu64 = None if cu is None else cu.long()
        fla_fn = _fla_chunk(fla, h, hv)
        o_fla, _ = fla_fn(*sets[0], cu_seqlens=cu64, **kw)
        rec.time(name, f"fla {fla_version}{fla_fn.label}", rotating(lambda *x: fla_fn(*x, cu_seqlens=cu64, **kw), sets),
                 flops=flops)
        rec.speedups(name)
        o_fast, _ = fast.chunk_gated_delta_rule(*sets[0], cu_seqlens=cu, **kw)
        diff = (o_fast.float() - o_fla.float()).pow(2).mean().sqrt() / o_fla.float().pow(2).mean().sqrt()
        rec.add(name, "fast", "rms_diff_vs_fla", diff.item(), "")


def _train_step(fn, q, k, v, g, beta, do, cu):
    """One forward + backward: the gradients of <o, do> w.r.t. q, k, v, g, beta."""
    o, _ = fn(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    return torch.autograd.grad(o, (q, k, v, g, beta), do)


def bench_train(rec, cases, fast, fla, fla_version, ceilings, *, h=16, dk=128, dv=128, dtype=torch.bfloat16,
                ref_max_tokens=2048):
    for name, hv, lengths in cases:
        name = name.replace("fwd", "fwd+bwd")
        t = sum(lengths)
        cu = None
        if len(lengths) > 1:
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        per_set = t * (2 * h * dk + 2 * hv * dv + hv) * 2
        sets = []
        for i in range(copies_for_rotation(per_set, max_sets=3)):
            x = [y.requires_grad_() for y in make_inputs(1, t, h, hv, dk, dv, dtype=dtype, seed=i)[:5]]
            sets.append(x + [torch.randn(1, t, hv, dv, device=DEVICE, dtype=dtype)])
        flops = chunk_flops(t, hv, dk, dv) + chunk_bwd_flops(t, hv, dk, dv)
        rec.time(name, "fast", rotating(lambda *x: _train_step(fast.chunk_gated_delta_rule, *x, cu), sets),
                 flops=flops, ceilings=ceilings)
        base = torch.cuda.memory_allocated() / 2**20            # the input sets, alive for both
        peak = peak_memory_mb(lambda: _train_step(fast.chunk_gated_delta_rule, *sets[0], cu))
        rec.add(name, "fast", "peak_MiB", peak, "MiB")
        rec.add(name, "fast", "step_MiB", peak - base, "MiB")
        if t <= ref_max_tokens:
            rec.time(name, "ref", lambda: _train_step(ref.chunk_gated_delta_rule, *sets[0], cu), warmup=1, rep=1)
        if fla is None:
            rec.missing(name, "fla chunk_gated_delta_rule", fla_version)
            rec.speedups(name)
            continue
        cu64 = None if cu is None else cu.long()
        fla_fn = _fla_chunk(fla, h, hv)
        _train_step(fla_fn, *sets[0], cu64)                    # (settles fla_fn.label before the peak)
        peak_fla = peak_memory_mb(lambda: _train_step(fla_fn, *sets[0], cu64))
        rec.time(name, f"fla {fla_version}{fla_fn.label}", rotating(lambda *x: _train_step(fla_fn, *x, cu64), sets),
                 flops=flops)
        rec.speedups(name)
        rec.add(name, f"fla {fla_version}{fla_fn.label}", "peak_MiB", peak_fla, "MiB")
        rec.add(name, f"fla {fla_version}{fla_fn.label}", "step_MiB", peak_fla - base, "MiB")
        rec.add(name, "fast", "peak_vs_fla", peak / peak_fla, "x")
        g_fla = _train_step(fla_fn, *sets[0], cu64)
        g_fast = _train_step(fast.chunk_gated_delta_rule, *sets[0], cu)
        for gname, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), g_fast, g_fla):
            diff = (a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()
            rec.add(name, "fast", f"rms_diff_vs_fla_{gname}", diff.item(), "")


def bench_decode(rec, batches, fast, fla, fla_version, ceilings):
    h, hv, dk, dv = 16, 32, 128, 128
    for n in batches:
        name = f"decode B={n} HV={hv}"
        nbytes = decode_bytes(n, h, hv, dk, dv)
        sets = [make_inputs(n, 1, h, hv, dk, dv, state=True, seed=i) for i in range(copies_for_rotation(nbytes))]
        kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)

        def run(fn, q, k, v, g, beta, h0):     # fla's recurrent signature: gk, gv come before beta
            return fn(q, k, v, g=g, beta=beta, initial_state=h0, **kw)

        rec.time(name, "fast", rotating(lambda *x: run(fast.fused_recurrent_gated_delta_rule, *x), sets),
                 nbytes=nbytes, ceilings=ceilings)
        rec.time(name, "ref", lambda: run(ref.fused_recurrent_gated_delta_rule, *sets[0]), nbytes=nbytes)
        if fla is None:
            rec.missing(name, "fla fused_recurrent", fla_version)
        else:
            def fla_recurrent(q, k, v, g, beta, h0):
                return fla.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, **kw)
            rec.time(name, f"fla {fla_version}", rotating(fla_recurrent, sets), nbytes=nbytes)
        rec.speedups(name)


def bench_cpu(rec, args):
    """What a CPU can say: the reference's own speed (the spec, not a kernel)."""
    h, hv, dk, dv = 2, 4, 64, 64
    for t in (256,) if args.quick else (256, 1024):
        q, k, v, g, beta, _ = make_inputs(1, t, h, hv, dk, dv, dtype=torch.float32)
        kw = dict(use_qk_l2norm_in_kernel=True)
        case = f"cpu ref T={t} HV={hv} K=V={dk}"
        rec.time(case, "ref chunk", lambda: ref.chunk_gated_delta_rule(q, k, v, g, beta, **kw),
                 flops=chunk_flops(t, hv, dk, dv))
        rec.time(case, "ref recurrent", lambda: ref.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw))
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
        do = torch.randn(1, t, hv, dv)
        rec.time(case + " fwd+bwd", "ref chunk", lambda: _train_step(ref.chunk_gated_delta_rule, *leaves, do, None),
                 flops=chunk_flops(t, hv, dk, dv) + chunk_bwd_flops(t, hv, dk, dv))


def bench_gpu(rec, args):
    import fast.gated_deltanet as fast
    fla, fla_version = _fla()
    ceilings = device_ceilings()
    print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['bf16_tflops']:.0f} TFLOP/s")
    forward = [(f"fwd T={t // 1024}k HV={hv}", hv, [t]) for hv in (16, 32, 64) for t in (2048, 8192, 32768)]
    forward += [("fwd varlen 32k (8x4k) HV=32", 32, [4096] * 8),
                ("fwd varlen 32k (mixed) HV=32", 32, [17000, 64, 1, 8191, 4096, 2000, 1416])]
    batches = [1, 4, 16, 64, 128, 256]
    if args.quick:
        forward, batches = forward[4:5], [1, 64]
    bench_forward(rec, forward, fast, fla, fla_version, ceilings)
    bench_train(rec, forward, fast, fla, fla_version, ceilings)
    bench_decode(rec, batches, fast, fla, fla_version, ceilings)


if __name__ == "__main__":
    sys.exit(run_bench("gated_deltanet", __doc__, gpu=bench_gpu, cpu=bench_cpu))
