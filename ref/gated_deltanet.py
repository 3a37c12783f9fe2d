"""Gated DeltaNet: the reference (readable PyTorch, the specification).

What it computes
    The gated delta rule of Yang, Kautz & Hatamizadeh (Gated Delta Networks, 2024), the linear
    attention inside Qwen3-Next / Qwen3.5: a [K, V] matrix state per value head that decays by
    exp(g_t), is corrected towards v_t along k_t with step size beta_t, and is read by q_t.
    Two forms of the same function, with fla's API (``chunk_gated_delta_rule`` and
    ``fused_recurrent_gated_delta_rule``), plus the Qwen3.5 ``GatedDeltaNet`` layer around it.

The math (per value head; q, k already scaled / normalized as asked)
    Recurrent form, token by token, state h [K, V]:
        h   = exp(g_t) * h
        u_t = beta_t * (v_t - h^T k_t)              the delta: what h gets wrong about v_t
        h   = h + k_t u_t^T
        o_t = h^T (scale * q_t)

    Chunk form (chunks of C = 64 tokens; S = the state when the chunk starts; b_i = g_1 + ... + g_i
    the within-chunk cumulative gate).  Unrolling the recurrence inside the chunk, the state
    just before token i is updated is  exp(b_i) S + sum_{j<i} exp(b_i - b_j) k_j u_j^T, so
        u_i = beta_i (v_i - exp(b_i) S^T k_i - sum_{j<i} exp(b_i - b_j) (k_i . k_j) u_j).
    All u_i of a chunk solve one unit lower-triangular system (the WY / UT representation):
        (I + A) U = diag(beta) V - diag(beta exp(b)) K S,   A_ij = beta_i exp(b_i - b_j) k_i . k_j  (j < i)
    so with T = (I + A)^-1 (forward substitution, C rows):
        w = T diag(beta exp(b)) K    [C, K],    u = T diag(beta) V    [C, V],    U = u - w S
        o_i = scale * (exp(b_i) q_i^T S + sum_{j<=i} exp(b_i - b_j) (q_i . k_j) U_j)
        S'  = exp(b_C) S + sum_j exp(b_C - b_j) k_j U_j^T                       (next chunk's S)
    Every exponent above is a difference b_i - b_j with j <= i (<= 0 when g <= 0): no
    exp(-b) appears, and masked entries get exponent -inf *before* exp, so no inf * 0.
    Within a chunk everything is batched matmuls; only the state S passes from chunk to chunk.

Tensors (B batch, T tokens, H query/key heads, HV value heads, N sequences)
    q, k            [B, T, H, K]      fp16 / bf16 / fp32 / fp64          value head i reads head i // (HV // H)
    v               [B, T, HV, V]     the dtype of q
    g               [B, T, HV]        float, the log decay (<= 0; positive g is the caller's choice)
    beta            [B, T, HV]        float, the delta-rule step (a sigmoid output in practice)
    initial_state   [N, HV, K, V]     fp32 (fp64 accepted with fp64 inputs); None = zeros
    cu_seqlens      [N + 1] int32 / int64    varlen: B == 1, document n is tokens cu[n]:cu[n+1]
    o               [B, T, HV, V]     the dtype of v
    final_state     [N, HV, K, V]     fp32 (fp64 for fp64 inputs), or None unless output_final_state
    N = B without cu_seqlens.  ``scale`` defaults to K ** -0.5.  ``use_qk_l2norm_in_kernel``
    replaces q and k by x * rsqrt(sum(x^2) + 1e-6) first (fla's l2norm).  ``upcast`` (reference
    only): True computes in fp32 (fp64 for fp64 inputs), False in the input dtype (the parity
    tests' "plain PyTorch in low precision" baseline).

Supported, and what raises
    HV a multiple of H, K <= 256 (the fast kernels' limit, kept here so both files share one
    contract), any V, empty sequences and documents (the state passes through), autograd through
    both forms (the spec of the fast backward).  Bad shapes, dtypes, devices and cu_seqlens raise
    ValueError / TypeError naming the argument; the README's "Known limits" lists the rest.

The layer
    ``GatedDeltaNet`` is Qwen3.5's linear-attention block with HF transformers' parameter names
    (in_proj_qkv -> causal depthwise conv + SiLU, restarting per document -> q, k, v; g =
    -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b); the rule with q/k l2-norm; gated RMSNorm;
    out_proj).  Its kernel functions are constructor arguments, so the fast ones drop in;
    ``GatedDeltaNetCache`` carries the conv tail and the state between calls (prefill, decode).

References
    Yang, Kautz, Hatamizadeh, Gated Delta Networks (ICLR 2025); Yang et al., Parallelizing
    Linear Transformers with the Delta Rule over Sequence Length (NeurIPS 2024, the WY/UT
    chunk form); fla (flash-linear-attention) ``chunk_gated_delta_rule`` /
    ``fused_recurrent_gated_delta_rule``; HF transformers Qwen3.5 ``Qwen3_5GatedDeltaNet``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "GatedDeltaNet", "GatedDeltaNetCache"]

CHUNK = 64          # tokens per chunk in the chunk form (fla's and the fast kernels' chunk)
MAX_HEAD_DIM_K = 256
L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------- recurrent form

def _recurrent(q, k, v, g, beta, h):
    """The recurrence, one token at a time.  q, k [B, T, HV, K]; v [B, T, HV, V]; g, beta [B, T, HV];
    h [B, HV, K, V].  Returns (o [B, T, HV, V], h)."""
    outs = []
    for t in range(q.shape[1]):
        h = h * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], h))   # [B, HV, V]
        h = h + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, h


# ----------------------------------------------------------------------------- chunk form

# The steps below mirror the fast file's kernels one to one (cumsum, kkt + solve, w/u,
# state pass + output), so each intermediate can be compared.  Tensors are chunked as
# [B, HV, NC, C, D]: batch, value head, chunk, position in the chunk, feature.

def _chunk_local_cumsum(g):
    """b_i = g_1 + ... + g_i inside each chunk.  g [B, HV, NC, C] -> [B, HV, NC, C]."""
    return g.cumsum(-1)


def _decay(gc, *, strict: bool):
    """[.., C, C]: exp(b_i - b_j) where j < i (strict) or j <= i, else 0; masked before exp."""
    c = gc.shape[-1]
    i = torch.arange(c, device=gc.device)
    keep = (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])
    diff = gc[..., :, None] - gc[..., None, :]
    return torch.exp(torch.where(keep, diff, torch.full_like(diff, float("-inf"))))


def _wy_inverse(k, gc, beta):
    """T = (I + A)^-1 with A_ij = beta_i exp(b_i - b_j) k_i . k_j for j < i.  [B, HV, NC, C, C].

    Forward substitution: row i of T is e_i - sum_{j<i} A_ij T_j, and rows j < i are final
    when row i is computed (C steps, each vectorized over every chunk and head)."""
    a = beta[..., :, None] * (k @ k.transpose(-1, -2)) * _decay(gc, strict=True)   # strictly lower
    c = a.shape[-1]
    eye = torch.eye(c, dtype=a.dtype, device=a.device)
    rows = torch.arange(c, device=a.device)[:, None]
    t_mat = eye.expand(a.shape)
    for i in range(1, c):
        row = eye[i] - a[..., i:i + 1, :] @ t_mat                         # [.., 1, C]
        t_mat = torch.where(rows == i, row, t_mat)
    return t_mat


def _wy_w_u(t_mat, k, v, gc, beta):
    """w = T diag(beta exp(b)) K  [.., C, K];  u = T diag(beta) V  [.., C, V]."""
    w = t_mat @ (k * (beta * gc.exp())[..., None])
    u = t_mat @ (v * beta[..., None])
    return w, u


def _chunk_state_pass(q, k, w, u, gc, h):
    """The only sequential part: carry the state S through the chunks, producing each chunk's
    output.  q, k, w [B, HV, NC, C, K]; u [B, HV, NC, C, V]; gc [B, HV, NC, C]; h [B, HV, K, V]."""
    q_gated = q * gc.exp()[..., None]                          # exp(b_i) q_i: reads the chunk-start state
    scores = (q @ k.transpose(-1, -2)) * _decay(gc, strict=False)   # [.., C, C] causal within the chunk
    g_last = gc[..., -1]                                       # [B, HV, NC]: b_C, the whole chunk's decay
    k_to_end = k * torch.exp(g_last[..., None] - gc)[..., None]   # exp(b_C - b_j) k_j
    outs = []
    for c in range(q.shape[2]):
        u_c = u[:, :, c] - w[:, :, c] @ h                      # U = u - w S  [B, HV, C, V]
        outs.append(q_gated[:, :, c] @ h + scores[:, :, c] @ u_c)
        h = h * g_last[:, :, c].exp()[..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u_c
    return torch.stack(outs, dim=2), h                         # [B, HV, NC, C, V]


def _chunked(x, nc):
    """[B, T_pad, HV, ...] -> [B, HV, NC, C, ...]."""
    b, _, hv = x.shape[:3]
    x = x.reshape(b, nc, CHUNK, hv, *x.shape[3:])
    return x.movedim(3, 1)


def _chunk(q, k, v, g, beta, h):
    """The chunk form; same arguments and result as ``_recurrent``."""
    b, t, hv, _ = q.shape
    if t == 0:
        return v.new_zeros(v.shape), h
    pad = (-t) % CHUNK
    # Padding tokens have k = v = beta = g = 0: they leave the state untouched (u = 0, no decay).
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    nc = (t + pad) // CHUNK
    q, k, v, g, beta = (_chunked(x, nc) for x in (q, k, v, g, beta))   # [B, HV, NC, C, ...]
    gc = _chunk_local_cumsum(g)
    t_mat = _wy_inverse(k, gc, beta)
    w, u = _wy_w_u(t_mat, k, v, gc, beta)
    o, h = _chunk_state_pass(q, k, w, u, gc, h)
    o = o.movedim(1, 3).reshape(b, t + pad, hv, -1)[:, :t]   # [B, HV, NC, C, V] -> [B, T, HV, V]
    return o, h


# ----------------------------------------------------------------------------- public API

def _forward(core, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
             use_qk_l2norm_in_kernel, upcast):
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    n = _check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                      float_dtypes=floats)
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    scale = dk ** -0.5 if scale is None else float(scale)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    dtype = wide if upcast else q.dtype
    q, k, v_c, g, beta = _prepare(q, k, v, g, beta, scale=scale, use_l2norm=use_qk_l2norm_in_kernel, dtype=dtype)
    if initial_state is None:
        h0 = torch.zeros(n, hv, dk, dv, dtype=dtype, device=q.device)
    else:
        h0 = initial_state.to(dtype)
    if cu_seqlens is None:
        o, ht = core(q, k, v_c, g, beta, h0)
    else:
        cu = cu_seqlens.tolist()
        _check_cu_seqlens_values(cu, t)
        outs, states = [], []
        for i in range(n):   # one document at a time: nothing crosses a document boundary
            sl = slice(cu[i], cu[i + 1])
            o_i, h_i = core(q[:, sl], k[:, sl], v_c[:, sl], g[:, sl], beta[:, sl], h0[i:i + 1])
            outs.append(o_i)
            states.append(h_i)
        o = torch.cat(outs, dim=1) if outs else v_c.new_zeros(v_c.shape)
        ht = torch.cat(states, dim=0) if states else h0
    return o.to(v.dtype), (ht.to(wide) if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, upcast=True):
    """The gated delta rule in chunk form (chunks of 64 tokens); see the module docstring.

    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``."""
    return _forward(_chunk, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, upcast=upcast)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                     upcast=True):
    """The gated delta rule token by token (the decode path); same arguments and result as
    ``chunk_gated_delta_rule``."""
    return _forward(_recurrent, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, upcast=upcast)


# ----------------------------------------------------------------------------- shared pieces

def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm: x * rsqrt(sum(x^2) + 1e-6) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, *, scale, use_l2norm, dtype):
    """Cast to the compute dtype, l2-normalize, fold the scale into q, give q/k the HV value heads."""
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    group = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(group, dim=2)   # [B, T, HV, K]: value head i reads q/k head i // group
    k = k.repeat_interleave(group, dim=2)
    return q, k, v, g, beta


# ----------------------------------------------------------------------------- the layer

class GatedDeltaNetCache:
    """What one ``GatedDeltaNet`` layer carries between calls for N sequences.

    ``conv_state [N, conv_dim, W - 1]``: the last W - 1 conv inputs of each sequence (zeros
    before its start), in the layer's dtype.  ``recurrent_state [N, HV, K, V]`` fp32.  A fresh
    cache is empty (both None); a call with it starts from zero state and fills it."""

    def __init__(self, conv_state=None, recurrent_state=None):
        self.conv_state = conv_state
        self.recurrent_state = recurrent_state

    @property
    def is_empty(self) -> bool:
        return self.recurrent_state is None


class _GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim, then times silu(gate) (Qwen3.5's norm, fp32 inside)."""

    def __init__(self, dim, eps, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x, gate):
        wide = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(wide)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(x.dtype)
        return (y * F.silu(gate.to(wide))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's Gated DeltaNet block: ``forward(hidden_states [B, T, D], *, cu_seqlens=None,
    cache=None) -> [B, T, D]``.

    ``chunk_fn`` / ``recurrent_fn`` have the signature of this file's ``chunk_gated_delta_rule``
    / ``fused_recurrent_gated_delta_rule`` (pass the fast file's to run on Triton kernels).
    The recurrent one runs decode steps (a cache holding state, one token per sequence, no
    cu_seqlens); the chunk one runs everything else (prefill, varlen, continuation).
    With ``cu_seqlens`` (B == 1), the conv and the recurrence restart at every document.
    With a ``cache``, the call continues from its state (if any) and leaves the new state in it.
    """

    def __init__(self, hidden_size, *, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                 conv_kernel_size=4, norm_eps=1e-6, chunk_fn=chunk_gated_delta_rule,
                 recurrent_fn=fused_recurrent_gated_delta_rule, device=None, dtype=None):
        super().__init__()
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}")
        self.hidden_size, self.conv_kernel_size = hidden_size, conv_kernel_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.chunk_fn, self.recurrent_fn = chunk_fn, recurrent_fn
        kw = dict(device=device, dtype=dtype)
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False, **kw)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False, **kw)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False, **kw)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False, **kw)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim,
                                bias=False, padding=conv_kernel_size - 1, **kw)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **kw))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **kw).uniform_(1, 16).log())
        self.norm = _GatedRMSNorm(head_v_dim, norm_eps, **kw)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **kw)

    def _conv(self, x, prefix, lengths):
        """Depthwise causal conv + SiLU per sequence.  x [B, T, C]; prefix [N, C, W-1] or None.
        Returns (out [B, T, C], tail [N, C, W-1]: the last W-1 inputs, the next call's prefix)."""
        w = self.conv1d.weight                                          # [C, 1, W]
        pieces = [x.transpose(1, 2)] if lengths is None else list(x[0].split(lengths, dim=0))
        if lengths is not None:
            pieces = [p.t()[None] for p in pieces]                      # each [1, C, L_n]
        outs, tails = [], []
        for n, p in enumerate(pieces):
            rows = slice(None) if lengths is None else slice(n, n + 1)
            left = (prefix[rows] if prefix is not None
                    else p.new_zeros(p.shape[0], p.shape[1], self.conv_kernel_size - 1))
            full = torch.cat([left.to(p.dtype), p], dim=-1)             # [b, C, W-1+L]
            if p.shape[-1]:                                             # (an empty document has no output)
                outs.append(F.silu(F.conv1d(full, w, groups=self.conv_dim)))   # [b, C, L]
            tails.append(full[..., full.shape[-1] - (self.conv_kernel_size - 1):])
        out = (torch.cat(outs, dim=-1) if outs else x.new_zeros(x.shape[0], x.shape[2], 0)).transpose(1, 2)
        return out, torch.cat(tails, dim=0)

    def forward(self, hidden_states, *, cu_seqlens=None, cache=None):
        b, t, _ = hidden_states.shape
        lengths = None
        if cu_seqlens is not None:
            if b != 1:
                raise ValueError(f"cu_seqlens requires batch size B == 1, got B={b}")
            lengths = cu_seqlens.diff().tolist()
        n = b if lengths is None else len(lengths)
        has_state = cache is not None and not cache.is_empty
        if has_state and cache.recurrent_state.shape[0] != n:
            raise ValueError(f"cache holds {cache.recurrent_state.shape[0]} sequences, this call has {n}")
        qkv, tail = self._conv(self.in_proj_qkv(hidden_states), cache.conv_state if has_state else None, lengths)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)
        z = self.in_proj_z(hidden_states).reshape(b, t, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        wide = torch.promote_types(hidden_states.dtype, torch.float32)
        a = self.in_proj_a(hidden_states).to(wide)
        g = -self.A_log.to(wide).exp() * F.softplus(a + self.dt_bias.to(wide))   # [B, T, HV], <= 0
        decode = has_state and t == 1 and cu_seqlens is None
        fn = self.recurrent_fn if decode else self.chunk_fn
        o, final = fn(q, k, v, g, beta, initial_state=cache.recurrent_state if has_state else None,
                      output_final_state=cache is not None, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        if cache is not None:
            cache.conv_state, cache.recurrent_state = tail, final
        o = self.norm(o, z)                                             # [B, T, HV, V]
        return self.out_proj(o.reshape(b, t, self.value_dim))


# ----------------------------------------------------------------------------- input checks

def _check_inputs(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, float_dtypes):
    """Shape / dtype / device checks; returns N (number of sequences).  No device sync here."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in float_dtypes:
            raise TypeError(f"{name} must have a dtype in {sorted(str(d) for d in float_dtypes)}, got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [B, T, H, K], got {tuple(k.shape)}")
    b, t, h, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t):
        raise ValueError(f"v must be [B={b}, T={t}, HV, V], got shape {tuple(v.shape)}")
    hv = v.shape[2]
    if h == 0 or hv % h != 0:
        raise ValueError(f"v's head count HV={hv} must be a multiple of q/k's head count H={h}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"{name} must be [B, T, HV] = {(b, t, hv)}, got shape {tuple(x.shape)}")
    if dk > MAX_HEAD_DIM_K:
        raise ValueError(f"head dim K = {dk} is not supported: K must be <= {MAX_HEAD_DIM_K}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    n = b
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be an int32 or int64 torch.Tensor, got "
                            f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be [N + 1] with N >= 0, got shape {tuple(cu_seqlens.shape)}")
        if b != 1:
            raise ValueError(f"cu_seqlens requires batch size B == 1 (documents packed along T), got B={b}")
        n = cu_seqlens.numel() - 1
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        state_dtypes = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        if initial_state.dtype not in state_dtypes:
            raise TypeError(f"initial_state must be fp32, got {initial_state.dtype}")
        if initial_state.shape != (n, hv, dk, v.shape[3]):
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(n, hv, dk, v.shape[3])}, "
                             f"got shape {tuple(initial_state.shape)}")
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
             ("cu_seqlens", cu_seqlens)]
    devices = {name: x.device for name, x in named if x is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got mixed devices {devices}")
    return n


def _check_cu_seqlens_values(cu: list[int], t: int):
    """Value checks of cu_seqlens (the caller pays one small device-to-host copy)."""
    if cu[0] != 0 or any(y < x for x, y in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
    if cu[-1] != t:
        raise ValueError(f"cu_seqlens[-1] must equal T = q.shape[1] = {t}, got {cu[-1]}")


if __name__ == "__main__":
    # A tiny self-check: the chunk form equals the recurrence.
    gen = torch.Generator().manual_seed(0)
    b, t, h, hv, dk, dv = 2, 75, 2, 4, 16, 8
    q, k = (torch.randn(b, t, h, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(b, t, hv, generator=gen, dtype=torch.float64))
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, h1 = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o2, h2 = fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    err = max((o1 - o2).abs().max().item(), (h1 - h2).abs().max().item())
    print("chunk vs recurrent max error:", err)
    assert err < 1e-12
