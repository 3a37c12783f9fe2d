"""Paged varlen attention: Triton forward and backward kernels, a drop-in for torch.nn.attention.varlen.

Example (runs as written next to this file; TRITON_INTERPRET=1 runs fast/'s kernels on a CPU)::

    # paged_varlen_attention.py, copied next to this script
    import torch
    from paged_varlen_attention import varlen_attn

    dev = "cuda" if torch.cuda.is_available() else "cpu"     # fast/ on a CPU: TRITON_INTERPRET=1 first
    q, k, v = (torch.randn(9, 4, 64, device=dev) for _ in range(3))   # two sequences, 4 and 5 tokens, packed
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=dev)
    out = varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0))     # causal: [9, 4, 64]
    print(out.shape)

Exactly what ref/paged_varlen_attention.py specifies (PyTorch's ``varlen_attn`` /
``varlen_attn_out`` contract plus ``softcap`` and ``sinks``), with one FlashAttention-2 style
forward kernel (a program owns a tile of query rows and streams the keys it can see through an
online softmax, reading K/V packed or through a block table) and, with packed keys, a
FlashAttention-2 backward in three kernels.

The math (per query row i of a sequence, log2 domain inside the kernels)
    s_ij = scale * <q_i, k_j>  [softcap * tanh(s_ij / softcap)],  t_ij = s_ij * log2(e)
    online softmax over key blocks:  m' = max(m, max_j t_ij);  l' = l * 2^(m - m') + sum_j 2^(t_ij - m')
                                     acc' = acc * 2^(m - m') + sum_j 2^(t_ij - m') v_j
    sink (optional): one more term 2^(sink_h * log2 e) in l, with no value
    o_i = acc / l (0 when l = 0);  lse_i = (m + log2 l) * ln 2 (-inf when l = 0)
    Row i of a sequence with L_q queries and L_k keys sees key j iff
    i + L_k - L_q - left <= j <= i + L_k - L_q + right (-1 = unbounded; causal = (-1, 0)).
    Edge cases as the reference defines them: a sink of -inf is no sink, one of +inf takes all the
    mass (out 0, lse +inf); a NaN stays NaN (l = 0 is tested as == 0); rows past cu_seq_q[-1] of a
    padded buffer get out 0 (untouched by varlen_attn_out), lse -inf and gradient 0.
    The backward (P recomputed from the saved lse, never stored), with delta_i = dO_i . O_i - dlse_i:
    dV = P^T dO;  dS = P * (dO V^T - delta) [* (1 - tanh^2) with softcap];  dQ = scale dS K;
    dK = scale dS^T Q;  d sink_h = -sum_i exp(sink_h - lse_i) delta_i.

Tensors (N sequences, T_q / T_k packed tokens, H_q / H_kv heads, D head dim, G = H_q / H_kv)
    query        [T_q, H_q, D]                     fp16 / bf16 / fp32, any strides
    key, value   [T_k, H_kv, D]                    packed (cu_seq_k), or
                 [num_pages, page_size, H_kv, D]   paged (block_table + seqused_k)
    cu_seq_q     [N + 1] int32, [-1] <= T_q;  cu_seq_k [N + 1] int32, [-1] <= T_k, or None when paged
    seqused_k    [N] int32;  block_table [N, max_pages] int32;  sinks [H_q] float
    out          [T_q, H_q, D] query dtype;  lse [H_q, T_q] fp32 natural log

Supported, and what raises
    Any page size, GQA ratio, head dims up to 256, fp16 / bf16 / fp32, windows, empty
    sequences, ``out=``, ``softcap``, ``sinks``; CUDA tensors (CPU tensors under
    ``TRITON_INTERPRET=1``).  Gradients (packed K/V) flow to query, key, value, sinks and through
    the returned lse; the paged path and ``varlen_attn_out`` refuse gradients, as in PyTorch; no
    double backward.  Bad input raises the reference's errors, plus fp64 and D > 256.  The value
    checks read the index tensors once on the host, except during CUDA-graph capture.  The ops are
    ``torch.library.custom_op``s (``torch.compile(fullgraph=True)`` traces forward and backward).
    ``num_splits`` is accepted; this kernel never splits.  The README's "Known limits" lists the rest.

Batch invariance (``batch_invariant=True``; the default, False, keeps the autotuned fast path)
    The contract: a query row's out and lse are bitwise equal (``torch.equal``) however the row is
    batched, given the same keys and values, position, window, scale, softcap and sinks, dtype and
    head dim, on one GPU family (or the interpreter) and one Triton version: in a packed forward
    over any other sequences (a trainer's), in a paged prefill chunk of any length starting at any
    position (any page size, block table, batch order), in a decode step of one row per sequence,
    and in fast/flash_decoding.py's ``flash_decode(..., batch_invariant=True)`` with any split count.
    The rule that makes it so: every phase computes a row with the same per-row arithmetic, the same
    instruction on the same row group, and reduces its keys in the same segments and blocks in the
    same order.  ``_attn_fwd_invariant_kernel`` and the decode kernel share the helpers, character
    for character.
    * Row groups of 16 (mma.sync m16n8k16's M, on sm_80 and sm_90 alike: no wgmma in the mode), the
      row of (position p, head g) at slot (p * G + g) mod 16 of its group in every call (a CPU BLAS,
      which runs ``tl.dot`` under the interpreter, rounds a tile's slots apart: OpenBLAS's
      Haswell/Zen sgemm takes rows 6-11 of 16 through another micro-kernel).  A prefill program holds
      SUB groups (8 in 16-bit at D <= 128: 128 packed rows, as the default's first tile) as a batched
      dot, one group a warp, so each K/V block is loaded once for all of them; a decode holds one.
    * The row sums of the probabilities are a dot with a ones block, like P V, and the row maxima are
      exact in any order: no floating-point sum of a row crosses threads, so spreading the same rows
      over other warps (SUB, num_warps, a decode's one group) changes no bits.
    * Fixed-size key splits: a row's keys (from the call's key 0: a packed sequence's first key, or
      ``cache_leftpad`` in the decode) in segments of SPLIT keys (``_INVARIANT_CONFIG_TABLE``: 120 on
      both families and every head dim, 8 under the interpreter), each reduced from a fresh state
      through key blocks of BLOCK_N from key 0 (a block that straddles a segment boundary is visited
      by both segments, each masking the other's keys), finished to (out rounded to the input dtype,
      lse fp32) as a decode's partial is stored, and the segment states folded in index order; the
      sink joins after the last.  A decode then splits a row's segments over programs like the
      default's split launch, and the program that merges folds them in the same order.
    * Every block masked; a hidden block, a hidden segment and an empty segment leave the state
      exactly as it was (p = 2^-inf = 0 and alpha = 2^0 = 1; weights e^-inf = 0 in the fold).
    The cost, against the default (the kernel observatory, B = 4 / 2 x 512, GQA 8/2, D = 128, fp16,
    sm_90 builds; bench/README.md has the candidates): a prefill issues 0.96x the default's bytes
    (128-row programs, but mma.sync instead of wgmma, one pipeline stage: 234 registers, 36 KB of
    shared memory; its speed on a GPU is owed), 1/16 more MMA work for the row sums, a block more
    per segment boundary inside a block, and a segment's finish and fold per 120 keys.  fp32, D = 256
    and rows aligned to fewer than 8 elements take one group a program (16 packed rows per K/V load:
    8x the K/V bytes of a 128-row tile).  Under the interpreter the default mode is invariant or not
    depending on the BLAS (one 16 x 16 tile in both loops); on a GPU it is not.

References
    PyTorch 2.13 torch.nn.attention.varlen; Dao, FlashAttention-2 (2023); Kwon et al.,
    PagedAttention / vLLM (2023); Triton fused-attention tutorial; Gemma 2 soft-capping;
    gpt-oss attention sinks; He, "Defeating Nondeterminism in LLM Inference" (Thinking Machines,
    2025), on batch-invariant kernels.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

__all__ = ["AuxRequest", "varlen_attn", "varlen_attn_out"]

_LOG2E = tl.constexpr(1.4426950408889634)   # log2(e): kernels use it as is, the host as .value
# tl.math.fdiv's approx flag (div.approx.f32) is newer than Triton 3.6, whose fdiv (div.full.f32) has no
# such flag; _div_2ulp takes whichever the installed Triton has.  Both are within 2 ulp and skip the slow
# path of a correctly rounded division; their bits may differ, so a bitwise comparison holds within one install.
_FDIV_APPROX = tl.constexpr("approx" in inspect.signature(tl.math.fdiv).parameters)
_LN2 = 0.6931471805599453
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AuxRequest(NamedTuple):
    """Which auxiliary outputs to return (PyTorch's ``AuxRequest``): ``lse=True`` adds the LSE."""

    lse: bool = False


# ----------------------------------------------------------------------------- public API

def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
                softcap=0.0, sinks=None, batch_invariant=False):
    """Variable-length (optionally paged) attention; see the module docstring for shapes.

    ``batch_invariant=True``: each row's out and lse are bitwise the same whatever else shares the
    call (see "Batch invariance" in the module docstring).
    Returns ``out [T_q, H_q, D]``, or ``(out, lse [H_q, T_q])`` when ``return_aux.lse``.
    """
    max_q, max_k, scale, left, right, softcap = _prepare(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
        enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table, num_splits=num_splits,
        softcap=softcap, sinks=sinks, batch_invariant=batch_invariant)
    out, lse = _varlen_attn_op(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, left, right, seqused_k,
                               block_table, softcap, sinks, batch_invariant)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


