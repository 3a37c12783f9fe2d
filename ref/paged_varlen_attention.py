"""Paged varlen attention: the reference (readable PyTorch, the specification).

Example (runs as written next to this file; TRITON_INTERPRET=1 runs fast/'s kernels on a CPU)::

    # paged_varlen_attention.py, copied next to this script
    import torch
    from paged_varlen_attention import varlen_attn

    dev = "cuda" if torch.cuda.is_available() else "cpu"     # fast/ on a CPU: TRITON_INTERPRET=1 first
    q, k, v = (torch.randn(9, 4, 64, device=dev) for _ in range(3))   # two sequences, 4 and 5 tokens, packed
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=dev)
    out = varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0))     # causal: [9, 4, 64]
    print(out.shape)

Softmax attention over a batch of packed, variable-length sequences: the contract of PyTorch's
``torch.nn.attention.varlen`` (``varlen_attn`` / ``varlen_attn_out``), with keys and values
packed like the queries or stored in a paged KV cache, plus logit soft-capping and attention
sinks, which PyTorch lacks.

The math, for sequence b with L_q query rows and L_k keys, query head h, KV head h // G
    s_ij  = scale * <q_i, k_j>                       scale defaults to D ** -0.5
    s_ij  = softcap * tanh(s_ij / softcap)           only when softcap > 0
    i sees j  iff  i + L_k - L_q - left <= j <= i + L_k - L_q + right
                                                     (bottom-right aligned; -1 = unbounded)
    lse_i = log( sum_{j seen} exp(s_ij) [+ exp(sink_h)] )
    o_i   = sum_{j seen} exp(s_ij - lse_i) v_j
    Causal is window (-1, 0).  The sink is a logit with no value vector: it only enlarges the
    denominator, so a head may put probability mass "nowhere" (gpt-oss, StreamingLLM).
    Edge cases.  A row that sees no key gets o_i = 0 and lse_i = -inf (with a sink, lse_i = sink_h;
    PyTorch's CUDA varlen_attn, i.e. FlashAttention-2, writes +inf there).  A sink of -inf is no
    sink; a sink of +inf takes all the mass: o_i = 0, lse_i = +inf, d lse_i / d sink_h = 1.  A NaN
    input gives NaN in the rows it reaches (out and lse).  Rows past cu_seq_q[-1] (a padded
    buffer) belong to no sequence: o = 0, lse = -inf, gradient 0; varlen_attn_out leaves them.

Tensors (N sequences, T_q / T_k packed tokens, H_q / H_kv heads, D head dim, G = H_q / H_kv)
    query        [T_q, H_q, D]                     fp16 / bf16 / fp32 / fp64
    key, value   [T_k, H_kv, D]                    packed: sequence b at cu_seq_k[b]:cu_seq_k[b+1]
                 [num_pages, page_size, H_kv, D]   paged, when block_table is given
    cu_seq_q     [N + 1] int32                     query offsets, cu_seq_q[0] = 0, cu_seq_q[-1] <= T_q
    cu_seq_k     [N + 1] int32 or None             key offsets, cu_seq_k[-1] <= T_k; may be None when paged
    seqused_k    [N] int32                         keys used per sequence (required when paged)
    block_table  [N, max_pages] int32              key j of sequence b: page block_table[b, j // page_size],
                                                   slot j % page_size
    sinks        [H_q] float                       one sink logit per query head
    out          [T_q, H_q, D]                     query's dtype
    lse          [H_q, T_q] fp32                   natural log (fp64 for fp64 inputs)

Supported, and what raises
    Any page size, GQA ratio and head dim, empty sequences, CPU and CUDA.  Autograd with packed
    keys (the specification of the fast backward); the paged path and ``varlen_attn_out`` are
    inference-only, as in PyTorch (NotImplementedError with grad).  ``num_splits`` is accepted
    and changes nothing.  Bad input raises ValueError / TypeError naming the argument.
    ``upcast=False`` (reference only) computes in the input dtype: the "plain PyTorch in low
    precision" baseline of the parity tests.

Batch invariance (``batch_invariant``, default False)
    The contract the fast kernel keeps with ``batch_invariant=True``: a query row's out and lse are
    bitwise the same however the row is batched (a trainer's packed forward over other sequences,
    a paged prefill chunk starting anywhere, any page size or block table, a decode step of one row
    per sequence, or ``flash_decode(..., batch_invariant=True)``), given the same keys, values,
    position, window, scale, softcap and sinks, on one device type and dtype.  That takes one row
    group shape at a fixed slot per position, row sums as MMAs, a row's keys in segments of a fixed
    number of keys from key 0 (each from a fresh state, through key blocks from key 0, masked blocks
    exact no-ops), the segment states folded in index order; see fast/paged_varlen_attention.py for
    the construction and its cost.  This reference accepts the keyword and computes the same
    values either way, but is not bitwise invariant itself: its einsums may take other kernels for
    other row counts (measured on CPU: a row's fp32 out differs in the last bits between a packed
    forward and a decode step).  It specifies the values; the bits are the fast kernels' contract.

References
    PyTorch 2.13 torch.nn.attention.varlen; Dao, FlashAttention-2 (2023); Kwon et al.,
    PagedAttention / vLLM (2023); Gemma 2 soft-capping (2024); Xiao et al., attention sinks
    (2023) and gpt-oss learned sinks (2025).
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch

__all__ = ["AuxRequest", "varlen_attn", "varlen_attn_out"]


class AuxRequest(NamedTuple):
    """Which auxiliary outputs to return (PyTorch's ``AuxRequest``): ``lse=True`` adds the LSE."""

    lse: bool = False


# ----------------------------------------------------------------------------- the math

def _visible(l_q: int, l_k: int, left: int, right: int, device) -> torch.Tensor:
    """[L_q, L_k] bool: query row i sees key j (bottom-right aligned window)."""
    i = torch.arange(l_q, device=device)[:, None] + (l_k - l_q)  # the key position row i is aligned with
    j = torch.arange(l_k, device=device)[None, :]
    seen = torch.ones(l_q, l_k, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    return seen


def _attend(q, k, v, *, scale, left, right, softcap, sinks, compute_dtype, q_block=1024):
    """Attention of one sequence.  q [L_q, H_q, D]; k, v [L_k, H_kv, D].

    Returns (o [L_q, H_q, D] in compute_dtype, lse [H_q, L_q] in compute_dtype).  Query
    rows are processed ``q_block`` at a time only to bound the [H, rows, L_k] score matrix.
    """
    l_q, h_q, _ = q.shape
    l_k, h_kv, _ = k.shape
    group = h_q // h_kv
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    k = k.repeat_interleave(group, dim=1)  # [L_k, H_q, D]: query head h reads KV head h // G
    v = v.repeat_interleave(group, dim=1)
    outs, lses = [], []
    for start in range(0, l_q, q_block):
        qb = q[start:start + q_block]                               # [R, H_q, D]
        s = torch.einsum("rhd,khd->hrk", qb, k) * scale             # [H_q, R, L_k]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        seen = _visible(l_q, l_k, left, right, q.device)[start:start + q_block]  # [R, L_k]
        s = s.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                            # [H_q, R]; -inf for a row that sees nothing
        # exp(s - lse) is 0 on hidden keys; a row with lse = -inf would give exp(-inf + inf) = nan,
        # so it subtracts 0 instead and its (all -inf) scores give probabilities 0.  A NaN stays NaN.
        p = torch.exp(s - torch.where(torch.isneginf(lse), 0, lse)[..., None])
        o = torch.einsum("hrk,khd->rhd", p, v)                      # [R, H_q, D]
        if sinks is not None:
            # The sink is one more attention state with no value: (o = 0, lse = sink_h), merged once.
            sink = sinks.to(compute_dtype)[:, None].expand(h_q, s.shape[1])
            o, lse = _merge(o, lse, torch.zeros_like(o), sink)
        outs.append(o)
        lses.append(lse)
    if l_q == 0:
        return q.new_zeros(0, h_q, v.shape[-1]), q.new_zeros(h_q, 0)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def _merge(o_a, lse_a, o_b, lse_b):
    """The exact merge of two attention states over disjoint key sets (o [R, H, D], lse [H, R]):

        m = max(lse_a, lse_b),  w = exp(lse - m),  lse = m + log(w_a + w_b),  o = (w_a o_a + w_b o_b) / (w_a + w_b)

    Subtracting the max keeps the weights in [0, 1].  lse = -inf is the empty state (no keys; its o
    is ignored); lse = +inf takes all the mass (a sink of +inf: out 0, lse +inf); a NaN gives NaN.
    Written so that autograd through it stays finite at every one of these.
    """
    m = torch.maximum(lse_a, lse_b)                                 # NaN if either side is NaN
    m = torch.where(torch.isneginf(m), 0, m)                        # two empty sides: any finite shift

    def weight(lse):                                                # exp(lse - m): 1 for a +inf side, not nan
        return torch.exp(torch.where(torch.isposinf(lse), 0, lse - m))

    w_a, w_b = weight(lse_a), weight(lse_b)
    den = w_a + w_b                                                 # 0 only when both sides are empty
    den_safe = torch.where(den == 0, 1, den)

    def share(w, o):                                                # w o / den, as [R, H, 1] * [R, H, D]
        w = (w / den_safe).transpose(-1, -2)[..., None]
        return w * torch.where(w == 0, 0, o)                        # an empty side's o may hold garbage

    o = share(w_a, o_a) + share(w_b, o_b)
    lse = torch.where(den == 0, float("-inf"), m + torch.log(den_safe))
    return o, lse


# ----------------------------------------------------------------------------- public API

def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                num_splits=None, softcap=0.0, sinks=None, batch_invariant=False, upcast=True):
    """Variable-length (optionally paged) attention; see the module docstring for shapes.

    ``batch_invariant`` names the fast kernel's bitwise contract (module docstring); the
    reference accepts it and computes the same values either way.
    Returns ``out [T_q, H_q, D]``, or ``(out, lse [H_q, T_q])`` when ``return_aux.lse``.
    """
    out, lse = _varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                               window_size=window_size, enable_gqa=enable_gqa, seqused_k=seqused_k,
                               block_table=block_table, num_splits=num_splits, softcap=softcap,
                               sinks=sinks, batch_invariant=batch_invariant, upcast=upcast)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


