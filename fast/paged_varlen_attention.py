"""Paged varlen attention: a Triton forward kernel, a drop-in for torch.nn.attention.varlen.

What it computes
    Exactly what ref/paged_varlen_attention.py specifies (PyTorch's ``varlen_attn`` /
    ``varlen_attn_out`` contract plus ``softcap`` and ``sinks``), with one FlashAttention-2
    style kernel: each program owns a tile of query rows and streams the keys it can see
    through an online softmax, reading K/V either packed or through a block table.

The math (per query row i of a sequence, log2 domain inside the kernel)
    s_ij = scale * <q_i, k_j>  [softcap * tanh(s_ij / softcap)],  t_ij = s_ij * log2(e)
    online softmax over key blocks:  m' = max(m, max_j t_ij);  l' = l * 2^(m - m') + sum_j 2^(t_ij - m')
                                     acc' = acc * 2^(m - m') + sum_j 2^(t_ij - m') v_j
    sink (optional): one more term 2^(sink_h * log2 e) in l, with no value
    o_i = acc / l (0 when l = 0);  lse_i = (m + log2 l) * ln 2 (-inf when l = 0)
    Row i of a sequence with L_q queries and L_k keys sees key j iff
    i + L_k - L_q - left <= j <= i + L_k - L_q + right (-1 = unbounded; causal = (-1, 0)).

Tensors (N sequences, T_q / T_k packed tokens, H_q / H_kv heads, D head dim, G = H_q / H_kv)
    query        [T_q, H_q, D]                     fp16 / bf16 / fp32, any strides
    key, value   [T_k, H_kv, D]                    packed (cu_seq_k), or
                 [num_pages, page_size, H_kv, D]   paged (block_table + seqused_k)
    cu_seq_q     [N + 1] int32;  cu_seq_k [N + 1] int32 or None when paged
    seqused_k    [N] int32;  block_table [N, max_pages] int32;  sinks [H_q] float
    out          [T_q, H_q, D] query dtype;  lse [H_q, T_q] fp32 natural log

How the kernel works
    * GQA packing: the G query heads of one KV head are packed into the rows of one tile
      (row r of the flattened (position, head-in-group) space is position r // G, head
      r % G), so each K/V block is loaded once per KV head, not once per query head, and
      decode-like sequences (L_q = 1) still fill G rows.
    * Grid: (query tiles x sequences, KV heads).  Tiles run heaviest-first (the last tile of
      each sequence sees the most keys under a causal mask).
    * Mask skipping: per tile, the visible key range [lo, hi) is computed from the window;
      blocks outside it are never loaded, blocks fully inside it run without any mask, and
      only the (at most two) edge segments pay for the mask.
    * Paged K/V: each key row's address comes from ``block_table[b, j // page_size]`` and the
      slot ``j % page_size``, so any page size >= 1 works and the loads pipeline like packed ones.
    * fp32 inputs use IEEE fp32 dots (no silent tf32); fp16/bf16 use tensor cores with fp32
      accumulation.  Head dims are padded to a power of two >= 16 with masks (60, 100, 192 work).
    * Alignment: the launcher passes the largest power of two (<= 16) dividing every row
      stride, so loads vectorize (D = 100 rows are 4-element aligned).  Rows aligned to fewer
      than 4 elements (odd head dims or strides) or an ``out`` with a non-unit last stride are
      staged through padded copies: correct, but one extra read and write of q, k, v, out.

Cost (what the benchmark measures against)
    FLOPs  = 4 * D * sum over heads and query rows of the keys that row sees
             (2 for QK^T, 2 for PV per visible pair; causal square L: pairs = L (L + 1) / 2)
    bytes >= (2 * T_q * H_q + 2 * T_k * H_kv) * D * elt + 4 * T_q * H_q   (q, o, k, v, lse once)

Supported, and what raises
    Any page size >= 1, any integer GQA ratio, head dims up to 256, fp16 / bf16 / fp32,
    windows and causal, empty sequences, ``out=``, ``softcap``, ``sinks``.  Forward only:
    inputs that require grad raise (use ref.varlen_attn for autograd).  fp64 and D > 256
    raise TypeError / ValueError.  ``num_splits`` is validated and accepted for API
    compatibility; this kernel never splits, so every ``num_splits`` gives the same,
    batch-invariant result.  Bad inputs raise the same errors as the reference.  Value
    checks (cu_seq_q[-1] == T_q, seqused_k within the pages, max_q/max_k) read the index
    tensors once on the host; during CUDA-graph capture they are skipped (a sync is illegal
    there) and the shape/dtype checks alone run.  The ops are ``torch.library.custom_op``s
    (``twofold::varlen_attn``, ``twofold::varlen_attn_out``) with fake implementations, so
    ``torch.compile(fullgraph=True)`` traces through them.

References
    PyTorch 2.13 torch.nn.attention.varlen; Dao, FlashAttention-2 (2023); Kwon et al.,
    PagedAttention / vLLM (2023); Triton fused-attention tutorial; Gemma 2 soft-capping;
    gpt-oss attention sinks.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

__all__ = ["AuxRequest", "varlen_attn", "varlen_attn_out"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AuxRequest(NamedTuple):
    """Which auxiliary outputs to return (PyTorch's ``AuxRequest``): ``lse=True`` adds the LSE."""

    lse: bool = False


# ----------------------------------------------------------------------------- input checks

def _check_meta(query, key, value, cu_seq_q, cu_seq_k, *, scale, window_size, enable_gqa, seqused_k,
                block_table, num_splits, softcap, sinks, out=None):
    """Shape, dtype and device checks that need no data (they also run on fake tensors)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    paged = block_table is not None
    if query.dim() != 3:
        raise ValueError(f"query must be [T_q, H_q, D], got shape {tuple(query.shape)}")
    kv_rank = 4 if paged else 3
    kv_layout = "[num_pages, page_size, H_kv, D] (paged)" if paged else "[T_k, H_kv, D]"
    for name, t in (("key", key), ("value", value)):
        if t.dim() != kv_rank:
            raise ValueError(f"{name} must be {kv_layout}, got shape {tuple(t.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key, value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"head dim mismatch: query has D={query.shape[-1]}, key/value have D={key.shape[-1]}")
    h_q, h_kv = query.shape[1], key.shape[-2]
    if not enable_gqa and h_q != h_kv:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={h_q} "
                         f"and Hkv={h_kv}. Try setting enable_gqa=True for GQA.")
    if h_kv == 0 or h_q % h_kv != 0:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got "
                         f"Hq={h_q} and Hkv={h_kv}.")

    def index_tensor(name, t, dim):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.dim() != dim:
            raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(t.shape)}")

    index_tensor("cu_seq_q", cu_seq_q, 1)
    if cu_seq_q.numel() < 1:
        raise ValueError("cu_seq_q must have N + 1 >= 1 entries, got 0")
    n = cu_seq_q.numel() - 1
    if cu_seq_k is not None:
        index_tensor("cu_seq_k", cu_seq_k, 1)
        if cu_seq_k.numel() != n + 1:
            raise ValueError(f"cu_seq_k must have N + 1 = {n + 1} entries like cu_seq_q, got {cu_seq_k.numel()}")
    elif not paged:
        raise ValueError("cu_seq_k may be None only with a paged KV cache (block_table)")
    if paged:
        if seqused_k is None:
            raise ValueError("block_table requires seqused_k (the number of valid keys per sequence)")
        index_tensor("block_table", block_table, 2)
        if block_table.shape[0] != n:
            raise ValueError(f"block_table must be [N={n}, max_pages], got shape {tuple(block_table.shape)}")
    if seqused_k is not None:
        index_tensor("seqused_k", seqused_k, 1)
        if seqused_k.numel() != n:
            raise ValueError(f"seqused_k must be [N={n}], got shape {tuple(seqused_k.shape)}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise TypeError("sinks must be a floating torch.Tensor of shape [H_q]")
        if sinks.shape != (h_q,):
            raise ValueError(f"sinks must be [H_q={h_q}], got shape {tuple(sinks.shape)}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} like query, "
                             f"got {tuple(out.shape)} {out.dtype}")
    named = [("query", query), ("key", key), ("value", value), ("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k),
             ("seqused_k", seqused_k), ("block_table", block_table), ("sinks", sinks), ("out", out)]
    devices = {name: t.device for name, t in named if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got mixed devices {devices}")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be (left, right) ints >= -1, got {window_size!r}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a float >= 0, got {softcap!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    # What this kernel adds to the contract's checks.
    if query.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"fast varlen_attn supports fp16, bf16, fp32; got {query.dtype} (the reference takes fp64)")
    if query.shape[-1] > 256:
        raise ValueError(f"fast varlen_attn supports head dims up to 256, got D={query.shape[-1]}")


def _check_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, *, seqused_k, block_table):
    """Checks that read the index tensors (one small device-to-host copy)."""
    paged = block_table is not None
    cq = cu_seq_q.tolist()
    if cq[0] != 0 or any(b < a for a, b in zip(cq, cq[1:])):
        raise ValueError(f"cu_seq_q must start at 0 and be non-decreasing, got {cq[:8]}...")
    if cq[-1] != query.shape[0]:
        raise ValueError(f"cu_seq_q[-1] must equal T_q = query.shape[0] = {query.shape[0]}, got {cq[-1]}")
    q_lens = [b - a for a, b in zip(cq, cq[1:])]
    if paged:
        k_lens = seqused_k.tolist()
        page_size, num_pages = key.shape[1], key.shape[0]
        capacity = block_table.shape[1] * page_size
        for b, length in enumerate(k_lens):
            if not 0 <= length <= capacity:
                raise ValueError(f"seqused_k[{b}] = {length} is beyond the {block_table.shape[1]} pages of "
                                 f"{page_size} keys that block_table holds per sequence (capacity {capacity})")
        table = block_table.tolist()
        for b, length in enumerate(k_lens):
            bad = [x for x in table[b][:-(-length // page_size)] if not 0 <= x < num_pages]
            if bad:
                raise ValueError(f"block_table[{b}] points at page {bad[0]}, outside the pool of {num_pages} pages")
    else:
        ck = cu_seq_k.tolist()
        if ck[0] != 0 or any(b < a for a, b in zip(ck, ck[1:])):
            raise ValueError(f"cu_seq_k must start at 0 and be non-decreasing, got {ck[:8]}...")
        if ck[-1] != key.shape[0]:
            raise ValueError(f"cu_seq_k[-1] must equal T_k = key.shape[0] = {key.shape[0]}, got {ck[-1]}")
        k_lens = [b - a for a, b in zip(ck, ck[1:])]
        if seqused_k is not None:
            used = seqused_k.tolist()
            for b, (u, length) in enumerate(zip(used, k_lens)):
                if not 0 <= u <= length:
                    raise ValueError(f"seqused_k[{b}] = {u} is outside [0, {length}], the keys sequence {b} has")
            k_lens = used
    if q_lens and max(q_lens) > max_q:
        raise ValueError(f"max_q = {max_q} is smaller than the longest query sequence ({max(q_lens)})")
    if k_lens and max(k_lens) > max_k:
        raise ValueError(f"max_k = {max_k} is smaller than the longest key sequence ({max(k_lens)})")


# ----------------------------------------------------------------------------- the kernel

@triton.jit
def _tanh(x):
    # tanh through exp2 (portable: the interpreter has no libdevice).  For large |x|, 2^(2x log2e)
    # overflows to inf or underflows to 0 and the expression saturates to +-1 as it should.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


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
        if HAS_SOFTCAP:
            b_s = softcap * _tanh(b_s * qk_scale) * 1.4426950408889634     # qk_scale = scale / softcap
        else:
            b_s = b_s * qk_scale                                          # qk_scale = scale * log2(e)
        if MASKED:
            m_s = m_n[None, :]
            if HAS_LEFT:
                m_s = m_s & (o_n[None, :] >= o_key_pos[:, None] - window_left)
            if HAS_RIGHT:
                m_s = m_s & (o_n[None, :] <= o_key_pos[:, None] + window_right)
            b_s = tl.where(m_s, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        # A row that has seen nothing yet keeps m = -inf; subtracting 0 instead keeps its
        # 2^(-inf) = 0 probabilities from turning into 2^(-inf + inf) = nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.exp2(b_s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


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
    # rows_bucket is read by the autotuner only (its key), never here.
    i_tile, i_kvh = tl.program_id(0), tl.program_id(1)
    i_b = i_tile % num_seqs
    i_m_from_end = i_tile // num_seqs                  # 0 = the sequence's last (heaviest) tile
    bos_q = tl.load(cu_seq_q_ptr + i_b)
    L_q = tl.load(cu_seq_q_ptr + i_b + 1) - bos_q
    num_tiles = tl.cdiv(L_q * GROUP, BLOCK_M)
    if i_m_from_end >= num_tiles:
        return
    i_m = num_tiles - 1 - i_m_from_end

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
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)         # [BLOCK_M]
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

    # The keys this tile can see at all, [lo, hi), and those every row of it sees, [full_lo, full_hi).
    pos_first = (i_m * BLOCK_M) // GROUP + (L_k - L_q)
    pos_last = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // GROUP, L_q - 1) + (L_k - L_q)
    lo = 0
    hi = L_k
    full_lo = 0
    full_hi = L_k
    if HAS_LEFT:
        lo = tl.maximum(pos_first - window_left, 0)
        full_lo = tl.maximum(pos_last - window_left, lo)
    if HAS_RIGHT:
        hi = tl.minimum(pos_last + window_right + 1, L_k)
        full_hi = tl.minimum(pos_first + window_right + 1, hi)
    blk_lo = (lo // BLOCK_N) * BLOCK_N
    full_blk_lo = tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, blk_lo)
    full_blk_hi = (full_hi // BLOCK_N) * BLOCK_N
    # Three segments: [blk_lo, edge_a_hi) masked, [full_blk_lo, full_blk_hi) unmasked,
    # [edge_c_lo, hi) masked.  Without a fully visible block, the last one takes everything.
    has_full = full_blk_lo < full_blk_hi
    edge_a_hi = tl.where(has_full, full_blk_lo, blk_lo)
    full_blk_hi = tl.where(has_full, full_blk_hi, full_blk_lo)
    edge_c_lo = tl.where(has_full, full_blk_hi, blk_lo)

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
    if HAS_LEFT:
        # Only a left window bound leaves partly hidden blocks before the fully visible ones.
        # (Without one this loop would be empty; leaving it out of the code saves registers.)
        acc, l_i, m_i = _attn_key_blocks(
            acc, l_i, m_i, b_q, k_base, v_base, bt_row_ptr, bos_k, L_k, o_key_pos, o_d, m_d,
            blk_lo, edge_a_hi, qk_scale, softcap, window_left, window_right, page_size,
            stride_k_page, stride_k_tok, stride_v_page, stride_v_tok,
            True, IS_PAGED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, True, DOT_PRECISION, ALIGN, BLOCK_N)
    acc, l_i, m_i = _attn_key_blocks(
        acc, l_i, m_i, b_q, k_base, v_base, bt_row_ptr, bos_k, L_k, o_key_pos, o_d, m_d,
        full_blk_lo, full_blk_hi, qk_scale, softcap, window_left, window_right, page_size,
        stride_k_page, stride_k_tok, stride_v_page, stride_v_tok,
        False, IS_PAGED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HEAD_DIM != BLOCK_D, DOT_PRECISION, ALIGN, BLOCK_N)
    acc, l_i, m_i = _attn_key_blocks(
        acc, l_i, m_i, b_q, k_base, v_base, bt_row_ptr, bos_k, L_k, o_key_pos, o_d, m_d,
        edge_c_lo, hi, qk_scale, softcap, window_left, window_right, page_size,
        stride_k_page, stride_k_tok, stride_v_page, stride_v_tok,
        True, IS_PAGED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, True, DOT_PRECISION, ALIGN, BLOCK_N)

    if HAS_SINKS:
        # The sink is one more logit in the denominator, with no value vector.
        b_sink = tl.load(sinks_ptr + o_head, mask=m_r, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, b_sink)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(b_sink - m_fin)
        acc = acc * alpha[:, None]
        m_i = m_fin
    seen = l_i > 0.0
    b_o = acc / tl.where(seen, l_i, 1.0)[:, None]
    b_lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))

    p_o = o_ptr + o_o_row[:, None] + o_d[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
    tl.store(lse_ptr + o_head.to(tl.int64) * stride_lse_head + bos_q + o_pos, b_lse, mask=m_r)


# ----------------------------------------------------------------------------- configs and launcher

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
    return configs


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


@functools.lru_cache(maxsize=None)
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


def _launch(out, query, key, value, cu_seq_q, cu_seq_k, max_q, scale, window_left, window_right,
            seqused_k, block_table, softcap, sinks):
    """Writes ``out`` and returns ``lse [H_q, T_q]`` fp32.  Inputs were checked by the caller."""
    t_q, h_q, head_dim = query.shape
    num_seqs = cu_seq_q.numel() - 1
    lse = torch.empty(h_q, t_q, dtype=torch.float32, device=query.device)
    if t_q == 0 or num_seqs == 0 or max_q == 0 or head_dim == 0:
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
        target = _padded_copy(out, copy=False)
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
    qk_scale = scale / softcap if has_softcap else scale * _LOG2E
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

    if query.is_cuda:
        with torch.cuda.device(query.device):
            if _FORCED_CONFIG is not None:
                _attn_fwd_kernel[grid](*args, **flags, **_FORCED_CONFIG)
            else:
                family = _gpu_family(query.device.index if query.device.index is not None
                                     else torch.cuda.current_device())
                _TUNED[(family, _block_d(head_dim), query.element_size())][grid](*args, **flags)
    else:
        _attn_fwd_kernel[grid](*args, **flags, **_INTERPRET_BLOCKS, num_warps=4)
    if target is not out:
        out.copy_(target)
    return lse


def _padded_copy(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A view of t's values in a buffer whose rows are padded to a multiple of 8 elements."""
    d = t.shape[-1]
    view = t.new_empty(*t.shape[:-1], -(-d // 8) * 8)[..., :d]
    if copy:
        view.copy_(t)
    return view


def _validate_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table):
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # a device-to-host copy is illegal while a CUDA graph is captured
    _check_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=seqused_k, block_table=block_table)


# ----------------------------------------------------------------------------- custom ops

@torch.library.custom_op("twofold::varlen_attn", mutates_args=())
def _varlen_attn_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                    cu_seq_k: Optional[torch.Tensor], max_q: int, max_k: int, scale: float, window_left: int,
                    window_right: int, seqused_k: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                    softcap: float, sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    _validate_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table)
    out = query.new_empty(query.shape)
    lse = _launch(out, query, key, value, cu_seq_q, cu_seq_k, max_q, scale, window_left, window_right,
                  seqused_k, block_table, softcap, sinks)
    return out, lse


