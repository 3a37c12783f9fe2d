"""FlashDecoding: split-KV decode attention over a KV cache: the reference (readable PyTorch).

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

Attention of a few new query rows per sequence (one while decoding, 2..16 while verifying
speculative tokens) against that sequence's KV cache, contiguous or paged, causal bottom-right
inside the cache, optionally writing the new keys and values into the cache first.  The
FlashDecoding algorithm splits each sequence's keys into ``num_splits`` chunks, attends to each
chunk on its own (a partial output and its log-sum-exp) and merges the partial results exactly.
``merge_attention_states`` is the merge step; ``choose_num_splits`` the rule the fast file uses
to decide how many chunks to make.

The math, for sequence b with L = seqused_k[b] keys, S_q query rows, query head h, KV head h // G
    s_ij  = scale * <q_i, k_j>                       scale defaults to D ** -0.5
    s_ij  = softcap * tanh(s_ij / softcap)           only when softcap > 0
    i sees j  iff  j <= L - S_q + i                  (row i is the key at position L - S_q + i)
             and  j >= L - S_q + i - left            only with window_size = (left, 0), left >= 0
    lse_i = log( sum_{j seen} exp(s_ij) [+ exp(sink_h)] )
    o_i   = sum_{j seen} exp(s_ij - lse_i) v_j
    A row that sees no key gets o_i = 0 and lse_i = -inf (with a sink: lse_i = sink_h).  A sink
    of -inf is no sink; one of +inf takes all the mass (o_i = 0, lse_i = +inf).  A NaN input gives
    NaN in the rows it reaches, with any number of splits.

    Split and merge.  A chunk C of keys gives a partial state (o_C, lse_C) computed as above
    over j in C only, without the sink.  Two states merge exactly:
        lse = log(exp(lse_A) + exp(lse_B))
        o   = exp(lse_A - lse) o_A + exp(lse_B - lse) o_B
    computed with the larger lse subtracted first.  The merge is associative and commutative, and
    the empty state (o = 0, lse = -inf) is its identity.  The sink is one more state, (o = 0,
    lse = sink_h), merged once at the end.  ``merge_attention_states`` also reads lse = +inf as
    empty: PyTorch's CUDA varlen_attn (FlashAttention-2) marks a row with no key that way.

    Cascade.  Rows that share their first P keys (the n samples of a GRPO group behind their
    prompt) split their keys there: the prefix state (o_p, lse_p) of all the group's rows at once
    (one read of the prefix), each row's own state over its keys from P on, then the merge and the
    sink: ``cascade_decode``, equal to ``flash_decode`` on every row.

Tensors (B sequences, S_q query rows each, H_q / H_kv heads, D head dim, G = H_q / H_kv)
    q             [B, S_q, H_q, D]                  fp16 / bf16 / fp32 / fp64
    k_cache,      [B, S_max, H_kv, D]               contiguous: key j of sequence b at [b, j]
    v_cache       [num_pages, page_size, H_kv, D]   paged (block_table): key j of sequence b at
                                                    [block_table[b, j // page_size], j % page_size]
    seqused_k     [B] int32                         valid keys per sequence, new ones included
    block_table   [B, max_pages] int32              page ids of each sequence
    k_new, v_new  [B, S_q, H_kv, D]                 written in place at positions L - S_q .. L - 1
    cache_leftpad [B] int32                         keys before it are not the sequence's (default 0)
    window_size   (left, right) ints                each row sees its last left + 1 keys (left = -1: all);
                                                    right is -1 or 0 (decode is causal either way)
    cu_groups     [G + 1] int32                     cascade_decode: group g is rows cu_groups[g] .. [g+1]-1
    prefix_lens   [G] int32                         its first keys, in the same pages for all its rows
    sinks         [H_q] float                       one sink logit per query head
    out           [B, S_q, H_q, D]                  q's dtype
    lse           [B, H_q, S_q] fp32                natural log (fp64 for fp64 inputs)

Supported, and what raises
    Any page size, GQA ratio and head dim, S_q >= 1, any ``num_splits`` (the result does not
    depend on it beyond rounding; ``None`` means one chunk here), CPU and CUDA.  An empty
    sequence (seqused_k[b] == 0, a padding slot of a captured batch) is legal: its rows see no
    key and its k_new rows are not written.  A sliding window (``window_size``, flash-attn's name)
    bounds each row on its own, so verification rows of a sliding layer (S_q > 1) each see their
    own last left + 1 keys; with ``cache_leftpad`` too, a key must pass both.  Bad input raises
    ValueError / TypeError naming the argument; a window with ``batch_invariant=True`` raises
    NotImplementedError (the invariant kernel counts its segments from one start per sequence).
    Inference only.  ``upcast=False`` (reference only) computes in the input dtype, the "plain
    PyTorch in low precision" baseline of the parity tests.

Batch invariance (``batch_invariant``, default False)
    The fast kernel's contract with ``batch_invariant=True``: each row's out and lse are bitwise
    those of ``varlen_attn(..., batch_invariant=True)`` of fast/paged_varlen_attention.py for the
    same row, however either call is batched and whatever ``num_splits``: both reduce a row's keys
    (from key 0 of the call: ``cache_leftpad`` with one) in segments of a fixed number of keys, each
    from a fresh state, and fold the segment states in index order, so a split launch divides the
    segments among its programs without changing a bit.  This reference computes the same values
    either way and is not bitwise invariant itself (see ref/paged_varlen_attention.py).

References
    Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference" (2023); Hong et al.,
    FlashDecoding++ (2023); flash-attn's ``flash_attn_with_kvcache`` (the API this mirrors);
    Kwon et al., PagedAttention / vLLM (2023); Ye et al., FlashInfer's attention-state merge
    (2025); Gemma 2 soft-capping; gpt-oss learned sinks.
"""
from __future__ import annotations

