"""FlashDecoding benchmark: split-KV decode vs one split, the reference, and the installed peers.

    python bench/flash_decoding.py               # the full grid on a GPU (bench/run.py calls this)
    python bench/flash_decoding.py --quick       # B in {1, 16}, contexts {8k, 32k}, 32/8 heads
    python bench/flash_decoding.py --flex-all    # FlexAttention on every case (one compile per shape)
    python bench/flash_decoding.py --quick --programs-per-sm 2 3 4   # the gate's programs per SM, swept

Grid: B in {1, 4, 16, 64, 256} x context in {1k, 8k, 32k, 128k} x H_q/H_kv in
{32/8, 64/8}, D = 128, bf16, one query row, paged cache with 16-key pages handed out as a random
permutation of the pool.  A case whose cache does not fit in device memory is recorded as missing.

What is measured, per case
    fast            fast.flash_decode with the shape gate (num_splits=None), timed as a CUDA-graph
                    replay: that is how decode steps run in a serving loop, and inside a captured
                    graph the per-call host value check (one small device-to-host copy) is skipped.
    fast eager      the same call without a graph: the host check and the launch latency included.
    fast splits=1   num_splits=1 (no partials, batch-invariant), CUDA graph as above.
    ref             ref.flash_decode (a Python loop per sequence), only where B * context <= 1M keys.
    sdpa            torch SDPA (enable_gqa) on a contiguous copy of the cache [B, H_kv, L, D].
    flex            FlexAttention (compiled, dynamic=False) on the same contiguous copy; by default
                    only on B in {1, 16} at 32k (one compile per shape); --flex-all for every case.
    flash_attn      flash_attn_with_kvcache on the contiguous copy (FA2 pages must be >= 256 keys).
    flashinfer      BatchDecodeWithPagedKVCacheWrapper on the same paged pool (NHD, 16-key pages).
A peer that is not installed, fails, or has no room for its contiguous copy is a ``missing`` row.

Numbers
    bytes = K and V read once (B * L * H_kv * D * 2 * 2 bytes) + q + out; GB/s = bytes / time;
    frac_copy_bw = GB/s / the device's measured copy bandwidth; speedups of fast over each other
    row.  Split partials (2 * B * H_q * num_splits * (D + 1) * 4 bytes) are reported separately and
    not counted in GB/s.  TFLOP/s uses 4 * B * H_q * L * D.

Without CUDA the script prints the shape gate's decision for every case (an H100's 132 SMs) and
times the reference on one small CPU case (kernel timings need CUDA).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import (DEVICE, Recorder, copies_for_rotation, device_ceilings, optional_import,  # noqa: E402
                     rotating, run_bench, time_ms)

import ref.flash_decoding as ref  # noqa: E402

PAGE = 16
HEAD_DIM = 128
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (1024, 8192, 32768, 131072)
HEADS = ((32, 8), (64, 8))
REF_MAX_KEYS = 1 << 20
FLEX_DEFAULT = {(1, 32768), (16, 32768)}


def case_name(b, ctx, h_q, h_kv):
    return f"B{b}-L{ctx // 1024}k-H{h_q}/{h_kv}"


def kv_bytes(b, ctx, h_kv, elt=2):
    return b * ctx * h_kv * HEAD_DIM * 2 * elt


def build_inputs(b, ctx, h_q, h_kv, *, gen_seed):
    """One input set on the GPU: q [B, 1, H_q, D], a paged pool [B * ctx / 16, 16, H_kv, D] whose
    pages are a random permutation, the block table, seqused_k = ctx."""
    torch.manual_seed(gen_seed)
    pages = b * ctx // PAGE
    dt = torch.bfloat16
    q = torch.randn(b, 1, h_q, HEAD_DIM, device=DEVICE, dtype=dt)
    k = torch.randn(pages, PAGE, h_kv, HEAD_DIM, device=DEVICE, dtype=dt)
    v = torch.randn(pages, PAGE, h_kv, HEAD_DIM, device=DEVICE, dtype=dt)
    table = torch.randperm(pages, device=DEVICE).to(torch.int32).view(b, ctx // PAGE)
    used = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
    return dict(q=q, k=k, v=v, table=table, used=used)


def dense_copy(inp):
    """The paged cache gathered into [B, L, H_kv, D] (the layout SDPA / flex / flash-attn read)."""
    b = inp["table"].shape[0]
    k = inp["k"][inp["table"].long()].reshape(b, -1, *inp["k"].shape[2:])
    v = inp["v"][inp["table"].long()].reshape(b, -1, *inp["v"].shape[2:])
    return k, v


def graph_of(fn):
    """Capture ``fn`` in a CUDA graph (warmed up on a side stream first, as PyTorch recommends)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graphs(fns):
    graphs = [graph_of(fn) for fn in fns]
    return time_ms(rotating(lambda g: g.replay(), [(g,) for g in graphs]))