@_varlen_attn_op.register_fake
def _varlen_attn_fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_left, window_right,
                      seqused_k, block_table, softcap, sinks):
    return query.new_empty(query.shape), query.new_empty(query.shape[1], query.shape[0], dtype=torch.float32)


@torch.library.custom_op("twofold::varlen_attn_out", mutates_args=("out",))
def _varlen_attn_out_op(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        cu_seq_q: torch.Tensor, cu_seq_k: Optional[torch.Tensor], max_q: int, max_k: int,
                        scale: float, window_left: int, window_right: int, seqused_k: Optional[torch.Tensor],
                        block_table: Optional[torch.Tensor], softcap: float,
                        sinks: Optional[torch.Tensor]) -> torch.Tensor:
    _validate_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table)
    return _launch(out, query, key, value, cu_seq_q, cu_seq_k, max_q, scale, window_left, window_right,
                   seqused_k, block_table, softcap, sinks)


@_varlen_attn_out_op.register_fake
def _varlen_attn_out_fake(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_left,
                          window_right, seqused_k, block_table, softcap, sinks):
    return query.new_empty(query.shape[1], query.shape[0], dtype=torch.float32)


# ----------------------------------------------------------------------------- public API

def _prepare(query, key, value, cu_seq_q, cu_seq_k, *, scale, window_size, enable_gqa, seqused_k,
             block_table, num_splits, softcap, sinks, out=None):
    _check_meta(query, key, value, cu_seq_q, cu_seq_k, scale=scale, window_size=window_size,
                enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table, num_splits=num_splits,
                softcap=softcap, sinks=sinks, out=out)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks)):
        raise NotImplementedError("fast varlen_attn is forward-only: call it under torch.no_grad(), "
                                  "or use ref.paged_varlen_attention.varlen_attn for autograd")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return scale, int(window_size[0]), int(window_size[1]), float(softcap)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
                softcap=0.0, sinks=None):
    """Variable-length (optionally paged) attention; see the module docstring for shapes.

    Returns ``out [T_q, H_q, D]``, or ``(out, lse [H_q, T_q])`` when ``return_aux.lse``.
    """
    scale, left, right, softcap = _prepare(
        query, key, value, cu_seq_q, cu_seq_k, scale=scale, window_size=window_size, enable_gqa=enable_gqa,
        seqused_k=seqused_k, block_table=block_table, num_splits=num_splits, softcap=softcap, sinks=sinks)
    out, lse = _varlen_attn_op(query, key, value, cu_seq_q, cu_seq_k, int(max_q), int(max_k), scale, left, right,
                               seqused_k, block_table, softcap, sinks)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