import math
import operator

import torch

__all__ = ["cascade_decode", "choose_num_splits", "flash_decode", "merge_attention_states"]


# ----------------------------------------------------------------------------- the math

def _merge(o_a, lse_a, o_b, lse_b):
    """The exact merge of two attention states, in the dtype of its inputs (o [..., T, H, D],
    lse [..., H, T]), the max subtracted first so the weights stay in [0, 1]:

        m = max(lse_a, lse_b),  w = exp(lse - m),  lse = m + log(w_a + w_b),  o = (w_a o_a + w_b o_b) / (w_a + w_b)

    lse = -inf is the empty state (no keys; its o is ignored, so it is the identity); lse = +inf
    takes all the mass (a sink of +inf: out 0, lse +inf); a NaN gives NaN, never "no keys".
    """
    m = torch.maximum(lse_a, lse_b)                                 # NaN if either side is NaN
    m = torch.where(torch.isneginf(m), 0, m)                        # two empty sides: any finite shift

    def weight(lse):                                                # exp(lse - m): 1 for a +inf side, not nan
        return torch.exp(torch.where(torch.isposinf(lse), 0, lse - m))

    w_a, w_b = weight(lse_a), weight(lse_b)
    den = w_a + w_b                                                 # 0 only when both sides are empty
    den_safe = torch.where(den == 0, 1, den)

    def share(w, o):                                                # w o / den, as [..., T, H, 1] * [..., T, H, D]
        w = (w / den_safe).transpose(-1, -2)[..., None]
        return w * torch.where(w == 0, 0, o)                        # an empty side's o may hold garbage

    o = share(w_a, o_a) + share(w_b, o_b)
    lse = torch.where(den == 0, float("-inf"), m + torch.log(den_safe))
    return o, lse


