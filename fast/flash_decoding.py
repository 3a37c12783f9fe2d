"""FlashDecoding: split-KV decode attention over a KV cache, in Triton, with a runtime shape gate.

Example (runs as written next to this file; TRITON_INTERPRET=1 runs fast/'s kernels on a CPU)::

    # flash_decoding.py, copied next to this script
    import torch
    from flash_decoding import flash_decode

    dev = "cuda" if torch.cuda.is_available() else "cpu"     # fast/ on a CPU: TRITON_INTERPRET=1 first
    q = torch.randn(2, 1, 8, 64, device=dev)                         # [B, S_q, H_q, D]: one new token each
    k_cache, v_cache = (torch.randn(2, 96, 2, 64, device=dev) for _ in range(2))    # [B, S_max, H_kv, D]
    lengths = torch.tensor([37, 96], dtype=torch.int32, device=dev)  # keys in use per sequence
    out, lse = flash_decode(q, k_cache, v_cache, lengths, return_lse=True)
    print(out.shape, lse.shape)

The same as ref/flash_decoding.py: attention of S_q new query rows per sequence (1 while
decoding, 2..16 while verifying speculative tokens) against that sequence's KV cache,
contiguous or paged, causal bottom-right inside the cache, after optionally writing the new
keys and values into the cache in place.  A kernel with one program per (sequence, head)
leaves most SMs idle when the batch is small and the context long; this one also splits each
sequence's keys across ``num_splits`` programs and merges their partial results by
log-sum-exp, so long-context decoding can run at memory bandwidth.

The math (the reference states it in full)
    s_ij = scale <q_i, k_j> (softcap * tanh(s / softcap) when softcap > 0); row i of a
    sequence with L keys sees j <= L - S_q + i; lse_i = log(sum_j exp(s_ij) [+ exp(sink_h)]);
    o_i = sum_j exp(s_ij - lse_i) v_j; a row that sees no key: o = 0, lse = -inf; a sink of -inf
    is no sink, one of +inf takes all the mass (o = 0, lse = +inf); a NaN stays NaN.
    Split s over key range C_s gives (o_s, lse_s) without the sink (o_s stored in the input dtype,
    lse_s in fp32); the merge, in fp32, is
    lse = log(sum_s exp(lse_s) + exp(sink)), o = sum_s exp(lse_s - lse) o_s, taken in split order
    with the largest lse so far subtracted (rescaled like the online softmax), the sink last.
    ``merge_attention_states`` reads lse = +inf (PyTorch's CUDA varlen_attn marks a row with no key
    that way) as an empty side, like -inf.
    A call runs ``_append_kv_kernel`` (with k_new / v_new) and ``_decode_fwd_kernel``, whose program
    that finishes a tile's keys last merges the splits' partials when there are several (the fused
    merge; its own partial never leaves its registers); each kernel's docstring gives its FLOPs and
    bytes.  ``cascade_decode``'s kernel merges alike (the same ``_merge_step``).  Either way the result
    does not depend on which program finishes last.
    ``num_splits=None`` asks ``choose_num_splits`` with the device's SM count (the interpreter
    assumes an H100's 132), one program per SM, and the cache's capacity, a shape: no host copy,
    the same choice under CUDA-graph capture; the count is then capped so that the splits' extra
    bytes (q read again, partials written and read) stay within 5% of the K and V bytes
    (``_traffic_splits``).  ``num_splits=1`` is deterministic, and a sequence's
    result does not depend on the rest of the batch; so is a split launch (the same bits on every
    run), whose result does depend on the split count.
    ``cache_leftpad [B]`` (flash-attn's name) starts sequence b's keys at that position: key k of the
    kernel is position cache_leftpad[b] + k.  ``window_size=(left, 0)`` (flash-attn's name: a sliding
    window) bounds each row on its own: row i (position L - S_q + i) sees the keys from L - S_q + i -
    left on.  The keys before row 0's window are nobody's, so the kernel starts the sequence there (as
    a cache_leftpad, the larger of the two) and masks each later row's first keys in the loop; the
    shape gate sizes the splits for the left + S_q keys a sequence can see, not the cache's capacity.
    Cascade (``cascade_decode``): the n rows of a group share their first P keys' pages (a GRPO
    group's prompt).  One launch of ``_cascade_fwd_kernel`` (after a memset of its counters):
    programs that attend all the group's rows (n S_q G of them per KV head, in one tile) to a share
    of those P keys, reading them once instead of n times, then programs that attend each row to a
    share of its own keys from P on; the last program to finish a sequence's rows merges their
    partials with the sink.  The split counts (``_cascade_splits``) give every program about the same
    keys, as many programs as a traffic budget allows (7.5% of the K/V bytes: a prefix split re-reads
    the whole group's q and writes its partial).  At n = 8, P = 2048, 256 own keys, GQA 8/2, D = 128,
    fp16 (Triton interpreter count): 30 programs, 1.096x the IO bound (the host checks' PyTorch ops
    included), 0.24x the bytes of flash_decode on the same rows; 8.8 us modeled on an H100 against
    flash_decode's 9.1 (parity/observatory.py's latency model: a model, not a measurement).

Tensors (B sequences, S_q rows, H_q / H_kv heads, D head dim)
    q             [B, S_q, H_q, D]                  fp16 / bf16 / fp32, unit stride in D (else copied)
    k_cache,      [B, S_max, H_kv, D]               contiguous, or
    v_cache       [num_pages, page_size, H_kv, D]   paged with block_table; unit stride in D
    seqused_k     [B] int32                         keys per sequence, new ones included
    block_table   [B, max_pages] int32
    k_new, v_new  [B, S_q, H_kv, D]                 q's dtype
    cache_leftpad [B] int32                         the first key of each sequence (0 <= it <= seqused_k)
    window_size   (left, right) ints                each row sees its last left + 1 keys; right -1 or 0
    cu_groups     [G + 1] int32                     cascade_decode: group g is rows cu_groups[g] .. [g+1]-1
    prefix_lens   [G] int32                         its shared prefix, <= seqused_k - S_q + 1 for its rows
    sinks         [H_q] float                       any float dtype, read as fp32
    out           [B, S_q, H_q, D]                  q's dtype, unit stride in D
    lse           [B, H_q, S_q] fp32                natural log

Supported, and what raises
    fp16 / bf16 / fp32 (IEEE fp32 dots), head dims up to 256, any page size and GQA ratio,
    CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``).  Everything the reference rejects
    raises the same ValueError / TypeError here, plus fp64, D > 256 and caches or ``out``
    without unit stride in D.  The value checks cost one small device-to-host copy per call and
    are skipped during CUDA-graph capture; ``cascade_decode`` also sizes its launch from its group
    check's copy, except with ``capturable=True`` (sized from shapes: the call a graph captures).
    The ops are ``torch.library.custom_op``s, so ``torch.compile(fullgraph=True)`` traces through
    them.  Inference only.  The README's "Known limits" lists the rest.

Batch invariance (``batch_invariant=True``; the default, False, keeps the fast path)
    The contract: each query row's out and lse are bitwise equal (``torch.equal``) to what
    fast/paged_varlen_attention.py's ``varlen_attn(..., batch_invariant=True)`` gives the same row
    (causal, same keys, scale, softcap, sinks, dtype and head dim, one GPU family or the
    interpreter, one Triton version) in a trainer's packed forward, a paged prefill chunk or a
    decode step, whatever else shares either batch, the page size, the block table or the split
    count.  ``_decode_invariant_kernel`` computes a row as that file's invariant kernel does, with the
    same helpers (character for character): the row in a 16-row group at slot (p * G + g) mod 16,
    the same mma.sync instruction, row sums as a ones dot; its keys (from key 0 of the call, i.e.
    from ``cache_leftpad`` with one) in segments of SPLIT keys (120 on sm_80 and sm_90, 8 under the
    interpreter), each reduced from a fresh state through key blocks of BLOCK_N from key 0 and
    finished to (out in the input dtype, lse fp32), the segment states folded in index order, the
    sink last.  The launch splits like the default's: split i takes segments floor(i n / s) ..
    floor((i + 1) n / s) - 1, and with more than one split the last program to finish folds every
    segment's state in index order (the fused merge, its own last segment from its registers): the
    same bits whichever program merges and whatever ``num_splits`` (None: the shape gate, one split
    once B * H_kv programs fill the GPU, else one program per SM up to a program per segment).
    The cost, against the default (B = 4, GQA 8/2, D = 128, fp16, page 16, sm_90 builds; the kernel
    observatory's figures, bench/README.md): a split launch writes every segment's partial but the
    merger's last, 5.1% of the K/V bytes at G = 4 (10% at G = 8), whatever the split count: 1.0495x
    the IO bound at L = 1k (72 programs, as the default), 1.039x at 8k (1.012 for the default); one
    split writes none.  A 16-row group for S_q * G rows (4x the useful MMA work at G = 4, plus the
    row sums' 1/16), 88 registers, 28.5 KB of shared memory (three K/V buffers).  GPU timings are owed.

References
    Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference" (2023); flash-attn's
    ``flash_attn_with_kvcache`` and its split heuristic; Kwon et al., PagedAttention / vLLM
    (2023); FlashInfer's ``merge_state``; the Triton fused-attention tutorial; Gemma 2
    soft-capping; gpt-oss learned sinks; He, "Defeating Nondeterminism in LLM Inference"
    (Thinking Machines, 2025), on batch-invariant kernels.
"""
from __future__ import annotations

import functools
import inspect
import math
import operator
import os
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["cascade_decode", "choose_num_splits", "flash_decode", "merge_attention_states"]

_INTERPRETER_SMS = 132       # what the gate assumes for CPU tensors under the Triton interpreter (an H100)
# The shape gate plans one program per SM: each keeps 16-32 KB of K/V loads in flight (see
# _fwd_config), and every further split adds partials (written, then read by the merge) and
# another read of q.  Programs past one per SM would only be worth that traffic if one program
# cannot keep an SM's share of HBM bandwidth busy: the GPU benchmark that decides it is owed.
_PROGRAMS_PER_SM = 1
_MAX_SPLITS = 1024
# Each split past the first costs traffic: it reads the tile's q rows again, and its partial output (the
# input dtype) and lse (fp32) are written, then read by the merge.  The gate's split count is capped so
# that these bytes stay within this fraction of the K and V bytes the launch must read (_traffic_splits).
_SPLIT_TRAFFIC = 0.05
# flash_decode merges the splits inside the decode kernel (the last program of a tile to finish merges;
# see _decode_fwd_kernel).  False runs the separate _merge_splits_kernel instead (the same arithmetic,
# bit for bit: the tests compare the two).  _SPLIT_ROTATE (tests only) shifts the split each program
# computes, so that another split's program arrives last and merges.
_FUSED_MERGE = True
_SPLIT_ROTATE = 0
# cascade_decode's splits (_cascade_splits): their extra bytes (q rows read again, partials written and read)
# within this fraction of the K and V bytes of the launch.  Higher than flash_decode's 5%, because a prefix
# tile holds a whole group's rows: at the GRPO case (8 samples of 2k + 256 keys, GQA 8/2, D = 128, fp16)
# a prefix split costs 25 KB, and 7.5% buys 7 per KV head (5%: 5), the most that keeps the case within
# 1.10 of its IO bound (1.096, the host checks' PyTorch ops included; 8 would give 1.108).  The latency
# model prices the launch by its busiest program, a prefix split: 172 KB, 8.8 us modeled against the
# plain decode's 9.1 (bench/README.md, "The GRPO decode").
_CASCADE_SPLIT_TRAFFIC = 0.075
_CASCADE_SPLITS = None       # tests only: (prefix splits, suffix splits) instead of _cascade_splits'
_CASCADE_REVERSE = False     # tests only: the suffix programs run first, so that prefix programs merge
_LOG2E = tl.constexpr(1.4426950408889634)   # log2(e): kernels use it as is, the host as .value
# tl.math.fdiv's approx flag (div.approx.f32) is newer than Triton 3.6, whose fdiv (div.full.f32) has no
# such flag; _div_2ulp takes whichever the installed Triton has.  Both are within 2 ulp and skip the slow
# path of a correctly rounded division; their bits may differ, so a bitwise comparison holds within one install.
_FDIV_APPROX = tl.constexpr("approx" in inspect.signature(tl.math.fdiv).parameters)


# ----------------------------------------------------------------------------- public API