def varlen_attn_out(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                    scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                    num_splits=None, softcap=0.0, sinks=None, batch_invariant=False, upcast=True):
    """``varlen_attn`` writing into ``out`` (same shape and dtype as ``query``); returns ``out``
    or ``(out, lse)``.  Rows past cu_seq_q[-1] (padding) are left as they were."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    result, lse = _varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                  window_size=window_size, enable_gqa=enable_gqa, seqused_k=seqused_k,
                                  block_table=block_table, num_splits=num_splits, softcap=softcap,
                                  sinks=sinks, batch_invariant=batch_invariant, upcast=upcast, out=out)
    rows = int(cu_seq_q[-1])                                        # validated: <= T_q
    with torch.no_grad():
        out[:rows].copy_(result[:rows])
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


# ----------------------------------------------------------------------------- one sequence at a time

def _varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size,
                    enable_gqa, seqused_k, block_table, num_splits, softcap, sinks, batch_invariant, upcast,
                    out=None):
    max_q, max_k, left, right = _check_meta(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
        enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table, num_splits=num_splits,
        softcap=softcap, sinks=sinks, batch_invariant=batch_invariant, out=out)
    q_lens, k_starts, k_lens = _check_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=seqused_k,
                                             block_table=block_table)
    paged = block_table is not None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks)):
        if paged:
            raise NotImplementedError("varlen_attn with a paged KV cache (block_table) is inference-only, as in "
                                      "PyTorch: call it under torch.no_grad(), or pass packed key/value to train")
        if out is not None:
            raise NotImplementedError("varlen_attn_out is forward-only, as in PyTorch: call it under "
                                      "torch.no_grad(), or use varlen_attn to train")
    t_q, h_q, d = query.shape
    scale = d ** -0.5 if scale is None else float(scale)
    if upcast:
        compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    else:
        compute_dtype = query.dtype
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    o_parts, lse_parts = [], []
    q_start = 0
    for b, l_q in enumerate(q_lens):
        q = query[q_start:q_start + l_q]
        q_start += l_q
        k, v = _gather_keys(key, value, b, paged=paged, k_starts=k_starts, k_lens=k_lens, block_table=block_table)
        o, lse = _attend(q, k, v, scale=scale, left=left, right=right, softcap=float(softcap),
                         sinks=sinks, compute_dtype=compute_dtype)
        o_parts.append(o.to(query.dtype))
        lse_parts.append(lse.to(lse_dtype))
    # Rows past cu_seq_q[-1] (a padded buffer) belong to no sequence: out 0, lse -inf, gradient 0.
    o_parts.append(query.new_zeros(t_q - q_start, h_q, d))
    lse_parts.append(torch.full((h_q, t_q - q_start), float("-inf"), dtype=lse_dtype, device=query.device))
    return torch.cat(o_parts, dim=0), torch.cat(lse_parts, dim=1)


def _gather_keys(key, value, b, *, paged, k_starts, k_lens, block_table):
    """The L_k used keys and values of sequence b, as [L_k, H_kv, D]."""
    length = k_lens[b]
    if not paged:
        start = k_starts[b]
        return key[start:start + length], value[start:start + length]
    page_size = key.shape[1]
    pages = block_table[b, :-(-length // page_size)].long()         # the pages this sequence owns
    k = key[pages].flatten(0, 1)[:length]                           # [pages * page_size, H_kv, D] -> [L_k, ...]
    v = value[pages].flatten(0, 1)[:length]
    return k, v


# ----------------------------------------------------------------------------- input checks
#
# One row per tensor argument (name, shape in the size names of the module docstring, dtype rule),
# checked in order by _check_tensors; then the rules that tie arguments together, the scalars, and
# the values of the index tensors.  fast/paged_varlen_attention.py holds the same code, so both
# files raise the same errors for the same bad inputs.

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


if __name__ == "__main__":
    # A tiny self-check: causal attention of one sequence equals SDPA.
    torch.manual_seed(0)
    q, k, v = (torch.randn(7, 4, 16, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 7], dtype=torch.int32)
    o = varlen_attn(q, k, v, cu, cu, 7, 7, window_size=(-1, 0))
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
    print("max error vs SDPA:", (o - expect).abs().max().item())
    assert math.isclose((o - expect).abs().max().item(), 0.0, abs_tol=1e-12)