def varlen_attn_out(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                    scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                    num_splits=None, softcap=0.0, sinks=None):
    """``varlen_attn`` writing into ``out`` (same shape and dtype as ``query``); returns ``out``
    or ``(out, lse)``."""
    scale, left, right, softcap = _prepare(
        query, key, value, cu_seq_q, cu_seq_k, scale=scale, window_size=window_size, enable_gqa=enable_gqa,
        seqused_k=seqused_k, block_table=block_table, num_splits=num_splits, softcap=softcap, sinks=sinks,
        out=out)
    lse = _varlen_attn_out_op(out, query, key, value, cu_seq_q, cu_seq_k, int(max_q), int(max_k), scale, left,
                              right, seqused_k, block_table, softcap, sinks)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


# ----------------------------------------------------------------------------- ahead-of-time builds

def _compile_cases():
    """Every launch shape, for parity/test_compile.py.  Per GPU family, element type and head-dim
    class: the leanest code path (packed, causal) and the fullest (paged, two-sided window,
    softcap, sinks), with 16-byte-aligned rows and every config; and the fullest path with rows
    aligned to 4 elements (head dims 60, 100, 196) and the configs that alignment keeps.  fp16
    builds the lean path with each class's first config only: its code matches bf16's but for
    the conversions (this keeps the CI build time down)."""
    cases = []
    lean = dict(GROUP=4, IS_PAGED=False, HAS_SEQUSED=False, HAS_LEFT=False, HAS_RIGHT=True,
                HAS_SOFTCAP=False, HAS_SINKS=False)
    full = dict(GROUP=3, IS_PAGED=True, HAS_SEQUSED=True, HAS_LEFT=True, HAS_RIGHT=True,
                HAS_SOFTCAP=True, HAS_SINKS=True)
    for family in (80, 90):
        for dtype, elt in (("fp16", 2), ("bf16", 2), ("fp32", 4)):
            for head_dim in (64, 128, 256, 60, 100, 196):
                align = _pow2_divisor(head_dim)
                variants = [("lean", lean)] if dtype == "fp16" else [("lean", lean), ("full", full)]
                if align < 16:
                    variants = [] if dtype == "fp16" else [("full", full)]
                block_d = _block_d(head_dim)
                sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "o_ptr": f"*{dtype}",
                       "lse_ptr": "*fp32", "sinks_ptr": "*fp32", "cu_seq_q_ptr": "*i32", "cu_seq_k_ptr": "*i32",
                       "seqused_k_ptr": "*i32", "block_table_ptr": "*i32", "qk_scale": "fp32", "softcap": "fp32"}
                # Strides of [.., H, D] tensors are multiples of 16 when D is (Triton specializes on
                # that at run time); otherwise the ALIGN constexpr carries the alignment.
                for name in ("stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_k_page",
                             "stride_k_tok", "stride_k_head", "stride_v_page", "stride_v_tok", "stride_v_head"):
                    sig[name] = "i32:16" if align == 16 else "i32"
                sig["rows_bucket"] = "i32:16"
                for name in ("stride_lse_head", "stride_bt", "page_size", "num_seqs", "window_left", "window_right"):
                    sig[name] = "i32"
                tuned = _TUNED[(family, block_d, elt)]
                for label, flags in variants:
                    configs = _prune_by_alignment(tuned.configs, {}, ALIGN=align)
                    cases.append(dict(
                        kernel=tuned, archs=[family], configs=configs[:1] if dtype == "fp16" else configs,
                        name=f"attn_fwd[sm{family},{dtype},D={head_dim},{label}]", signature=sig,
                        constexprs=dict(flags, DOT_PRECISION="ieee" if elt == 4 else None, HEAD_DIM=head_dim,
                                        BLOCK_D=block_d, ALIGN=align),
                        tensor_cores=elt == 2))
    return cases