def flash_decode(q, k_cache, v_cache, seqused_k, *, block_table=None, k_new=None, v_new=None, scale=None,
                 num_splits=None, softcap=0.0, sinks=None, return_lse=False, out=None, batch_invariant=False,
                 cache_leftpad=None, window_size=(-1, -1)):
    """Decode attention of q against the KV cache; see the module docstring for shapes.

    With ``k_new``/``v_new`` the cache is written in place first.  ``num_splits=None`` lets
    ``choose_num_splits`` decide; ``num_splits=1`` is deterministic and independent of the rest of
    the batch.  ``batch_invariant=True`` rounds exactly like fast/paged_varlen_attention.py's
    ``varlen_attn(..., batch_invariant=True)`` at any ``num_splits`` (its fixed-size key segments are
    split over the programs): see "Batch invariance" in the module docstring.  ``cache_leftpad [B]
    int32`` (flash-attn's name): sequence b's keys start at that position (0 <= cache_leftpad[b] <=
    seqused_k[b]); the mode then counts row slots, key blocks and segments from that start.
    ``window_size=(left, 0)``: row i (position L - S_q + i) sees the keys from L - S_q + i - left on
    (-1: no bound; not with ``batch_invariant=True``: NotImplementedError).
    Returns ``out [B, S_q, H_q, D]``, or ``(out, lse [B, H_q, S_q] fp32)`` when ``return_lse``;
    with ``out=`` the result is written there.
    """
    q, seqused_k, block_table, sinks, out, left = _prepare(
        q, k_cache, v_cache, seqused_k, block_table=block_table, k_new=k_new, v_new=v_new, scale=scale,
        num_splits=num_splits, softcap=softcap, sinks=sinks, out=out, batch_invariant=batch_invariant,
        cache_leftpad=cache_leftpad, window_size=window_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    num_splits = 0 if num_splits is None else operator.index(num_splits)   # 0: the shape gate decides
    lse = torch.ops.twofold.flash_decode(q, k_cache, v_cache, seqused_k, block_table, sinks, out, scale,
                                         float(softcap), num_splits, k_new is None, batch_invariant,
                                         cache_leftpad.contiguous() if cache_leftpad is not None else None, left)
    return (out, lse) if return_lse else out


def cascade_decode(q, k_cache, v_cache, seqused_k, *, block_table, cu_groups, prefix_lens, k_new=None, v_new=None,
                   scale=None, softcap=0.0, sinks=None, return_lse=False, out=None, capturable=False):
    """Cascade (shared-prefix) decode over a paged cache: ``flash_decode`` for groups of sequences whose
    first keys lie in the same pages, such as a GRPO group's samples behind their prompt.

    Group g is rows cu_groups[g] .. cu_groups[g + 1] - 1 (``cu_groups [G + 1] int32``, 0 .. B); its
    first ``prefix_lens[g]`` keys (``prefix_lens [G] int32``) lie in the same pages for all its rows,
    and every query row sees them all (prefix_lens[g] <= seqused_k[b] - S_q + 1).  One launch: its
    prefix programs read each group's prefix K/V once for all the group's rows (they share a tile,
    as GQA's heads do), each a share of the keys, its suffix programs each row's own keys after the
    prefix, and the program that finishes a sequence last merges the states exactly and adds the
    sink.  The result equals ``flash_decode``'s for every row, to
    rounding; the other keywords are flash_decode's.  Returns ``out [B, S_q, H_q, D]``, or ``(out,
    lse [B, H_q, S_q] fp32)``.

    ``capturable=True``: the launch is sized from shapes alone, as if one group held all B rows and every
    prefix and suffix could fill the cache's capacity (``block_table``'s width), so a CUDA graph can capture
    the call and replay it over other groups: empty groups (cu_groups[g] == cu_groups[g + 1]) and prefixes
    of 0 are allowed, the group values are not checked (the caller vouches for them: their check reads
    them back), and the programs with no rows or keys exit at once.
    The split counts then follow the capacity, not the keys in use, so the bits differ from a sized call's.
    """
    if block_table is None:
        raise ValueError("cascade_decode needs a paged cache (block_table): a group's rows share the pages "
                         "that hold its prefix")
    q, seqused_k, block_table, sinks, out, _ = _prepare(
        q, k_cache, v_cache, seqused_k, block_table=block_table, k_new=k_new, v_new=v_new, scale=scale,
        num_splits=None, softcap=softcap, sinks=sinks, out=out, batch_invariant=False, cache_leftpad=None)
    _check_group_tensors(cu_groups, prefix_lens, q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    lse = torch.ops.twofold.cascade_decode(q, k_cache, v_cache, seqused_k, block_table, cu_groups.contiguous(),
                                           prefix_lens.contiguous(), sinks, out, scale, float(softcap),
                                           k_new is None, bool(capturable))
    return (out, lse) if return_lse else out


def _prepare(q, k_cache, v_cache, seqused_k, *, block_table, k_new, v_new, scale, num_splits, softcap, sinks, out,
             batch_invariant, cache_leftpad, window_size=(-1, -1)):
    """The host checks and layouts both decode functions need, and the append of k_new / v_new (which
    validates the index tensors with one host copy).  Returns (q, seqused_k, block_table, sinks, out, the
    window's left: -1 for none)."""
    left = _check_inputs(q, k_cache, v_cache, seqused_k, block_table=block_table, k_new=k_new, v_new=v_new,
                         scale=scale, num_splits=num_splits, softcap=softcap, sinks=sinks, out=out,
                         batch_invariant=batch_invariant, cache_leftpad=cache_leftpad, window_size=window_size)
    _check_device("q", q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    seqused_k = seqused_k.contiguous()
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    sinks = sinks.contiguous() if sinks is not None else None
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k_new is not None:
        k_new = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
        v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
        torch.ops.twofold.kv_cache_append(k_cache, v_cache, k_new, v_new, seqused_k, block_table)
    return q, seqused_k, block_table, sinks, out, left


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Merge two attention states over disjoint key sets into the state over their union.

    ``out_* [..., T, H, D]`` (fp16 / bf16 / fp32) and ``lse_* [..., H, T]`` fp32 (natural log),
    the layouts ``flash_decode`` returns ([B, S_q, H_q, D] and [B, H_q, S_q]) and varlen
    attention returns ([T, H, D] and [H, T]).  Returns ``(out in out_a's dtype, lse fp32)``.
    Associative and commutative, exact at any |lse| (the larger is subtracted
    first).  A side with lse = -inf or +inf (no keys: this repo writes -inf, PyTorch's CUDA
    varlen_attn, i.e. FlashAttention-2, writes +inf) leaves the other side exactly as it is; two
    empty sides give out 0 and lse -inf.  A NaN lse on either side gives NaN, never the other side.
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating torch.Tensor")
    if out_a.dim() < 3:
        raise ValueError(f"out_a must be [..., T, H, D], got shape {tuple(out_a.shape)}")
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(f"out_b must match out_a {tuple(out_a.shape)} {out_a.dtype}, "
                         f"got {tuple(out_b.shape)} {out_b.dtype}")
    if out_a.dtype not in _DTYPES:
        raise TypeError(f"out_a must be float16, bfloat16 or float32 in the fast path, got {out_a.dtype}")
    lse_shape = (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3])
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != lse_shape:
            raise ValueError(f"{name} must be [..., H, T] = {lse_shape} for out {tuple(out_a.shape)}, "
                             f"got shape {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32, got {t.dtype}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    _check_device("out_a", out_a)
    return _merge_attention_states(out_a, lse_a, out_b, lse_b)


def choose_num_splits(batch, num_kv_heads, max_seqlen_k, *, num_sms, num_q_tiles=1, block_n=64,
                      programs_per_sm=2, max_splits=128):
    """How many chunks to split each sequence's keys into, from explicit shape numbers only.

    The decode kernel runs one program per (sequence, KV head, query tile, split); a GPU runs
    ``num_sms * programs_per_sm`` programs at once (one "wave").  The rule:

    1. ``programs = batch * num_kv_heads * num_q_tiles``.  If that already fills a wave, or the
       longest sequence has a single block of ``block_n`` keys, return 1 (no partials to merge).
    2. Otherwise consider every split count ``s`` from 1 to ``min(max_splits, KV blocks,
       programs per wave)``, skipping an ``s`` that leaves the largest chunk as long as ``s - 1``
       does (it would add work to merge without shortening the slowest program).
    3. The wave efficiency of ``s`` is ``w / ceil(w)`` with ``w = programs * s / slots``: the
       fraction of the last wave that is busy.  Return the smallest ``s`` whose efficiency is
       at least 85% of the best one: more splits cost partial writes and a merge.

    Never more splits than KV blocks.  Pure: no device is queried (the op passes the SM count
    it reads once per device).
    """
    batch, num_kv_heads, max_seqlen_k, num_q_tiles = (
        _integer(name, value, 0) for name, value in (("batch", batch), ("num_kv_heads", num_kv_heads),
                                                     ("max_seqlen_k", max_seqlen_k), ("num_q_tiles", num_q_tiles)))
    num_sms, block_n, programs_per_sm, max_splits = (
        _integer(name, value, 1) for name, value in (("num_sms", num_sms), ("block_n", block_n),
                                                     ("programs_per_sm", programs_per_sm), ("max_splits", max_splits)))
    programs = batch * num_kv_heads * num_q_tiles
    slots = num_sms * programs_per_sm
    num_blocks = -(-max_seqlen_k // block_n)
    if programs == 0 or num_blocks <= 1 or programs >= slots:
        return 1
    limit = min(max_splits, num_blocks, slots)
    candidates = [s for s in range(1, limit + 1)
                  if s == 1 or -(-num_blocks // s) != -(-num_blocks // (s - 1))]

    def efficiency(s):
        waves = programs * s / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.85 * best)


# ----------------------------------------------------------------------------- launchers (custom ops)

@torch.library.custom_op("twofold::kv_cache_append", mutates_args=("k_cache", "v_cache"))
def _kv_cache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     seqused_k: torch.Tensor, block_table: Optional[torch.Tensor]) -> None:
    """Write k_new/v_new [B, S_q, H_kv, D] at positions L - S_q .. L - 1 of each sequence."""
    batch, s_q, h_kv, d = k_new.shape
    paged = block_table is not None
    _check_values(seqused_k, block_table, s_q=s_q, capacity=_capacity(k_cache, block_table),
                  num_pages=k_cache.shape[0], page_size=k_cache.shape[1])
    if k_new.numel() == 0:
        return
    bt = block_table if paged else seqused_k   # a valid pointer the kernel never reads
    _append_kv_kernel[(batch * s_q, h_kv)](
        k_new, v_new, k_cache, v_cache, seqused_k, bt,
        k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0,
        s_q, k_cache.shape[1],
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), IS_PAGED=paged, num_warps=1)


@_kv_cache_append.register_fake
def _(k_cache, v_cache, k_new, v_new, seqused_k, block_table):
    return None


@torch.library.custom_op("twofold::flash_decode", mutates_args=("out",))
def _flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqused_k: torch.Tensor,
                  block_table: Optional[torch.Tensor], sinks: Optional[torch.Tensor], out: torch.Tensor,
                  scale: float, softcap: float, num_splits: int, check_values: bool,
                  batch_invariant: bool, cache_leftpad: Optional[torch.Tensor], window_left: int = -1) -> torch.Tensor:
    """Writes out [B, S_q, H_q, D]; returns lse [B, H_q, S_q].  num_splits 0 = the shape gate; window_left
    -1 = no sliding window."""
    batch, s_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    paged = block_table is not None
    capacity = _capacity(k_cache, block_table)
    if check_values:
        _check_values(seqused_k, block_table, s_q=s_q, capacity=capacity, num_pages=k_cache.shape[0],
                      page_size=k_cache.shape[1])
    if cache_leftpad is not None:
        _check_leftpad(cache_leftpad, seqused_k)
    lse = torch.empty(batch, h_q, s_q, dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return lse
    if batch_invariant:
        _decode_invariant(q, k_cache, v_cache, seqused_k, block_table, sinks, out, lse, scale, softcap, num_splits,
                          cache_leftpad, capacity)
        return lse
    cfg = _fwd_config(d, q.dtype, s_q * group, paged, _kv_align(k_cache, v_cache), q.device)
    # the most keys a sequence's rows can see: the cache's capacity, or a window's left + S_q keys
    keys = capacity if window_left < 0 else min(capacity, window_left + s_q)
    max_blocks = max(1, -(-keys // cfg["BLOCK_N"]))
    fused = _FUSED_MERGE
    if num_splits == 0:
        num_splits = choose_num_splits(batch, h_kv, keys, num_sms=_sm_count(q.device),
                                       num_q_tiles=cfg["num_q_tiles"], block_n=cfg["BLOCK_N"],
                                       programs_per_sm=_PROGRAMS_PER_SM)
        num_splits = min(num_splits, _traffic_splits(keys, s_q * group, d, q.element_size(), fused=fused))
    num_splits = max(1, min(num_splits, max_blocks, _MAX_SPLITS))
    split = num_splits > 1
    fused = fused and split
    grid = (batch * h_kv, num_splits, cfg["num_q_tiles"])
    if split:
        o_part, lse_part = _new_partials((batch, s_q, h_q, num_splits, d), (batch, s_q, h_q, num_splits), q.dtype,
                                         q.device)
        o_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3))
        l_strides = (lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), lse_part.stride(3))
        o_dst, l_dst = o_part, lse_part
    else:
        o_strides = (out.stride(0), out.stride(1), out.stride(2), 0)
        l_strides = (lse.stride(0), lse.stride(2), lse.stride(1), 0)   # lse is [B, H_q, S_q]
        o_dst, l_dst = out, lse
    # The fused merge's arrival counters, one per (sequence, KV head, query tile), zeroed by each call.
    counters = _new_counters(batch * h_kv * cfg["num_q_tiles"], q.device) if fused else seqused_k
    qk_scale = scale / softcap if softcap > 0 else scale * _LOG2E.value   # what the varlen kernel passes, rounded alike
    bt = block_table if paged else seqused_k     # valid pointers the kernel never reads
    sk = sinks if sinks is not None else seqused_k
    _decode_fwd_kernel[grid](
        q, k_cache, v_cache, seqused_k, bt, sk, o_dst, l_dst,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *o_strides, *l_strides,
        block_table.stride(0) if paged else 0,
        h_kv, group, s_q, k_cache.shape[1], num_splits, qk_scale, softcap,
        cache_leftpad if cache_leftpad is not None else seqused_k, max(window_left, 0),
        out, lse, counters, out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        IS_PAGED=paged, IS_SPLIT=split, HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_ALIGN=cfg["KV_ALIGN"],
        HAS_LEFTPAD=cache_leftpad is not None, HAS_WINDOW=window_left >= 0,
        BLOCK_IN_PAGE=paged and k_cache.shape[1] % cfg["BLOCK_N"] == 0 and cache_leftpad is None and window_left < 0,
        FUSED_MERGE=fused, SPLIT_ROTATE=_SPLIT_ROTATE % num_splits if fused else 0,
        num_warps=cfg["fused_warps"] if fused else cfg["num_warps"], num_stages=cfg["num_stages"])
    if split and not fused:
        _merge_splits_kernel[(batch * s_q * h_q,)](
            o_part, lse_part, sk, out, lse,
            out.stride(0), out.stride(1), out.stride(2),
            s_q, h_q, num_splits,
            HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], HAS_SINKS=sinks is not None, num_warps=4)
    return lse


@_flash_decode.register_fake
def _(q, k_cache, v_cache, seqused_k, block_table, sinks, out, scale, softcap, num_splits, check_values,
      batch_invariant, cache_leftpad, window_left=-1):
    batch, s_q, h_q, _ = q.shape
    return q.new_empty(batch, h_q, s_q, dtype=torch.float32)


def _decode_invariant(q, k_cache, v_cache, seqused_k, block_table, sinks, out, lse, scale, softcap, num_splits,
                      cache_leftpad, capacity):
    """``batch_invariant=True``: writes out and lse with ``_decode_invariant_kernel``.  num_splits 0 = the
    shape gate: one split when the launch fills a wave, else one program per SM (up to the segments of the
    cache's capacity).  Any split count gives the same bits; with more than one, every segment's state but
    the merging program's last is written and read as a partial (in q's dtype, lse fp32)."""
    batch, s_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    paged = block_table is not None
    family = None if not q.is_cuda else _gpu_family(
        q.device.index if q.device.index is not None else torch.cuda.current_device())
    cfg = _invariant_config(d, q.dtype, s_q * group, group, _kv_align(k_cache, v_cache), family)
    n_seg = max(1, -(-capacity // cfg["SPLIT"]))
    programs = batch * h_kv * cfg["num_q_tiles"]
    if num_splits == 0:
        slots = _sm_count(q.device) * _PROGRAMS_PER_SM
        num_splits = 1 if programs >= slots else slots // programs
    num_splits = max(1, min(num_splits, n_seg, _MAX_SPLITS))
    split = num_splits > 1
    if split:
        o_part, lse_part = _new_partials((batch, s_q, h_q, n_seg, d), (batch, s_q, h_q, n_seg), q.dtype, q.device)
        counters = _new_counters(programs, q.device)
    else:
        o_part, lse_part, counters = out[:, :, :, None], lse[:, None].transpose(2, 3), seqused_k   # never read
    qk_scale = scale / softcap if softcap > 0 else scale * _LOG2E.value   # what the varlen kernel passes
    bt = block_table if paged else seqused_k     # valid pointers the kernel never reads
    _decode_invariant_kernel[(batch * h_kv, num_splits, cfg["num_q_tiles"])](
        q, k_cache, v_cache, seqused_k, bt, sinks if sinks is not None else seqused_k,
        cache_leftpad if cache_leftpad is not None else seqused_k, out, lse, o_part, lse_part, counters,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *o_part.stride()[:4], *lse_part.stride()[:4],
        block_table.stride(0) if paged else 0,
        h_kv, group, s_q, k_cache.shape[1], num_splits, qk_scale, softcap,
        HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_N=cfg["BLOCK_N"], SPLIT=cfg["SPLIT"], IS_PAGED=paged,
        IS_SPLIT=split, HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_ALIGN=cfg["KV_ALIGN"],
        BLOCK_IN_PAGE=paged and k_cache.shape[1] % cfg["BLOCK_N"] == 0 and cache_leftpad is None,
        HAS_LEFTPAD=cache_leftpad is not None, SPLIT_ROTATE=_SPLIT_ROTATE % num_splits if split else 0,
        num_warps=cfg["num_warps"], num_stages=2 * cfg["buffers"] + 1 if paged else cfg["buffers"] + 1)


@torch.library.custom_op("twofold::cascade_decode", mutates_args=("out",))
def _cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqused_k: torch.Tensor,
                    block_table: torch.Tensor, cu_groups: torch.Tensor, prefix_lens: torch.Tensor,
                    sinks: Optional[torch.Tensor], out: torch.Tensor, scale: float, softcap: float,
                    check_values: bool, capturable: bool) -> torch.Tensor:
    """Writes out [B, S_q, H_q, D]; returns lse [B, H_q, S_q]: one launch of ``_cascade_fwd_kernel``
    (the prefix splits of every group's row tiles, then every row's suffix splits; the program that
    finishes a sequence's keys last merges its partials), after a memset of its arrival counters.
    ``capturable``: sized for any groups (one of all B rows; prefixes and suffixes up to the capacity, not
    known to end on a page boundary), nothing read back."""
    batch, s_q, h_q, d = q.shape
    h_kv, page_size = k_cache.shape[2], k_cache.shape[1]
    group = h_q // h_kv
    capacity = _capacity(k_cache, block_table)
    if check_values:
        _check_values(seqused_k, block_table, s_q=s_q, capacity=capacity, num_pages=k_cache.shape[0],
                      page_size=page_size)
    if capturable:
        largest, shortest_prefix, longest_prefix, aligned = batch, 0, max(0, capacity - s_q + 1), False
    else:
        largest, shortest_prefix, longest_prefix, aligned = _check_group_values(
            cu_groups, prefix_lens, seqused_k, block_table, s_q=s_q, page_size=page_size)
    lse = torch.empty(batch, h_q, s_q, dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return lse
    kv_align, elt = _kv_align(k_cache, v_cache), q.element_size()
    rows = s_q * group                                      # a sequence's rows per KV head
    cfg = _cascade_config(d, q.dtype, max(1, largest) * rows, kv_align, q.device)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    n_groups = prefix_lens.numel()
    p_tiles = -(-largest * rows // block_m) if longest_prefix > 0 else 0   # no prefix: no prefix programs
    s_tiles = -(-rows // block_m)
    suffix = capacity - shortest_prefix                     # the most keys a row has after its prefix
    p_splits, s_splits = _cascade_splits(      # (capturable: budgeted as one group of all the rows)
        n_groups=1 if capturable else n_groups, p_tiles=p_tiles, prefix=longest_prefix,
        p_rows=min(block_m, largest * rows), batch=batch, s_tiles=s_tiles, suffix=suffix, s_rows=min(block_m, rows),
        h_kv=h_kv, head_dim=d, elt=elt, block_n=block_n, num_sms=_sm_count(q.device))
    if _CASCADE_SPLITS is not None:                          # tests only
        p_splits, s_splits = _CASCADE_SPLITS
    n_prefix, n_items = n_groups * p_tiles * p_splits, n_groups * p_tiles * p_splits + batch * s_tiles * s_splits
    o_part, lse_part = _new_partials((batch, s_q, h_q, p_splits + s_splits, d), (batch, s_q, h_q, p_splits + s_splits),
                                     q.dtype, q.device)
    counters = _new_counters(batch * h_kv, q.device)
    qk_scale = scale / softcap if softcap > 0 else scale * _LOG2E.value
    sk = sinks if sinks is not None else seqused_k          # a valid pointer the kernel never reads
    _cascade_fwd_kernel[(n_items * h_kv,)](
        q, k_cache, v_cache, seqused_k, block_table, cu_groups, prefix_lens, sk, o_part, lse_part, out, lse, counters,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *o_part.stride()[:4], *lse_part.stride()[:4],
        *out.stride()[:3], block_table.stride(0),
        h_kv, group, s_q, page_size, n_groups, p_tiles, p_splits, s_tiles, s_splits, n_prefix, n_items,
        qk_scale, softcap,
        HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=block_m, BLOCK_N=block_n, HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=softcap > 0, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_ALIGN=kv_align,
        BLOCK_IN_PAGE=aligned and page_size % block_n == 0, REVERSE=_CASCADE_REVERSE,
        num_warps=cfg["warps"], num_stages=cfg["num_stages"])
    return lse


@_cascade_decode.register_fake
def _(q, k_cache, v_cache, seqused_k, block_table, cu_groups, prefix_lens, sinks, out, scale, softcap, check_values,
      capturable):
    batch, s_q, h_q, _ = q.shape
    return q.new_empty(batch, h_q, s_q, dtype=torch.float32)


@torch.library.custom_op("twofold::merge_attention_states", mutates_args=())
def _merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
    if out.numel() == 0:
        return out, lse
    t, h, d = out_a.shape[-3:]
    oa, ob = out_a.contiguous(), out_b.contiguous()        # [..., T, H, D] as rows (n, t, h)
    la, lb = lse_a.contiguous(), lse_b.contiguous()        # [..., H, T]
    _merge_states_kernel[(out.numel() // d,)](
        oa, la, ob, lb, out, lse, t, h,
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=1 if d <= 128 else 2)
    return out, lse


@_merge_attention_states.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return torch.empty_like(out_a), torch.empty_like(lse_a, dtype=torch.float32)


# ----------------------------------------------------------------------------- kernels, in call order

@triton.jit
def _append_kv_kernel(
    kn_ptr, vn_ptr, k_ptr, v_ptr, seqused_ptr, bt_ptr,
    stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb,
    S_q, PAGE_SIZE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_PAGED: tl.constexpr,
):
    """One program per (sequence x new row, KV head) writes k_new / v_new row i at position
    L - S_q + i of the cache, in place.  No FLOPs; bytes = 4 * B * S_q * H_kv * D * elt."""
    i_bs, i_h = tl.program_id(0), tl.program_id(1)
    i_b, i_s = i_bs // S_q, i_bs % S_q
    i_b64 = i_b.to(tl.int64)
    seqlen = tl.load(seqused_ptr + i_b)
    pos = seqlen - S_q + i_s
    if pos >= 0:                                   # < 0 only for an empty (padding) sequence: no write
        if IS_PAGED:
            page = tl.load(bt_ptr + i_b64 * stride_btb + pos // PAGE_SIZE).to(tl.int64)
            o_k = page * stride_kb + (pos % PAGE_SIZE) * stride_kt
            o_v = page * stride_vb + (pos % PAGE_SIZE) * stride_vt
        else:
            o_k = i_b64 * stride_kb + pos.to(tl.int64) * stride_kt
            o_v = i_b64 * stride_vb + pos.to(tl.int64) * stride_vt
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < HEAD_DIM
        b_k = tl.load(kn_ptr + i_b64 * stride_knb + i_s * stride_kns + i_h * stride_knh + o_d, mask=m_d)
        b_v = tl.load(vn_ptr + i_b64 * stride_vnb + i_s * stride_vns + i_h * stride_vnh + o_d, mask=m_d)
        tl.store(k_ptr + o_k + i_h * stride_kh + o_d, b_k, mask=m_d)
        tl.store(v_ptr + o_v + i_h * stride_vh + o_d, b_v, mask=m_d)


@triton.jit
def _cascade_fwd_kernel(
    q_ptr, k_ptr, v_ptr, seqused_ptr, bt_ptr, cu_groups_ptr, prefix_ptr, sinks_ptr,
    po_ptr, plse_ptr, out_ptr, lse_ptr, count_ptr,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_pb, stride_ps, stride_ph, stride_pj, stride_lb, stride_ls, stride_lh, stride_lj,
    stride_ob, stride_os, stride_oh, stride_btb,
    H_kv, GROUP, S_q, PAGE_SIZE, N_GROUPS, P_TILES, P_SPLITS, S_TILES, S_SPLITS, N_PREFIX, N_ITEMS,
    qk_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_ALIGN: tl.constexpr,
    BLOCK_IN_PAGE: tl.constexpr, REVERSE: tl.constexpr = False,
):
    """``cascade_decode`` in one launch.  Program ``pid`` is KV head pid % H_kv of work item pid // H_kv:

    - items 0 .. N_PREFIX - 1, a group's shared prefix: (group, row tile, split).  The tile packs the
      rows of every sequence of the group, row r = (n * S_q + i) * G + g for its n-th sequence, query
      row i and head g, so the prefix's K and V (through the group's first block-table row) are read
      once per row tile, not once per sequence; split j takes key blocks floor(j n / s) ..
      floor((j + 1) n / s) - 1 of the prefix's n (every row sees them all: the host checked
      prefix <= seqused_k - S_q + 1).
    - then a row's own keys, from its group's prefix length on (its suffix, causal): (sequence,
      query tile, split), the tile packing r = i * G + g, the splits shared out alike.
    Each computes its tile's partial state (normalized out in the partials' dtype, lse in fp32, no
    sink: slot j of the prefix's, P_SPLITS + j of the suffix's) and, for every sequence its tile holds
    rows of, takes a ticket from that sequence's counter (int32 per sequence and KV head, zeroed by the
    launcher: tickets in the low 16 bits, programs done in the high bits).  The program taking a
    sequence's last ticket merges its partials (``_merge_step`` in slot order, then the sink): the
    prefix programs store their partial before their tickets and count themselves done with them; a
    suffix program takes its ticket first, and stores its partial and counts itself done only if it is
    not the last, so a merging suffix program keeps its own state in registers (rounded as stored).  A
    merger waits until all the others are done: they hold tickets, so they are running, and every
    program counts itself done for all its sequences before it waits for any: no deadlock, whatever
    the occupancy.  The slots are taken in index order, each as stored, so the result is the same bits
    whichever program merges.  Splits with no keys neither run nor count (but a suffix with no keys runs
    its split 0: someone must write the row).

    FLOPs ~= 4 * S_q * H_q * D * (sum over rows of their keys), plus the merge's ~3 * S_q * H_q * D per
    partial.  Minimum bytes = 2 * H_kv * D * elt * (each prefix once + each row's suffix) + B * S_q * H_q *
    (2 * D * elt + 4) (q, out, lse), plus 4-byte page ids.  Each further split of a tile reads its q rows
    again and writes a partial (D * elt + 4 bytes a row) that the merger reads, 3 * rows * (D * elt + 4)
    in all: 25 KB for the 32 rows of a GRPO group of 8 at GQA 8/2, D = 128, fp16, against 1 KB for a
    suffix tile's 4 rows (``_cascade_splits`` budgets them).  A sequence whose rows another program merges
    adds its own suffix partial, written and read.  A group of more than BLOCK_M / (S_q G) sequences
    reads its prefix once per row tile.
    """
    pid = tl.program_id(0)
    i_hkv = pid % H_kv
    item = pid // H_kv
    if REVERSE:   # tests only: the suffix programs run first, so that prefix programs arrive last and merge
        item = N_ITEMS - 1 - item
    rows_seq = S_q * GROUP
    is_prefix = item < N_PREFIX
    if is_prefix:
        i_split = item % P_SPLITS
        i_tile = (item // P_SPLITS) % P_TILES
        i_g = item // (P_SPLITS * P_TILES)
        g_first = tl.load(cu_groups_ptr + i_g)
        n_rows = (tl.load(cu_groups_ptr + i_g + 1) - g_first) * rows_seq
        prefix = tl.load(prefix_ptr + i_g)
        row_base = g_first                # rows count from the group's first sequence
        kv_first = 0
        n_keys = prefix
        n_splits = P_SPLITS
        slot = i_split
        causal = 0                        # every row sees every key: last_seen = n_keys + i >= n_keys
    else:
        i_item = item - N_PREFIX
        i_split = i_item % S_SPLITS
        i_tile = (i_item // S_SPLITS) % S_TILES
        row_base = i_item // (S_SPLITS * S_TILES)          # the sequence
        lo = 0                            # its group: the last g with cu_groups[g] <= the sequence
        hi = N_GROUPS - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(cu_groups_ptr + mid) <= row_base:
                lo = mid
            else:
                hi = mid - 1
        g_first = tl.load(cu_groups_ptr + lo)
        prefix = tl.load(prefix_ptr + lo)
        n_rows = rows_seq
        kv_first = prefix                 # key k of this item is position prefix + k
        n_keys = tl.load(seqused_ptr + row_base) - prefix
        n_splits = S_SPLITS
        slot = P_SPLITS + i_split
        causal = S_q                      # row i sees keys k <= n_keys - S_q + i
    r0 = i_tile * BLOCK_M
    n_blocks = tl.cdiv(n_keys, BLOCK_N)
    blk_lo = i_split * n_blocks // n_splits
    blk_hi = (i_split + 1) * n_blocks // n_splits
    # A prefix tile past a smaller group's rows, or a split with no keys, neither runs nor counts
    # (_cascade_arrivals counts alike); but a suffix with no keys at all runs its split 0, which writes the
    # row when no prefix does.
    if (r0 >= n_rows) | ((blk_lo == blk_hi) & (is_prefix | (i_split > 0) | (n_blocks > 0))):
        return

    o_r = r0 + tl.arange(0, BLOCK_M)
    m_r = o_r < n_rows
    i_b = (row_base + o_r // rows_seq).to(tl.int64)                           # each row's sequence
    i_q = (o_r // GROUP) % S_q
    i_hq = i_hkv * GROUP + o_r % GROUP
    o_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        m_d = tl.full([BLOCK_D], 1, tl.int1)      # a constant mask keeps the loads vectorized
    else:
        m_d = o_d < HEAD_DIM
    p_q = q_ptr + i_b[:, None] * stride_qb + i_q[:, None] * stride_qs + i_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)           # [BLOCK_M, BLOCK_D]

    start = blk_lo * BLOCK_N
    end = tl.minimum(blk_hi * BLOCK_N, n_keys)
    last_seen = n_keys - causal + i_q                                          # [BLOCK_M]
    bt_row = bt_ptr + row_base.to(tl.int64) * stride_btb                       # the pages of the keys
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)                 # running max, log2 units
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)                                # running sum of exp2
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    i_page = (kv_first + start) // PAGE_SIZE
    o_page = (kv_first + start) % PAGE_SIZE
    for start_n in range(start, end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < end
        # The K/V loads and scores are _decode_fwd_kernel's, written out again on purpose: in a shared
        # @triton.jit function the alignment hint no longer reaches the loads' pipeliner (measured on
        # the sm_90 builds of the earlier prefix kernel: D = 100 or 60 lost their async copies).  The
        # softcap's tanh is _tanh_near_zero: no bitwise contract ties the cascade to another kernel.
        if BLOCK_IN_PAGE:    # one page id per block (BLOCK_N divides the page size and every prefix)
            page = tl.load(bt_row + i_page).to(tl.int64)
            o_t = o_page + tl.arange(0, BLOCK_N)
            o_k = page * stride_kb + (o_t * stride_kt + i_hkv * stride_kh)
            o_v = page * stride_vb + (o_t * stride_vt + i_hkv * stride_vh)
            o_page += BLOCK_N
            i_page += (o_page == PAGE_SIZE).to(tl.int32)
            o_page = tl.where(o_page == PAGE_SIZE, 0, o_page)
        else:
            o_pos = o_n + kv_first                                          # the keys' positions
            page = tl.load(bt_row + o_pos // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
            o_k = page * stride_kb + (o_pos % PAGE_SIZE) * stride_kt + i_hkv * stride_kh
            o_v = page * stride_vb + (o_pos % PAGE_SIZE) * stride_vt + i_hkv * stride_vh
        if KV_ALIGN > 1:  # the host checked that every K/V row starts at a multiple of KV_ALIGN elements
            o_k = tl.multiple_of(o_k, KV_ALIGN)
            o_v = tl.multiple_of(o_v, KV_ALIGN)
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(k_ptr + o_k[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        b_v = tl.load(v_ptr + o_v[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)       # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:                                                # log2-domain scores
            b_s = softcap * _tanh_near_zero(b_s * qk_scale) * _LOG2E     # qk_scale = scale / softcap
        else:
            b_s = b_s * qk_scale                                          # qk_scale = scale * log2(e)
        b_s = tl.where(m_n[None, :] & (o_n[None, :] <= last_seen[:, None]), b_s, float("-inf"))
        b_acc, b_l, b_m = _online_softmax_step(b_acc, b_l, b_m, b_s, b_v, DOT_PRECISION)

    b_o, b_lse = _finish_rows(b_acc, b_l, b_m, tl.zeros([BLOCK_M], dtype=tl.float32), False)
    b_o = b_o.to(po_ptr.dtype.element_ty)          # as stored: the merge reads every partial in this dtype
    m_o = m_r[:, None] & m_d[None, :]
    p_po = (po_ptr + i_b[:, None] * stride_pb + i_q[:, None] * stride_ps + i_hq[:, None] * stride_ph
            + slot * stride_pj + o_d[None, :])
    p_pl = plse_ptr + i_b * stride_lb + i_q * stride_ls + i_hq * stride_lh + slot * stride_lj
    if is_prefix:       # stored before the tickets: a prefix program's tile feeds several sequences
        tl.store(p_po, b_o, mask=m_o)
        tl.store(p_pl, b_lse, mask=m_r)
        tl.debug_barrier()

    # The sequences this tile holds rows of: one ticket each.  Prefix programs count themselves done with
    # the ticket (acq_rel: after their stores); a suffix program, if not the last, stores and then counts.
    s_last = (tl.minimum(r0 + BLOCK_M, n_rows) - 1) // rows_seq
    for s in range(r0 // rows_seq, s_last + 1):
        i_s = row_base + s
        arrivals = _cascade_arrivals(i_s, g_first, prefix, seqused_ptr, S_q, GROUP, P_SPLITS, S_SPLITS, S_TILES,
                                     BLOCK_M, BLOCK_N)
        p_count = count_ptr + i_s * H_kv + i_hkv
        old = tl.atomic_add(p_count, tl.where(is_prefix, 1 + (1 << 16), 1), sem="acq_rel", scope="gpu")
        last = (old & 0xFFFF) == arrivals - 1
        if (not last) & (not is_prefix):
            tl.store(p_po, b_o, mask=m_o)
            tl.store(p_pl, b_lse, mask=m_r)
            tl.debug_barrier()
            tl.atomic_add(p_count, 1 << 16, sem="release", scope="gpu")
        if last:
            need = arrivals - 1 + is_prefix.to(tl.int32)              # the others; a prefix program too
            done = (old >> 16) + is_prefix.to(tl.int32)
            while done < need:
                done = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu") >> 16
            i_s64 = i_s.to(tl.int64)
            n_pblocks = tl.cdiv(prefix, BLOCK_N)
            n_sblocks = tl.cdiv(tl.load(seqused_ptr + i_s) - prefix, BLOCK_N)
            for c in range(0, S_TILES):                    # the sequence's rows, BLOCK_M at a time
                o_c = c * BLOCK_M + tl.arange(0, BLOCK_M)
                m_c = o_c < rows_seq
                c_q = o_c // GROUP
                c_h = i_hkv * GROUP + o_c % GROUP
                own = (not is_prefix) & (c == i_tile)      # this program's rows: its state is in registers
                # Scalar row bases and int32 offsets: pointer tensors would hold 64 bits an element (the
                # D = 100 build spilled with them).
                r_co = c_q[:, None] * stride_ps + c_h[:, None] * stride_ph + o_d[None, :]
                r_cl = c_q * stride_ls + c_h * stride_lh
                p_co = po_ptr + i_s64 * stride_pb
                p_cl = plse_ptr + i_s64 * stride_lb
                m_mrg = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                den = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                for j in range(0, P_SPLITS + S_SPLITS):
                    # The slots with keys (as _cascade_arrivals counts them), in index order.
                    js = j - P_SPLITS
                    present = tl.where(j < P_SPLITS,
                                       (j + 1) * n_pblocks // P_SPLITS > j * n_pblocks // P_SPLITS,
                                       ((js == 0) & (n_sblocks == 0))
                                       | ((js + 1) * n_sblocks // S_SPLITS > js * n_sblocks // S_SPLITS))
                    if present:
                        m_j = tl.where(own & (j == slot), False, m_c)   # (m_c & a scalar: the interpreter casts)
                        lse_j = tl.load(p_cl + j * stride_lj + r_cl, mask=m_j, other=b_lse, cache_modifier=".cg")
                        o_j = tl.load(p_co + j * stride_pj + r_co, mask=m_j[:, None] & m_d[None, :], other=b_o,
                                      cache_modifier=".cg")
                        acc, den, m_mrg = _merge_step(acc, den, m_mrg, lse_j, o_j)
                sink = tl.zeros([BLOCK_M], dtype=tl.float32)
                if HAS_SINKS:
                    sink = tl.load(sinks_ptr + c_h, mask=m_c, other=0.0).to(tl.float32)
                f_o, f_lse = _merge_finish(acc, den, m_mrg, sink, HAS_SINKS)
                p_out = out_ptr + i_s64 * stride_ob + c_q[:, None] * stride_os + c_h[:, None] * stride_oh + o_d[None, :]
                tl.store(p_out, f_o.to(out_ptr.dtype.element_ty), mask=m_c[:, None] & m_d[None, :])
                tl.store(lse_ptr + (i_s64 * (H_kv * GROUP) + c_h) * S_q + c_q, f_lse, mask=m_c)   # [B, H_q, S_q]


@triton.jit
def _cascade_arrivals(i_s, g_first, prefix, seqused_ptr, S_q, GROUP, P_SPLITS, S_SPLITS, S_TILES,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many programs write a partial of sequence i_s (one KV head): the prefix splits with keys, once
    per prefix row tile holding some of its rows, and each query tile's suffix splits with keys (split 0
    when the suffix has none).  Split j of n blocks in s splits has keys iff floor((j + 1) n / s) >
    floor(j n / s): min(n, s) of them."""
    rows_seq = S_q * GROUP
    first_row = (i_s - g_first) * rows_seq                       # in the group's packed rows
    p_tiles = (first_row + rows_seq - 1) // BLOCK_M - first_row // BLOCK_M + 1
    p_splits = tl.minimum(tl.cdiv(prefix, BLOCK_N), P_SPLITS)
    s_splits = tl.maximum(tl.minimum(tl.cdiv(tl.load(seqused_ptr + i_s) - prefix, BLOCK_N), S_SPLITS), 1)
    return p_splits * p_tiles + s_splits * S_TILES


@triton.jit
def _decode_fwd_kernel(
    q_ptr, k_ptr, v_ptr, seqused_ptr, bt_ptr, sinks_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_os, stride_oh, stride_osplit,
    stride_lb, stride_ls, stride_lh, stride_lsplit,
    stride_btb,
    H_kv, GROUP, S_q, PAGE_SIZE, NUM_SPLITS, qk_scale, softcap, leftpad_ptr, window_left,
    out_ptr, out_lse_ptr, count_ptr, stride_fb, stride_fs, stride_fh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_PAGED: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_ALIGN: tl.constexpr, BATCH_INVARIANT: tl.constexpr = False,
    BLOCK_IN_PAGE: tl.constexpr = False, HAS_LEFTPAD: tl.constexpr = False, FUSED_MERGE: tl.constexpr = False,
    SPLIT_ROTATE: tl.constexpr = 0, HAS_WINDOW: tl.constexpr = False,
):
    """One program per (sequence x KV head, split, query tile).  The tile packs the S_q rows of
    all G query heads of one KV head (row r = i * G + g), so K and V are read once per KV head,
    not once per query head.  It streams its share of the key blocks (page ids looked up per
    block when BLOCK_N divides the page size, else per key, so any page size works) through an
    online softmax in fp32 (exp2, scale folded with log2 e).  With one split it adds the sink and
    writes out / lse: no partials, and a sequence's result does not depend on the rest of the
    batch.  With several, split i takes key blocks floor(i n / s) .. floor((i + 1) n / s) - 1 of the
    sequence's n, and each program writes its normalized output in the input dtype (rounded like the
    final output) and its LSE in fp32: for ``_merge_splits_kernel`` (``_FUSED_MERGE = False``), or, with
    FUSED_MERGE (flash_decode), for the tile's last program, which merges them.

    The fused merge.  A program takes a ticket from its tile's counter (an int32 per (sequence, KV
    head, query tile), zeroed by the launcher) once its keys are done.  All but the last write their
    partial and count themselves done; the last waits for them (they hold tickets, so they are
    running and wait on nothing: no deadlock whatever the occupancy), reads the s - 1 partials and
    merges them with its own state, kept in registers, then adds the sink and writes out and lse.  It
    takes the splits in index order and its own state as the others read theirs (the partials' dtype,
    the fp32 lse: tl.load casts ``other``), through the same ``_merge_step`` / ``_merge_finish`` as
    ``_merge_splits_kernel``: the result is the same bits whichever program finishes last, and the
    same as the merge kernel's (parity/test_flash_decoding.py compares them with torch.equal, with
    the first, a middle, the next-to-last and the last split's program made the merger).  It saves the
    merge kernel's launch, the merging program's partial (written and read) and one more read of every
    LSE.

    FLOPs ~= 4 * B * H_q * S_q * L * D (QK^T and PV; L the mean seqused_k), plus ~3 * S_q * H_q * D
    per split and sequence for the merge.
    Minimum bytes (the IO bound) = B * (2 * L * H_kv * D * elt (K, V once) + 2 * S_q * H_q * D * elt
    (q, out) + 4 * S_q * H_q (lse) + 4 * ceil(L / page_size) (page ids)).
    Issued bytes (active lanes) with s splits (fused) add, per sequence: (s - 1) * S_q * H_q * D * elt
    (each split reads q); the page ids each program reads, 4 * H_kv * ceil(L / BLOCK_N) when BLOCK_N
    divides the page size (one per key block), else 4 * H_kv * L (one per key), less the bound's
    4 * ceil(L / page_size); 2 * (s - 1) * S_q * H_q * (D * elt + 4) (the partials but the merging
    program's, written once and read once); 4 * H_kv * s (seqused_k); and per tile 4 bytes of zeros
    and 2 s atomics of 4 bytes read and written (a ticket per program, a done per partial, the
    merger's poll: once in the interpreter, where the others are done by then; a GPU may poll more,
    in L2).  At B = 4, GQA 8/2, D = 128, fp16, page 16 that is 1.0099 (s = 14, 112 programs) at
    L = 8k, 1.0097 contiguous, and 1.0478 (s = 9, 72 programs: 0.55 of an H100's 132 SMs) at L = 1k;
    the Triton interpreter's count of active lanes gives the same bytes exactly.  The kernel
    observatory (``make roofline``: its bound is q, K, V and out only, and it counts the host checks'
    PyTorch ops, 6 KB here) reads 1.0115 and 1.0495.  The merge kernel would write and read every
    partial: 1.0514 with the same 9 splits (hence 8 there: 1.0455, 64 programs, 0.48 of the SMs).  A
    tenth split costs 3 * S_q * H_q * D * elt + 8 * S_q * H_q + 20 * H_kv bytes more per sequence (q;
    a partial written and read; seqused_k and two atomics per program), 0.59%: 1.0537 > 1.05, so the
    traffic cap (_traffic_splits) stops at 9.
    """
    # o_ptr / lse_ptr are out [B, S_q, H_q, D] / lse [B, H_q, S_q] with one split, else the partials
    # [B, S_q, H_q, NUM_SPLITS, D] (q's dtype) / [B, S_q, H_q, NUM_SPLITS] (fp32): the strides say which.
    i_bh, i_split, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if SPLIT_ROTATE != 0:    # tests only: another split's program arrives last and merges
        i_split = (i_split + SPLIT_ROTATE) % NUM_SPLITS
    i_b, i_hkv = i_bh // H_kv, i_bh % H_kv
    i_b64 = i_b.to(tl.int64)
    # HAS_LEFTPAD: the sequence's keys start at position kv_first (cache_leftpad; a cascade's suffix starts
    # after its shared prefix).  Key k of this call is position kv_first + k; below, seqlen counts them.
    kv_first = 0
    if HAS_LEFTPAD:
        kv_first = tl.load(leftpad_ptr + i_b)
    if HAS_WINDOW:
        # a sliding window: row 0 (position used - S_q) sees the keys from used - S_q - window_left on, and
        # the keys before them no row sees: the sequence starts there (the later rows' first keys: below)
        used = tl.load(seqused_ptr + i_b)
        kv_first = tl.maximum(kv_first, used - S_q - window_left)
        seqlen = used - kv_first
    else:
        seqlen = tl.load(seqused_ptr + i_b) - kv_first

    # Tile rows pack (query row i, head g of the group) as r = i * GROUP + g: K/V are read once per KV head.
    # BATCH_INVARIANT puts row (position p, head g) at slot (p * G + g) mod BLOCK_M, as the varlen
    # kernel's mode does in a trainer's forward or a prefill (a CPU BLAS rounds a tile's slots apart).
    shift = 0
    if BATCH_INVARIANT:
        shift = (((seqlen - S_q) * GROUP) % BLOCK_M + BLOCK_M) % BLOCK_M
        if i_m * BLOCK_M >= S_q * GROUP + shift:          # the launch has one tile more than the rows need
            return
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M) - shift
    if S_q == 1 and not BATCH_INVARIANT:   # decoding (a launch makes an int equal to 1 a constant): no division
        i_q = o_r * 0
        i_hq = i_hkv * GROUP + o_r
    else:
        i_q = o_r // GROUP
        i_hq = i_hkv * GROUP + o_r % GROUP
    m_r = (o_r >= 0) & (o_r < S_q * GROUP)
    o_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        m_d = tl.full([BLOCK_D], 1, tl.int1)      # a constant mask keeps the loads vectorized
    else:
        m_d = o_d < HEAD_DIM
    p_q = q_ptr + i_b64 * stride_qb + i_q[:, None] * stride_qs + i_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)           # [BLOCK_M, BLOCK_D]

    # This split's share of the sequence's key blocks, from the real length: split i takes blocks
    # floor(i n / s) .. floor((i + 1) n / s) - 1, so the shares differ by at most one block and no split
    # is left empty while there are at least as many blocks as splits.  One split takes them all (written
    # as before this rule: the one-split builds, the batch-invariant mode's included, stay as they were).
    n_blocks = tl.cdiv(seqlen, BLOCK_N)
    if IS_SPLIT:
        start = (i_split * n_blocks // NUM_SPLITS) * BLOCK_N
        end = tl.minimum(((i_split + 1) * n_blocks // NUM_SPLITS) * BLOCK_N, seqlen)
    else:
        per_split = tl.cdiv(n_blocks, NUM_SPLITS)
        start = i_split * per_split * BLOCK_N
        end = tl.minimum(start + per_split * BLOCK_N, seqlen)
    last_seen = seqlen - S_q + i_q                                             # row i sees keys j <= last_seen
    first_seen = last_seen - window_left                                       # and j >= first_seen (HAS_WINDOW)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)                 # running max, log2 units
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)                                # running sum of exp2
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # BLOCK_IN_PAGE: each key block lies in one page (BLOCK_N divides the page size), whose id and the
    # block's offset in it advance with the loop instead of being divided out per block.
    i_page = (kv_first + start) // PAGE_SIZE
    o_page = (kv_first + start) % PAGE_SIZE
    for start_n in range(start, end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < end
        if IS_PAGED and BLOCK_IN_PAGE:    # one page id per block, rows at a fixed stride
            page = tl.load(bt_ptr + i_b64 * stride_btb + i_page).to(tl.int64)
            o_t = o_page + tl.arange(0, BLOCK_N)
            o_k = page * stride_kb + (o_t * stride_kt + i_hkv * stride_kh)
            o_v = page * stride_vb + (o_t * stride_vt + i_hkv * stride_vh)
            o_page += BLOCK_N
            i_page += (o_page == PAGE_SIZE).to(tl.int32)
            o_page = tl.where(o_page == PAGE_SIZE, 0, o_page)
        elif IS_PAGED:
            o_pos = o_n + kv_first                                          # the keys' positions
            page = tl.load(bt_ptr + i_b64 * stride_btb + o_pos // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
            o_k = page * stride_kb + (o_pos % PAGE_SIZE) * stride_kt + i_hkv * stride_kh
            o_v = page * stride_vb + (o_pos % PAGE_SIZE) * stride_vt + i_hkv * stride_vh
        else:
            o_pos = (o_n + kv_first).to(tl.int64)
            o_k = i_b64 * stride_kb + o_pos * stride_kt + i_hkv * stride_kh
            o_v = i_b64 * stride_vb + o_pos * stride_vt + i_hkv * stride_vh
        if KV_ALIGN > 1:  # the host checked that every K/V row starts at a multiple of KV_ALIGN elements
            o_k = tl.multiple_of(o_k, KV_ALIGN)
            o_v = tl.multiple_of(o_v, KV_ALIGN)
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(k_ptr + o_k[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        b_v = tl.load(v_ptr + o_v[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)       # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:                                                # log2-domain scores
            b_s = softcap * _tanh_near_zero(b_s * qk_scale) * _LOG2E     # qk_scale = scale / softcap
        else:
            b_s = b_s * qk_scale                                          # qk_scale = scale * log2(e)
        m_s = m_n[None, :] & (o_n[None, :] <= last_seen[:, None])
        if HAS_WINDOW:
            m_s = m_s & (o_n[None, :] >= first_seen[:, None])
        b_s = tl.where(m_s, b_s, float("-inf"))
        b_acc, b_l, b_m = _online_softmax_step(b_acc, b_l, b_m, b_s, b_v, DOT_PRECISION)

    b_sink = tl.zeros([BLOCK_M], dtype=tl.float32)
    if IS_SPLIT:    # a partial state: the sink joins the denominator once, in the merge
        b_o, b_lse = _finish_rows(b_acc, b_l, b_m, b_sink, False)
    else:
        if HAS_SINKS:
            b_sink = tl.load(sinks_ptr + i_hq, mask=m_r, other=0.0).to(tl.float32)
        b_o, b_lse = _finish_rows(b_acc, b_l, b_m, b_sink, HAS_SINKS)
    b_o = b_o.to(o_ptr.dtype.element_ty)           # as stored: the partials (and out) are in the input dtype
    m_o = m_r[:, None] & m_d[None, :]
    if not FUSED_MERGE:
        # out / lse with one split, else this split's partial (the merge kernel merges them).
        p_o = (o_ptr + i_b64 * stride_ob + i_q[:, None] * stride_os + i_hq[:, None] * stride_oh
               + i_split * stride_osplit + o_d[None, :])
        tl.store(p_o, b_o, mask=m_o)
        p_lse = lse_ptr + i_b64 * stride_lb + i_q * stride_ls + i_hq * stride_lh + i_split * stride_lsplit
        tl.store(p_lse, b_lse, mask=m_r)
    else:
        # The split merge, by the program of the tile that finishes its keys last.  Its ticket (the low 16
        # bits of the tile's counter; NUM_SPLITS <= _MAX_SPLITS < 2^16) says so; the others store their
        # partial and count themselves done (the high bits), a barrier putting every thread's stores
        # before one thread's release atomic (GPU scope).  The last one waits for the s - 1 others, which
        # all hold tickets, so are running and wait on nothing: no deadlock, whatever the number of
        # resident programs.  Its acquire (and the barrier behind a scalar atomic's result) orders its
        # loads of the partials (.cg: from L2) after their stores.  Its own partial is neither stored nor
        # read: its state stays in registers.
        p_o = o_ptr + i_b64 * stride_ob + i_split * stride_osplit      # this split's partial, by default
        r_o = i_q * stride_os + i_hq * stride_oh
        p_lse = lse_ptr + i_b64 * stride_lb + i_split * stride_lsplit
        r_lse = i_q * stride_ls + i_hq * stride_lh
        p_count = count_ptr + i_bh * tl.num_programs(2) + i_m
        ticket = tl.atomic_add(p_count, 1, sem="relaxed", scope="gpu") & 0xFFFF
        if ticket == NUM_SPLITS - 1:
            done = 0                                                 # (s >= 2: the loop runs)
            while done < NUM_SPLITS - 1:
                done = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu") >> 16
            # The splits in index order, this program's own state as the others' are read (tl.load casts
            # ``other`` to the partials' dtype; the lse is fp32 as stored): the result does not depend on
            # which program merges.  ``step`` is 1, but not to ptxas, which would unroll the loop.
            step = done + 2 - NUM_SPLITS
            p_po = o_ptr + i_b64 * stride_ob + r_o[:, None] + o_d[None, :]
            p_pl = lse_ptr + i_b64 * stride_lb + r_lse
            m_mrg = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            den = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for j in range(0, NUM_SPLITS, step):
                m_j = tl.where(j != i_split, m_r, False)     # (m_r & a scalar: the interpreter casts it to int)
                lse_j = tl.load(p_pl + j * stride_lsplit, mask=m_j, other=b_lse, cache_modifier=".cg")
                o_j = tl.load(p_po + j * stride_osplit, mask=m_j[:, None] & m_d[None, :], other=b_o,
                              cache_modifier=".cg")
                acc, den, m_mrg = _merge_step(acc, den, m_mrg, lse_j, o_j)
            sink = tl.zeros([BLOCK_M], dtype=tl.float32)
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + i_hq, mask=m_r, other=0.0).to(tl.float32)
            f_o, b_lse = _merge_finish(acc, den, m_mrg, sink, HAS_SINKS)
            b_o = f_o.to(o_ptr.dtype.element_ty)
            p_o = out_ptr + i_b64 * stride_fb                      # out [B, S_q, H_q, D]
            r_o = i_q * stride_fs + i_hq * stride_fh
            p_lse = out_lse_ptr + i_b64 * (S_q * H_kv * GROUP)     # lse [B, H_q, S_q]
            r_lse = i_hq * S_q + i_q
        tl.store(p_o + r_o[:, None] + o_d[None, :], b_o, mask=m_o)
        tl.store(p_lse + r_lse, b_lse, mask=m_r)
        if ticket != NUM_SPLITS - 1:
            tl.debug_barrier()
            tl.atomic_add(p_count, 1 << 16, sem="release", scope="gpu")


# A row's result is made of the score transform in the decode loop and the next three functions
# (fast/paged_varlen_attention.py's default kernel holds the same code but its softcap's tanh, which is
# _tanh_near_zero here: see there; the batch-invariant mode's helpers, shared with that file character for
# character, _tanh included, are further below).

@triton.jit
def _online_softmax_step(acc, l_i, m_i, b_s, b_v, DOT_PRECISION: tl.constexpr):
    """One key block of the online softmax: b_s [BLOCK_M, BLOCK_N] log2-domain scores (-inf where
    hidden), b_v [BLOCK_N, BLOCK_D]; returns the new (acc, l, m)."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    # A row that has seen nothing yet keeps m = -inf; subtracting 0 instead keeps its
    # 2^(-inf) = 0 probabilities from turning into 2^(-inf + inf) = nan.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_p = tl.exp2(b_s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _finish_rows(acc, l_i, m_i, b_sink, HAS_SINKS: tl.constexpr):
    """(out, lse) of the rows: acc / l and (m + log2 l) ln 2, after the sink (b_sink, natural log)."""
    if HAS_SINKS:
        # The sink is one more logit in the denominator, with no value vector.  A sink of -inf is no
        # sink; one of +inf takes all the mass (its term is 1 against m = +inf, not 2^(inf - inf)).
        b_sink = b_sink * _LOG2E
        m_fin = tl.maximum(m_i, b_sink)
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)          # no key seen and a sink of -inf
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(tl.where(b_sink == m_fin, 0.0, b_sink - m_fin))
        acc = acc * alpha[:, None]
        m_i = m_fin
    # l = 0: the row saw nothing (out 0, lse -inf).  Tested as == 0, so that a NaN stays NaN.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    return b_o, b_lse


@triton.jit
def _merge_step(acc, den, m, lse_j, o_j):
    """One partial state more in the split merge, the splits taken in index order: lse_j [R] fp32 natural
    log (-inf: the split saw no key), o_j [R, BLOCK_D] its normalized output (the partials' dtype).  The
    running state is (acc, den, m): the weighted sum, its weight and the largest lse so far, rescaled like
    the online softmax so that every weight is at most 1 (exact at any |lse|).  _merge_splits_kernel and
    the decode kernel's fused merge run this same code, so both round alike."""
    m_new = tl.maximum(m, lse_j)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # nothing seen yet: weights 0, not NaN
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse_j - m_safe)
    return acc * alpha[:, None] + w[:, None] * o_j.to(tl.float32), den * alpha + w, m_new


@triton.jit
def _merge_finish(acc, den, m, sink, HAS_SINKS: tl.constexpr):
    """The merged rows' (out, lse) from _merge_step's state, after the sink (natural log) joins the
    denominator once."""
    m = tl.where(m == float("-inf"), 0.0, m)
    if HAS_SINKS:
        m_fin = tl.maximum(m, sink)
        alpha = tl.exp(m - m_fin)                                 # 0 against a sink of +inf
        den = den * alpha + tl.exp(tl.where(sink == m_fin, 0.0, sink - m_fin))   # 1 for a sink of +inf
        acc = acc * alpha[:, None]
        m = m_fin
    empty = den == 0                                              # no key and no sink (or one of -inf)
    den_safe = tl.where(empty, 1.0, den)
    b_o = acc * (1.0 / den_safe)[:, None]
    b_lse = tl.where(empty, float("-inf"), m + tl.log(den_safe))
    return b_o, b_lse


@triton.jit
def _tanh(x):
    # tanh through exp2 (portable: the interpreter has no libdevice).  For large |x|, 2^(2x log2e)
    # overflows to inf or underflows to 0 and the expression saturates to +-1 as it should.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit
def _tanh_near_zero(x):
    """tanh with a small relative error near 0 as well (flash_decode's and cascade_decode's softcap): _tanh's
    1 - 2 / (e^2x + 1) loses about eps of absolute accuracy where tanh is small, eps * softcap in the
    score (fp32, softcap 20: 2.4e-6 against a tolerance of 2.1e-6 in parity/test_cascade_decode.py; in
    flash_decode, 4 of 12 seeds of a 4-row verification over 2.0x the fp32 reference's error, up to 4.2x;
    with this one 1.3x at most).
    Below |x| = 0.3 the Taylor series to x^11 (next term < 6e-10); above, (1 - t) / (1 + t) with
    t = e^(-2|x|) <= 0.55 (no cancellation past eps t).  Saturates to +-1 and keeps NaN."""
    a = tl.abs(x)
    t = tl.exp2(a * (-2.0 * _LOG2E))
    x2 = x * x
    near = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0
                                                                                     - x2 * (1382.0 / 155925.0))))))
    r = tl.where(a < 0.3, near, (1.0 - t) / (1.0 + t))
    return tl.where(x < 0, -r, r)


@triton.jit
def _merge_splits_kernel(
    po_ptr, plse_ptr, sinks_ptr, o_ptr, lse_ptr,
    stride_ob, stride_os, stride_oh,
    S_q, H_q, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One program per (sequence, row, query head) merges the splits' partials (outputs in the input
    dtype, LSEs in fp32) in split order, in fp32 (_merge_step), and adds the sink once.  flash_decode
    merges inside the decode kernel (FUSED_MERGE) with the same code; ``_FUSED_MERGE = False`` runs this
    kernel instead (the tests compare the two).  FLOPs ~= 3 * B * S_q * H_q * num_splits * D;
    bytes = B * S_q * H_q * (num_splits * (D * elt + 4) + D * elt + 4): each partial and LSE read once."""
    # One program per row (b, i, h), numbered like the partials [B, S_q, H_q, NUM_SPLITS, ...]; the
    # row is a tile of one ([1] and [1, BLOCK_D]) so that _merge_step serves both kernels.
    i_row = tl.program_id(0)
    i_h, i_s, i_b = i_row % H_q, (i_row // H_q) % S_q, i_row // (H_q * S_q)
    base = i_row.to(tl.int64) * NUM_SPLITS
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_one = tl.zeros([1], dtype=tl.int64)

    m = tl.full([1], float("-inf"), dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    for j in range(0, NUM_SPLITS):
        lse_j = tl.load(plse_ptr + base + j + o_one)
        o_j = tl.load(po_ptr + (base + j + o_one)[:, None] * HEAD_DIM + o_d[None, :], mask=m_d[None, :], other=0.0)
        acc, den, m = _merge_step(acc, den, m, lse_j, o_j)
    sink = tl.zeros([1], dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + i_h + o_one).to(tl.float32)
    b_o, lse = _merge_finish(acc, den, m, sink, HAS_SINKS)
    p_o = o_ptr + i_b.to(tl.int64) * stride_ob + i_s * stride_os + i_h * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_d[None, :])
    tl.store(lse_ptr + (i_b.to(tl.int64) * H_q + i_h) * S_q + i_s + o_one, lse)


@triton.jit
def _merge_states_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, lse_ptr, T, H,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``merge_attention_states``: one program per row.  FLOPs ~= 3 * rows * D; bytes =
    rows * (3 * D * elt + 12)."""
    # One program per row (n, t, h) of contiguous out [N, T, H, D]; lse is [N, H, T].
    i_row = tl.program_id(0)
    i_h, i_t, i_n = i_row % H, (i_row // H) % T, i_row // (H * T)
    o_l = (i_n.to(tl.int64) * H + i_h) * T + i_t
    # PyTorch's CUDA varlen_attn (FlashAttention-2) marks a row that saw no key with lse = +inf,
    # this repo with -inf: both are the empty side.
    b_la = tl.load(la_ptr + o_l)
    b_la = tl.where(b_la == float("inf"), float("-inf"), b_la)
    b_lb = tl.load(lb_ptr + o_l)
    b_lb = tl.where(b_lb == float("inf"), float("-inf"), b_lb)
    m = tl.maximum(b_la, b_lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(b_la - m)                      # exactly 1 and 0 when one side is empty; NaN stays NaN
    w_b = tl.exp(b_lb - m)
    den = w_a + w_b
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    base = i_row.to(tl.int64) * HEAD_DIM
    b_oa = tl.load(oa_ptr + base + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_ob = tl.load(ob_ptr + base + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_o = tl.where(w_a == 0, 0.0, w_a * b_oa) + tl.where(w_b == 0, 0.0, w_b * b_ob)   # an empty side's o: garbage
    empty = den == 0
    den_safe = tl.where(empty, 1.0, den)
    b_o = b_o / den_safe
    tl.store(o_ptr + base + o_d, b_o.to(o_ptr.dtype.element_ty), mask=m_d)
    tl.store(lse_ptr + o_l, tl.where(empty, float("-inf"), m + tl.log(den_safe)))


# ----------------------------------------------------------------------------- the batch-invariant decode
#
# batch_invariant=True runs _decode_invariant_kernel: a row's result is fast/paged_varlen_attention.py's
# ``varlen_attn(..., batch_invariant=True)`` for the same row, bit for bit.  The construction (that file's
# comment above _attn_fwd_invariant_kernel has it in full): rows in groups of 16 at slot (p G + g) mod 16;
# a row's keys in segments of SPLIT keys from key 0 of the call (cache_leftpad's position with one), each
# segment from a fresh state through key blocks of BLOCK_N from key 0, finished to (out in the input
# dtype, lse fp32), the segment states folded in index order; row sums as a ones dot.  The helpers below
# are that file's, character for character.  Here one program per (sequence x KV head, split, row group):
# split i takes segments floor(i n / s) .. floor((i + 1) n / s) - 1 of the sequence's n, so the launch
# splits the keys like the default's split launch, yet a row's bits do not depend on the split count.

_ROWS = tl.constexpr(16)     # the mode's row group: mma.sync's M; a row's slot is fixed within it


@triton.jit
def _inv_block_step(acc, l_i, m_i, b_s, b_v, b_ones, DOT_PRECISION: tl.constexpr):
    """One key block of a segment's online softmax, for a row group [.., 16] (or SUB of them): b_s
    [.., 16, BLOCK_N] log2-domain scores (-inf where hidden), b_v [.., BLOCK_N, BLOCK_D], b_ones
    [.., BLOCK_N, 8]; returns the new (acc, l, m).  l adds the rounded probabilities' row sums as an MMA."""
    m_new = tl.maximum(m_i, tl.max(b_s, -1))
    # A row that has seen nothing yet keeps m = -inf; subtracting 0 instead keeps its
    # 2^(-inf) = 0 probabilities from turning into 2^(-inf + inf) = nan.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_p = tl.exp2(b_s - tl.expand_dims(m_safe, -1)).to(b_v.dtype)
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.max(tl.dot(b_p, b_ones, input_precision=DOT_PRECISION), -1)
    acc = acc * tl.expand_dims(alpha, -1) + tl.dot(b_p, b_v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _div_2ulp(x, y):
    """x / y within 2 ulp, without the slow path of a correctly rounded division (see _FDIV_APPROX)."""
    if _FDIV_APPROX:
        q = tl.math.fdiv(x, y, approx=True)
    else:
        q = tl.math.fdiv(x, y)
    return q


@triton.jit
def _inv_segment_state(acc, l_i, m_i):
    """A segment's state: (out = acc / l, lse = (m + log2 l) ln 2), out 0 and lse -inf where it saw nothing.
    The caller rounds out to the input dtype, as a decode's partial is stored."""
    empty = l_i == 0.0                                  # tested as == 0, so that a NaN stays NaN
    l_safe = tl.where(empty, 1.0, l_i)
    b_o = _div_2ulp(acc, tl.expand_dims(l_safe, -1))    # l >= 1: 2 ulp, no slow path
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    return b_o, b_lse


@triton.jit
def _inv_fold_step(acc, den, m, lse_j, o_j):
    """Fold the next segment's state (lse_j fp32, o_j in the input dtype) into the running (acc, den, m),
    the segments taken in index order; rescaled like the online softmax so that every weight is at most 1.
    An empty segment (lse -inf, out 0) changes nothing."""
    m_new = tl.maximum(m, lse_j)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # nothing seen yet: weights 0, not NaN
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse_j - m_safe)
    return acc * tl.expand_dims(alpha, -1) + tl.expand_dims(w, -1) * o_j.to(tl.float32), den * alpha + w, m_new


@triton.jit
def _inv_fold_finish(acc, den, m, sink, HAS_SINKS: tl.constexpr):
    """The rows' (out, lse) from the folded segments, after the sink (natural log) joins the denominator."""
    m = tl.where(m == float("-inf"), 0.0, m)
    if HAS_SINKS:
        m_fin = tl.maximum(m, sink)
        alpha = tl.exp(m - m_fin)                                 # 0 against a sink of +inf
        den = den * alpha + tl.exp(tl.where(sink == m_fin, 0.0, sink - m_fin))   # 1 for a sink of +inf
        acc = acc * tl.expand_dims(alpha, -1)
        m = m_fin
    empty = den == 0                                              # no key and no sink (or one of -inf)
    den_safe = tl.where(empty, 1.0, den)
    b_o = _div_2ulp(acc, tl.expand_dims(den_safe, -1))   # den >= 1 (or a sink's share)
    b_lse = tl.where(empty, float("-inf"), m + tl.log(den_safe))
    return b_o, b_lse


@triton.jit
def _decode_invariant_kernel(
    q_ptr, k_ptr, v_ptr, seqused_ptr, bt_ptr, sinks_ptr, leftpad_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, count_ptr,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_pb, stride_ps, stride_ph, stride_pseg, stride_lb, stride_ls, stride_lh, stride_lseg,
    stride_btb,
    H_kv, GROUP, S_q, PAGE_SIZE, NUM_SPLITS, qk_scale, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    IS_PAGED: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_ALIGN: tl.constexpr, BLOCK_IN_PAGE: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    SPLIT_ROTATE: tl.constexpr = 0,
):
    """``flash_decode(..., batch_invariant=True)``.  One program per (sequence x KV head, split, row group):
    the group holds the S_q * G rows of one KV head at slots (p * G + g) mod 16 (one group while decoding
    with G <= 13 or G | 16).  The program reduces its share of the sequence's segments, each from a fresh
    state.  With one split it folds them as it goes and writes out / lse.  With several, it writes every
    segment's state but its last as a partial (out in the input dtype, lse fp32; index = the segment), takes
    a ticket from its tile's counter once its keys are done, and the program with the last ticket (the
    others hold tickets, so they are running and wait on nothing) folds all the segments in index order,
    its own last one from its registers, as the others were stored: the same fold as the varlen kernel's,
    whichever program merges and whatever the split count (the fused merge of ``_decode_fwd_kernel``, with
    partials per segment instead of per split).

    FLOPs ~= 4 * B * H_q * S_q * L * D, plus the row sums' ones dot (2 * 16 * 8 per key and row group: 1/16
    more MMA work at D = 128) and ~3 * S_q * H_q * D per segment for the fold.  Minimum bytes (the IO bound)
    as ``_decode_fwd_kernel``'s.  Issued bytes add, per sequence: with s > 1 splits, (n - 1) * S_q * H_q *
    (D * elt + 4) twice (every segment's partial but the merger's own last, written and read: n =
    ceil(L / SPLIT) segments) and (s - 1) * S_q * H_q * D * elt (q read again); the page ids, one per key
    block and one more per segment boundary inside a block (per key with cache_leftpad); 4 * H_kv * s
    (seqused_k) and per tile 4 bytes of zeros and 2 s atomics of 4 bytes read and written.  At B = 4, GQA
    8/2, D = 128, fp16, page 16, SPLIT = 120: L = 1k, 9 segments, 9 splits (72 programs): 1.0495 of the
    bound; L = 8k, 69 segments in 16 splits (128 programs): 1.039 (the kernel observatory's figures,
    bench/README.md).
    """
    i_bh, i_split, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if SPLIT_ROTATE != 0:    # tests only: another split's program arrives last and merges
        i_split = (i_split + SPLIT_ROTATE) % NUM_SPLITS
    i_b, i_hkv = i_bh // H_kv, i_bh % H_kv
    i_b64 = i_b.to(tl.int64)
    # HAS_LEFTPAD: the sequence's keys start at position kv_first (cache_leftpad); key k of this call is
    # position kv_first + k: the segments and key blocks count from kv_first, as the trainer's from its
    # packed sequence's first key.
    kv_first = 0
    if HAS_LEFTPAD:
        kv_first = tl.load(leftpad_ptr + i_b)
    seqlen = tl.load(seqused_ptr + i_b) - kv_first

    # The group's rows: (query row i, head g) at slot (p * G + g) mod 16 for its position p = seqlen - S_q + i.
    shift = (((seqlen - S_q) * GROUP) % _ROWS + _ROWS) % _ROWS
    if i_m * _ROWS >= S_q * GROUP + shift:          # the launch has one group more than the rows need
        return
    o_r = i_m * _ROWS + tl.arange(0, _ROWS) - shift
    i_q = o_r // GROUP
    i_hq = i_hkv * GROUP + o_r % GROUP
    m_r = (o_r >= 0) & (o_r < S_q * GROUP)
    o_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        m_d = tl.full([BLOCK_D], 1, tl.int1)      # a constant mask keeps the loads vectorized
    else:
        m_d = o_d < HEAD_DIM
    m_rd = m_r[:, None] & m_d[None, :]
    p_q = q_ptr + i_b64 * stride_qb + i_q[:, None] * stride_qs + i_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_rd, other=0.0)                                 # [16, BLOCK_D]
    last_seen = seqlen - S_q + i_q                                             # row i sees keys j <= last_seen

    # This split's share of the sequence's segments: split i takes floor(i n / s) .. floor((i + 1) n / s) - 1.
    n_seg = tl.cdiv(seqlen, SPLIT)
    seg_first = i_split * n_seg // NUM_SPLITS
    seg_end = (i_split + 1) * n_seg // NUM_SPLITS
    p_po = po_ptr + i_b64 * stride_pb + i_q[:, None] * stride_ps + i_hq[:, None] * stride_ph + o_d[None, :]
    p_pl = plse_ptr + i_b64 * stride_lb + i_q * stride_ls + i_hq * stride_lh
    b_ones = tl.full([BLOCK_N, 8], 1.0, dtype=k_ptr.dtype.element_ty)
    f_acc = tl.zeros([_ROWS, BLOCK_D], dtype=tl.float32)       # one split: the folded segments
    f_den = tl.zeros([_ROWS], dtype=tl.float32)
    f_m = tl.full([_ROWS], float("-inf"), dtype=tl.float32)
    b_o = tl.zeros([_ROWS, BLOCK_D], dtype=out_ptr.dtype.element_ty)   # the last segment's state, as stored
    b_lse = tl.full([_ROWS], float("-inf"), dtype=tl.float32)
    for i_seg in range(seg_first, seg_end):
        seg_lo = i_seg * SPLIT
        seg_hi = tl.minimum(seg_lo + SPLIT, seqlen)
        acc = tl.zeros([_ROWS, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([_ROWS], dtype=tl.float32)
        m_i = tl.full([_ROWS], float("-inf"), dtype=tl.float32)
        # Key blocks of BLOCK_N from key 0: the segment's first may start before it (SPLIT % BLOCK_N keys
        # of the previous segment, masked).  BLOCK_IN_PAGE: each block lies in one page, whose id and the
        # block's offset in it advance with the loop.
        blk_lo = (seg_lo // BLOCK_N) * BLOCK_N
        i_page = blk_lo // PAGE_SIZE
        o_page = blk_lo % PAGE_SIZE
        for start_n in range(blk_lo, seg_hi, BLOCK_N):
            o_n = start_n + tl.arange(0, BLOCK_N)
            m_n = (o_n >= seg_lo) & (o_n < seg_hi)
            if IS_PAGED and BLOCK_IN_PAGE:    # one page id per block, rows at a fixed stride
                page = tl.load(bt_ptr + i_b64 * stride_btb + i_page).to(tl.int64)
                o_t = o_page + tl.arange(0, BLOCK_N)
                o_k = page * stride_kb + (o_t * stride_kt + i_hkv * stride_kh)
                o_v = page * stride_vb + (o_t * stride_vt + i_hkv * stride_vh)
                o_page += BLOCK_N
                i_page += (o_page == PAGE_SIZE).to(tl.int32)
                o_page = tl.where(o_page == PAGE_SIZE, 0, o_page)
            elif IS_PAGED:
                o_pos = o_n + kv_first                                          # the keys' positions
                page = tl.load(bt_ptr + i_b64 * stride_btb + o_pos // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
                o_k = page * stride_kb + (o_pos % PAGE_SIZE) * stride_kt + i_hkv * stride_kh
                o_v = page * stride_vb + (o_pos % PAGE_SIZE) * stride_vt + i_hkv * stride_vh
            else:
                o_pos = (o_n + kv_first).to(tl.int64)
                o_k = i_b64 * stride_kb + o_pos * stride_kt + i_hkv * stride_kh
                o_v = i_b64 * stride_vb + o_pos * stride_vt + i_hkv * stride_vh
            if KV_ALIGN > 1:  # the host checked that every K/V row starts at a multiple of KV_ALIGN elements
                o_k = tl.multiple_of(o_k, KV_ALIGN)
                o_v = tl.multiple_of(o_v, KV_ALIGN)
            m_kv = m_n[:, None] & m_d[None, :]
            b_k = tl.load(k_ptr + o_k[:, None] + o_d[None, :], mask=m_kv, other=0.0)
            b_v = tl.load(v_ptr + o_v[:, None] + o_d[None, :], mask=m_kv, other=0.0)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)       # [16, BLOCK_N]
            if HAS_SOFTCAP:                                                # log2-domain scores
                b_s = softcap * _tanh(b_s * qk_scale) * _LOG2E     # qk_scale = scale / softcap
            else:
                b_s = b_s * qk_scale                                          # qk_scale = scale * log2(e)
            b_s = tl.where(m_n[None, :] & (o_n[None, :] <= last_seen[:, None]), b_s, float("-inf"))
            acc, l_i, m_i = _inv_block_step(acc, l_i, m_i, b_s, b_v, b_ones, DOT_PRECISION)
        s_o, b_lse = _inv_segment_state(acc, l_i, m_i)
        b_o = s_o.to(out_ptr.dtype.element_ty)        # rounded as a partial is stored
        if IS_SPLIT:
            if i_seg + 1 < seg_end:                   # not this split's last: a partial for the merger
                tl.store(p_po + i_seg * stride_pseg, b_o, mask=m_rd)
                tl.store(p_pl + i_seg * stride_lseg, b_lse, mask=m_r)
        else:
            f_acc, f_den, f_m = _inv_fold_step(f_acc, f_den, f_m, b_lse, b_o)

    b_sink = tl.zeros([_ROWS], dtype=tl.float32)
    if HAS_SINKS:
        b_sink = tl.load(sinks_ptr + i_hq, mask=m_r, other=0.0).to(tl.float32)
    p_out = out_ptr + i_b64 * stride_ob + i_q[:, None] * stride_os + i_hq[:, None] * stride_oh + o_d[None, :]
    p_lse = lse_ptr + i_b64 * (S_q * H_kv * GROUP) + i_hq * S_q + i_q           # lse [B, H_q, S_q]
    if not IS_SPLIT:
        f_o, f_lse = _inv_fold_finish(f_acc, f_den, f_m, b_sink, HAS_SINKS)
        tl.store(p_out, f_o.to(out_ptr.dtype.element_ty), mask=m_rd)
        tl.store(p_lse, f_lse, mask=m_r)
    else:
        # The merge, by the program of the tile that finishes its keys last: its ticket (the low 16 bits of
        # the tile's counter; NUM_SPLITS <= _MAX_SPLITS < 2^16) says so.  The others store their last
        # segment's partial and count themselves done (the high bits), a barrier putting every thread's
        # stores before one thread's release atomic (GPU scope); the last waits for them with acquire
        # semantics, then reads the partials from L2 (.cg).  A split with no segment (more splits than the
        # sequence has segments) only counts itself.
        own = tl.where(seg_end > seg_first, seg_end - 1, -1)          # the segment this program still holds
        p_count = count_ptr + i_bh * tl.num_programs(2) + i_m
        ticket = tl.atomic_add(p_count, 1, sem="relaxed", scope="gpu") & 0xFFFF
        if ticket == NUM_SPLITS - 1:
            done = 0                                                 # (s >= 2: the loop runs)
            while done < NUM_SPLITS - 1:
                done = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu") >> 16
            # The segments in index order, this program's own as the others' are read (tl.load casts
            # ``other`` to the partials' dtype).  ``step`` is 1, but not to ptxas, which would unroll the loop.
            step = done + 2 - NUM_SPLITS
            for j in range(0, n_seg, step):
                m_j = tl.where(j != own, m_r, False)     # (m_r & a scalar: the interpreter casts it to int)
                lse_j = tl.load(p_pl + j * stride_lseg, mask=m_j, other=b_lse, cache_modifier=".cg")
                o_j = tl.load(p_po + j * stride_pseg, mask=m_j[:, None] & m_d[None, :], other=b_o,
                              cache_modifier=".cg")
                f_acc, f_den, f_m = _inv_fold_step(f_acc, f_den, f_m, lse_j, o_j)
            f_o, f_lse = _inv_fold_finish(f_acc, f_den, f_m, b_sink, HAS_SINKS)
            tl.store(p_out, f_o.to(out_ptr.dtype.element_ty), mask=m_rd)
            tl.store(p_lse, f_lse, mask=m_r)
        else:
            if own >= 0:
                tl.store(p_po + own * stride_pseg, b_o, mask=m_rd)
                tl.store(p_pl + own * stride_lseg, b_lse, mask=m_r)
            tl.debug_barrier()
            tl.atomic_add(p_count, 1 << 16, sem="release", scope="gpu")


# ----------------------------------------------------------------------------- launch configuration

def _fwd_config(head_dim: int, dtype: torch.dtype, rows: int, paged: bool, kv_align: int,
                device: torch.device) -> dict:
    """Tile sizes and launch options of the decode kernel: one config per (dtype, head dim, rows,
    layout), never per batch (a config that followed the batch would break batch invariance, and
    autotuning cannot run under CUDA-graph capture).  BLOCK_N depends on the dtype and head dim only.

    Decode streams K and V once and does ~1 FLOP per byte, so the kernel is memory-bound: what
    counts is the bytes each program keeps in flight, not tile width.
    - BLOCK_N: about 8 KB of K and V per pipeline stage (2 * BLOCK_N * BLOCK_D * elt), at least 16
      keys (one mma): 32 keys at D = 64, 16 at D = 128 and 256 in 16-bit types.
    - Stages: two K/V buffers (16 KB in flight at 8 KB a stage; 32 KB at D = 256).  A third buffer
      cost 8 KB of shared memory per program at D = 128 (29 KB instead of 20.5 KB) and, with its
      pipeline prologue, about 140 SASS instructions paged (30 contiguous); its worth at run time is a GPU measurement,
      owed.  Paged loads are indirect (page id, then K/V) and Triton's pipeliner spreads the stages
      over both levels: 2 * buffers + 1 stages give the paged K/V loads ``buffers`` buffers,
      buffers + 1 do for the contiguous cache.
    - BLOCK_M rows of (query row, group head): up to 64 (32 at D = 256, 16 in fp32); decoding
      (S_q = 1, G <= 16) takes one 16-row tile.
    - 4 warps, 8 for tiles of 32 rows or more, fp32 (IEEE dots on FMA units) and rows not aligned to
      16 bytes (narrower vectors, more addresses in registers).  A split launch that merges its
      partials itself (flash_decode's fused merge) runs enough warps for 8 elements of the BLOCK_M x
      BLOCK_D tile a thread, up to 16 (``fused_warps``): 8 for the 16 x 128 tile, where 4 warps (16
      elements a thread) took the paged kernel to 1,213 SASS instructions against 974; 16 for 32 x 256
      (8 warps spill on sm_90) and 64 x 128.  The shape gate
      splits only a launch that leaves SMs idle and plans one program per SM, so the 8 warps cost no
      occupancy there (their worth at run time is a GPU measurement, owed).  The split count depends
      on the batch, so a split launch's config does too; one split never changes it.
    sm_90, D = 128, 16-bit, 16-row tile (parity/aot_compile.py, as a launch specializes it): one
    split, 63 registers, 20.5 KB of shared memory (two 8 KB K/V stages and q), 828 SASS instructions
    paged (page 16), 64 / 20.5 KB / 678 contiguous, so 8 programs fit an SM; split with the fused merge
    (8 warps), 78 / 20.5 KB / 974 paged, 78 / 20.5 KB / 858 contiguous, 3 programs an SM (registers);
    split for the merge kernel (4 warps, ``_FUSED_MERGE = False``), 63 / 20.5 KB / 871 paged.  Every
    config builds without spills for sm_80 and sm_90 (parity/test_compile.py).
    """
    elt = torch.finfo(dtype).bits // 8
    block_d = max(16, triton.next_power_of_2(head_dim))
    max_m = 16 if elt == 4 else (64 if block_d <= 128 else 32)
    block_m = min(max_m, max(16, triton.next_power_of_2(rows)))
    block_n = max(16, 8192 // (2 * block_d * elt))
    buffers = 2
    if device.type != "cuda":
        block_n = 16  # the interpreter: small blocks so small test shapes still loop over several
    num_warps = 8 if block_m >= 32 or elt == 4 or kv_align * elt < 16 else 4
    return dict(BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, KV_ALIGN=kv_align, num_warps=num_warps,
                fused_warps=max(num_warps, min(16, block_m * block_d // 256)),     # 8 merge elements a thread
                num_stages=2 * buffers + 1 if paged else buffers + 1,
                num_q_tiles=-(-rows // block_m))


def _cascade_config(head_dim: int, dtype: torch.dtype, rows: int, kv_align: int, device: torch.device) -> dict:
    """cascade_decode's one tile shape, for both kinds of program: _fwd_config's for the rows of its largest
    group packed together (``rows``), paged.  ``warps``: enough for 8 elements of the tile a thread in the
    merge (``fused_warps``, as flash_decode's fused merge), but at most 8 (16 warps cap a thread at 128
    registers: the sinks' merge then spilled 16 bytes on sm_80).  Rows not aligned to 16 bytes (D = 100,
    60) take 16-row tiles: a 32-row tile with the merge spilled on sm_90 (255 registers at 8 warps, 128 at
    16); a group of more than 16 / (S_q G) sequences then reads its prefix once per 16 rows."""
    if kv_align * (torch.finfo(dtype).bits // 8) < 16:
        rows = min(rows, 16)
    cfg = _fwd_config(head_dim, dtype, rows, True, kv_align, device)
    cfg["warps"] = max(cfg["num_warps"], min(cfg["fused_warps"], 8))
    return cfg


# The batch-invariant mode's launch: fast/paged_varlen_attention.py's table, copied (its comment gives the
# reasons).  Per GPU family, head-dim class and element size: (BLOCK_N, SPLIT, the varlen kernel's row groups
# a program, its stages, the warps and stages of a one-group program, K/V buffers of this file's decode
# kernel); then the interpreter's (CPU tensors).  A row's bits depend on the row group (16), BLOCK_N and
# SPLIT, so a decode step reduces like the varlen kernel; warps and stages spread the same arithmetic.
_INVARIANT_CONFIG_TABLE = {
    (90, 64, 2): (16, 120, 8, 2, 4, 2, 2), (90, 128, 2): (16, 120, 8, 1, 8, 2, 3),
    (90, 256, 2): (16, 120, 1, 2, 8, 2, 2),
    (80, 64, 2): (16, 120, 8, 2, 4, 2, 2), (80, 128, 2): (16, 120, 8, 1, 8, 2, 2),
    (80, 256, 2): (16, 120, 1, 2, 8, 2, 2),
    (90, 64, 4): (16, 120, 1, 2, 4, 2, 1), (90, 128, 4): (16, 120, 1, 2, 8, 2, 2),
    (90, 256, 4): (16, 120, 1, 1, 8, 1, 1),
    (80, 64, 4): (16, 120, 1, 2, 4, 2, 3), (80, 128, 4): (16, 120, 1, 2, 8, 3, 2),
    (80, 256, 4): (16, 120, 1, 2, 8, 2, 1),
}
# The Triton interpreter's (CPU tensors): segments of 8 keys, so that short test sequences cross several
# and every 16-key block straddles two; two row groups a prefill program.
_INTERPRET_INVARIANT_CONFIG = (16, 8, 2, 1, 4, 1, 1)


def _invariant_config(head_dim: int, dtype: torch.dtype, rows: int, group: int, kv_align: int,
                      family: Optional[int]) -> dict:
    """The decode kernel's batch-invariant launch on GPU family 80 or 90 (None: the interpreter): a 16-row
    group, the varlen kernel's BLOCK_N and SPLIT, the table's warps and this kernel's K/V buffers."""
    elt = torch.finfo(dtype).bits // 8
    block_d = max(16, triton.next_power_of_2(head_dim))
    if family is None:
        block_n, split, _, _, warps, _, buffers = _INTERPRET_INVARIANT_CONFIG
    else:
        block_n, split, _, _, warps, _, buffers = _INVARIANT_CONFIG_TABLE[(family, max(64, block_d), elt)]
    # Rows sit at position-aligned slots (see the kernel): the first at a multiple of gcd(G, 16) up to
    # 16 - gcd, so S_q * G rows span at most this many groups (one, decoding with G | 16).
    num_q_tiles = -(-(rows + 16 - math.gcd(group, 16)) // 16)
    return dict(BLOCK_D=block_d, BLOCK_M=16, BLOCK_N=block_n, SPLIT=split, KV_ALIGN=kv_align, num_warps=warps,
                buffers=buffers, num_q_tiles=num_q_tiles)


@functools.cache
def _gpu_family(device_index: int) -> int:
    """90 for Hopper and newer, 80 for Ampere/Ada (queried at the first call, never at import)."""
    return 90 if torch.cuda.get_device_capability(device_index)[0] >= 9 else 80


def _kv_align(*tensors) -> int:
    """The largest power of two (<= 16) dividing every non-unit stride of K and V, in elements."""
    align = 16
    for t in tensors:
        for stride in t.stride()[:-1]:
            while stride % align:
                align //= 2
    return align


def _sm_count(device: torch.device) -> int:
    """The SM count of ``device``, read at call time (never at import) and cached per device."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return _INTERPRETER_SMS


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _traffic_splits(capacity: int, rows: int, head_dim: int, elt: int, fused: bool = False) -> int:
    """The most splits whose extra bytes per (sequence, KV head) stay within _SPLIT_TRAFFIC of the K and V
    bytes of a full cache, 2 * capacity * D * elt.  A split costs about 3 * rows * (D * elt + 4): q read
    again, a partial out and lse written, then read.  The fused merge (``fused``) spares the merging
    program's partial, so s splits cost s - 1 of these; the merge kernel reads all s.  B = 4, GQA 8/2,
    D = 128, fp16: 9 splits at 1k keys fused (8 with the merge kernel), 68 (67) at 8k."""
    splits = int(_SPLIT_TRAFFIC * 2 * capacity * head_dim * elt) // (3 * rows * (head_dim * elt + 4))
    return max(1, splits + 1 if fused else splits)


def _cascade_splits(*, n_groups, p_tiles, prefix, p_rows, batch, s_tiles, suffix, s_rows, h_kv, head_dim, elt,
                    block_n, num_sms) -> tuple[int, int]:
    """cascade_decode's (prefix splits, suffix splits), from shape numbers only (the longest prefix, the
    longest suffix a row can have, the largest group): the smallest common share of keys per program
    (a multiple of block_n) such that

    - the splits' extra bytes stay within _CASCADE_SPLIT_TRAFFIC of the launch's K and V bytes: a split
      past the first of a tile of r rows costs 3 r (D elt + 4) (q read again, a partial written and
      read), over n_groups * p_tiles prefix tiles and batch * s_tiles suffix tiles per KV head;
    - the launch has at most one program per SM (or one per tile, if that is more).

    One share for both kinds keeps the programs' bytes even: the latency model prices a launch that
    leaves SMs idle by its busiest program.  At the GRPO case (one group of 8, 2k + 256 keys, GQA 8/2,
    D = 128, fp16): 7 prefix splits of 288-304 keys per KV head and one suffix split, 30 programs."""
    kv = 2 * head_dim * elt                                   # K and V bytes of a key, one KV head
    budget = _CASCADE_SPLIT_TRAFFIC * kv * h_kv * (n_groups * p_tiles * prefix + batch * suffix)
    per_row = 3 * (head_dim * elt + 4)
    tiles = h_kv * (n_groups * p_tiles + batch * s_tiles)
    slots = max(num_sms * _PROGRAMS_PER_SM, tiles)

    def splits(blocks):                                       # keys per program: blocks * block_n
        chunk = blocks * block_n
        return (max(1, -(-prefix // chunk)) if p_tiles else 1), max(1, -(-suffix // chunk))

    def fits(blocks):
        sp, ss = splits(blocks)
        extra = h_kv * (n_groups * p_tiles * (sp - 1) * p_rows + batch * s_tiles * (ss - 1) * s_rows) * per_row
        programs = h_kv * (n_groups * p_tiles * sp + batch * s_tiles * ss)
        return extra <= budget and programs <= slots

    lo, hi = 1, max(1, -(-max(prefix, suffix) // block_n))  # the whole of both in one program always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return splits(lo)


def _new_counters(n, device):
    """The fused merge's arrival counters: n int32 zeros (a function so tests can inspect them)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def _new_partials(o_shape, lse_shape, dtype, device):
    """The partial buffers of a split launch: each split's normalized output in the input dtype, its lse
    in fp32 (a function so tests can poison them)."""
    return (torch.empty(o_shape, dtype=dtype, device=device),
            torch.empty(lse_shape, dtype=torch.float32, device=device))


def _capacity(k_cache, block_table) -> int:
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


# ----------------------------------------------------------------------------- input checks

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_SIZES = {"B": "batch size", "S_q": "query row count", "H_q": "query head count", "H_kv": "KV head count",
          "D": "head dim", "S_max": "cache length", "num_pages": "page count", "page_size": "page size",
          "max_pages": "pages per sequence"}


def _check_inputs(q, k_cache, v_cache, seqused_k, *, block_table, k_new, v_new, scale, num_splits,
                  softcap, sinks, out, batch_invariant, cache_leftpad, window_size=(-1, -1)):
    """Shapes, dtypes, devices and strides (no device-to-host copy: this runs under torch.compile):
    ref/flash_decoding.py's table and rules, then what this kernel adds.  Returns the window's left (-1:
    none)."""
    paged = block_table is not None
    cache = ("num_pages", "page_size", "H_kv", "D") if paged else ("B", "S_max", "H_kv", "D")
    size = _check_tensors(
        # name          tensor        shape                       dtype          may be None
        ("q",           q,            ("B", "S_q", "H_q", "D"),   "float",       False),
        ("k_cache",     k_cache,      cache,                      "q",           False),   # q's dtype
        ("v_cache",     v_cache,      cache,                      "q",           False),
        ("seqused_k",   seqused_k,    ("B",),                     torch.int32,   False),
        ("block_table", block_table,  ("B", "max_pages"),         torch.int32,   True),
        ("k_new",       k_new,        ("B", "S_q", "H_kv", "D"),  "q",           True),    # with v_new
        ("v_new",       v_new,        ("B", "S_q", "H_kv", "D"),  "q",           True),
        ("sinks",       sinks,        ("H_q",),                   "float",       True),
        ("out",         out,          ("B", "S_q", "H_q", "D"),   None,          True),    # dtype: below
        ("cache_leftpad", cache_leftpad, ("B",),                  torch.int32,   True))
    if size["S_q"] < 1:
        raise ValueError(f"q must have S_q >= 1 query rows per sequence, got shape {tuple(q.shape)}")
    if size["H_kv"] == 0 or size["H_q"] % size["H_kv"] != 0:
        raise ValueError(f"the number of query heads must be a multiple of the KV heads, got H_q={size['H_q']} "
                         f"and H_kv={size['H_kv']}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if out is not None and out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype} like q, got {out.dtype}")
    left = _check_scalars(scale=scale, softcap=softcap, num_splits=num_splits, batch_invariant=batch_invariant,
                          window_size=window_size)
    # What this kernel adds to the contract's checks.
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32 in the fast path, got {q.dtype}")
    if size["D"] > 256:
        raise ValueError(f"head dim D must be <= 256 in the fast path, got D={size['D']}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in the head dim (it is written in place), "
                             f"got strides {tuple(t.stride())}")
    if out is not None and out.stride(-1) != 1:
        raise ValueError(f"out must have unit stride in the head dim, got strides {tuple(out.stride())}")
    return left


def _check_tensors(*rows):
    """Check a table of (name, tensor, shape, dtype, may be None) rows in order; returns the sizes.

    ``shape`` names each dimension's size: the first row to name a size fixes it and later rows
    must agree.  ``dtype`` is "float", a torch.dtype, the name of an earlier row whose dtype is
    required, or None (any).  One device for all.
    """
    size, owner, dtypes, devices = {}, {}, {}, {}
    for name, t, shape, dtype, optional in rows:
        if t is None and optional:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if dtype == "float" and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
        if isinstance(dtype, torch.dtype) and t.dtype != dtype:
            raise TypeError(f"{name} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}")
        if dtype in dtypes and t.dtype != dtypes[dtype]:
            raise TypeError(f"{dtype} and {name} must share a dtype, got {dtypes[dtype]} and {t.dtype}")
        layout = "[" + ", ".join(f"{s}={size[s]}" if s in size else s for s in shape) + "]"
        if t.dim() != len(shape):
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
        for s, n in zip(shape, t.shape):
            if size.setdefault(s, n) != n:
                raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}: {_SIZES.get(s, 'size')} "
                                 f"mismatch, {owner[s]} and {name} have {s}={size[s]} and {n}")
            owner.setdefault(s, name)
        dtypes[name], devices[name] = t.dtype, t.device
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got mixed devices {devices}")
    return size


def _check_scalars(*, scale, softcap, num_splits, batch_invariant, window_size=(-1, -1)):
    """The non-tensor arguments; returns the window's left (-1: none)."""
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a float >= 0, got {softcap!r}")
    if num_splits is not None:
        _integer("num_splits", num_splits, 1)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__} {batch_invariant!r}")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be (left, right) integers >= -1, got {window_size!r}")
    left, right = (_integer("window_size", w, -1) for w in window_size)
    if right > 0:
        raise ValueError(f"window_size = {tuple(window_size)}: decode attention is causal, right must be -1 or 0")
    if left >= 0 and batch_invariant:
        raise NotImplementedError("flash_decode(batch_invariant=True) takes no window_size: its kernel counts a "
                                  "row's segments from one first key per sequence (cache_leftpad, S_q = 1)")
    return left


def _check_device(name, t):
    """Triton needs a GPU driver; say so on the host instead of failing inside Triton."""
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{name} is a {t.device.type} tensor, and fast/flash_decoding.py runs Triton kernels, which need "
            f"CUDA tensors.  Move the inputs to a GPU; or set TRITON_INTERPRET=1 before triton is imported to "
            f"run the kernels on CPU tensors in the Triton interpreter (slow: for tests); or use "
            f"ref/flash_decoding.py, the same API in plain PyTorch, for CPU work.")


def _check_values(seqused_k, block_table, *, s_q, capacity, num_pages, page_size):
    """seqused_k within capacity, not 0 < seqused_k < S_q, used page ids inside the pool.

    Reduced on the device to four numbers, then one small device-to-host copy; skipped while a
    CUDA graph is captured (no copy is possible there).  The error path re-reads the index
    tensors to name the offending sequence, like the reference.
    """
    if seqused_k.numel() == 0:
        return
    if seqused_k.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lens = seqused_k.to(torch.int64)
    stats = [lens.min(), lens.max(), ((lens > 0) & (lens < s_q)).sum()]
    if block_table is not None:
        cols = torch.arange(block_table.shape[1], device=lens.device)
        used = cols[None, :] < ((lens + page_size - 1) // page_size)[:, None]   # [B, max_pages]
        stats.append((used & ((block_table < 0) | (block_table >= num_pages))).sum())
    lo, hi, short, *bad_pages = torch.stack(stats).tolist()                     # the one copy
    if lo >= 0 and hi <= capacity and short == 0 and not any(bad_pages):
        return
    lengths = seqused_k.tolist()
    where = (f"the {block_table.shape[1]} pages of {page_size} keys that block_table holds per sequence"
             if block_table is not None else f"the S_max = {capacity} slots of the contiguous cache")
    for b, length in enumerate(lengths):
        if not 0 <= length <= capacity:
            raise ValueError(f"seqused_k[{b}] = {length} is beyond {where} (capacity {capacity})")
        if 0 < length < s_q:
            raise ValueError(f"seqused_k[{b}] = {length} is smaller than S_q = {s_q}: the query rows are the "
                             f"last S_q keys of the sequence (0 marks an empty sequence)")
    table = block_table.tolist()
    for b, length in enumerate(lengths):
        bad = [p for p in table[b][:-(-length // page_size)] if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"block_table[{b}] points at page {bad[0]}, outside the pool of {num_pages} pages")


def _check_leftpad(cache_leftpad, seqused_k):
    """0 <= cache_leftpad[b] <= seqused_k[b] (one small device-to-host copy, none during capture)."""
    if cache_leftpad.numel() == 0 or (cache_leftpad.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if bool(((cache_leftpad < 0) | (cache_leftpad > seqused_k)).any()):
        for b, (first, length) in enumerate(zip(cache_leftpad.tolist(), seqused_k.tolist())):
            if not 0 <= first <= length:
                raise ValueError(f"cache_leftpad[{b}] = {first} must be in [0, seqused_k[{b}] = {length}]")


def _check_group_tensors(cu_groups, prefix_lens, q):
    """cascade_decode's group tensors: int32, one dimension, on q's device (no host copy)."""
    for name, t, shape in (("cu_groups", cu_groups, "[G + 1]"), ("prefix_lens", prefix_lens, "[G]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor {shape}, got {type(t).__name__}")
        if t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name} must be an int32 tensor {shape}, got {t.dtype} of shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} like q, got {t.device}")
    if cu_groups.numel() != prefix_lens.numel() + 1:
        raise ValueError(f"cu_groups must have one more entry than prefix_lens ({prefix_lens.numel()} groups), got "
                         f"{cu_groups.numel()}")


def _check_group_values(cu_groups, prefix_lens, seqused_k, block_table, *, s_q, page_size) -> tuple:
    """cu_groups rises from 0 to B; each prefix is seen by every query row of its group and lies in the
    same pages for all of them.  Reduced on the device, one host copy; returns (the largest group, the
    shortest and the longest prefix of a row, whether every prefix ends on a page boundary)."""
    batch = seqused_k.numel()
    bounds = cu_groups.to(torch.int64)
    sizes = bounds.diff()
    fails = [(bounds[:1] != 0).sum() + (bounds[-1:] != batch).sum() + (sizes < 0).sum()]
    if not bool(fails[0] == 0):
        raise ValueError(f"cu_groups must rise from 0 to B = {batch}, got {cu_groups.tolist()}")
    group = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes, output_size=batch)
    prefix = prefix_lens.to(torch.int64)[group]                                    # [B]: its group's prefix
    lens = seqused_k.to(torch.int64)
    fails.append(((prefix < 0) | (prefix > (lens - s_q + 1).clamp(min=0))).sum())
    cols = torch.arange(block_table.shape[1], device=lens.device)
    shared = cols[None, :] < ((prefix + page_size - 1) // page_size)[:, None]     # [B, max_pages]
    fails.append((shared & (block_table != block_table[bounds[:-1][group]])).sum())
    largest = sizes.max() if sizes.numel() else sizes.new_zeros(())
    shortest = prefix.min() if batch else sizes.new_zeros(())
    longest = prefix.max() if batch else sizes.new_zeros(())
    unaligned = (prefix % page_size != 0).sum()
    _, bad_prefix, bad_pages, largest, shortest, longest, unaligned = torch.stack(
        [*fails, largest, shortest, longest, unaligned]).tolist()                  # the one copy
    if bad_prefix:
        raise ValueError("prefix_lens[g] must be in [0, seqused_k[b] - S_q + 1] for every row b of group g (every "
                         f"query row sees the whole prefix): prefix_lens {prefix_lens.tolist()}, cu_groups "
                         f"{cu_groups.tolist()}, seqused_k {seqused_k.tolist()}")
    if bad_pages:
        raise ValueError("the rows of a group must hold their prefix in the same pages: block_table rows differ "
                         "within a group over the first ceil(prefix_lens[g] / page_size) pages")
    return largest, shortest, longest, unaligned == 0


def _integer(name, value, minimum):
    """``value`` as an int: any integral number (int, numpy's integers: whatever has ``__index__``),
    never a bool or a float, and at least ``minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


# ----------------------------------------------------------------------------- self-check

if __name__ == "__main__":
    # A tiny self-check on the GPU (or CPU with TRITON_INTERPRET=1): split and unsplit agree.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 64, generator=g).to(dev)
    k = torch.randn(2, 300, 2, 64, generator=g).to(dev)
    v = torch.randn(2, 300, 2, 64, generator=g).to(dev)
    used = torch.tensor([300, 123], dtype=torch.int32, device=dev)
    a = flash_decode(q, k, v, used, num_splits=1)
    b = flash_decode(q, k, v, used, num_splits=5)
    print("max |split - unsplit|:", (a - b).abs().max().item())
