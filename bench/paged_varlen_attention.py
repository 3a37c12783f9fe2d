"""Benchmark: paged varlen attention, forward and training, fast vs ref vs PyTorch varlen_attn / FlexAttention /
flash-attn.

    python bench/paged_varlen_attention.py          # or: make bench FEATURE=paged_varlen_attention

Cases (bf16, D = 128, GQA 32/8):
  prefill-16k     causal prefill, 16k tokens packed in documents of 512..8k
  prefill-16k-p16 the same keys read through a block table (page 16): should be within 10% of packed
  mixed-p16       a serving step over a paged cache (page 16): 4 prefill chunks of 1k new tokens on
                  3k cached + 64 decode rows on 4k contexts, one launch

Training cases (forward + backward through autograd, bf16, causal, GQA 32/8, the same 16k
packed tokens): train-16k-d128 and train-16k-d64.  Target: at least 0.9x PyTorch varlen_attn
(FlashAttention-2) forward + backward.

FLOPs = 4 * D * H_q * (visible query-key pairs), counted exactly per sequence (causal counts
about half of L_q * L_k).  Forward + backward counts 3.5x that (FlashAttention's convention: the
backward's five matmuls; our backward runs seven, recomputing QK^T and dO V^T for dQ, and is
credited only five).  TFLOP/s is reported with its fraction of this device's measured
dense bf16 matmul rate.  Without CUDA, only the reference's CPU time on a small case is measured.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import DEVICE, Recorder, device_ceilings, optional_import, run_bench  # noqa: E402

import ref.paged_varlen_attention as ref  # noqa: E402

FEATURE = "paged_varlen_attention"


def visible_pairs(l_q: int, l_k: int, left: int, right: int) -> int:
    """Number of (query, key) pairs the bottom-right-aligned window lets through."""
    total = 0
    for i in range(l_q):
        center = i + l_k - l_q
        lo = 0 if left < 0 else max(0, center - left)
        hi = l_k - 1 if right < 0 else min(l_k - 1, center + right)
        total += max(0, hi - lo + 1)
    return total


def make_case(q_lens, k_lens, *, h_q=32, h_kv=8, d=128, page_size=None, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(sum(q_lens), h_q, d, device=DEVICE, dtype=dtype, generator=gen)
    k = torch.randn(sum(k_lens), h_kv, d, device=DEVICE, dtype=dtype, generator=gen)
    v = torch.randn(sum(k_lens), h_kv, d, device=DEVICE, dtype=dtype, generator=gen)

    def cu(lengths):
        return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)

    case = dict(q=q, k=k, v=v, cu_q=cu(q_lens), cu_k=cu(k_lens), max_q=max(q_lens), max_k=max(k_lens),
                q_lens=q_lens, k_lens=k_lens, paged=None)
    if page_size:
        # Shuffled pages, as a serving system's allocator leaves them.
        pages = [-(-length // page_size) for length in k_lens]
        perm = torch.randperm(sum(pages), device="cpu")
        table = torch.zeros(len(k_lens), max(pages), dtype=torch.int32)
        k_pool = torch.empty(sum(pages), page_size, h_kv, d, device=DEVICE, dtype=dtype)
        v_pool = torch.empty_like(k_pool)
        cursor, start = 0, 0
        for i, (n_pages, length) in enumerate(zip(pages, k_lens)):
            ids = perm[cursor:cursor + n_pages]
            table[i, :n_pages] = ids.to(torch.int32)
            padded = n_pages * page_size
            kk = torch.zeros(padded, h_kv, d, device=DEVICE, dtype=dtype)
            vv = torch.zeros_like(kk)
            kk[:length], vv[:length] = k[start:start + length], v[start:start + length]
            k_pool[ids.to(DEVICE)] = kk.view(n_pages, page_size, h_kv, d)
            v_pool[ids.to(DEVICE)] = vv.view(n_pages, page_size, h_kv, d)
            cursor, start = cursor + n_pages, start + length
        case["paged"] = (k_pool, v_pool, table.to(DEVICE), torch.tensor(k_lens, dtype=torch.int32, device=DEVICE))
    return case


def call(mod, c, *, paged: bool, window=(-1, 0)):
    if paged:
        k_pool, v_pool, table, used = c["paged"]
        return lambda: mod.varlen_attn(c["q"], k_pool, v_pool, c["cu_q"], None, c["max_q"], c["max_k"],
                                       window_size=window, enable_gqa=True, block_table=table, seqused_k=used)
    return lambda: mod.varlen_attn(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["max_q"], c["max_k"],
                                   window_size=window, enable_gqa=True)


def peers(c, *, paged: bool):
    """(name, callable or None, why missing) for every public peer this machine may have."""
    out = []
    varlen = optional_import("torch.nn.attention.varlen")
    if varlen is None:
        out.append(("torch varlen_attn", None, "torch.nn.attention.varlen not available"))
    else:
        out.append(("torch varlen_attn", call(varlen, c, paged=paged), None))
    fa = optional_import("flash_attn")
    if fa is None:
        out.append(("flash-attn", None, "flash_attn not installed"))
    elif paged:
        k_pool, v_pool, table, used = c["paged"]
        if k_pool.shape[1] % 256 != 0:
            out.append(("flash-attn", None, "flash-attn 2 paged KV needs page_size % 256 == 0"))
        else:
            out.append(("flash-attn", lambda: fa.flash_attn_varlen_func(
                c["q"], k_pool, v_pool, c["cu_q"], c["cu_k"], c["max_q"], c["max_k"], causal=True,
                block_table=table), None))
    else:
        out.append(("flash-attn", lambda: fa.flash_attn_varlen_func(
            c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["max_q"], c["max_k"], causal=True), None))
    flex = optional_import("torch.nn.attention.flex_attention")
    if flex is None or paged:
        out.append(("FlexAttention", None, "not available" if flex is None else "no paged adapter here"))
    else:
        out.append(("FlexAttention", flex_document_causal(flex, c), None))
    if optional_import("flashinfer") is None:
        out.append(("FlashInfer", None, "flashinfer not installed"))
    else:
        out.append(("FlashInfer", None, "installed, but no adapter is written in this benchmark yet"))
    return out


def flex_document_causal(flex, c):
    """FlexAttention over the packed batch with a document-causal block mask (compiled once)."""
    doc_q = torch.repeat_interleave(torch.arange(len(c["q_lens"]), device=DEVICE),
                                    torch.tensor(c["q_lens"], device=DEVICE))
    pos_q = torch.arange(c["q"].shape[0], device=DEVICE) - c["cu_q"][:-1].long()[doc_q]
    doc_k = torch.repeat_interleave(torch.arange(len(c["k_lens"]), device=DEVICE),
                                    torch.tensor(c["k_lens"], device=DEVICE))
    pos_k = torch.arange(c["k"].shape[0], device=DEVICE) - c["cu_k"][:-1].long()[doc_k]
    shift = (torch.tensor(c["k_lens"], device=DEVICE) - torch.tensor(c["q_lens"], device=DEVICE))

    def mask_mod(b, h, qi, ki):
        return (doc_q[qi] == doc_k[ki]) & (pos_k[ki] <= pos_q[qi] + shift[doc_q[qi]])

    t_q, t_k = c["q"].shape[0], c["k"].shape[0]
    block_mask = flex.create_block_mask(mask_mod, None, None, t_q, t_k, device=DEVICE)
    attend = torch.compile(flex.flex_attention)
    q, k, v = (x.transpose(0, 1)[None] for x in (c["q"], c["k"], c["v"]))     # [1, H, T, D]
    return lambda: attend(q, k, v, block_mask=block_mask, enable_gqa=True)


def bench_gpu(rec: Recorder, args):
    import fast.paged_varlen_attention as fast
    ceil = device_ceilings()
    rec.add("device", "measured", "bf16 matmul", ceil["bf16_tflops"], "TFLOP/s")
    rec.add("device", "measured", "copy bandwidth", ceil["copy_gbps"], "GB/s")
    docs = [8192, 4096, 2048, 1024, 512, 512]                                  # 16k tokens
    prefill = make_case(docs, docs, page_size=16)
    mixed_q = [1024] * 4 + [1] * 64
    mixed_k = [4096] * 4 + [4096] * 64
    mixed = make_case(mixed_q, mixed_k, page_size=16, seed=1)
    cases = [("prefill-16k", prefill, False), ("prefill-16k-p16", prefill, True), ("mixed-p16", mixed, True)]
    if args.quick:
        cases = cases[:2]
    for name, c, paged in cases:
        flops = 4 * c["q"].shape[-1] * c["q"].shape[1] * sum(
            visible_pairs(lq, lk, -1, 0) for lq, lk in zip(c["q_lens"], c["k_lens"]))
        with torch.no_grad():
            fast_fn = call(fast, c, paged=paged)
            fast_fn()                                                           # autotune outside the timing
            ms = rec.time(name, "fast", fast_fn, flops=flops, ceilings=ceil)
            if name == "prefill-16k-p16" and ("prefill-16k", "fast") in rec.timed:
                rec.add(name, "fast", "paged / packed", ms / rec.timed[("prefill-16k", "fast")], "ratio")
            rec.time(name, "ref", call(ref, c, paged=paged), flops=flops, warmup=1, rep=3)
            for peer, fn, why in peers(c, paged=paged):
                if fn is None:
                    rec.missing(name, peer, why)
                    continue
                try:
                    fn()
                    rec.time(name, peer, fn, flops=flops)
                except Exception as e:  # a peer that cannot run this case is reported, not hidden
                    rec.missing(name, peer, f"failed: {type(e).__name__}: {str(e)[:80]}")
            rec.speedups(name)
    bench_train(rec, ceil, quick=args.quick)


def train_step(fn, leaves, grad_out):
    """One forward + backward through autograd (torch.autograd.grad: nothing accumulates in .grad)."""
    def step():
        o = fn()
        o = o[0] if isinstance(o, tuple) else o
        if o.dim() == 4:                                                   # FlexAttention: [1, H, T, D]
            o = o[0].transpose(0, 1)
        torch.autograd.grad(o, leaves, grad_out)
    return step


def bench_train(rec: Recorder, ceil: dict, *, quick: bool = False):
    import fast.paged_varlen_attention as fast
    docs = [8192, 4096, 2048, 1024, 512, 512]                                  # 16k tokens
    for d in (128,) if quick else (128, 64):
        name = f"train-16k-d{d}"
        c = make_case(docs, docs, d=d, seed=2)
        leaves = [c[x].requires_grad_() for x in ("q", "k", "v")]
        grad_out = torch.randn_like(c["q"])
        flops = 3.5 * 4 * d * c["q"].shape[1] * sum(visible_pairs(n, n, -1, 0) for n in docs)
        fast_step = train_step(call(fast, c, paged=False), leaves, grad_out)
        fast_step()                                                         # autotune outside the timing
        rec.time(name, "fast", fast_step, flops=flops, ceilings=ceil)
        contenders = [("ref", train_step(call(ref, c, paged=False), leaves, grad_out), None)]
        contenders += [(peer, fn and train_step(fn, leaves, grad_out), why) for peer, fn, why in peers(c, paged=False)
                       if peer != "FlashInfer"]
        for impl, fn, why in contenders:
            if fn is None:
                rec.missing(name, impl, why)
                continue
            try:
                fn()
                rec.time(name, impl, fn, flops=flops, **(dict(warmup=1, rep=3) if impl == "ref" else {}))
            except Exception as e:  # out of memory (the ref's score matrices) or a peer that cannot train
                rec.missing(name, impl, f"failed: {type(e).__name__}: {str(e)[:80]}")
                torch.cuda.empty_cache()
        rec.speedups(name)


def bench_cpu(rec: Recorder, args):
    docs = [512, 384, 128]
    c = make_case(docs, docs, h_q=8, h_kv=2, d=64, dtype=torch.float32)
    flops = 4 * 64 * 8 * sum(visible_pairs(n, n, -1, 0) for n in docs)
    rec.time("cpu-1k-causal-8/2-d64-fp32", "ref", call(ref, c, paged=False), flops=flops)


if __name__ == "__main__":
    sys.exit(run_bench(FEATURE, __doc__, gpu=bench_gpu, cpu=bench_cpu))