def varlen_attn_out(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                    scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                    num_splits=None, softcap=0.0, sinks=None, batch_invariant=False):
    """``varlen_attn`` writing into ``out`` (same shape and dtype as ``query``); returns ``out``
    or ``(out, lse)``.  Rows past cu_seq_q[-1] (padding) are left as they were."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    max_q, max_k, scale, left, right, softcap = _prepare(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
        enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table, num_splits=num_splits,
        softcap=softcap, sinks=sinks, batch_invariant=batch_invariant, out=out)
    lse = _varlen_attn_out_op(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, left, right,
                              seqused_k, block_table, softcap, sinks, batch_invariant)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


# ----------------------------------------------------------------------------- forward kernel
#
# A row's result is made of the next three functions and the score transform in _attn_key_blocks'
# loop (fast/flash_decoding.py holds the same code; the batch-invariant mode's helpers, shared with it
# character for character, are further below).  (The transform stays inline: as a function called
# in the loop it cost the fp32 D = 256 sm_90 build 8 bytes of stack.)

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
def _tanh(x):
    # tanh through exp2 (portable: the interpreter has no libdevice).  For large |x|, 2^(2x log2e)
    # overflows to inf or underflows to 0 and the expression saturates to +-1 as it should.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sinks_ptr,
    cu_seq_q_ptr, cu_seq_k_ptr, seqused_k_ptr, block_table_ptr,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_lse_head,
    stride_k_page, stride_k_tok, stride_k_head, stride_v_page, stride_v_tok, stride_v_head,
    stride_bt, page_size, num_seqs, rows_bucket,
    qk_scale, softcap, window_left, window_right,
    GROUP: tl.constexpr, IS_PAGED: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The forward.  Grid: (query tiles x sequences, KV heads), heaviest tile first (under a causal
    mask a sequence's last tile sees the most keys).

    * GQA packing: the G query heads of one KV head share the rows of a tile (row r = position
      r // G, head r % G), so each K/V block is loaded once per KV head, and decode-like
      sequences (L_q = 1) still fill G rows.
    * Mask skipping: the tile's visible key range [lo, hi) comes from the window; blocks outside
      it are never loaded, blocks fully inside it run without a mask, and only the (at most two)
      edge segments pay for it.  (``batch_invariant=True`` runs ``_attn_fwd_invariant_kernel``.)
    * Paged K/V: key j's row is at ``block_table[b, j // page_size]``, slot ``j % page_size``, so
      any page size works and the loads pipeline like packed ones.
    * fp32 inputs use IEEE fp32 dots (no silent tf32); fp16 / bf16 tensor cores, fp32 accumulation.
      Head dims are padded to a power of two >= 16 with masks; ALIGN (the largest power of two
      <= 16 dividing every row stride) lets loads vectorize.  Rows aligned to fewer than 4
      elements, or an ``out`` with a non-unit last stride, are staged through padded copies.

    FLOPs = 4 * D * sum over heads and query rows of the keys that row sees (causal square L:
    L (L + 1) / 2 pairs).  Minimum bytes = (2 * T_q * H_q + 2 * T_k * H_kv) * D * elt + 4 * T_q * H_q
    (q, o, k, v, lse once).
    """
    # rows_bucket is read by the autotuner only (its key), never here.
    i_tile, i_kvh = tl.program_id(0), tl.program_id(1)
    i_b = i_tile % num_seqs
    i_m_from_end = i_tile // num_seqs                  # 0 = the sequence's last (heaviest) tile
    bos_q = tl.load(cu_seq_q_ptr + i_b)
    L_q = tl.load(cu_seq_q_ptr + i_b + 1) - bos_q
    if IS_PAGED:
        bos_k = 0
        L_k = tl.load(seqused_k_ptr + i_b)
    else:
        bos_k = tl.load(cu_seq_k_ptr + i_b)
        if HAS_SEQUSED:
            L_k = tl.load(seqused_k_ptr + i_b)
        else:
            L_k = tl.load(cu_seq_k_ptr + i_b + 1) - bos_k

    # Rows of the tile: flattened (position, head-in-group), so the G query heads of this KV
    # head share every K/V block.
    num_tiles = tl.cdiv(L_q * GROUP, BLOCK_M)
    if i_m_from_end >= num_tiles:
        return
    i_m = num_tiles - 1 - i_m_from_end
    first_r = i_m * BLOCK_M                             # the tile's first row within the sequence
    o_r = first_r + tl.arange(0, BLOCK_M)               # [BLOCK_M]
    m_r = o_r < L_q * GROUP
    o_pos = o_r // GROUP                                # query position inside the sequence
    o_head = i_kvh * GROUP + o_r % GROUP                # query head
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_key_pos = o_pos + (L_k - L_q)                     # the key position each row is aligned with

    o_q_row = (bos_q + o_pos).to(tl.int64) * stride_q_tok + o_head.to(tl.int64) * stride_q_head
    o_o_row = (bos_q + o_pos).to(tl.int64) * stride_o_tok + o_head.to(tl.int64) * stride_o_head
    if ALIGN > 1:
        o_q_row = tl.multiple_of(o_q_row, ALIGN)
        o_o_row = tl.multiple_of(o_o_row, ALIGN)
    p_q = q_ptr + o_q_row[:, None] + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)   # [BLOCK_M, BLOCK_D]

    # The keys this tile can see at all, [lo, hi), and those every row of it sees, [full_lo, full_hi),
    # from the key positions its first and last rows are aligned with.
    pos_first = tl.maximum(first_r, 0) // GROUP + (L_k - L_q)
    pos_last = tl.minimum((first_r + BLOCK_M - 1) // GROUP, L_q - 1) + (L_k - L_q)
    lo, hi, full_lo, full_hi = _visible_span(pos_first, pos_last, L_k, window_left, window_right,
                                             HAS_LEFT, HAS_RIGHT)
    blk_lo, edge_a_hi, full_blk_lo, full_blk_hi, edge_c_lo = _block_segments(lo, full_lo, full_hi, BLOCK_N)

    bt_row_ptr = block_table_ptr + i_b.to(tl.int64) * stride_bt
    o_k_head = i_kvh.to(tl.int64) * stride_k_head
    o_v_head = i_kvh.to(tl.int64) * stride_v_head
    if ALIGN > 1:
        o_k_head = tl.multiple_of(o_k_head, ALIGN)
        o_v_head = tl.multiple_of(o_v_head, ALIGN)
    k_base = k_ptr + o_k_head
    v_base = v_ptr + o_v_head

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # The key blocks the tile sees, one loop per segment (unrolled at compile time): [blk_lo, edge_a_hi)
    # masked, [full_blk_lo, full_blk_hi) without a mask (every row sees every key), [edge_c_lo, hi)
    # masked.  Only a left window bound leaves blocks in the first segment (without one that loop
    # would be empty; leaving it out of the code saves registers).
    seg_start = (blk_lo, full_blk_lo, edge_c_lo)
    seg_end = (edge_a_hi, full_blk_hi, hi)
    for i_seg in tl.static_range(0 if HAS_LEFT else 1, 3):
        acc, l_i, m_i = _attn_key_blocks(
            acc, l_i, m_i, b_q, k_base, v_base, bt_row_ptr, bos_k, L_k, o_key_pos, o_d, m_d,
            seg_start[i_seg], seg_end[i_seg], qk_scale, softcap, window_left, window_right, page_size,
            stride_k_page, stride_k_tok, stride_v_page, stride_v_tok,
            i_seg != 1, IS_PAGED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HEAD_DIM != BLOCK_D, DOT_PRECISION, ALIGN, BLOCK_N)

    b_sink = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        b_sink = tl.load(sinks_ptr + o_head, mask=m_r, other=0.0).to(tl.float32)
    b_o, b_lse = _finish_rows(acc, l_i, m_i, b_sink, HAS_SINKS)

    p_o = o_ptr + o_o_row[:, None] + o_d[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
    tl.store(lse_ptr + o_head.to(tl.int64) * stride_lse_head + bos_q + o_pos, b_lse, mask=m_r)


@triton.jit
def _attn_key_blocks(acc, l_i, m_i, b_q, k_ptr, v_ptr, bt_row_ptr, bos_k, L_k, o_key_pos, o_d, m_d,
                     n_start, n_end, qk_scale, softcap, window_left, window_right, page_size,
                     stride_k_page, stride_k_tok, stride_v_page, stride_v_tok,
                     MASKED: tl.constexpr, IS_PAGED: tl.constexpr, HAS_LEFT: tl.constexpr,
                     HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HEAD_PADDED: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key blocks [n_start, n_end).  With MASKED, keys past L_k and outside
    the window are hidden; without it every key of every block is visible to every row."""
    for start_n in range(n_start, n_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)                          # key positions [BLOCK_N]
        m_n = o_n < L_k
        if IS_PAGED:
            page = tl.load(bt_row_ptr + o_n // page_size, mask=m_n, other=0).to(tl.int64)
            slot = (o_n % page_size).to(tl.int64)
            o_k_row = page * stride_k_page + slot * stride_k_tok
            o_v_row = page * stride_v_page + slot * stride_v_tok
        else:
            o_k_row = (bos_k + o_n).to(tl.int64) * stride_k_tok
            o_v_row = (bos_k + o_n).to(tl.int64) * stride_v_tok
        if ALIGN > 1:  # the launcher checked every K/V row starts at a multiple of ALIGN elements
            o_k_row = tl.multiple_of(o_k_row, ALIGN)
            o_v_row = tl.multiple_of(o_v_row, ALIGN)
        p_k = k_ptr + o_k_row[:, None] + o_d[None, :]                  # [BLOCK_N, BLOCK_D]
        p_v = v_ptr + o_v_row[:, None] + o_d[None, :]
        if MASKED:
            b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0.0)
            b_v = tl.load(p_v, mask=m_n[:, None] & m_d[None, :], other=0.0)
        elif HEAD_PADDED:
            b_k = tl.load(p_k, mask=m_d[None, :], other=0.0)
            b_v = tl.load(p_v, mask=m_d[None, :], other=0.0)
        else:
            b_k = tl.load(p_k)
            b_v = tl.load(p_v)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)   # [BLOCK_M, BLOCK_N] fp32
        if HAS_SOFTCAP:                                                # log2-domain scores
            b_s = softcap * _tanh(b_s * qk_scale) * _LOG2E     # qk_scale = scale / softcap
        else:
            b_s = b_s * qk_scale                                          # qk_scale = scale * log2(e)
        if MASKED:
            m_s = m_n[None, :]
            if HAS_LEFT:
                m_s = m_s & (o_n[None, :] >= o_key_pos[:, None] - window_left)
            if HAS_RIGHT:
                m_s = m_s & (o_n[None, :] <= o_key_pos[:, None] + window_right)
            b_s = tl.where(m_s, b_s, float("-inf"))
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, b_s, b_v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _visible_span(first, last, length, before, after, HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr):
    """Items t in [0, length) seen from positions x in [first, last], where x sees t iff
    x - before <= t <= x + after: returns [lo, hi), seen by some x, and [full_lo, full_hi), seen
    by every x.  Forward / dQ: x = the key position a query row is aligned with, t = a key,
    (before, after) = (left, right).  dK/dV: x = key j - (L_k - L_q), t = a query position,
    (before, after) = (right, left): the same window read from the key's side."""
    lo = 0
    hi = length
    full_lo = 0
    full_hi = length
    if HAS_BEFORE:
        lo = tl.maximum(first - before, 0)
        full_lo = tl.maximum(last - before, lo)
    if HAS_AFTER:
        hi = tl.minimum(last + after + 1, length)
        full_hi = tl.minimum(first + after + 1, hi)
    return lo, hi, full_lo, full_hi


@triton.jit
def _block_segments(lo, full_lo, full_hi, BLOCK: tl.constexpr):
    """Cut the visible span at BLOCK boundaries into three loops: [blk_lo, edge_a_hi) masked,
    [full_blk_lo, full_blk_hi) unmasked (every item of every block visible), [edge_c_lo, hi)
    masked.  Without a fully visible block, the last loop takes everything."""
    blk_lo = (lo // BLOCK) * BLOCK
    full_blk_lo = tl.maximum(tl.cdiv(full_lo, BLOCK) * BLOCK, blk_lo)
    full_blk_hi = (full_hi // BLOCK) * BLOCK
    has_full = full_blk_lo < full_blk_hi
    edge_a_hi = tl.where(has_full, full_blk_lo, blk_lo)
    full_blk_hi = tl.where(has_full, full_blk_hi, full_blk_lo)
    edge_c_lo = tl.where(has_full, full_blk_hi, blk_lo)
    return blk_lo, edge_a_hi, full_blk_lo, full_blk_hi, edge_c_lo


# ----------------------------------------------------------------------------- the batch-invariant forward
#
# batch_invariant=True runs this kernel in every phase (a trainer's packed forward, a paged prefill chunk,
# a decode step through varlen_attn); fast/flash_decoding.py's _decode_invariant_kernel computes the same
# rows with the same helpers below (the two files hold them character for character).  A row's result:
#   * rows in groups of _ROWS = 16 (mma.sync's M), the row of (position p, head g) at slot (p G + g) mod 16
#     of its group in every call (a CPU BLAS rounds a tile's slots apart); a program holds SUB groups
#     ([SUB, 16, D]: a batched dot, one group per warp) that share each K/V block it loads;
#   * its keys cut into segments of SPLIT keys from key 0 (the call's first key), each segment reduced from
#     a fresh state by the masked online softmax over key blocks of BLOCK_N from key 0 (a block that
#     straddles a segment boundary is visited by both segments, each masking the other's keys), finished
#     to (out rounded to the input dtype, lse fp32), and the segment states folded in index order;
#   * the row sum of the probabilities a dot with a ones block (like the P V dot), not a reduction across
#     threads: then on a GPU every floating-point reduction of a row is an MMA (mma.sync m16n8k16, the same
#     instruction whatever the launch's warps, SUB or tile) or a max (exact in any order), so the bits do not
#     depend on how a launch spreads its rows over warps.
# Every block runs masked (the default kernel's unmasked loop fuses scale and max-subtraction into one FMA
# where a masked loop rounds twice): a hidden block, a hidden segment and an empty segment are exact no-ops.

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
def _attn_fwd_invariant_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sinks_ptr,
    cu_seq_q_ptr, cu_seq_k_ptr, seqused_k_ptr, block_table_ptr,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_lse_head,
    stride_k_page, stride_k_tok, stride_k_head, stride_v_page, stride_v_tok, stride_v_head,
    stride_bt, page_size, num_seqs,
    qk_scale, softcap, window_left, window_right,
    GROUP: tl.constexpr, IS_PAGED: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SUB: tl.constexpr,
):
    """The forward of ``batch_invariant=True`` (see the comment above and "Batch invariance" in the module
    docstring).  Grid: (tiles of SUB row groups x sequences, KV heads), heaviest tile first.  A program
    holds SUB * 16 packed rows (position r // G, head r % G), the first at slot (p G + g) mod 16, so a
    sequence's first group may be partly empty; SUB > 1 computes the groups as a batched dot ([SUB, 16,
    D] x [SUB, D, BLOCK_N] with K broadcast: each K/V block is loaded once for all of them).

    FLOPs = 4 * D * (visible pairs) as the default kernel's, plus the row sums' ones dot (2 * 16 * 8 * BLOCK_N
    per block and row group: 1/16 more MMA work at D = 128) and a block more per segment boundary that
    cuts one.  Minimum bytes as the default kernel's; K and V are read once per program that sees them,
    i.e. once per SUB * 16 packed rows.
    """
    i_tile, i_kvh = tl.program_id(0), tl.program_id(1)
    i_b = i_tile % num_seqs
    i_m_from_end = i_tile // num_seqs                  # 0 = the sequence's last (heaviest) tile
    bos_q = tl.load(cu_seq_q_ptr + i_b)
    L_q = tl.load(cu_seq_q_ptr + i_b + 1) - bos_q
    if IS_PAGED:
        bos_k = 0
        L_k = tl.load(seqused_k_ptr + i_b)
    else:
        bos_k = tl.load(cu_seq_k_ptr + i_b)
        if HAS_SEQUSED:
            L_k = tl.load(seqused_k_ptr + i_b)
        else:
            L_k = tl.load(cu_seq_k_ptr + i_b + 1) - bos_k

    # The rows, aligned to absolute positions: (position p, head g) at slot (p * G + g) mod 16 of a group.
    shift = (((L_k - L_q) * GROUP) % _ROWS + _ROWS) % _ROWS            # the sequence's first row's slot
    num_tiles = tl.cdiv(L_q * GROUP + shift, SUB * _ROWS)
    if i_m_from_end >= num_tiles:
        return
    first_r = (num_tiles - 1 - i_m_from_end) * (SUB * _ROWS) - shift
    o_r = first_r + tl.arange(0, SUB * _ROWS)
    if SUB > 1:
        o_r = tl.reshape(o_r, [SUB, _ROWS])                             # [SUB, 16]: a row group per warp
    m_r = (o_r >= 0) & (o_r < L_q * GROUP)
    o_pos = o_r // GROUP                                # query position inside the sequence
    o_head = i_kvh * GROUP + o_r % GROUP                # query head
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_key_pos = o_pos + (L_k - L_q)                     # the key position each row is aligned with
    o_q_row = (bos_q + o_pos).to(tl.int64) * stride_q_tok + o_head.to(tl.int64) * stride_q_head
    o_o_row = (bos_q + o_pos).to(tl.int64) * stride_o_tok + o_head.to(tl.int64) * stride_o_head
    if ALIGN > 1:
        if SUB > 1:
            o_q_row = tl.multiple_of(o_q_row, [ALIGN, ALIGN])
            o_o_row = tl.multiple_of(o_o_row, [ALIGN, ALIGN])
        else:
            o_q_row = tl.multiple_of(o_q_row, ALIGN)
            o_o_row = tl.multiple_of(o_o_row, ALIGN)
    m_rd = tl.expand_dims(m_r, -1) & m_d
    b_q = tl.load(q_ptr + tl.expand_dims(o_q_row, -1) + o_d, mask=m_rd, other=0.0)   # [.., 16, BLOCK_D]

    # The keys some row of the tile can see, [lo, hi): segments lo // SPLIT .. cdiv(hi, SPLIT) - 1.
    pos_first = tl.maximum(first_r, 0) // GROUP + (L_k - L_q)
    pos_last = tl.minimum((first_r + SUB * _ROWS - 1) // GROUP, L_q - 1) + (L_k - L_q)
    lo, hi, _, _ = _visible_span(pos_first, pos_last, L_k, window_left, window_right, HAS_LEFT, HAS_RIGHT)
    bt_row_ptr = block_table_ptr + i_b.to(tl.int64) * stride_bt
    o_k_head = i_kvh.to(tl.int64) * stride_k_head
    o_v_head = i_kvh.to(tl.int64) * stride_v_head
    if ALIGN > 1:
        o_k_head = tl.multiple_of(o_k_head, ALIGN)
        o_v_head = tl.multiple_of(o_v_head, ALIGN)
    k_base = k_ptr + o_k_head
    v_base = v_ptr + o_v_head

    f_acc = tl.zeros(b_q.shape, dtype=tl.float32)       # the folded segments
    f_den = tl.zeros(o_r.shape, dtype=tl.float32)
    f_m = tl.full(o_r.shape, float("-inf"), dtype=tl.float32)
    for i_seg in range(lo // SPLIT, tl.cdiv(hi, SPLIT)):
        seg_lo = tl.maximum(i_seg * SPLIT, lo)
        seg_hi = tl.minimum(i_seg * SPLIT + SPLIT, hi)
        acc, l_i, m_i = _inv_key_blocks(
            b_q, k_base, v_base, bt_row_ptr, bos_k, o_key_pos, o_d, m_d, seg_lo, seg_hi, qk_scale, softcap,
            window_left, window_right, page_size, stride_k_page, stride_k_tok, stride_v_page, stride_v_tok,
            IS_PAGED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, DOT_PRECISION, ALIGN, BLOCK_N, SUB)
        b_o, b_lse = _inv_segment_state(acc, l_i, m_i)
        f_acc, f_den, f_m = _inv_fold_step(f_acc, f_den, f_m, b_lse, b_o.to(o_ptr.dtype.element_ty))

    b_sink = tl.zeros(o_r.shape, dtype=tl.float32)
    if HAS_SINKS:
        b_sink = tl.load(sinks_ptr + o_head, mask=m_r, other=0.0).to(tl.float32)
    b_o, b_lse = _inv_fold_finish(f_acc, f_den, f_m, b_sink, HAS_SINKS)
    tl.store(o_ptr + tl.expand_dims(o_o_row, -1) + o_d, b_o.to(o_ptr.dtype.element_ty), mask=m_rd)
    tl.store(lse_ptr + o_head.to(tl.int64) * stride_lse_head + bos_q + o_pos, b_lse, mask=m_r)


@triton.jit
def _inv_key_blocks(b_q, k_ptr, v_ptr, bt_row_ptr, bos_k, o_key_pos, o_d, m_d, n_lo, n_hi, qk_scale, softcap,
                    window_left, window_right, page_size, stride_k_page, stride_k_tok, stride_v_page, stride_v_tok,
                    IS_PAGED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr,
                    BLOCK_N: tl.constexpr, SUB: tl.constexpr):
    """One segment's state from a fresh start: the keys [n_lo, n_hi) through key blocks of BLOCK_N from
    key 0 (the first may start before n_lo), every block masked.  Returns (acc, l, m)."""
    acc = tl.zeros(b_q.shape, dtype=tl.float32)
    l_i = tl.zeros(o_key_pos.shape, dtype=tl.float32)
    m_i = tl.full(o_key_pos.shape, float("-inf"), dtype=tl.float32)
    if SUB > 1:
        b_ones = tl.full([SUB, BLOCK_N, 8], 1.0, dtype=k_ptr.dtype.element_ty)
    else:
        b_ones = tl.full([BLOCK_N, 8], 1.0, dtype=k_ptr.dtype.element_ty)
    for start_n in range((n_lo // BLOCK_N) * BLOCK_N, n_hi, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)                          # key positions [BLOCK_N]
        m_n = (o_n >= n_lo) & (o_n < n_hi)
        if IS_PAGED:
            page = tl.load(bt_row_ptr + o_n // page_size, mask=m_n, other=0).to(tl.int64)
            slot = (o_n % page_size).to(tl.int64)
            o_k_row = page * stride_k_page + slot * stride_k_tok
            o_v_row = page * stride_v_page + slot * stride_v_tok
        else:
            o_k_row = (bos_k + o_n).to(tl.int64) * stride_k_tok
            o_v_row = (bos_k + o_n).to(tl.int64) * stride_v_tok
        if ALIGN > 1:  # the launcher checked every K/V row starts at a multiple of ALIGN elements
            o_k_row = tl.multiple_of(o_k_row, ALIGN)
            o_v_row = tl.multiple_of(o_v_row, ALIGN)
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(k_ptr + o_k_row[:, None] + o_d[None, :], mask=m_kv, other=0.0)   # [BLOCK_N, BLOCK_D]
        b_v = tl.load(v_ptr + o_v_row[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        if SUB > 1:     # every row group against the one K/V block
            b_kt = tl.broadcast_to(tl.expand_dims(tl.trans(b_k), 0), [SUB, b_k.shape[1], BLOCK_N])
            b_v = tl.broadcast_to(tl.expand_dims(b_v, 0), [SUB, BLOCK_N, b_v.shape[1]])
        else:
            b_kt = tl.trans(b_k)
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION)          # [.., 16, BLOCK_N] fp32
        if HAS_SOFTCAP:                                                # log2-domain scores
            b_s = softcap * _tanh(b_s * qk_scale) * _LOG2E     # qk_scale = scale / softcap
        else:
            b_s = b_s * qk_scale                                          # qk_scale = scale * log2(e)
        m_s = m_n[None, :]
        if HAS_LEFT:
            m_s = m_s & (o_n[None, :] >= tl.expand_dims(o_key_pos, -1) - window_left)
        if HAS_RIGHT:
            m_s = m_s & (o_n[None, :] <= tl.expand_dims(o_key_pos, -1) + window_right)
        b_s = tl.where(m_s, b_s, float("-inf"))
        acc, l_i, m_i = _inv_block_step(acc, l_i, m_i, b_s, b_v, b_ones, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _padding_rows_kernel(x_ptr, y_ptr, lse_ptr, cu_ptr, num_seqs, T, stride_x_tok, stride_x_head, stride_y_tok,
                         stride_y_head, stride_lse_head, HEAD_DIM: tl.constexpr, NUM_ZEROS: tl.constexpr,
                         HAS_LSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows past cu[num_seqs] of a padded buffer: zero rows in x and y ([T, H, D], NUM_ZEROS of them)
    and lse [H, T] = -inf.  One program per (BLOCK_T rows, head).  No FLOPs; bytes = the padding rows
    written (nothing when there are none: every store is masked)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    first = tl.load(cu_ptr + num_seqs)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = (o_t >= first) & (o_t < T)
    o_tok = o_t.to(tl.int64)
    if HAS_LSE:
        tl.store(lse_ptr + i_h * stride_lse_head + o_tok, tl.full([BLOCK_T], float("-inf"), tl.float32), mask=m_t)
    if NUM_ZEROS > 0:
        o_d = tl.arange(0, BLOCK_D)
        m = m_t[:, None] & (o_d[None, :] < HEAD_DIM)
        b_zero = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        p_x = x_ptr + o_tok[:, None] * stride_x_tok + i_h * stride_x_head + o_d[None, :]
        tl.store(p_x, b_zero.to(x_ptr.dtype.element_ty), mask=m)
        if NUM_ZEROS > 1:
            p_y = y_ptr + o_tok[:, None] * stride_y_tok + i_h * stride_y_head + o_d[None, :]
            tl.store(p_y, b_zero.to(y_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------- forward configs

# Launch configs (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU family (90: Hopper, wgmma;
# 80: Ampere/Ada, mma.sync), padded head dim and element size.  Every one builds without
# register spills and within the family's shared memory (parity/test_compile.py builds them
# all).  "any" configs hold for rows aligned to 4 elements (ALIGN >= 4, e.g. D = 60, 100);
# "aligned" ones need 16-byte rows (ALIGN >= 8) and are pruned otherwise.  fp32 runs IEEE
# dots on CUDA cores (no tensor cores), so its tiles are small.
_CONFIG_TABLE = {
    # (family, head-dim class, element size): (any, aligned)
    (90, 64, 2): ([(128, 64, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3)], [(128, 128, 8, 3), (128, 128, 8, 2)]),
    (90, 128, 2): ([(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 8, 3)], [(128, 64, 8, 2), (128, 64, 8, 4)]),
    (90, 256, 2): ([(64, 32, 8, 3), (64, 32, 8, 2), (64, 16, 8, 3)], []),
    (80, 64, 2): ([(128, 64, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3)], []),
    (80, 128, 2): ([(64, 32, 8, 3), (64, 64, 8, 2)], [(128, 32, 8, 3), (64, 64, 8, 3)]),
    (80, 256, 2): ([(64, 16, 8, 3)], [(64, 32, 8, 3), (64, 32, 8, 2)]),
    (90, 64, 4): ([(16, 16, 4, 2)], []),
    (90, 128, 4): ([(32, 16, 8, 2)], []),
    (90, 256, 4): ([(16, 16, 8, 1)], []),
    (80, 64, 4): ([(16, 16, 4, 2)], []),
    (80, 128, 4): ([(32, 16, 8, 2)], []),
    (80, 256, 4): ([(16, 16, 4, 2)], []),
}


_MIN_ALIGN = 4  # rows aligned to fewer elements are staged through padded copies (see _launch)


def _configs(family: int, block_d: int, elt_size: int) -> list:
    any_align, aligned = _CONFIG_TABLE[(family, max(64, block_d), elt_size)]
    configs = []
    for rows, min_align in ((any_align, _MIN_ALIGN), (aligned, 8)):
        for bm, bn, warps, stages in rows:
            cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
            cfg.min_align = min_align  # read by _prune_by_alignment
            configs.append(cfg)
    # Least memory traffic first (K and V are read once per BLOCK_M query rows; ties keep the
    # table's order): the first config that survives pruning is what CI builds and the CPU
    # traffic report reads, so it is the best-rated one.
    return sorted(configs, key=lambda c: -c.kwargs["BLOCK_M"])


def _prune_by_alignment(configs, named_args, **constexprs):
    # Triton passes the launch's constexprs as keyword arguments (not in named_args).
    return [c for c in configs if c.min_align <= constexprs["ALIGN"]]


# One autotuner per (GPU family, head-dim class, element size), so each tries only configs that fit.
# key: the constexprs that change the code path, and rows_bucket, the query rows per sequence
# and KV head (max_q * G) rounded up to a power of two in [16, 4096], so decode-like batches and
# long prefills tune separately; triton adds the tensors' dtypes itself.
_AUTOTUNE_KEY = ["rows_bucket", "HEAD_DIM", "ALIGN", "GROUP", "IS_PAGED", "HAS_LEFT", "HAS_RIGHT", "HAS_SOFTCAP",
                 "HAS_SINKS"]


_TUNED = {(family, block_d, elt): triton.autotune(
    configs=_configs(family, block_d, elt), key=_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_by_alignment})(_attn_fwd_kernel)
    for family in (80, 90) for block_d in (16, 32, 64, 128, 256) for elt in (2, 4)}


# The batch-invariant mode's launch per GPU family, head-dim class and element size, whatever the rows or
# the batch: (BLOCK_N, SPLIT, SUB, stages of a SUB-group program, warps and stages of a one-group program,
# K/V buffers of fast/flash_decoding.py's decode kernel).  What a row's bits depend on, and so what every
# phase shares, is the row group (16 rows, mma.sync m16n8k16), BLOCK_N (the key blocks: the P V dot's K)
# and SPLIT (the segments); SUB (row groups a program, a warp each), the warps and the stages only spread
# the same per-row arithmetic over threads, since no row's floating-point reduction crosses threads but
# through an MMA or a max (the row sums are a ones dot).
# * BLOCK_N = 16: a decode's K/V stage is 8 KB (two 16 x 128 fp16 blocks), as the default decode's; 32
#   would double it (38 KB of shared memory at two buffers) and spill the 128-row prefill.
# * SUB: a prefill program takes 8 groups (128 packed rows: the K/V bytes of the default's first tile) at
#   D <= 128 in 16-bit; a launch whose longest sequence fits one group (a decode step) takes one, spread over
#   the warps.  Each warp of a SUB-group program holds its group's fp32 [16, D] state twice (the segment's
#   and the fold's): at D = 128 only one pipeline stage builds without spilling (234-244 registers), and
#   D = 256, fp32 and rows aligned to fewer than 8 elements take one group a program.
# * SPLIT = 120 keys: a decode split's fixed bytes (q read again, its partial written and read: 3 G (D e + 4)
#   per KV head) are 5.1% of its K/V bytes (2 SPLIT D e) at G = 4, any D; 9 segments for 1k keys (72 programs
#   at B = 4, H_kv = 2: more than half of an H100's SMs), where 128 would give 8 (64) and 112 would give 10
#   (9 partials: 1.053x the IO bound).  A constant of the table, so that it can follow a GPU family.
# * The warps, stages and buffers: what builds for sm_80 and sm_90 without spills (parity/test_compile.py).
# bench/README.md's batch-invariant section has the candidates' costs.  fast/flash_decoding.py holds the
# same table.
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


def _invariant_config(family: Optional[int], head_dim: int, elt_size: int) -> dict:
    """The batch-invariant launch options for GPU family 80 or 90, or the interpreter's (None):
    BLOCK_N, SPLIT, SUB (the most row groups a program takes), and the warps and stages of a SUB-group and
    of a one-group program."""
    if family is None:
        block_n, split, sub, stages, warps, group_stages, _ = _INTERPRET_INVARIANT_CONFIG
    else:
        block_n, split, sub, stages, warps, group_stages, _ = _INVARIANT_CONFIG_TABLE[
            (family, max(64, _block_d(head_dim)), elt_size)]
    return dict(BLOCK_N=block_n, SPLIT=split, SUB=sub, num_stages=stages, group_warps=warps,
                group_stages=group_stages)


def _invariant_sub(config: dict, align: int) -> int:
    """The most row groups a program of the mode takes: the table's, one for rows aligned to fewer than 8
    elements (narrow loads: a warp's two fp32 [16, D] states then spill)."""
    return config["SUB"] if align >= 8 else 1


# ----------------------------------------------------------------------------- backward kernels
#
# With P = softmax rows, O = P V and the saved lse, the FlashAttention-2 backward recomputes P block
# by block and never stores it:
#     dV = P^T dO          dP = dO V^T          dS = P * (dP - delta),  delta_i = dO_i . O_i - dlse_i
#     softcap: dS_raw = dS * (1 - tanh^2)       dQ = scale dS_raw K     dK = scale dS_raw^T Q
#     sinks:   d sink_h = -sum_i exp(sink_h - lse_i) delta_i
# (dlse, the gradient reaching the returned lse, enters through delta since d lse_i / d s_ij = P_ij.)
# Three kernels: a preprocess pass (delta, the log2-domain lse, the sink gradient's partial sums),
# dK/dV over key blocks (each program owns BLOCK_N keys of one KV head and visits every query row of
# the G heads that see them, so GQA's sum over a group happens in fp32 registers), and dQ over
# query tiles (the forward's tiling): no atomics, deterministic.
# FLOPs as run = 14 * D * pairs (QK^T, dO V^T, P^T dO, dS^T Q in dK/dV; QK^T, dO V^T, dS K in dQ);
# FlashAttention's convention credits 10 * D * pairs, and the benchmark reports that one.
# Minimum bytes = (4 * T_q * H_q + 4 * T_k * H_kv) * D * elt + 8 * T_q * H_q (read q, o, dO, k, v,
# lse; write dq, dk, dv; delta written and read once).

@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, lse_ptr, dlse_ptr, sinks_ptr, delta_ptr, lse2_ptr, dsink_part_ptr,
    T_q, stride_o_tok, stride_o_head, stride_do_tok, stride_do_head, stride_dlse_head, stride_dlse_tok,
    HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Backward step 1, one program per (BLOCK_T tokens, query head): delta = rowsum(dO * O) - dlse,
    the lse in log2 units, the sink gradient's per-block partial sums.  FLOPs = 2 * T_q * H_q * D;
    bytes = T_q * H_q * (2 * D * elt + 16) (read o, dO, lse, dlse; write delta, lse2)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)                            # token rows [BLOCK_T]
    m_t = o_t < T_q
    o_d = tl.arange(0, BLOCK_D)
    m_td = m_t[:, None]                                                    # rows are BLOCK_D wide
    o_tok = o_t.to(tl.int64)
    b_o = tl.load(o_ptr + o_tok[:, None] * stride_o_tok + i_h * stride_o_head + o_d[None, :], mask=m_td, other=0.0)
    b_do = tl.load(do_ptr + o_tok[:, None] * stride_do_tok + i_h * stride_do_head + o_d[None, :], mask=m_td,
                   other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)          # [BLOCK_T]
    if HAS_DLSE:
        b_delta -= tl.load(dlse_ptr + i_h * stride_dlse_head + o_tok * stride_dlse_tok, mask=m_t, other=0.0)
    b_lse = tl.load(lse_ptr + i_h * T_q + o_tok, mask=m_t, other=0.0)
    seen = b_lse != float("-inf")                                         # NaN counts as seen: it stays NaN
    # A row that saw nothing (lse = -inf) gets +inf, so its recomputed probabilities 2^(s - inf) are 0.
    tl.store(lse2_ptr + i_h * T_q + o_tok, tl.where(seen, b_lse * _LOG2E, float("inf")), mask=m_t)
    tl.store(delta_ptr + i_h * T_q + o_tok, b_delta, mask=m_t)
    if HAS_SINKS:
        # The sink's probability exp(sink - lse): 1 for a sink of +inf (then lse = +inf too).
        b_sink = tl.load(sinks_ptr + i_h).to(tl.float32)
        p_sink = tl.exp(tl.where(b_sink == b_lse, 0.0, b_sink - tl.where(seen, b_lse, 0.0)))
        p_sink = tl.where(seen & m_t, p_sink, 0.0)
        tl.store(dsink_part_ptr + i_h * tl.num_programs(0) + i_t, -tl.sum(p_sink * b_delta, 0))


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr, dk_ptr, dv_ptr,
    cu_seq_q_ptr, cu_seq_k_ptr, seqused_k_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_do_tok, stride_do_head, stride_dk_tok, stride_dk_head, stride_dv_tok, stride_dv_head,
    stride_lse_head, num_seqs, keys_bucket,
    qk_scale, softcap, scale, window_left, window_right,
    GROUP: tl.constexpr, HAS_SEQUSED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Backward step 2, one program per (BLOCK_N keys of a sequence, KV head): dK, dV in fp32
    registers over the packed query rows of the G heads that see the keys.  FLOPs = 8 * D * pairs
    (QK^T, dO V^T, P^T dO, dS^T Q).  Minimum bytes = 4 * T_k * H_kv * D * elt (read k, v; write dk,
    dv); q, dO, lse and delta are read once per key block that sees them."""
    # Rows are BLOCK_D wide with strides divisible by 16 (the launcher zero-pads other head dims).
    # keys_bucket is read by the autotuner only (its key), never here.
    i_tile, i_kvh = tl.program_id(0), tl.program_id(1)
    i_b = i_tile % num_seqs
    i_n = i_tile // num_seqs                            # key blocks in order: under causal the first sees most
    bos_q, L_q, bos_k, L_k = _packed_bounds(i_b, cu_seq_q_ptr, cu_seq_k_ptr, seqused_k_ptr, HAS_SEQUSED)
    n_start = i_n * BLOCK_N
    if n_start >= L_k:
        return

    o_n = n_start + tl.arange(0, BLOCK_N)               # key positions [BLOCK_N]
    m_n = o_n < L_k
    o_d = tl.arange(0, BLOCK_D)
    m_nd = m_n[:, None]
    o_tok = (bos_k + o_n).to(tl.int64)
    o_k_row = o_tok * stride_k_tok + i_kvh.to(tl.int64) * stride_k_head
    o_v_row = o_tok * stride_v_tok + i_kvh.to(tl.int64) * stride_v_head
    b_k = tl.load(k_ptr + o_k_row[:, None] + o_d[None, :], mask=m_nd, other=0.0)   # [BLOCK_N, BLOCK_D]
    b_v = tl.load(v_ptr + o_v_row[:, None] + o_d[None, :], mask=m_nd, other=0.0)

    # The query positions that see some key of this block, and those that see all of it (none when
    # the block runs past L_k: its missing keys need the mask), then in packed rows (x GROUP).
    key_shift = L_k - L_q
    n_last = tl.minimum(n_start + BLOCK_N, L_k) - 1
    lo, hi, full_lo, full_hi = _visible_span(n_start - key_shift, n_last - key_shift, L_q, window_right,
                                             window_left, HAS_RIGHT, HAS_LEFT)
    full_hi = tl.where(n_start + BLOCK_N <= L_k, full_hi, full_lo)
    blk_lo, edge_a_hi, full_blk_lo, full_blk_hi, edge_c_lo = _block_segments(
        lo * GROUP, full_lo * GROUP, full_hi * GROUP, BLOCK_M)
    rows = L_q * GROUP

    i_qh = i_kvh * GROUP                                # first query head of the group
    q_base = q_ptr + i_qh.to(tl.int64) * stride_q_head
    do_base = do_ptr + i_qh.to(tl.int64) * stride_do_head
    lse2_base = lse2_ptr + i_qh.to(tl.int64) * stride_lse_head
    delta_base = delta_ptr + i_qh.to(tl.int64) * stride_lse_head
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if HAS_RIGHT:
        # Only a right window bound (causal) leaves rows before the full ones that see part of the block.
        dk, dv = _dkdv_query_blocks(
            dk, dv, b_k, b_v, q_base, do_base, lse2_base, delta_base, bos_q, rows, o_n, m_n, key_shift,
            blk_lo, edge_a_hi, qk_scale, softcap, window_left, window_right, stride_q_tok, stride_q_head,
            stride_do_tok, stride_do_head, stride_lse_head, o_d,
            GROUP, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, DOT_PRECISION, BLOCK_M)
    dk, dv = _dkdv_query_blocks(
        dk, dv, b_k, b_v, q_base, do_base, lse2_base, delta_base, bos_q, rows, o_n, m_n, key_shift,
        full_blk_lo, full_blk_hi, qk_scale, softcap, window_left, window_right, stride_q_tok, stride_q_head,
        stride_do_tok, stride_do_head, stride_lse_head, o_d,
        GROUP, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, DOT_PRECISION, BLOCK_M)
    dk, dv = _dkdv_query_blocks(
        dk, dv, b_k, b_v, q_base, do_base, lse2_base, delta_base, bos_q, rows, o_n, m_n, key_shift,
        edge_c_lo, hi * GROUP, qk_scale, softcap, window_left, window_right, stride_q_tok, stride_q_head,
        stride_do_tok, stride_do_head, stride_lse_head, o_d,
        GROUP, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, DOT_PRECISION, BLOCK_M)

    o_dk_row = o_tok * stride_dk_tok + i_kvh.to(tl.int64) * stride_dk_head
    o_dv_row = o_tok * stride_dv_tok + i_kvh.to(tl.int64) * stride_dv_head
    tl.store(dk_ptr + o_dk_row[:, None] + o_d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=m_nd)
    tl.store(dv_ptr + o_dv_row[:, None] + o_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=m_nd)


@triton.jit
def _dkdv_query_blocks(dk, dv, b_k, b_v, q_base, do_base, lse2_base, delta_base, bos_q, rows, o_n, m_n,
                       key_shift, r_start, r_end, qk_scale, softcap, window_left, window_right,
                       stride_q_tok, stride_q_head, stride_do_tok, stride_do_head, stride_lse_head,
                       o_d, GROUP: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                       HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    """Accumulate dK, dV [BLOCK_N, BLOCK_D] of one key block over the packed query rows
    [r_start, r_end) (row r = position r // G, head r % G of the group).  Works transposed,
    [BLOCK_N, BLOCK_M] tiles, so no probability tile is ever transposed.  key_shift = L_k - L_q."""
    for start_r in range(r_start, r_end, BLOCK_M):
        o_r = start_r + tl.arange(0, BLOCK_M)                              # packed rows [BLOCK_M]
        o_pos = o_r // GROUP
        o_head = o_r % GROUP                                               # head within the group
        o_q_row = (bos_q + o_pos).to(tl.int64) * stride_q_tok + o_head.to(tl.int64) * stride_q_head
        o_do_row = (bos_q + o_pos).to(tl.int64) * stride_do_tok + o_head.to(tl.int64) * stride_do_head
        o_lse = o_head.to(tl.int64) * stride_lse_head + bos_q + o_pos
        if MASKED:
            m_r = o_r < rows
            b_q = tl.load(q_base + o_q_row[:, None] + o_d[None, :], mask=m_r[:, None], other=0.0)
            b_do = tl.load(do_base + o_do_row[:, None] + o_d[None, :], mask=m_r[:, None], other=0.0)
            b_lse2 = tl.load(lse2_base + o_lse, mask=m_r, other=float("inf"))
            b_delta = tl.load(delta_base + o_lse, mask=m_r, other=0.0)
        else:
            b_q = tl.load(q_base + o_q_row[:, None] + o_d[None, :])
            b_do = tl.load(do_base + o_do_row[:, None] + o_d[None, :])
            b_lse2 = tl.load(lse2_base + o_lse)
            b_delta = tl.load(delta_base + o_lse)
        b_sT = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M] fp32
        b_sT, b_tanhT = _bwd_scores(b_sT, qk_scale, softcap, HAS_SOFTCAP)
        if MASKED:
            m_s = m_n[:, None] & m_r[None, :]
            o_key_pos = o_pos + key_shift                                  # key position row r is aligned with
            if HAS_LEFT:
                m_s = m_s & (o_n[:, None] >= o_key_pos[None, :] - window_left)
            if HAS_RIGHT:
                m_s = m_s & (o_n[:, None] <= o_key_pos[None, :] + window_right)
            b_sT = tl.where(m_s, b_sT, float("-inf"))
        b_pT = tl.exp2(b_sT - b_lse2[None, :])                             # probabilities, transposed
        dv += tl.dot(b_pT.to(b_do.dtype), b_do, input_precision=DOT_PRECISION)
        b_dpT = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)
        b_dsT = b_pT * (b_dpT - b_delta[None, :])
        if HAS_SOFTCAP:
            b_dsT = b_dsT * (1.0 - b_tanhT * b_tanhT)
        dk += tl.dot(b_dsT.to(b_q.dtype), b_q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr, dq_ptr,
    cu_seq_q_ptr, cu_seq_k_ptr, seqused_k_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_do_tok, stride_do_head, stride_dq_tok, stride_dq_head, stride_lse_head, num_seqs, rows_bucket,
    qk_scale, softcap, scale, window_left, window_right,
    GROUP: tl.constexpr, HAS_SEQUSED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Backward step 3, the forward's tiling: dQ over the key blocks each query tile sees.  FLOPs =
    6 * D * pairs (QK^T, dO V^T, dS K).  Minimum bytes = 3 * T_q * H_q * D * elt + 8 * T_q * H_q
    (read q, dO, lse, delta; write dq); K and V are read once per query tile that sees them."""
    # The forward's tiling: packed (position, head-in-group) rows, heaviest tile first.
    i_tile, i_kvh = tl.program_id(0), tl.program_id(1)
    i_b = i_tile % num_seqs
    i_m_from_end = i_tile // num_seqs
    bos_q, L_q, bos_k, L_k = _packed_bounds(i_b, cu_seq_q_ptr, cu_seq_k_ptr, seqused_k_ptr, HAS_SEQUSED)
    num_tiles = tl.cdiv(L_q * GROUP, BLOCK_M)
    if i_m_from_end >= num_tiles:
        return
    i_m = num_tiles - 1 - i_m_from_end

    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)         # packed rows [BLOCK_M]
    m_r = o_r < L_q * GROUP
    o_pos = o_r // GROUP
    o_head = i_kvh * GROUP + o_r % GROUP
    o_d = tl.arange(0, BLOCK_D)
    m_rd = m_r[:, None]
    o_key_pos = o_pos + (L_k - L_q)
    o_q_row = (bos_q + o_pos).to(tl.int64) * stride_q_tok + o_head.to(tl.int64) * stride_q_head
    o_do_row = (bos_q + o_pos).to(tl.int64) * stride_do_tok + o_head.to(tl.int64) * stride_do_head
    b_q = tl.load(q_ptr + o_q_row[:, None] + o_d[None, :], mask=m_rd, other=0.0)   # [BLOCK_M, BLOCK_D]
    b_do = tl.load(do_ptr + o_do_row[:, None] + o_d[None, :], mask=m_rd, other=0.0)
    o_lse = o_head.to(tl.int64) * stride_lse_head + bos_q + o_pos
    b_lse2 = tl.load(lse2_ptr + o_lse, mask=m_r, other=float("inf"))
    b_delta = tl.load(delta_ptr + o_lse, mask=m_r, other=0.0)

    pos_first = (i_m * BLOCK_M) // GROUP + (L_k - L_q)
    pos_last = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // GROUP, L_q - 1) + (L_k - L_q)
    lo, hi, full_lo, full_hi = _visible_span(pos_first, pos_last, L_k, window_left, window_right,
                                             HAS_LEFT, HAS_RIGHT)
    blk_lo, edge_a_hi, full_blk_lo, full_blk_hi, edge_c_lo = _block_segments(lo, full_lo, full_hi, BLOCK_N)

    k_base = k_ptr + i_kvh.to(tl.int64) * stride_k_head
    v_base = v_ptr + i_kvh.to(tl.int64) * stride_v_head
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_LEFT:
        dq = _dq_key_blocks(dq, b_q, b_do, b_lse2, b_delta, k_base, v_base, bos_k, L_k, o_key_pos, o_d,
                            blk_lo, edge_a_hi, qk_scale, softcap, window_left, window_right, stride_k_tok,
                            stride_v_tok, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, DOT_PRECISION, BLOCK_N)
    dq = _dq_key_blocks(dq, b_q, b_do, b_lse2, b_delta, k_base, v_base, bos_k, L_k, o_key_pos, o_d,
                        full_blk_lo, full_blk_hi, qk_scale, softcap, window_left, window_right, stride_k_tok,
                        stride_v_tok, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, DOT_PRECISION, BLOCK_N)
    dq = _dq_key_blocks(dq, b_q, b_do, b_lse2, b_delta, k_base, v_base, bos_k, L_k, o_key_pos, o_d,
                        edge_c_lo, hi, qk_scale, softcap, window_left, window_right, stride_k_tok,
                        stride_v_tok, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, DOT_PRECISION, BLOCK_N)
    o_dq_row = (bos_q + o_pos).to(tl.int64) * stride_dq_tok + o_head.to(tl.int64) * stride_dq_head
    tl.store(dq_ptr + o_dq_row[:, None] + o_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=m_rd)


@triton.jit
def _dq_key_blocks(dq, b_q, b_do, b_lse2, b_delta, k_base, v_base, bos_k, L_k, o_key_pos, o_d,
                   n_start, n_end, qk_scale, softcap, window_left, window_right, stride_k_tok, stride_v_tok,
                   MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Accumulate dQ [BLOCK_M, BLOCK_D] of one query tile over the key blocks [n_start, n_end)."""
    for start_n in range(n_start, n_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)                              # key positions [BLOCK_N]
        m_n = o_n < L_k
        o_k_row = (bos_k + o_n).to(tl.int64) * stride_k_tok
        o_v_row = (bos_k + o_n).to(tl.int64) * stride_v_tok
        p_k = k_base + o_k_row[:, None] + o_d[None, :]                     # [BLOCK_N, BLOCK_D]
        p_v = v_base + o_v_row[:, None] + o_d[None, :]
        if MASKED:
            b_k = tl.load(p_k, mask=m_n[:, None], other=0.0)
            b_v = tl.load(p_v, mask=m_n[:, None], other=0.0)
        else:
            b_k = tl.load(p_k)
            b_v = tl.load(p_v)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)   # [BLOCK_M, BLOCK_N] fp32
        b_s, b_tanh = _bwd_scores(b_s, qk_scale, softcap, HAS_SOFTCAP)
        if MASKED:
            m_s = m_n[None, :]
            if HAS_LEFT:
                m_s = m_s & (o_n[None, :] >= o_key_pos[:, None] - window_left)
            if HAS_RIGHT:
                m_s = m_s & (o_n[None, :] <= o_key_pos[:, None] + window_right)
            b_s = tl.where(m_s, b_s, float("-inf"))
        b_p = tl.exp2(b_s - b_lse2[:, None])
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
        b_ds = b_p * (b_dp - b_delta[:, None])
        if HAS_SOFTCAP:
            b_ds = b_ds * (1.0 - b_tanh * b_tanh)
        dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_scores(b_s, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw dot products -> log2-domain scores, and tanh(s / softcap) for the softcap derivative."""
    if HAS_SOFTCAP:
        b_tanh = _tanh(b_s * qk_scale)                                     # qk_scale = scale / softcap
        return softcap * b_tanh * _LOG2E, b_tanh
    return b_s * qk_scale, b_s                                             # qk_scale = scale * log2(e)


@triton.jit
def _packed_bounds(i_b, cu_seq_q_ptr, cu_seq_k_ptr, seqused_k_ptr, HAS_SEQUSED: tl.constexpr):
    """Sequence i_b's first query token and query count, first key token and key count (packed K/V)."""
    bos_q = tl.load(cu_seq_q_ptr + i_b)
    L_q = tl.load(cu_seq_q_ptr + i_b + 1) - bos_q
    bos_k = tl.load(cu_seq_k_ptr + i_b)
    if HAS_SEQUSED:
        L_k = tl.load(seqused_k_ptr + i_b)
    else:
        L_k = tl.load(cu_seq_k_ptr + i_b + 1) - bos_k
    return bos_q, L_q, bos_k, L_k


# ----------------------------------------------------------------------------- backward configs

# Backward launch configs (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU family, head dim
# (a power of two: the launcher pads others) and element size, for the dK/dV kernel (BLOCK_N keys
# a program, BLOCK_M query rows a step) and the dQ kernel (BLOCK_M rows a program, BLOCK_N keys a
# step).  dK/dV keeps two fp32 [BLOCK_N, D] accumulators and K, V in registers, so its key tile
# shrinks as D grows; at D = 256 it is too small for Hopper's wgmma (64 rows a warpgroup: two
# fp32 [64, 256] accumulators alone would take 256 registers a thread) and runs mma.sync.  Every
# config builds without spills (parity/test_compile.py); candidates that spilled were dropped.
_BWD_CONFIG_TABLE = {
    # (family, head dim, element size): (dK/dV configs, dQ configs)
    (90, 64, 2): ([(32, 128, 8, 3), (64, 64, 8, 2), (32, 64, 8, 2)],
                  [(128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3)]),
    (90, 128, 2): ([(32, 128, 8, 2), (32, 64, 8, 3), (16, 128, 8, 2)],
                   [(128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 8, 3)]),
    (90, 256, 2): ([(32, 32, 8, 2), (16, 32, 8, 2)], [(64, 16, 8, 2)]),
    (80, 64, 2): ([(32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2)],
                  [(128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3)]),
    (80, 128, 2): ([(32, 64, 8, 3), (32, 64, 8, 2), (16, 128, 8, 2)], [(64, 64, 8, 3), (64, 32, 8, 3)]),
    (80, 256, 2): ([(32, 32, 8, 2), (16, 32, 8, 2)], [(32, 64, 8, 1), (64, 32, 8, 1)]),
    (90, 64, 4): ([(16, 32, 4, 2)], [(32, 16, 4, 2)]),
    (90, 128, 4): ([(16, 32, 8, 2), (16, 16, 4, 2)], [(32, 16, 8, 2), (16, 16, 4, 2)]),
    (90, 256, 4): ([(16, 16, 8, 2), (16, 16, 8, 1)], [(16, 16, 8, 1)]),
    (80, 64, 4): ([(16, 32, 4, 2)], [(32, 16, 4, 2)]),
    (80, 128, 4): ([(16, 32, 8, 2)], [(16, 32, 4, 2), (32, 16, 4, 2)]),
    (80, 256, 4): ([(16, 16, 8, 1), (16, 16, 8, 2)], [(16, 16, 8, 2), (16, 16, 4, 2)]),
}


def _bwd_configs(family: int, block_d: int, elt_size: int, kernel: int) -> list:
    rows = _BWD_CONFIG_TABLE[(family, max(64, block_d), elt_size)][kernel]
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
               for bm, bn, warps, stages in rows]
    # Least memory traffic first (ties keep the table's order): dK/dV re-reads q, dO, lse, delta once
    # per BLOCK_N keys, dQ re-reads K and V once per BLOCK_M rows.
    tile = "BLOCK_N" if kernel == 0 else "BLOCK_M"
    return sorted(configs, key=lambda c: -c.kwargs[tile])


# key: like the forward's, with keys_bucket (max_k rounded up to a power of two in [16, 4096]) for
# dK/dV, whose programs walk query rows.  Both kernels overwrite their outputs completely, so the
# autotuner's repeated runs leave the right result.
_BWD_KEY = ["BLOCK_D", "GROUP", "HAS_LEFT", "HAS_RIGHT", "HAS_SOFTCAP"]


_TUNED_DKDV = {(family, block_d, elt): triton.autotune(
    configs=_bwd_configs(family, block_d, elt, 0), key=["keys_bucket", *_BWD_KEY])(_attn_bwd_dkdv_kernel)
    for family in (80, 90) for block_d in (16, 32, 64, 128, 256) for elt in (2, 4)}


_TUNED_DQ = {(family, block_d, elt): triton.autotune(
    configs=_bwd_configs(family, block_d, elt, 1), key=["rows_bucket", *_BWD_KEY])(_attn_bwd_dq_kernel)
    for family in (80, 90) for block_d in (16, 32, 64, 128, 256) for elt in (2, 4)}


# Tests set these to one config's kwargs (+ num_warps, num_stages) to bypass the autotuners on CUDA.
_FORCED_BWD_CONFIGS: Optional[tuple[dict, dict]] = None


# ----------------------------------------------------------------------------- custom ops: forward, backward, autograd

@torch.library.custom_op("twofold::varlen_attn", mutates_args=())
def _varlen_attn_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                    cu_seq_k: Optional[torch.Tensor], max_q: int, max_k: int, scale: float, window_left: int,
                    window_right: int, seqused_k: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                    softcap: float, sinks: Optional[torch.Tensor],
                    batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _validate_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table)
    out = query.new_empty(query.shape)
    lse = _launch(out, query, key, value, cu_seq_q, cu_seq_k, max_q, scale, window_left, window_right,
                  seqused_k, block_table, softcap, sinks, rows_used=rows, zero_padding=True,
                  batch_invariant=batch_invariant)
    return out, lse


@_varlen_attn_op.register_fake
def _varlen_attn_fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_left, window_right,
                      seqused_k, block_table, softcap, sinks, batch_invariant):
    return query.new_empty(query.shape), query.new_empty(query.shape[1], query.shape[0], dtype=torch.float32)


@torch.library.custom_op("twofold::varlen_attn_out", mutates_args=("out",))
def _varlen_attn_out_op(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        cu_seq_q: torch.Tensor, cu_seq_k: Optional[torch.Tensor], max_q: int, max_k: int,
                        scale: float, window_left: int, window_right: int, seqused_k: Optional[torch.Tensor],
                        block_table: Optional[torch.Tensor], softcap: float,
                        sinks: Optional[torch.Tensor], batch_invariant: bool) -> torch.Tensor:
    rows = _validate_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table)
    return _launch(out, query, key, value, cu_seq_q, cu_seq_k, max_q, scale, window_left, window_right,
                   seqused_k, block_table, softcap, sinks, rows_used=rows, zero_padding=False,
                   batch_invariant=batch_invariant)


@_varlen_attn_out_op.register_fake
def _varlen_attn_out_fake(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_left,
                          window_right, seqused_k, block_table, softcap, sinks, batch_invariant):
    return query.new_empty(query.shape[1], query.shape[0], dtype=torch.float32)


# The backward: twofold::varlen_attn_bwd, tied to twofold::varlen_attn by register_autograd.
@torch.library.custom_op("twofold::varlen_attn_bwd", mutates_args=())
def _varlen_attn_bwd_op(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], query: torch.Tensor,
                        key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, seqused_k: Optional[torch.Tensor],
                        max_q: int, max_k: int, scale: float, window_left: int, window_right: int, softcap: float,
                        sinks: Optional[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, dsinks or an empty tensor)."""
    return _launch_bwd(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k, max_q,
                       max_k, scale, window_left, window_right, softcap, sinks)


@_varlen_attn_bwd_op.register_fake
def _varlen_attn_bwd_fake(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k, max_q,
                          max_k, scale, window_left, window_right, softcap, sinks):
    dsinks = torch.empty_like(sinks) if sinks is not None else query.new_empty(0)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dsinks


def _setup_context(ctx, inputs, output):
    (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_left, window_right, seqused_k,
     block_table, softcap, sinks, _) = inputs
    if block_table is not None:  # varlen_attn raised already; this guards direct calls of the op
        raise NotImplementedError("varlen_attn with a paged KV cache (block_table) is inference-only")
    out, lse = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k, sinks)
    ctx.scalars = (max_q, max_k, scale, window_left, window_right, softcap)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k, sinks = ctx.saved_tensors
    if grad_out is None:  # only the lse was used
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks = _varlen_attn_bwd_op(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k,
                                             seqused_k, *ctx.scalars, sinks)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None, None,
            dsinks if sinks is not None else None, None)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("fast varlen_attn has no double backward (second derivative); "
                              "ref.paged_varlen_attention.varlen_attn has one through plain autograd")


_varlen_attn_op.register_autograd(_backward, setup_context=_setup_context)
_varlen_attn_bwd_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# ----------------------------------------------------------------------------- launchers

def _launch(out, query, key, value, cu_seq_q, cu_seq_k, max_q, scale, window_left, window_right,
            seqused_k, block_table, softcap, sinks, *, rows_used, zero_padding, batch_invariant):
    """Writes ``out`` and returns ``lse [H_q, T_q]`` fp32.  Inputs were checked by the caller.

    Rows past cu_seq_q[-1] (a padded buffer) get lse -inf and, with ``zero_padding`` (varlen_attn,
    not varlen_attn_out), out 0.  ``rows_used`` is cu_seq_q[-1] when the value checks read it, else
    None (CUDA-graph capture), and then the padding kernel runs whatever the data.
    """
    t_q, h_q, head_dim = query.shape
    num_seqs = cu_seq_q.numel() - 1
    lse = torch.empty(h_q, t_q, dtype=torch.float32, device=query.device)
    if t_q == 0 or num_seqs == 0 or max_q == 0 or head_dim == 0:   # no row sees a key: all rows padding
        if zero_padding:
            out.zero_()
        lse.fill_(float("-inf"))
        return lse
    paged = block_table is not None
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    target = out
    align = _pow2_divisor(*query.stride()[:-1], *out.stride()[:-1], *key.stride()[:-1], *value.stride()[:-1])
    if align < _MIN_ALIGN or out.stride(-1) != 1:
        # Rows aligned to fewer than 4 elements would compile to scalar loads that spill
        # registers: stage through copies whose rows are 16-byte aligned (a slow path, for
        # odd head dims or strides; the common head dims never take it).
        query, key, value = (_padded_copy(t) for t in (query, key, value))
        target = _padded_copy(out, copy=not zero_padding)   # varlen_attn_out keeps its padding rows
        align = _pow2_divisor(*query.stride()[:-1], *target.stride()[:-1], *key.stride()[:-1],
                              *value.stride()[:-1])
    h_kv = key.shape[-2]
    group = h_q // h_kv
    if paged:
        k_strides, v_strides = key.stride()[:3], value.stride()[:3]      # page, slot, head
        page_size, stride_bt = key.shape[1], block_table.stride(0)
    else:
        k_strides, v_strides = (0, *key.stride()[:2]), (0, *value.stride()[:2])
        page_size, stride_bt = 1, 0
    has_softcap = softcap > 0
    qk_scale = scale / softcap if has_softcap else scale * _LOG2E.value
    int_dummy = cu_seq_q                                                  # never read when its flag is off
    args = (query, key, value, target, lse, sinks if sinks is not None else query,
            cu_seq_q, cu_seq_k if cu_seq_k is not None else int_dummy,
            seqused_k if seqused_k is not None else int_dummy,
            block_table if paged else int_dummy,
            query.stride(0), query.stride(1), target.stride(0), target.stride(1), lse.stride(0),
            *k_strides, *v_strides, stride_bt, page_size, num_seqs,
            min(4096, max(16, triton.next_power_of_2(max_q * group))),
            qk_scale, float(softcap), window_left, window_right)
    flags = dict(GROUP=group, IS_PAGED=paged, HAS_SEQUSED=seqused_k is not None,
                 HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=has_softcap,
                 HAS_SINKS=sinks is not None, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
                 ALIGN=align, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim))

    def grid(meta):
        return (triton.cdiv(max_q * group, meta["BLOCK_M"]) * num_seqs, h_kv)

    if batch_invariant:
        # One fixed row group, key block and segment per device family, dtype and head-dim class: never
        # tuned, never forced.  Row groups a program: one when the longest sequence's rows fit one (a decode
        # step), else the table's SUB (only these two shapes are built and checked for spills).
        family = None if not query.is_cuda else _gpu_family(
            query.device.index if query.device.index is not None else torch.cuda.current_device())
        config = _invariant_config(family, head_dim, query.element_size())
        rows = max_q * group + _ROWS.value - math.gcd(group, _ROWS.value)   # the first row's slot: < 16
        sub = 1 if rows <= _ROWS.value else _invariant_sub(config, align)
        launch = dict(num_warps=sub, num_stages=config["num_stages"]) if sub > 1 else dict(
            num_warps=config["group_warps"], num_stages=config["group_stages"])
        grid = (triton.cdiv(rows, sub * _ROWS.value) * num_seqs, h_kv)
        with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
            _attn_fwd_invariant_kernel[grid](*args[:24], *args[25:], **flags, BLOCK_N=config["BLOCK_N"],
                                             SPLIT=config["SPLIT"], SUB=sub, **launch)
    elif query.is_cuda:
        with torch.cuda.device(query.device):
            if _FORCED_CONFIG is not None:
                _attn_fwd_kernel[grid](*args, **flags, **_FORCED_CONFIG)
            else:
                family = _gpu_family(query.device.index if query.device.index is not None
                                     else torch.cuda.current_device())
                _TUNED[(family, _block_d(head_dim), query.element_size())][grid](*args, **flags)
    else:
        _attn_fwd_kernel[grid](*args, **flags, **_INTERPRET_BLOCKS, num_warps=4)
    if rows_used is None or rows_used < t_q:
        _fill_padding(cu_seq_q, lse=lse, zeros=(target,) if zero_padding else ())
    if target is not out:
        out.copy_(target)
    return lse


def _launch_bwd(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k, max_q, max_k,
                scale, window_left, window_right, softcap, sinks):
    """Returns (dq, dk, dv, dsinks or an empty tensor).  Packed K/V only; the forward checked the inputs."""
    t_q, h_q, head_dim = query.shape
    h_kv = key.shape[1]
    group = h_q // h_kv
    num_seqs = cu_seq_q.numel() - 1
    dsinks = torch.zeros_like(sinks) if sinks is not None else query.new_empty(0)
    if t_q == 0 or num_seqs == 0 or max_q == 0 or head_dim == 0:
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), dsinks
    block_d = _block_d(head_dim)
    tensors = [t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, out, grad_out)]
    padded = head_dim != block_d or _pow2_divisor(*(s for t in tensors for s in t.stride()[:-1])) < 16
    if padded:
        # Head dims that are not a power of two (or rows not 16-element aligned) run on zero-padded
        # copies of width block_d: the extra zero columns change no dot product, and every load is a
        # full, vectorized row (a column mask at D = 100 would split loads into 4-element pieces and
        # spill the dK/dV kernel's registers).  One extra copy of q, k, v, o, dO; dq, dk, dv sliced back.
        tensors = [_zero_padded(t, block_d) for t in tensors]
    query_, key_, value_, out_, grad_out_ = tensors
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query_, key_, value_))
    if seqused_k is not None or max_k == 0:
        dk.zero_()   # keys past seqused_k (or of a sequence no program visits) get gradient 0
        dv.zero_()

    # 1. delta = rowsum(dO * O) - dlse, the log2-domain lse, the sink gradient's partial sums.
    block_t = max(16, 4096 // block_d)
    delta = torch.empty(h_q, t_q, dtype=torch.float32, device=query.device)
    lse2 = torch.empty_like(delta)
    n_t = triton.cdiv(t_q, block_t)
    dsink_part = torch.empty(h_q, n_t, dtype=torch.float32, device=query.device)
    dlse_strides = grad_lse.stride() if grad_lse is not None else (0, 0)
    device_ctx = torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()
    with device_ctx:
        _attn_bwd_preprocess_kernel[(n_t, h_q)](
            out_, grad_out_, lse, grad_lse if grad_lse is not None else lse, sinks if sinks is not None else lse,
            delta, lse2, dsink_part, t_q, out_.stride(0), out_.stride(1), grad_out_.stride(0), grad_out_.stride(1),
            *dlse_strides, HAS_DLSE=grad_lse is not None, HAS_SINKS=sinks is not None, BLOCK_D=block_d,
            BLOCK_T=block_t, num_warps=4)
        if sinks is not None:
            dsinks = dsink_part.sum(1).to(sinks.dtype)

        # 2. dK, dV over key blocks; 3. dQ over query tiles.
        has_softcap = softcap > 0
        qk_scale = scale / softcap if has_softcap else scale * _LOG2E.value
        common = (qk_scale, float(softcap), scale, window_left, window_right)
        int_dummy = cu_seq_q
        seq_args = (cu_seq_q, cu_seq_k, seqused_k if seqused_k is not None else int_dummy)
        in_strides = (*query_.stride()[:2], *key_.stride()[:2], *value_.stride()[:2], *grad_out_.stride()[:2])
        flags = dict(GROUP=group, HAS_SEQUSED=seqused_k is not None, HAS_LEFT=window_left >= 0,
                     HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=has_softcap,
                     DOT_PRECISION="ieee" if query.dtype == torch.float32 else None, BLOCK_D=block_d)
        dkdv_args = (query_, key_, value_, grad_out_, lse2, delta, dk, dv, *seq_args, *in_strides,
                     *dk.stride()[:2], *dv.stride()[:2], lse2.stride(0), num_seqs,
                     min(4096, max(16, triton.next_power_of_2(max_k))), *common)
        dq_args = (query_, key_, value_, grad_out_, lse2, delta, dq, *seq_args, *in_strides, *dq.stride()[:2],
                   lse2.stride(0), num_seqs, min(4096, max(16, triton.next_power_of_2(max_q * group))), *common)

        def dkdv_grid(meta):
            return (triton.cdiv(max_k, meta["BLOCK_N"]) * num_seqs, h_kv)

        def dq_grid(meta):
            return (triton.cdiv(max_q * group, meta["BLOCK_M"]) * num_seqs, h_kv)

        if not query.is_cuda:
            blocks = dict(_INTERPRET_BLOCKS, num_warps=4)
            if max_k > 0:
                _attn_bwd_dkdv_kernel[dkdv_grid](*dkdv_args, **flags, **blocks)
            _attn_bwd_dq_kernel[dq_grid](*dq_args, **flags, **blocks)
        elif _FORCED_BWD_CONFIGS is not None:
            if max_k > 0:
                _attn_bwd_dkdv_kernel[dkdv_grid](*dkdv_args, **flags, **_FORCED_BWD_CONFIGS[0])
            _attn_bwd_dq_kernel[dq_grid](*dq_args, **flags, **_FORCED_BWD_CONFIGS[1])
        else:
            family = _gpu_family(query.device.index if query.device.index is not None
                                 else torch.cuda.current_device())
            table_key = (family, block_d, query.element_size())
            if max_k > 0:
                _TUNED_DKDV[table_key][dkdv_grid](*dkdv_args, **flags)
            _TUNED_DQ[table_key][dq_grid](*dq_args, **flags)
        # Rows past cu_seq_q[-1] / keys past cu_seq_k[-1] (padded buffers) belong to no sequence: no
        # kernel above wrote them.  Without a host copy of the offsets, a small kernel zeroes them.
        _fill_padding(cu_seq_q, zeros=(dq,))
        if not (seqused_k is not None or max_k == 0):      # else dk, dv were zeroed whole
            _fill_padding(cu_seq_k, zeros=(dk, dv))
    if padded:
        dq, dk, dv = (t[..., :head_dim].contiguous() for t in (dq, dk, dv))
    return dq, dk, dv, dsinks


def _fill_padding(cu_seq, *, zeros=(), lse=None):
    """Rows t >= cu_seq[-1] of the [T, H, D] tensors ``zeros`` (at most two) become 0, and of
    ``lse`` [H, T] -inf.  Reads cu_seq[-1] on the device (no host copy), so it also runs under
    CUDA-graph capture."""
    t, h = (zeros[0].shape[0], zeros[0].shape[1]) if zeros else (lse.shape[1], lse.shape[0])
    if t == 0 or h == 0:
        return
    # Pointer slots left empty get cu_seq: a valid pointer the kernel never reads.
    x, y = (*zeros, cu_seq, cu_seq)[:2]
    x_strides, y_strides = (t.stride()[:2] if t is not cu_seq else (0, 0) for t in (x, y))
    head_dim = zeros[0].shape[-1] if zeros else 0
    device_ctx = torch.cuda.device(cu_seq.device) if cu_seq.is_cuda else contextlib.nullcontext()
    with device_ctx:
        _padding_rows_kernel[(triton.cdiv(t, 16), h)](
            x, y, lse if lse is not None else cu_seq, cu_seq, cu_seq.numel() - 1, t, *x_strides, *y_strides,
            lse.stride(0) if lse is not None else 0, HEAD_DIM=head_dim, NUM_ZEROS=len(zeros),
            HAS_LSE=lse is not None, BLOCK_T=16, BLOCK_D=_block_d(head_dim), num_warps=1)


# ----------------------------------------------------------------------------- launch plumbing

@functools.cache
def _gpu_family(device_index: int) -> int:
    """90 for Hopper and newer, 80 for Ampere/Ada (queried at the first call, never at import)."""
    return 90 if torch.cuda.get_device_capability(device_index)[0] >= 9 else 80


# The Triton interpreter (CPU) cannot autotune; it runs this fixed, small tile.
_INTERPRET_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


# Tests set this to one config's kwargs (+ num_warps, num_stages) to bypass the autotuner on CUDA.
_FORCED_CONFIG: Optional[dict] = None


def _pow2_divisor(*strides: int, cap: int = 16) -> int:
    """The largest power of two <= cap dividing every stride: rows then start at multiples of it,
    which lets the compiler vectorize loads (D = 100 still gets 4-element vectors)."""
    align = cap
    while align > 1 and any(s % align for s in strides):
        align //= 2
    return align


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _zero_padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """A contiguous copy of t [..., D] widened to [..., width] with zeros."""
    buf = torch.zeros(*t.shape[:-1], width, dtype=t.dtype, device=t.device)
    buf[..., :t.shape[-1]] = t
    return buf


def _padded_copy(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A view of t's values in a buffer whose rows are padded to a multiple of 8 elements."""
    d = t.shape[-1]
    view = torch.empty(*t.shape[:-1], -(-d // 8) * 8, dtype=t.dtype, device=t.device)[..., :d]
    if copy:
        view.copy_(t)
    return view


# ----------------------------------------------------------------------------- input checks
#
# One row per tensor argument (name, shape in the size names of the module docstring, dtype rule),
# checked in order by _check_tensors; then the rules that tie arguments together, the scalars, and
# the values of the index tensors.  ref/paged_varlen_attention.py holds the same code, so both
# files raise the same errors for the same bad inputs (parity/ checks it); what this kernel adds
# is in _check_fast_limits.

def _prepare(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa, seqused_k,
             block_table, num_splits, softcap, sinks, batch_invariant, out=None):
    """The host checks; returns the op's scalars (max_q, max_k, scale, left, right, softcap)."""
    max_q, max_k, left, right = _check_meta(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
        enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table, num_splits=num_splits,
        softcap=softcap, sinks=sinks, batch_invariant=batch_invariant, out=out)
    _check_fast_limits(query)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks)):
        if block_table is not None:
            raise NotImplementedError("varlen_attn with a paged KV cache (block_table) is inference-only, as in "
                                      "PyTorch: call it under torch.no_grad(), or pass packed key/value to train")
        if out is not None:
            raise NotImplementedError("varlen_attn_out is forward-only, as in PyTorch: call it under "
                                      "torch.no_grad(), or use varlen_attn to train")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return max_q, max_k, scale, left, right, float(softcap)


_SIZES = {"N": "sequence count", "T_q": "query token count", "T_k": "key token count", "H_q": "query head count",
          "H_kv": "KV head count", "D": "head dim", "num_pages": "page count", "page_size": "page size",
          "max_pages": "pages per sequence"}


def _check_meta(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa,
                seqused_k, block_table, num_splits, softcap, sinks, batch_invariant, out=None):
    """Shapes, dtypes and devices: the checks that read no tensor's data (they also run on fake
    tensors).  Returns (max_q, max_k, left, right) as ints."""
    paged = block_table is not None
    kv = ("num_pages", "page_size", "H_kv", "D") if paged else ("T_k", "H_kv", "D")
    size = _check_tensors(
        # name          tensor        shape                 dtype          may be None
        ("query",       query,        ("T_q", "H_q", "D"),  "float",       False),
        ("key",         key,          kv,                   "query",       False),   # query's dtype
        ("value",       value,        kv,                   "query",       False),
        ("cu_seq_q",    cu_seq_q,     ("N+1",),             torch.int32,   False),
        ("cu_seq_k",    cu_seq_k,     ("N+1",),             torch.int32,   True),    # None only when paged
        ("block_table", block_table,  ("N", "max_pages"),   torch.int32,   True),
        ("seqused_k",   seqused_k,    ("N",),               torch.int32,   True),    # required when paged
        ("sinks",       sinks,        ("H_q",),             "float",       True),
        ("out",         out,          ("T_q", "H_q", "D"),  None,          True))    # dtype: below
    if cu_seq_k is None and not paged:
        raise ValueError("cu_seq_k may be None only with a paged KV cache (block_table)")
    if paged and seqused_k is None:
        raise ValueError("block_table requires seqused_k (the number of valid keys per sequence)")
    h_q, h_kv = size["H_q"], size["H_kv"]
    if not enable_gqa and h_q != h_kv:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={h_q} "
                         f"and Hkv={h_kv}. Try setting enable_gqa=True for GQA.")
    if h_kv == 0 or h_q % h_kv != 0:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got "
                         f"Hq={h_q} and Hkv={h_kv}.")
    if out is not None and out.dtype != query.dtype:
        raise ValueError(f"out must be {query.dtype} like query, got {out.dtype}")
    return _check_scalars(max_q, max_k, scale=scale, window_size=window_size, num_splits=num_splits,
                          softcap=softcap, batch_invariant=batch_invariant)


def _check_tensors(*rows):
    """Check a table of (name, tensor, shape, dtype, may be None) rows in order; returns the sizes.

    ``shape`` names each dimension's size: the first row to name a size fixes it and later rows
    must agree ("N+1" fixes N to the length minus one).  ``dtype`` is "float", a torch.dtype, the
    name of an earlier row whose dtype is required, or None (any).  One device for all.
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
        dims = [(d, d.removesuffix("+1"), int(d.endswith("+1"))) for d in shape]   # (text, size, offset)
        layout = "[" + ", ".join(f"{d}={size[s] + k}" if s in size else d for d, s, k in dims) + "]"
        if t.dim() != len(shape):
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
        for (d, s, k), n in zip(dims, t.shape):
            if n - k < 0:
                raise ValueError(f"{name} must be {layout} with {d} >= 1, got shape {tuple(t.shape)}")
            if size.setdefault(s, n - k) != n - k:
                raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}: {_SIZES.get(s, 'size')} "
                                 f"mismatch, {owner[s]} and {name} have {s}={size[s]} and {n - k}")
            owner.setdefault(s, name)
        dtypes[name], devices[name] = t.dtype, t.device
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got mixed devices {devices}")
    return size


def _check_scalars(max_q, max_k, *, scale, window_size, num_splits, softcap, batch_invariant):
    """The non-tensor arguments; returns (max_q, max_k, left, right) as ints."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be (left, right) integers >= -1, got {window_size!r}")
    left, right = (_integer("window_size", w, -1) for w in window_size)
    max_q, max_k = _integer("max_q", max_q, 0), _integer("max_k", max_k, 0)
    if num_splits is not None:
        _integer("num_splits", num_splits, 1)
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a float >= 0, got {softcap!r}")
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__} {batch_invariant!r}")
    return max_q, max_k, left, right


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


def _check_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, *, seqused_k, block_table):
    """The checks that read the index tensors (one small device-to-host copy: a wrong length would
    otherwise give a silently wrong answer or an out-of-bounds read).  Returns (q_lens, k_starts,
    k_lens), host lists."""
    _, q_lens = _offsets("cu_seq_q", cu_seq_q.tolist(), "T_q = query.shape[0]", query.shape[0])
    if block_table is None:
        k_starts, k_lens = _offsets("cu_seq_k", cu_seq_k.tolist(), "T_k = key.shape[0]", key.shape[0])
        if seqused_k is not None:
            used = seqused_k.tolist()
            for b, (u, length) in enumerate(zip(used, k_lens)):
                if not 0 <= u <= length:
                    raise ValueError(f"seqused_k[{b}] = {u} is outside [0, {length}], the keys sequence {b} has")
            k_lens = used
    else:
        k_starts, k_lens = [0] * len(q_lens), seqused_k.tolist()
        (num_pages, page_size), max_pages = key.shape[:2], block_table.shape[1]
        for b, length in enumerate(k_lens):
            if not 0 <= length <= max_pages * page_size:
                raise ValueError(f"seqused_k[{b}] = {length} is beyond the {max_pages} pages of {page_size} keys "
                                 f"that block_table holds per sequence (capacity {max_pages * page_size})")
        for b, (length, pages) in enumerate(zip(k_lens, block_table.tolist())):
            bad = [p for p in pages[:-(-length // page_size)] if not 0 <= p < num_pages]
            if bad:
                raise ValueError(f"block_table[{b}] points at page {bad[0]}, outside the pool of {num_pages} pages")
    for name, limit, lens, what in (("max_q", max_q, q_lens, "query"), ("max_k", max_k, k_lens, "key")):
        if lens and max(lens) > limit:
            raise ValueError(f"{name} = {limit} is smaller than the longest {what} sequence ({max(lens)})")
    return q_lens, k_starts, k_lens


def _offsets(name, cu, limit_text, limit):
    """(starts, lengths) from the offsets ``cu`` [N + 1]: from 0, non-decreasing, at most ``limit``."""
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu[:8]}...")
    if cu[-1] > limit:          # < limit is a padded buffer: the rows past cu[-1] belong to no sequence
        raise ValueError(f"{name}[-1] must be <= {limit_text} = {limit}, got {cu[-1]}")
    return cu[:-1], [b - a for a, b in zip(cu, cu[1:])]


def _check_fast_limits(query):
    """What this kernel adds to the contract's checks: fp16 / bf16 / fp32, head dims up to 256, CUDA."""
    if query.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"fast varlen_attn supports fp16, bf16, fp32; got {query.dtype} (the reference takes fp64)")
    if query.shape[-1] > 256:
        raise ValueError(f"fast varlen_attn supports head dims up to 256, got D={query.shape[-1]}")
    _check_device("query", query)


def _check_device(name, t):
    """Triton needs a GPU driver; say so on the host instead of failing inside Triton."""
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{name} is a {t.device.type} tensor, and fast/paged_varlen_attention.py runs Triton kernels, "
            f"which need CUDA tensors.  Move the inputs to a GPU; or set TRITON_INTERPRET=1 before triton is "
            f"imported to run the kernels on CPU tensors in the Triton interpreter (slow: for tests); or use "
            f"ref/paged_varlen_attention.py, the same API in plain PyTorch, for CPU work.")


def _validate_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table):
    """cu_seq_q[-1] (the rows that belong to sequences), or None while a CUDA graph is captured: a
    device-to-host copy is illegal there, so the values go unchecked."""
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    q_lens, _, _ = _check_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=seqused_k,
                                 block_table=block_table)
    return sum(q_lens)