def _attend_chunk(q, k, v, key_pos, last_seen, *, scale, softcap, first_seen=None):
    """Attention of R query rows to one chunk of keys, without the sink.

    q [R, H_q, D]; k, v [n, H_kv, D] are the keys at positions ``key_pos`` [n]; row r sees the keys at
    positions <= ``last_seen[r]`` (and >= ``first_seen[r]``, a sliding window, when given).  Returns the
    partial state (o [R, H_q, D], lse [H_q, R]).
    """
    r, h_q, _ = q.shape
    h_kv = k.shape[1]
    q = q.unflatten(1, (h_kv, h_q // h_kv))                         # [R, H_kv, G, D]: head h reads KV head h // G
    s = torch.einsum("skgd,nkd->kgsn", q, k) * scale                # [H_kv, G, R, n]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    hidden = key_pos[None, :] > last_seen[:, None]                   # [R, n]
    if first_seen is not None:
        hidden = hidden | (key_pos[None, :] < first_seen[:, None])
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                # [H_kv, G, R], -inf for a row that sees nothing
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("kgsn,nkd->skgd", p, v)                        # [R, H_kv, G, D]
    return o.flatten(1, 2), lse.flatten(0, 1)                       # [R, H_q, D], [H_q, R]


def _with_sink(o, lse, sinks, dtype):
    """The sink: one more state (o = 0, lse = sink_h), merged once at the end."""
    if sinks is None:
        return o, lse
    return _merge(o, lse, torch.zeros_like(o), sinks.to(dtype)[:, None].expand(lse.shape))


# ----------------------------------------------------------------------------- public API

def flash_decode(q, k_cache, v_cache, seqused_k, *, block_table=None, k_new=None, v_new=None, scale=None,
                 num_splits=None, softcap=0.0, sinks=None, return_lse=False, out=None, batch_invariant=False,
                 cache_leftpad=None, window_size=(-1, -1), upcast=True):
    """Decode attention of q against the KV cache; see the module docstring for shapes.

    With ``k_new``/``v_new`` the cache is written in place first.  ``cache_leftpad [B] int32`` (as in
    flash-attn's ``flash_attn_with_kvcache``): sequence b's keys start at that position, the ones
    before it are not attended (0 <= cache_leftpad[b] <= seqused_k[b]).  ``window_size=(left, 0)``:
    row i (the key at position L - S_q + i) sees the keys from L - S_q + i - left on (a sliding
    window of left + 1 keys; -1: no bound).  ``batch_invariant=True``
    names the fast kernel's bitwise contract (module docstring), at any ``num_splits``.
    Returns ``out [B, S_q, H_q, D]``, or ``(out, lse [B, H_q, S_q])`` when ``return_lse``; with
    ``out=`` the result is written there.
    """
    lengths, starts, left = _check_inputs(q, k_cache, v_cache, seqused_k, block_table=block_table, k_new=k_new,
                                          v_new=v_new, scale=scale, num_splits=num_splits, softcap=softcap,
                                          sinks=sinks, out=out, batch_invariant=batch_invariant,
                                          cache_leftpad=cache_leftpad, window_size=window_size)
    batch, s_q, h_q, d = q.shape
    scale = d ** -0.5 if scale is None else float(scale)
    softcap = float(softcap)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    dtype = wide if upcast else q.dtype
    splits = 1 if num_splits is None else operator.index(num_splits)
    with torch.no_grad():
        if k_new is not None:
            _append_to_cache(k_cache, v_cache, k_new, v_new, lengths, block_table)
        outs, lses = [], []
        for b, (length, first_key) in enumerate(zip(lengths, starts)):
            k, v = _gather_sequence(k_cache, v_cache, b, length, block_table)
            qb, k, v = q[b].to(dtype), k.to(dtype), v.to(dtype)
            last_seen = length - s_q + torch.arange(s_q, device=q.device)     # row i is the key at L - S_q + i
            first_seen = last_seen - left if left >= 0 else None               # its window's first key
            # Start from the empty state (o = 0, lse = -inf), the identity of the merge.
            o = torch.zeros(s_q, h_q, d, dtype=dtype, device=q.device)
            lse = torch.full((h_q, s_q), float("-inf"), dtype=dtype, device=q.device)
            chunk = max(1, -(-(length - first_key) // splits))
            for first in range(first_key, length, chunk):           # the splits, one after another
                pos = torch.arange(first, min(first + chunk, length), device=q.device)
                o_c, lse_c = _attend_chunk(qb, k[pos], v[pos], pos, last_seen, scale=scale, softcap=softcap,
                                           first_seen=first_seen)
                o, lse = _merge(o, lse, o_c, lse_c)
            o, lse = _with_sink(o, lse, sinks, dtype)
            outs.append(o.to(q.dtype))
            lses.append(lse.to(wide))
        result = torch.stack(outs) if outs else q.new_zeros(q.shape)
        lse = torch.stack(lses) if lses else torch.zeros(0, h_q, s_q, dtype=wide, device=q.device)
        if out is not None:
            out.copy_(result)
            result = out
    return (result, lse) if return_lse else result


def cascade_decode(q, k_cache, v_cache, seqused_k, *, block_table, cu_groups, prefix_lens, k_new=None, v_new=None,
                   scale=None, softcap=0.0, sinks=None, return_lse=False, out=None, upcast=True):
    """Cascade (shared-prefix) decode: ``flash_decode`` over a paged cache for groups of sequences
    whose first keys lie in the same pages, the n samples of a GRPO group behind their prompt.

    Group g is the rows cu_groups[g] .. cu_groups[g + 1] - 1 (``cu_groups [G + 1] int32``, from 0 to B);
    its first ``prefix_lens[g]`` keys (``prefix_lens [G] int32``) are in the same pages for every row
    of the group, and every query row sees all of them (prefix_lens[g] <= seqused_k[b] - S_q + 1).
    Each row's attention is two states merged exactly: over the shared prefix, computed for the
    whole group's rows at once (the prefix's K/V read once per group), and over the row's own keys
    after it; then the sink.  The result equals ``flash_decode``'s for every row; the other keywords
    are flash_decode's.  Returns ``out [B, S_q, H_q, D]``, or ``(out, lse [B, H_q, S_q])``.
    """
    lengths, _, _ = _check_inputs(q, k_cache, v_cache, seqused_k, block_table=block_table, k_new=k_new,
                                  v_new=v_new, scale=scale, num_splits=None, softcap=softcap, sinks=sinks, out=out,
                               batch_invariant=False, cache_leftpad=None, paged_only="cascade_decode")
    groups, prefixes = _check_groups(cu_groups, prefix_lens, block_table, lengths, s_q=q.shape[1],
                                     page_size=k_cache.shape[1])
    batch, s_q, h_q, d = q.shape
    scale = d ** -0.5 if scale is None else float(scale)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    dtype = wide if upcast else q.dtype
    result = q.new_zeros(q.shape)
    lse_all = torch.zeros(batch, h_q, s_q, dtype=wide, device=q.device)
    with torch.no_grad():
        if k_new is not None:
            _append_to_cache(k_cache, v_cache, k_new, v_new, lengths, block_table)
        for (first, last), prefix in zip(groups, prefixes):
            rows = range(first, last)
            # The prefix: every row of the group at once, K/V gathered from its first row's pages.
            k, v = _gather_sequence(k_cache, v_cache, first, prefix, block_table)
            q_rows = q[first:last].to(dtype).flatten(0, 1)                        # [n * S_q, H_q, D]
            pos = torch.arange(prefix, device=q.device)
            o_p, lse_p = _attend_chunk(q_rows, k.to(dtype), v.to(dtype), pos, torch.full((1,), prefix, device=q.device),
                                       scale=scale, softcap=float(softcap))
            o_p, lse_p = o_p.unflatten(0, (len(rows), s_q)), lse_p.unflatten(1, (len(rows), s_q))
            for i, b in enumerate(rows):
                # Its own keys, prefix .. L - 1 (causal), then the merge and the sink.
                k, v = _gather_sequence(k_cache, v_cache, b, lengths[b], block_table)
                pos = torch.arange(prefix, lengths[b], device=q.device)
                last_seen = lengths[b] - s_q + torch.arange(s_q, device=q.device)
                o_s, lse_s = _attend_chunk(q[b].to(dtype), k[pos].to(dtype), v[pos].to(dtype), pos, last_seen,
                                           scale=scale, softcap=float(softcap))
                o, lse = _with_sink(*_merge(o_p[i], lse_p[:, i], o_s, lse_s), sinks, dtype)
                result[b], lse_all[b] = o.to(q.dtype), lse.to(wide)
        if out is not None:
            out.copy_(result)
            result = out
    return (result, lse_all) if return_lse else result


def merge_attention_states(out_a, lse_a, out_b, lse_b, *, upcast=True):
    """Merge two attention states over disjoint key sets into the state over their union.

    ``out_* [..., T, H, D]`` (any float dtype) and ``lse_* [..., H, T]`` (natural log), the
    layouts ``flash_decode`` returns ([B, S_q, H_q, D] and [B, H_q, S_q]) and varlen
    attention returns ([T, H, D] and [H, T]).  Returns ``(out in out_a's dtype, lse fp32)``
    (fp64 for fp64 inputs).  Associative and commutative, exact at any |lse| (the larger is subtracted
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
    lse_shape = (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3])
    wide = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != lse_shape:
            raise ValueError(f"{name} must be [..., H, T] = {lse_shape} for out {tuple(out_a.shape)}, "
                             f"got shape {tuple(t.shape)}")
        if t.dtype != wide:
            raise TypeError(f"{name} must be {wide}, got {t.dtype}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    dtype = wide if upcast else out_a.dtype
    # PyTorch's CUDA varlen_attn (FlashAttention-2) marks a row that saw no key with lse = +inf, this
    # repo with -inf: read both as the empty side.
    lse_a, lse_b = (torch.where(torch.isposinf(t), float("-inf"), t) for t in (lse_a, lse_b))
    o, lse = _merge(out_a.to(dtype), lse_a.to(dtype), out_b.to(dtype), lse_b.to(dtype))
    return o.to(out_a.dtype), lse.to(wide)


# ----------------------------------------------------------------------------- the cache

def _gather_sequence(k_cache, v_cache, b, length, block_table):
    """The ``length`` cached keys and values of sequence b, as [L, H_kv, D]."""
    if block_table is None:
        return k_cache[b, :length], v_cache[b, :length]
    page_size = k_cache.shape[1]
    pages = block_table[b, :-(-length // page_size)].long()        # the pages the sequence owns
    return k_cache[pages].flatten(0, 1)[:length], v_cache[pages].flatten(0, 1)[:length]


def _append_to_cache(k_cache, v_cache, k_new, v_new, lengths, block_table):
    """Write k_new/v_new [B, S_q, H_kv, D] at positions L - S_q .. L - 1 of each sequence, in place."""
    s_q = k_new.shape[1]
    for b, length in enumerate(lengths):
        if length == 0:                                             # an empty (padding) slot: nothing to write
            continue
        pos = torch.arange(length - s_q, length, device=k_cache.device)
        if block_table is None:
            k_cache[b, pos] = k_new[b]
            v_cache[b, pos] = v_new[b]
        else:
            page_size = k_cache.shape[1]
            pages = block_table[b].long()[pos // page_size]
            k_cache[pages, pos % page_size] = k_new[b]
            v_cache[pages, pos % page_size] = v_new[b]


# ----------------------------------------------------------------------------- the shape gate

def choose_num_splits(batch, num_kv_heads, max_seqlen_k, *, num_sms, num_q_tiles=1, block_n=64,
                      programs_per_sm=2, max_splits=128):
    """How many chunks to split each sequence's keys into, from explicit shape numbers only.

    The fast kernel runs one program per (sequence, KV head, query tile, split); a GPU runs
    ``num_sms * programs_per_sm`` programs at once (one "wave").  The rule:

    1. ``programs = batch * num_kv_heads * num_q_tiles``.  If that already fills a wave, or the
       longest sequence has a single block of ``block_n`` keys, return 1 (no partials to merge).
    2. Otherwise consider every split count ``s`` from 1 to ``min(max_splits, KV blocks,
       programs per wave)``, skipping an ``s`` that leaves the largest chunk as long as ``s - 1``
       does (it would add work to merge without shortening the slowest program).
    3. The wave efficiency of ``s`` is ``w / ceil(w)`` with ``w = programs * s / slots``: the
       fraction of the last wave that is busy.  Return the smallest ``s`` whose efficiency is
       at least 85% of the best one: more splits cost partial writes and a merge.

    Never more splits than KV blocks.  Pure: no device is queried (the fast op passes the
    SM count it reads once per device).
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


# ----------------------------------------------------------------------------- input checks
#
# One row per tensor argument (name, shape in the size names of the module docstring, dtype rule),
# checked in order by _check_tensors; then the rules that tie arguments together, the scalars, and
# the values of the index tensors.

_SIZES = {"B": "batch size", "S_q": "query row count", "H_q": "query head count", "H_kv": "KV head count",
          "D": "head dim", "S_max": "cache length", "num_pages": "page count", "page_size": "page size",
          "max_pages": "pages per sequence"}


def _check_inputs(q, k_cache, v_cache, seqused_k, *, block_table, k_new, v_new, scale, num_splits,
                  softcap, sinks, out, batch_invariant, cache_leftpad, window_size=(-1, -1), paged_only=None):
    """Validate shapes, dtypes and devices, then the values of the index tensors; returns the
    sequence lengths and the first key of each (cache_leftpad, else 0) as host lists, and the window's
    left (-1: none)."""
    if paged_only and block_table is None:
        raise ValueError(f"{paged_only} needs a paged cache (block_table): a group's rows share the pages "
                         f"that hold its prefix")
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
    lengths = _check_values(seqused_k, block_table, s_q=size["S_q"], page_size=k_cache.shape[1],
                            capacity=block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1],
                            num_pages=k_cache.shape[0])
    starts = [0] * len(lengths) if cache_leftpad is None else cache_leftpad.tolist()
    for b, (first, length) in enumerate(zip(starts, lengths)):
        if not 0 <= first <= length:
            raise ValueError(f"cache_leftpad[{b}] = {first} must be in [0, seqused_k[{b}] = {length}]")
    return lengths, starts, left


def _check_groups(cu_groups, prefix_lens, block_table, lengths, *, s_q, page_size):
    """cascade_decode's groups: [(first row, end row)] and the prefix lengths, or a clear error."""
    for name, t, shape in (("cu_groups", cu_groups, "[G + 1]"), ("prefix_lens", prefix_lens, "[G]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor {shape}, got {type(t).__name__}")
        if t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name} must be an int32 tensor {shape}, got {t.dtype} of shape {tuple(t.shape)}")
        if t.device != block_table.device:
            raise ValueError(f"{name} must be on {block_table.device} like block_table, got {t.device}")
    bounds, prefixes = cu_groups.tolist(), prefix_lens.tolist()
    if len(bounds) != len(prefixes) + 1:
        raise ValueError(f"cu_groups must have one more entry than prefix_lens ({len(prefixes)} groups), got "
                         f"{len(bounds)}")
    if not bounds or bounds[0] != 0 or bounds[-1] != len(lengths) or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_groups must rise from 0 to B = {len(lengths)}, got {bounds}")
    table = block_table.tolist()
    for g, ((first, last), prefix) in enumerate(zip(zip(bounds, bounds[1:]), prefixes)):
        for b in range(first, last):
            if not 0 <= prefix <= max(0, lengths[b] - s_q + 1):
                raise ValueError(f"prefix_lens[{g}] = {prefix} must be in [0, seqused_k[b] - S_q + 1] for every row "
                                 f"b of its group (every query row sees the whole prefix); row {b} has "
                                 f"seqused_k = {lengths[b]}")
            pages = -(-prefix // page_size)
            if table[b][:pages] != table[first][:pages]:
                raise ValueError(f"block_table rows {first} and {b} of group {g} differ in the first {pages} pages: "
                                 f"a group's prefix of {prefix} keys must lie in the same pages")
    return list(zip(bounds, bounds[1:])), prefixes


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


def _check_values(seqused_k, block_table, *, s_q, page_size, capacity, num_pages):
    """seqused_k within capacity and not 0 < seqused_k < S_q, used page ids inside the pool: one small
    device-to-host copy (a wrong length would otherwise be a silent wrong answer or an out-of-bounds
    read).  Returns the lengths."""
    lengths = seqused_k.tolist()
    where = (f"the {block_table.shape[1]} pages of {page_size} keys that block_table holds per sequence"
             if block_table is not None else f"the S_max = {capacity} slots of the contiguous cache")
    for b, length in enumerate(lengths):
        if not 0 <= length <= capacity:
            raise ValueError(f"seqused_k[{b}] = {length} is beyond {where} (capacity {capacity})")
        if 0 < length < s_q:
            raise ValueError(f"seqused_k[{b}] = {length} is smaller than S_q = {s_q}: the query rows are the "
                             f"last S_q keys of the sequence (0 marks an empty sequence)")
    if block_table is not None:
        for b, (length, pages) in enumerate(zip(lengths, block_table.tolist())):
            bad = [p for p in pages[:-(-length // page_size)] if not 0 <= p < num_pages]
            if bad:
                raise ValueError(f"block_table[{b}] points at page {bad[0]}, outside the pool of {num_pages} pages")
    return lengths


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


if __name__ == "__main__":
    # A tiny self-check: split-and-merge equals one softmax over all keys, and SDPA.
    torch.manual_seed(0)
    q = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    k, v = torch.randn(1, 37, 2, 16, dtype=torch.float64), torch.randn(1, 37, 2, 16, dtype=torch.float64)
    used = torch.tensor([37], dtype=torch.int32)
    whole = flash_decode(q, k, v, used)
    split = flash_decode(q, k, v, used, num_splits=5)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    print("max error vs SDPA:", (whole - expect).abs().max().item(), (split - expect).abs().max().item())
    assert (split - expect).abs().max().item() < 1e-12
    print("splits for B=1, 8 KV heads, 128k keys on 132 SMs:", choose_num_splits(1, 8, 131072, num_sms=132))