def gpu_case(rec, fast, b, ctx, h_q, h_kv, *, peers, flex_all, ceilings, programs_per_sm=()):
    name = case_name(b, ctx, h_q, h_kv)
    set_bytes = kv_bytes(b, ctx, h_kv)
    free, _ = torch.cuda.mem_get_info()
    if set_bytes > 0.85 * free:
        for impl in ("fast", "fast splits=1", "ref", *peers):
            rec.missing(name, impl, f"the cache ({set_bytes / 2**30:.1f} GiB) does not fit in device memory")
        return
    n_sets = max(1, min(copies_for_rotation(set_bytes), int(0.5 * free // set_bytes)))
    sets = [build_inputs(b, ctx, h_q, h_kv, gen_seed=i) for i in range(n_sets)]
    io_bytes = 2 * b * h_q * HEAD_DIM * 2
    total_bytes = set_bytes + io_bytes
    flops = 4 * b * h_q * ctx * HEAD_DIM
    outs = [torch.empty_like(s["q"]) for s in sets]

    def fast_fn(s, out, splits):
        return lambda: fast.flash_decode(s["q"], s["k"], s["v"], s["used"], block_table=s["table"],
                                         num_splits=splits, out=out)

    times = {}
    times["fast"] = time_graphs([fast_fn(s, o, None) for s, o in zip(sets, outs)])
    times["fast eager"] = time_ms(rotating(lambda f: f(), [(fast_fn(s, o, None),) for s, o in zip(sets, outs)]))
    times["fast splits=1"] = time_graphs([fast_fn(s, o, 1) for s, o in zip(sets, outs)])
    planned = fast._PROGRAMS_PER_SM
    for per_sm in programs_per_sm:          # --programs-per-sm: the gate planning more programs per SM
        fast._PROGRAMS_PER_SM = per_sm
        try:
            times[f"fast {per_sm} programs/SM"] = time_graphs([fast_fn(s, o, None) for s, o in zip(sets, outs)])
        finally:
            fast._PROGRAMS_PER_SM = planned
    rows = fast._fwd_config(HEAD_DIM, torch.bfloat16, h_q // h_kv, True, 16, DEVICE)
    splits = fast.choose_num_splits(b, h_kv, ctx, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                                    num_q_tiles=rows["num_q_tiles"], block_n=rows["BLOCK_N"],
                                    programs_per_sm=fast._PROGRAMS_PER_SM)
    splits = min(splits, fast._traffic_splits(ctx, h_q // h_kv, HEAD_DIM, 2, fused=fast._FUSED_MERGE))  # the cap
    rec.add(name, "fast", "num_splits", splits)
    # bf16 partial outputs and fp32 partial lse, written once and read once by the merging program: all but
    # its own (the fused merge), or all of them by the merge kernel
    partials = splits - 1 if fast._FUSED_MERGE else splits
    rec.add(name, "fast", "partials_MB", 2 * b * h_q * partials * (HEAD_DIM * 2 + 4) / 2**20 if splits > 1 else 0,
            "MB")

    if b * ctx <= REF_MAX_KEYS:
        s = sets[0]
        times["ref"] = time_ms(lambda: ref.flash_decode(s["q"], s["k"], s["v"], s["used"], block_table=s["table"]))
    else:
        rec.missing(name, "ref", f"not timed above {REF_MAX_KEYS} keys in the batch (a Python loop per sequence)")

    # Peers on a contiguous copy of the first input set (they cannot read a 16-key paged cache).
    s = sets[0]
    want_dense = any(p in peers for p in ("sdpa", "flex", "flash_attn"))
    dense = None
    if want_dense:
        if set_bytes > 0.8 * torch.cuda.mem_get_info()[0]:
            for p in ("sdpa", "flex", "flash_attn"):
                if p in peers:
                    rec.missing(name, p, "no room for the contiguous copy of the cache it needs")
        else:
            dense = dense_copy(s)
    if dense is not None and "sdpa" in peers:
        qt, kt, vt = s["q"].transpose(1, 2), dense[0].transpose(1, 2), dense[1].transpose(1, 2)
        try:
            sdpa = torch.nn.functional.scaled_dot_product_attention
            times["sdpa"] = time_ms(lambda: sdpa(qt, kt, vt, enable_gqa=True))
        except Exception as e:  # a peer failing is a finding, not a crash
            rec.missing(name, "sdpa", f"failed: {type(e).__name__}: {str(e)[:120]}")
    if dense is not None and "flex" in peers:
        if flex_all or (b, ctx) in FLEX_DEFAULT:
            try:
                from torch.nn.attention.flex_attention import flex_attention
                flex = torch.compile(flex_attention, dynamic=False)
                qt, kt, vt = s["q"].transpose(1, 2), dense[0].transpose(1, 2), dense[1].transpose(1, 2)
                flex(qt, kt, vt, enable_gqa=True)
                times["flex"] = time_ms(lambda: flex(qt, kt, vt, enable_gqa=True))
            except Exception as e:
                rec.missing(name, "flex", f"failed: {type(e).__name__}: {str(e)[:120]}")
        else:
            rec.missing(name, "flex", "not run by default (one compile per shape); --flex-all runs it")
    if dense is not None and "flash_attn" in peers:
        fa = optional_import("flash_attn")
        if fa is None:
            rec.missing(name, "flash_attn", "flash_attn is not installed")
        else:
            try:
                fn = lambda: fa.flash_attn_with_kvcache(s["q"], dense[0], dense[1], cache_seqlens=s["used"],  # noqa: E731
                                                        causal=True, num_splits=0)
                fn()
                times["flash_attn"] = time_ms(fn)
            except Exception as e:
                rec.missing(name, "flash_attn", f"failed: {type(e).__name__}: {str(e)[:120]}")
    dense = None  # free the contiguous copy before the next peer
    if "flashinfer" in peers:
        fi = optional_import("flashinfer")
        if fi is None:
            rec.missing(name, "flashinfer", "flashinfer is not installed")
        else:
            try:
                workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
                pages_per = ctx // PAGE
                indptr = torch.arange(b + 1, dtype=torch.int32, device=DEVICE) * pages_per
                last = torch.full((b,), PAGE, dtype=torch.int32, device=DEVICE)
                wrapper.plan(indptr, s["table"].reshape(-1), last, h_q, h_kv, HEAD_DIM, PAGE,
                             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                q3 = s["q"][:, 0]
                wrapper.run(q3, (s["k"], s["v"]))
                times["flashinfer"] = time_ms(lambda: wrapper.run(q3, (s["k"], s["v"])))
            except Exception as e:
                rec.missing(name, "flashinfer", f"failed: {type(e).__name__}: {str(e)[:120]}")

    for impl, ms in times.items():
        rec.time(name, impl, None, ms=ms, nbytes=total_bytes, ceilings=ceilings,
                 flops=flops if impl.startswith("fast") else None)
    rec.speedups(name)
    del sets, outs
    torch.cuda.empty_cache()


def bench_cpu(rec: Recorder, args):
    """What a CPU can say: the gate's decisions (pure) and the reference's own speed."""
    print("The shape gate on an H100 (132 SMs), D = 128, bf16:")
    print(f"  {'case':<22} num_splits")
    for h_q, h_kv in HEADS:
        for b in BATCHES:
            for ctx in CONTEXTS:
                print(f"  {case_name(b, ctx, h_q, h_kv):<22} {ref.choose_num_splits(b, h_kv, ctx, num_sms=132)}")
    b, ctx, h_q, h_kv = 1, 8192, 32, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, 1, h_q, HEAD_DIM, generator=g)
    k = torch.randn(b, ctx, h_kv, HEAD_DIM, generator=g)
    v = torch.randn(b, ctx, h_kv, HEAD_DIM, generator=g)
    used = torch.full((b,), ctx, dtype=torch.int32)
    rec.time(case_name(b, ctx, h_q, h_kv) + "-fp32-cpu", "ref", lambda: ref.flash_decode(q, k, v, used),
             nbytes=kv_bytes(b, ctx, h_kv, elt=4))


def bench_gpu(rec: Recorder, args):
    import fast.flash_decoding as fast
    peers = () if args.no_peers else ("sdpa", "flex", "flash_attn", "flashinfer")
    ceilings = device_ceilings()
    rec.add("device", "copy", "GB/s", ceilings["copy_gbps"], "GB/s")
    rec.add("device", "bf16 matmul", "TFLOP/s", ceilings["bf16_tflops"], "TFLOP/s")
    batches, contexts, heads = (BATCHES, CONTEXTS, HEADS) if not args.quick else ((1, 16), (8192, 32768), HEADS[:1])
    for h_q, h_kv in heads:
        for ctx in contexts:
            for b in batches:
                gpu_case(rec, fast, b, ctx, h_q, h_kv, peers=peers, flex_all=args.flex_all, ceilings=ceilings,
                         programs_per_sm=args.programs_per_sm)


def _flags(ap):
    ap.add_argument("--flex-all", action="store_true", help="FlexAttention on every case")
    ap.add_argument("--no-peers", action="store_true", help="only fast and ref")
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=(), metavar="N",
                    help="also time fast with the shape gate planning N programs per SM (a 'fast N programs/SM' "
                         "row per N; the shipped value is fast._PROGRAMS_PER_SM)")


if __name__ == "__main__":
    sys.exit(run_bench("flash_decoding", __doc__, gpu=bench_gpu, cpu=bench_cpu, configure=_flags))
