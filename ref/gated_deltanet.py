"""Gated DeltaNet: the reference (readable PyTorch, the specification).

Example (runs as written next to this file; TRITON_INTERPRET=1 runs fast/'s kernels on a CPU)::

    # gated_deltanet.py, copied next to this script
    import torch
    import torch.nn.functional as F
    from gated_deltanet import chunk_gated_delta_rule

    dev = "cuda" if torch.cuda.is_available() else "cpu"     # fast/ on a CPU: TRITON_INTERPRET=1 first
    B, T, H, K, V = 1, 70, 2, 32, 32
    q, k = (torch.randn(B, T, H, K, device=dev) for _ in range(2))
    v = torch.randn(B, T, H, V, device=dev)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev))              # log decay <= 0
    beta = torch.rand(B, T, H, device=dev)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    print(o.shape, state.shape)                                      # [1, 70, 2, 32], [1, 2, 32, 32]

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
    Every exponent above is b_i - b_j = g_{j+1} + ... + g_i with j <= i (<= 0 when g <= 0), summed
    over (j, i] itself, not subtracted: b reaches 64 |g|, and exp would carry its fp32 rounding into
    every decay (see _GateSums).  No exp(-b) appears; masked entries get exponent -inf *before* exp
    (no inf * 0); a hard reset g_t = -inf (the state forgets) makes every exponent across t -inf.
    Within a chunk everything is batched matmuls; only the state S passes from chunk to chunk.

A row inside a partial chunk (what the batch-invariant mode builds on)
    Row i of T, w, u, U and o depends only on tokens 0..i of its chunk: A is strictly lower
    triangular, so T = (I + A)^-1 is unit lower triangular and its row i (forward substitution,
    rows in order) reads rows 0..i-1 of itself and row i of A; w_i, u_i read T_i and tokens j <= i;
    U_i = u_i - w_i S; o_i reads U_j for j <= i (pair decays are 0 above the diagonal).  So the chunk
    form run on the chunk's first m tokens, S the state at the chunk's start, gives rows 0..m-1 what
    the whole chunk gives them; with the rest *absent* (padded with q = k = v = 0, beta = 0, g = 0, or
    masked to those values), every term an absent token adds to a present row is an exact zero
    (0 * finite: A's entries, decays <= 1, normalized keys are finite), so in floating point the rows
    keep the same bits too, provided every product and sum runs over the same tile shape with the row
    at the same slot (the position in its chunk) and the same order (for a CPU BLAS or an MMA, an
    added exact zero moves no bits; only an exact-zero result's sign can differ).  The state
    advances only at a chunk's end, by S' above, which the whole chunk's tokens determine.  Hence the
    batch-invariant mode (``GatedDeltaNet.set_batch_invariant``): chunks start at absolute positions
    (multiples of 64 from a sequence's start) in every phase, and a call continuing a sequence runs
    the chunk form over [the current chunk's tokens so far, from the cache; the new tokens] from the
    state at that chunk's start:
        a decode step at position p (chunk p // 64, row i = p % 64)
            o_p = row i of the chunk form on the chunk's tokens 0..i, from S_(p // 64)
            S_(p // 64 + 1) = S' of that chunk when i = 63 (else S is kept, the token buffered)
        a prefill / trainer call    whole chunks from the state at the first one's start; the last,
                                    partial chunk's tokens stay buffered with its start state.
    A trainer's one call over a document, a prefill cut anywhere (pages, chunk budgets, prefix-cache
    hits) and decode steps then give a token the same bits (``_aligned_chunks`` states it; the
    decode step is ``_aligned_decode_step``).

fla's options (fla 0.6.0's signature, positional order included)
    use_gate_in_kernel     g is the gate's raw input a:  g = -exp(A_log) * softplus(a + dt_bias)
    use_beta_sigmoid_in_kernel   beta is a logit:  beta = sigmoid(beta);  with allow_neg_eigval
                           beta = 2 sigmoid(beta) in (0, 2) (the transition I - beta k k^T may then
                           have negative eigenvalues)
    state_v_first          initial and final states stored [N, HV, V, K] (vLLM / SGLang / FlashInfer
                           state pools) instead of [N, HV, K, V]
    cu_seqlens_cpu         cu_seqlens' values on the host: no device-to-host copy to read them
    The recurrent form's g = None is no decay and beta = None is beta = 1.  Extra keyword
    arguments are ignored, as fla ignores them (HF's layers pass max_length_q, position_ids, ...).
    Ours: ``batch_invariant`` (chunk form; the fast kernels' fixed tiles, see the fast file).

Tensors (B batch, T tokens, H query/key heads, HV value heads, N sequences)
    q, k            [B, T, H, K]      fp16 / bf16 / fp32 / fp64          value head i reads head i // (HV // H)
    v               [B, T, HV, V]     any of those (q and k share one)
    g               [B, T, HV]        float, the log decay (<= 0; positive g is the caller's choice)
    beta            [B, T, HV]        float, the delta-rule step (a sigmoid output in practice)
    A_log, dt_bias  [HV]              float (use_gate_in_kernel)
    initial_state   [N, HV, K, V]     any float dtype ([N, HV, V, K] with state_v_first); None = zeros
    cu_seqlens      [N + 1] int32 / int64    varlen: B == 1, document n is tokens cu[n]:cu[n+1]
    o               [B, T, HV, V]     the dtype of v
    final_state     [N, HV, K, V]     fp32 (fp64 for fp64 inputs), or None unless output_final_state
    N = B without cu_seqlens.  ``scale`` defaults to K ** -0.5.  ``use_qk_l2norm_in_kernel``
    replaces q and k by x * rsqrt(sum(x^2) + 1e-6) first (fla's l2norm).  ``upcast`` (reference
    only): True computes in fp32 (fp64 for fp64 inputs), False in v's dtype (the parity tests'
    "plain PyTorch in low precision" baseline).

Supported, and what raises
    HV a multiple of H, K <= 256 (the fast kernels' limit, kept here so both files share one
    contract), any V, empty batches, sequences and documents (the state passes through), autograd
    through both forms (the spec of the fast backward; the chunk form's dg is summed without
    cancellation, see _GateSums).  gk / gv and cp_context raise NotImplementedError; chunk_size other
    than 64 raises ValueError; bad shapes, dtypes, devices and cu_seqlens raise ValueError / TypeError
    naming the argument (batch_invariant not a bool: TypeError); the layer in the batch-invariant mode
    refuses a cache filled outside it (ValueError).  The README's "Known limits" lists the rest.

The layer
    ``GatedDeltaNet`` is Qwen3.5's linear-attention block with HF transformers' parameter names
    (in_proj_qkv -> causal depthwise conv + SiLU, restarting per document -> q, k, v; g =
    -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b); the rule with q/k l2-norm; gated RMSNorm;
    out_proj).  Its kernel functions are constructor arguments, so the fast ones drop in;
    ``GatedDeltaNetCache`` carries the conv tail and the state between calls (prefill, decode).
    ``set_batch_invariant(linear)`` switches it to batch-invariant numerics (a token's output bit
    for bit the same in any batch, packing or prefill/decode split, given a row-invariant matmul
    ``linear`` and a ``chunk_fn`` that computes a chunk's row alike in any call): the chunk form in
    every call, chunks at absolute positions, the cache holding the current chunk's start state and
    tokens (above, "A row inside a partial chunk"): fast/decoder_lm.py's bitwise on-policy mode.

References
    Yang, Kautz, Hatamizadeh, Gated Delta Networks (ICLR 2025); Yang et al., Parallelizing
    Linear Transformers with the Delta Rule over Sequence Length (NeurIPS 2024, the WY/UT
    chunk form); fla (flash-linear-attention) ``chunk_gated_delta_rule`` /
    ``fused_recurrent_gated_delta_rule``; HF transformers Qwen3.5 ``Qwen3_5GatedDeltaNet``.
"""
from __future__ import annotations

import itertools
import warnings

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
# The steps below mirror the fast file's kernels one to one (gate sums, kkt + solve, w/u, state
# pass + output; the kernels subtract cumulative gates, fla's way), so each intermediate can be compared.
# Tensors are chunked as [B, HV, NC, C, D]: batch, value head, chunk, position in the chunk, feature.

class _GateSums(torch.autograd.Function):
    """D [.., C + 1, C + 1] from g [.., C]: D_ij = g_{j+1} + ... + g_i for i >= j, the log decay from
    just after position j to position i (position 0 is the chunk's start, 1..C its tokens); -inf
    for j > i and across a hard reset (g = -inf anywhere in (j, i]).
    Forward: each D_ij summed over its own stretch (j, i] (a running sum down column j), not as
    b_i - b_j: b grows to ~64 |g| in a chunk (4480 at g ~ -70), where fp32 rounds to 2.4e-4, and
    exp turns that absolute error into a relative error of every decay (dg's rms error 1.5e-4);
    a direct sum is rounded at the scale of D itself (|D| < 104 wherever exp(D) > 0 in fp32).
    A reset's -inf makes the rest of its column -inf; nothing is subtracted, so no -inf - (-inf).
    Backward, without cancellation: g_l enters exactly the D_ij with j < l <= i, so
        dg_l = sum_{i >= l > j} dD_ij.
    (Autograd through b_i - b_j would send +dD to every g up to i and -dD to every g up to j: terms
    that cancel in exact arithmetic, but under strong decay their rounding leaves dg few digits.)"""

    @staticmethod
    def forward(ctx, g):
        g0 = F.pad(g, (1, 0))                                  # [.., C + 1]: position 0 = chunk start
        i = torch.arange(g0.shape[-1], device=g.device)
        after = i[:, None] > i[None, :]                        # [l, j]: g_l is in D_ij for every i >= l
        steps = torch.where(after, g0[..., :, None], torch.zeros_like(g0[..., :, None]))   # [.., l, j]
        d = steps.cumsum(-2)                                   # [.., i, j] = g_{j+1} + ... + g_i (i >= j)
        d = torch.where(i[:, None] >= i[None, :], d, torch.full_like(d, float("-inf")))
        # the pairs that carry a gradient: i >= j with no reset in (j, i] (where D is finite or NaN)
        ctx.save_for_backward(~torch.isneginf(d))
        return d

    @staticmethod
    def backward(ctx, dd):
        (valid,) = ctx.saved_tensors
        dd = torch.where(valid, dd, torch.zeros_like(dd))
        rows_below = dd.flip(-2).cumsum(-2).flip(-2)           # [l, j] = sum_{i >= l} dD_ij
        i = torch.arange(dd.shape[-1], device=dd.device)
        dg0 = torch.where(i[None, :] < i[:, None], rows_below, torch.zeros_like(rows_below)).sum(-1)   # j < l
        return dg0[..., 1:]


def _decays(g):
    """The chunk form's decays from D (see _GateSums), each an exp of a masked exponent:
    from the chunk start to token i exp(b_i) [.., C]; token j to token i >= j exp(b_i - b_j)
    [.., C, C] (0 above the diagonal); token j to the chunk end exp(b_C - b_j) [.., C]; the whole
    chunk exp(b_C) [..]."""
    d = _GateSums.apply(g)
    return d[..., 1:, 0].exp(), d[..., 1:, 1:].exp(), d[..., -1, 1:].exp(), d[..., -1, 0].exp()


def _wy_inverse(k, pair_decay, beta):
    """T = (I + A)^-1 with A_ij = beta_i exp(b_i - b_j) k_i . k_j for j < i.  [B, HV, NC, C, C].

    Forward substitution: row i of T is e_i - sum_{j<i} A_ij T_j, and rows j < i are final
    when row i is computed (C steps, each vectorized over every chunk and head)."""
    a = beta[..., :, None] * (k @ k.transpose(-1, -2)) * pair_decay.tril(-1)   # strictly lower
    c = a.shape[-1]
    eye = torch.eye(c, dtype=a.dtype, device=a.device)
    rows = torch.arange(c, device=a.device)[:, None]
    t_mat = eye.expand(a.shape)
    for i in range(1, c):
        row = eye[i] - a[..., i:i + 1, :] @ t_mat                         # [.., 1, C]
        t_mat = torch.where(rows == i, row, t_mat)
    return t_mat


def _wy_w_u(t_mat, k, v, start_decay, beta):
    """w = T diag(beta exp(b)) K  [.., C, K];  u = T diag(beta) V  [.., C, V]."""
    w = t_mat @ (k * (beta * start_decay)[..., None])
    u = t_mat @ (v * beta[..., None])
    return w, u


def _chunk_state_pass(q, k, w, u, start_decay, pair_decay, end_decay, chunk_decay, h):
    """The only sequential part: carry the state S through the chunks, producing each chunk's
    output.  q, k, w [B, HV, NC, C, K]; u [B, HV, NC, C, V]; decays from _decays; h [B, HV, K, V]."""
    q_gated = q * start_decay[..., None]                       # exp(b_i) q_i: reads the chunk-start state
    scores = (q @ k.transpose(-1, -2)) * pair_decay            # [.., C, C] causal within the chunk
    k_to_end = k * end_decay[..., None]                        # exp(b_C - b_j) k_j
    outs = []
    for c in range(q.shape[2]):
        u_c = u[:, :, c] - w[:, :, c] @ h                      # U = u - w S  [B, HV, C, V]
        outs.append(q_gated[:, :, c] @ h + scores[:, :, c] @ u_c)
        h = h * chunk_decay[:, :, c, None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u_c
    return torch.stack(outs, dim=2), h                         # [B, HV, NC, C, V]


def _chunked(x, nc):
    """[B, T_pad, HV, ...] -> [B, HV, NC, C, ...]."""
    b, _, hv = x.shape[:3]
    x = x.reshape(b, nc, CHUNK, hv, *x.shape[3:])
    return x.movedim(3, 1)


def _chunk(q, k, v, g, beta, h):
    """The chunk form; same arguments and result as ``_recurrent``."""
    b, t, hv, dv = v.shape
    if t == 0:
        return v.new_zeros(v.shape), h
    pad = (-t) % CHUNK
    # Padding tokens have k = v = beta = g = 0: they leave the state untouched (u = 0, no decay).
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    nc = (t + pad) // CHUNK
    q, k, v, g, beta = (_chunked(x, nc) for x in (q, k, v, g, beta))   # [B, HV, NC, C, ...]
    start_decay, pair_decay, end_decay, chunk_decay = _decays(g)
    t_mat = _wy_inverse(k, pair_decay, beta)
    w, u = _wy_w_u(t_mat, k, v, start_decay, beta)
    o, h = _chunk_state_pass(q, k, w, u, start_decay, pair_decay, end_decay, chunk_decay, h)
    o = o.movedim(1, 3).reshape(b, t + pad, hv, dv)[:, :t]   # [B, HV, NC, C, V] -> [B, T, HV, V]
    return o, h


# ----------------------------------------------------------------------------- public API

def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, use_gate_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64,
                           batch_invariant=False, upcast=True, **kwargs):
    """The gated delta rule in chunk form (chunks of 64 tokens), with fla 0.6.0's signature; see the
    module docstring.  Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``.
    ``batch_invariant`` (the fast file's keyword, checked here): this form is batch invariant as
    written (every chunk padded to 64 rows: each product has one shape, a row one slot, whatever the
    call), so it computes the same either way."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    if g is None or beta is None:
        raise TypeError("chunk_gated_delta_rule needs g and beta (only the recurrent form has defaults)")
    state_v_first = _fla_extras(kwargs, state_v_first)
    return _forward(_chunk, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                    state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                    chunk_indices=chunk_indices, cp_context=cp_context, use_gate_in_kernel=use_gate_in_kernel,
                    A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, upcast=upcast)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, cu_seqlens_cpu=None, upcast=True, **kwargs):
    """The gated delta rule token by token (the decode path), with fla 0.6.0's signature: g = None
    means no decay, beta = None means beta = 1.  Returns what ``chunk_gated_delta_rule`` returns."""
    state_v_first = _fla_extras(kwargs, state_v_first)
    return _forward(_recurrent, q, k, v, g, beta, gk=gk, gv=gv, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                    state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                    use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, upcast=upcast)


def _forward(core, q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
             use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
             use_gate_in_kernel, A_log, dt_bias, upcast, chunk_indices=None, cp_context=None, chunk_size=CHUNK,
             gk=None, gv=None):
    """Both forms: check, apply the in-kernel options (gate, beta sigmoid, l2norm, scale), then run
    ``core`` on each sequence of the batch, or on each document of a varlen batch."""
    _check_options(gk=gk, gv=gv, cp_context=cp_context, chunk_size=chunk_size, g=g,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log)
    if not use_gate_in_kernel:
        A_log = dt_bias = None                                 # fla ignores them then
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    n = _check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state, state_v_first=state_v_first,
                      cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                      A_log=A_log, dt_bias=dt_bias, float_dtypes=floats)
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    scale = dk ** -0.5 if scale is None else float(scale)
    wide = torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32
    dtype = wide if upcast else v.dtype
    g = torch.zeros(b, t, hv, dtype=dtype, device=v.device) if g is None else g.to(dtype)
    beta = torch.ones(b, t, hv, dtype=dtype, device=v.device) if beta is None else beta.to(dtype)
    if use_gate_in_kernel:                                     # g is the gate's raw input
        g = -A_log.to(dtype).exp() * F.softplus(g + (dt_bias.to(dtype) if dt_bias is not None else 0))
    if use_beta_sigmoid_in_kernel:                             # beta is a logit; allow_neg_eigval: beta in (0, 2)
        beta = beta.sigmoid() * (2 if allow_neg_eigval else 1)
    q, k, v_c = _prepare(q, k, v, scale=scale, use_l2norm=use_qk_l2norm_in_kernel, dtype=dtype)
    if initial_state is None:
        h0 = torch.zeros(n, hv, dk, dv, dtype=dtype, device=v.device)
    else:
        h0 = (initial_state.transpose(-1, -2) if state_v_first else initial_state).to(dtype)   # [N, HV, K, V]
    if cu_seqlens is None:
        o, ht = core(q, k, v_c, g, beta, h0)
    else:
        cu = _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, chunk_indices, t)
        outs, states = [], []
        for i in range(n):   # one document at a time: nothing crosses a document boundary
            sl = slice(cu[i], cu[i + 1])
            o_i, h_i = core(q[:, sl], k[:, sl], v_c[:, sl], g[:, sl], beta[:, sl], h0[i:i + 1])
            outs.append(o_i)
            states.append(h_i)
        o = torch.cat(outs, dim=1) if outs else v_c.new_zeros(v_c.shape)
        ht = torch.cat(states, dim=0) if states else h0
    if not output_final_state:
        return o.to(v.dtype), None
    ht = ht.to(wide)
    return o.to(v.dtype), (ht.transpose(-1, -2).contiguous() if state_v_first else ht)


# ----------------------------------------------------------------------------- shared pieces

def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm: x * rsqrt(sum(x^2) + 1e-6) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, *, scale, use_l2norm, dtype):
    """Cast to the compute dtype, l2-normalize, fold the scale into q, give q/k the HV value heads."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if use_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    group = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(group, dim=2)   # [B, T, HV, K]: value head i reads q/k head i // group
    k = k.repeat_interleave(group, dim=2)
    return q, k, v


# ----------------------------------------------------------------------------- the layer

class GatedDeltaNetCache:
    """What one ``GatedDeltaNet`` layer carries between calls for N sequences.

    ``conv_state [N, conv_dim, W - 1]``: the last W - 1 conv inputs of each sequence (zeros
    before its start), in the layer's dtype.  ``recurrent_state [N, HV, K, V]`` fp32 (fp64 for an fp64
    layer): the state after the sequence's last token; in the batch-invariant mode, the state at the
    start of its current chunk (the last multiple of 64 tokens), with that chunk's tokens so far in
    ``chunk_qkv [N, 63, conv_dim]`` (the conv output, the layer's dtype), ``chunk_g [N, 63, HV]`` (fp32)
    and ``chunk_beta [N, 63, HV]`` (the layer's dtype): ``chunk_len [N]`` int64 rows of each, the rest
    zeros (a fixed capacity of 63 rows, so an engine pools and checkpoints them per slot like the
    state).  A fresh cache is empty (all None); a call with it starts from zero state and fills it;
    an all-zero cache (an engine's fresh slot) is a sequence at position 0 too."""

    def __init__(self, conv_state=None, recurrent_state=None, chunk_qkv=None, chunk_g=None, chunk_beta=None,
                 chunk_len=None):
        self.conv_state = conv_state
        self.recurrent_state = recurrent_state
        self.chunk_qkv, self.chunk_g, self.chunk_beta, self.chunk_len = chunk_qkv, chunk_g, chunk_beta, chunk_len

    @property
    def is_empty(self) -> bool:
        return self.recurrent_state is None


class _GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim, then times silu(gate) (Qwen3.5's norm, fp32 inside).  ``linear``
    (batch-invariant mode): the mean of squares as a product with a ones vector through it, and the
    composed SiLU."""

    def __init__(self, dim, eps, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x, gate, linear=None):
        wide = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(wide)
        if linear is None:
            mean_sq, act = xf.pow(2).mean(-1, keepdim=True), F.silu(gate.to(wide))
        else:
            ones = torch.ones(1, xf.shape[-1], dtype=wide, device=xf.device)
            mean_sq, act = linear(xf * xf, ones) / xf.shape[-1], _silu(gate.to(wide))
        xf = xf * torch.rsqrt(mean_sq + self.eps)
        y = self.weight * xf.to(x.dtype)
        return (y * act).to(x.dtype)


# Batch-invariant mode's activations: composed from exp / log1p and IEEE arithmetic, because torch's CPU
# kernels for silu, sigmoid and softplus round the elements of a vector loop's tail (a position that
# depends on the tensor's size) through another formula, while exp and log1p use one vector formula for
# every element.  exp's argument is clamped so that neither a value nor a gradient overflows.

def _sigmoid(x):
    return 1 / (1 + torch.exp(-x.clamp(min=-80)))


def _silu(x):
    return x * _sigmoid(x)


def _softplus(x):
    """log(1 + exp(x)), and x itself above 20 (torch's threshold)."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


# Without gradients (an engine), the layer continues a cache through the recurrent form when no sequence brings
# more tokens than this (a speculative verification, a short prefill piece): the chunk form would pad each to a
# whole chunk.  (With gradients only decode steps do: the chunk form's backward is the more accurate one.)
RECURRENT_MAX_TOKENS = 16


class GatedDeltaNet(nn.Module):
    """Qwen3.5's Gated DeltaNet block: ``forward(hidden_states [B, T, D], *, cu_seqlens=None,
    cache=None) -> [B, T, D]``.

    ``chunk_fn`` / ``recurrent_fn`` have the signature of this file's ``chunk_gated_delta_rule``
    / ``fused_recurrent_gated_delta_rule`` (pass the fast file's to run on Triton kernels).
    The recurrent one runs decode steps (a cache holding state, one token per sequence, no
    cu_seqlens) and, without gradients, any continuation of a cache in which no sequence brings
    more than ``RECURRENT_MAX_TOKENS`` tokens (speculative verifications, short prefill pieces);
    the chunk one runs everything else (prefills, longer continuations, training).
    With ``cu_seqlens`` (B == 1), the conv and the recurrence restart at every document.
    With a ``cache``, the call continues from its state (if any) and leaves the new state in it
    (``new_cache()`` gives an empty one).  ``set_batch_invariant(linear)`` switches the layer to
    batch-invariant numerics (see there): then every call runs the chunk form, chunks aligned to
    absolute positions, and the cache carries the current chunk's start state and tokens; ``rewind``
    takes a cache back to fewer of a call's tokens (speculative decoding's rejected drafts).
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
        self.invariant_linear = self.invariant_out_linear = None        # set_batch_invariant's products

    def new_cache(self) -> GatedDeltaNetCache:
        """An empty cache (the generator engines' plug-in contract)."""
        return GatedDeltaNetCache()

    def set_batch_invariant(self, linear, out_linear=None) -> None:
        """Batch-invariant mode (fast/decoder_lm.py's ``DecoderLM(batch_invariant=True)`` calls it):
        from then on a token's output is bit for bit the same whichever sequences share the call, however
        they are packed, and whether its sequence runs in one call or is split across calls anywhere (a
        prefill cut at any token, then decode steps with the cache), provided ``linear(x [..., K], weight
        [N, K]) -> [..., N]`` rounds each row independently of the other rows and ``chunk_fn`` computes a
        row of a chunk with the same arithmetic in any call (this file's, and fast/gated_deltanet.py's
        with the ``batch_invariant=True`` it is called with).  What changes: the projections go through
        ``linear`` (``out_proj`` through ``out_linear`` when given: decoder_lm.py's tensor-parallel
        reduction tree); the short conv is an explicit tap-by-tap multiply-add in fp32, the same
        expression in a prefill and in a decode step (``F.conv1d`` over a sequence and a decode step's sum
        round differently); every call runs ``chunk_fn`` (prefill, decode and training, whose backward is
        the chunk form's) with chunks at absolute positions, the cache holding the state at the current
        chunk's start and that chunk's tokens so far (the module docstring's "A row inside a partial
        chunk": a decode step is row count of its chunk, computed over the chunk so far); SiLU, sigmoid
        and softplus are composed from exp / log1p; the gated RMSNorm's mean of squares is a product
        with a ones vector through ``linear``."""
        if not callable(linear) or not (out_linear is None or callable(out_linear)):
            raise TypeError(f"linear and out_linear must be functions (x, weight) -> x @ weight.T, got "
                            f"{type(linear).__name__} and {type(out_linear).__name__}")
        self.invariant_linear, self.invariant_out_linear = linear, out_linear or linear

    def _project(self, x, layer: nn.Linear):
        return layer(x) if self.invariant_linear is None else self.invariant_linear(x, layer.weight)

    def _conv(self, x, prefix, lengths):
        """Depthwise causal conv + SiLU per sequence.  x [B, T, C]; prefix [N, C, W-1] or None.
        Returns (out [B, T, C], tail [N, C, W-1]: the last W-1 inputs, the next call's prefix)."""
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
                outs.append(self._conv_taps(full) if self.invariant_linear is not None
                            else self._conv_fp32(full))                 # [b, C, L]
            tails.append(full[..., full.shape[-1] - (self.conv_kernel_size - 1):])
        out = (torch.cat(outs, dim=-1) if outs else x.new_zeros(x.shape[0], x.shape[2], 0)).transpose(1, 2)
        return out, torch.cat(tails, dim=0)

    def _conv_fp32(self, full):
        """silu(conv1d(full)) in fp32 (fp64 for an fp64 layer), cast back: [b, C, W-1+L] -> [b, C, L].  (Not in
        16-bit: torch's CPU depthwise conv1d takes ~80 s per call in bf16 at Qwen3.5-0.8B's 6144 channels.)"""
        wide = torch.promote_types(full.dtype, torch.float32)
        out = F.conv1d(full.to(wide), self.conv1d.weight.to(wide), groups=self.conv_dim)
        return F.silu(out).to(full.dtype)

    def _conv_taps(self, full):
        """silu(sum_j w_j * x_{t - W + 1 + j}) tap by tap, j = 0 .. W-1 in order, fp32: [b, C, W-1+L] ->
        [b, C, L].  Each output is one expression whatever L is, so a prefill and a decode step (L = 1)
        round it alike."""
        w = self.conv1d.weight[:, 0].float()                            # [C, W]
        xf = full.float()
        length = full.shape[-1] - (self.conv_kernel_size - 1)
        acc = w[:, :1] * xf[..., :length]
        for j in range(1, self.conv_kernel_size):
            acc = acc + w[:, j:j + 1] * xf[..., j:j + length]
        return _silu(acc).to(full.dtype)

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
        invariant = self.invariant_linear is not None
        qkv, tail = self._conv(self._project(hidden_states, self.in_proj_qkv),
                               cache.conv_state if has_state else None, lengths)
        if invariant:   # row-major [B, T, C]: the kernel's sums over a head (q/k l2-norm) round by stride
            qkv = qkv.contiguous()
        z = self._project(hidden_states, self.in_proj_z).reshape(b, t, self.num_v_heads, self.head_v_dim)
        wide = torch.promote_types(hidden_states.dtype, torch.float32)
        b_in = self._project(hidden_states, self.in_proj_b)
        beta = _sigmoid(b_in.to(wide)).to(b_in.dtype) if invariant else b_in.sigmoid()
        a = self._project(hidden_states, self.in_proj_a).to(wide) + self.dt_bias.to(wide)
        g = -self.A_log.to(wide).exp() * (_softplus(a) if invariant else F.softplus(a))   # [B, T, HV], <= 0
        if invariant:
            o = self._invariant_rule(qkv, g, beta, lengths, cache, decode=has_state and t == 1 and lengths is None)
        else:
            q, k, v = self._split(qkv)
            decode = has_state and t == 1 and cu_seqlens is None
            short = has_state and max(lengths or [t]) <= RECURRENT_MAX_TOKENS and not torch.is_grad_enabled()
            fn = self.recurrent_fn if decode or short else self.chunk_fn
            o, final = fn(q, k, v, g=g, beta=beta, initial_state=cache.recurrent_state if has_state else None,
                          output_final_state=cache is not None, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
            if cache is not None:
                cache.recurrent_state = final
        if cache is not None:
            cache.conv_state = tail
        o = self.norm(o, z, self.invariant_linear)                      # [B, T, HV, V]
        o = o.reshape(b, t, self.value_dim)
        return self.out_proj(o) if self.invariant_linear is None else self.invariant_out_linear(o, self.out_proj.weight)

    def rewind(self, cache: GatedDeltaNetCache, before: GatedDeltaNetCache, inputs: list, keep: list) -> list:
        """Speculative decoding's rollback in the batch-invariant mode: ``cache`` holds N sequences continued
        from ``before`` (their caches then) by a call over inputs[n] [L_n, D] (the tokens' hidden states);
        leave in it what a call over their first keep[n] tokens alone would have left, bit for bit.  Where the
        call completed no chunk, the chunk's start state is unchanged and the buffer holds the new tokens'
        rows (each a function of its own token and the conv's earlier inputs), so the rejected rows are
        dropped from it (the rest zeros again, as the buffer keeps them) and the conv state is rebuilt from
        ``before``'s and the kept tokens' conv inputs (their projection, row by row as the call computed it).
        Returns per sequence whether it was rewound; the others (outside the mode, or where a chunk was
        completed and its start state moved) need their kept tokens run again from ``before``."""
        done = []
        for n, (x, k) in enumerate(zip(inputs, keep)):
            count = None if before.chunk_len is None or self.invariant_linear is None else int(before.chunk_len[n])
            if count is None or count + x.shape[0] >= CHUNK:
                done.append(False)
                continue
            cache.chunk_len[n] = count + k
            for buffer in (cache.chunk_qkv, cache.chunk_g, cache.chunk_beta):
                buffer[n, count + k:count + x.shape[0]] = 0
            w = self.conv_kernel_size - 1
            tail = self._project(x[max(0, k - w):k][None], self.in_proj_qkv)[0].t()     # [C, <= W - 1]
            cache.conv_state[n] = torch.cat([before.conv_state[n], tail], dim=-1)[:, -w:]
            done.append(True)
        return done

    def _split(self, qkv):
        """The conv output [B, T, conv_dim] -> q, k [B, T, H, K], v [B, T, HV, V] (views)."""
        b, t = qkv.shape[:2]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(b, t, self.num_k_heads, self.head_k_dim), k.reshape(b, t, self.num_k_heads, self.head_k_dim),
                v.reshape(b, t, self.num_v_heads, self.head_v_dim))

    # The batch-invariant mode's rule: the chunk form over token inputs (qkv, g, beta) with chunks at
    # absolute positions; the cache's chunk_* tensors hold the current chunk's inputs.

    def _invariant_rule(self, qkv, g, beta, lengths, cache, *, decode: bool):
        """qkv [B, T, conv_dim], g / beta [B, T, HV] (B == 1 with ``lengths``, the documents' sizes) ->
        o [B, T, HV, V]; the cache (if any) continued.  A dense batch runs as B documents of T tokens
        (one kernel path for every phase).  No cache: each document whole, chunks from its start (a
        trainer).  A cache: ``_aligned_decode_step`` for one token per sequence (decode), else
        ``_aligned_chunks``."""
        b, t = qkv.shape[:2]
        tokens = tuple(x.flatten(0, 1) for x in (qkv, g, beta))            # [B T, ...]: documents packed
        lengths = [t] * b if lengths is None else lengths
        if cache is None:
            o, _ = self._chunk_rule(tokens, lengths, None, False)
            return o.unflatten(0, (b, t))
        n = len(lengths)
        if cache.is_empty:
            state, count = None, torch.zeros(n, dtype=torch.int64, device=qkv.device)
            buffered = tuple(x.new_zeros(n, CHUNK - 1, *x.shape[1:]) for x in tokens)
        elif cache.chunk_len is None:
            raise ValueError("this cache was filled outside the batch-invariant mode (it has no chunk_* tensors): "
                             "continue it with the mode off, or start from an empty cache")
        else:
            state, count = cache.recurrent_state, cache.chunk_len
            buffered = (cache.chunk_qkv, cache.chunk_g, cache.chunk_beta)
        if decode:
            o, state, buffered, count = _aligned_decode_step(self._chunk_rule, tokens, state, buffered, count)
        else:
            o, state, buffered, counts = _aligned_chunks(self._chunk_rule, tokens, lengths, state, buffered,
                                                         count.tolist())
            count = torch.tensor(counts, dtype=torch.int64, device=qkv.device)
        if state is None:                   # no chunk completed yet: the state at position 0
            state = qkv.new_zeros(n, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                  dtype=torch.promote_types(qkv.dtype, torch.float32))
        cache.recurrent_state, cache.chunk_len = state, count
        cache.chunk_qkv, cache.chunk_g, cache.chunk_beta = buffered
        return o.unflatten(0, (b, t))

    def _chunk_rule(self, tokens, lengths, initial_state, output_final_state: bool):
        """``chunk_fn`` over documents of packed token inputs (qkv [T, conv_dim], g / beta [T, HV]), laid
        out as a trainer's forward lays them out (q, k, v views of one row-major qkv; cu_seqlens, with its
        host copy) -> (o [T, HV, V], the final state or None).  ``lengths=None``: the inputs are a dense
        batch of N documents of one length (qkv [N, L, conv_dim], o [N, L, HV, V]), run as one with no
        cu_seqlens, so with no host-side bookkeeping (a CUDA graph can capture it: the decode step's
        call); its rows are the varlen call's bits (the same per-chunk arithmetic: the fast kernels'
        dense and varlen builds differ in their integer code only, parity/invariant_sass.py).  Every
        call passes a start state (zeros for None) and takes the end state, so that a trainer's call
        and an engine's launch the same kernel builds (the fast state pass's USE_H0 / STORE_FINAL alike)."""
        qkv, g, beta = tokens
        dense = lengths is None
        n = qkv.shape[0] if dense else len(lengths)
        if initial_state is None:
            initial_state = qkv.new_zeros(n, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                          dtype=torch.promote_types(qkv.dtype, torch.float32))
        if dense:
            packed = {}
        else:
            qkv, g, beta = qkv[None], g[None], beta[None]
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            packed = dict(cu_seqlens=cu.to(qkv.device), cu_seqlens_cpu=cu)
        q, k, v = self._split(qkv)
        o, final = self.chunk_fn(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, batch_invariant=True, **packed)
        return o if dense else o[0], final if output_final_state else None


def _aligned_chunks(rule, tokens, lengths, state, buffered, counts):
    """The batch-invariant mode's continuation of N sequences (the module docstring's "A row inside a
    partial chunk"): sequence n has counts[n] tokens of its current chunk buffered and lengths[n] new
    ones.  ``tokens``: the new tokens' inputs, a tuple of [T, ...] tensors packed by ``lengths``;
    ``buffered``: the same inputs [N, C - 1, ...], each sequence's buffered rows first (zeros after);
    ``state`` [N, HV, K, V] at each current chunk's start, None for zeros.  ``rule(tokens, lengths,
    initial_state, output_final_state) -> (o [T, ...], final)`` runs the chunk form over documents
    (``lengths=None``: a dense batch, tokens [N, L, ...] and o [N, L, ...]).
    Each sequence's buffered + new tokens are cut at their last chunk boundary: the whole chunks run
    first, from ``state`` (their end state starts the next chunk), then the partial rest from that
    state, its tokens kept.  Returns (o [T, ...] of the new tokens, the new state (None if still
    none), the new buffered inputs, the new counts)."""
    n = len(lengths)
    new = [x.split(lengths) for x in tokens]                                # per input: per sequence
    rows = [[torch.cat([b[i, :counts[i]], x[i]]) for i in range(n)] for b, x in zip(buffered, new)]
    total = [c + m for c, m in zip(counts, lengths)]
    whole = [m - m % CHUNK for m in total]                                  # tokens in complete chunks
    rest = [m - w for m, w in zip(total, whole)]
    outs = [[] for _ in range(n)]
    for complete, sizes in ((True, whole), (False, rest)):
        if not any(sizes) and (complete or any(whole)):    # (the second call runs when nothing else does)
            continue
        pieces = tuple(torch.cat([r[i][:whole[i]] if complete else r[i][whole[i]:] for i in range(n)]) for r in rows)
        o, final = rule(pieces, sizes, state, complete)
        if complete:
            state = final
        for i, o_i in enumerate(o.split(sizes)):
            outs[i].append(o_i)
    o = torch.cat([torch.cat(o_n)[c:] for o_n, c in zip(outs, counts)])   # the new tokens' rows, in order
    buffered = tuple(torch.stack([torch.cat([r[i][whole[i]:], b.new_zeros(CHUNK - 1 - rest[i], *b.shape[2:])])
                                  for i in range(n)]) for r, b in zip(rows, buffered))
    return o, state, buffered, rest


def _aligned_decode_step(rule, tokens, state, buffered, count):
    """One new token per sequence (``tokens``: a tuple of [N, ...]; ``count`` [N] int64 on the device),
    the rows ``_aligned_chunks`` gives it, without reading the counts on the host: each sequence's
    current chunk is laid out whole, [its buffered rows, the new token at row count, absent tokens
    (zeros) after it], and the chunk form runs once over the N chunks of 64 rows, a dense batch
    (``rule(chunks [N, C, ...], None, state, True)``: no cu_seqlens, nothing computed on the host, so
    the step can be captured in a CUDA graph).  The new token's row is its output; where it ends its
    chunk (count = 63) the chunk's end state becomes the state and the buffer empties, else the token
    joins the buffer.  Returns what ``_aligned_chunks`` returns (counts
    as a tensor)."""
    n = count.shape[0]
    at = torch.arange(CHUNK, device=count.device) == count[:, None]        # [N, C]: the new token's row
    chunks = tuple(torch.where(at.view(n, CHUNK, *[1] * (x.dim() - 1)), x[:, None],
                               torch.cat([b, b.new_zeros(n, 1, *b.shape[2:])], 1))
                   for x, b in zip(tokens, buffered))                      # [N, C, ...]
    o, end = rule(chunks, None, state, True)                               # a dense batch of N chunks
    o = o[at]                                                               # [N, ...]: row count of each
    done = count == CHUNK - 1
    state = torch.where(done.view(n, 1, 1, 1), end, end.new_zeros(()) if state is None else state)
    buffered = tuple(torch.where(done.view(n, 1, *[1] * (c.dim() - 2)), c.new_zeros(()), c[:, :CHUNK - 1])
                     for c in chunks)
    return o, state, buffered, torch.where(done, 0, count + 1)


# ----------------------------------------------------------------------------- input checks
# (the same checks and messages in both gated_deltanet files; each file stands alone)

def _fla_extras(kwargs: dict, state_v_first: bool) -> bool:
    """Extra keyword arguments, tolerated as fla tolerates them: callers such as HF's Qwen3.5 layer
    pass their own (max_length_q, cu_seq_lens_k, position_ids, ...), which are ignored; fla's old
    name transpose_state_layout still sets state_v_first; head_first=True is refused (inputs are
    [B, T, H, ...]).  Returns state_v_first."""
    if kwargs.get("head_first"):
        raise ValueError("head_first=True is not supported (fla removed it too): inputs are [B, T, H, ...]")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass state_v_first or the deprecated transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated: fla renamed it state_v_first", DeprecationWarning,
                      stacklevel=3)
        return bool(kwargs["transpose_state_layout"])
    return state_v_first


def _check_options(*, gk, gv, cp_context, chunk_size, g, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   use_gate_in_kernel, A_log):
    """fla's options that this file does not implement raise; the combinations fla refuses raise."""
    if gk is not None or gv is not None:
        raise NotImplementedError("gk / gv (per-key / per-value decays) are not implemented: pass the per-head "
                                  "gate g [B, T, HV] (in fla's order the recurrent form's 5th positional "
                                  "argument is gk: pass beta=...)")
    if cp_context is not None:
        raise NotImplementedError("cp_context (fla's context parallelism) is not implemented")
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size must be {CHUNK} (the kernels' chunk; the chunk size changes only the "
                         f"rounding, not the result), got {chunk_size!r}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (beta = 2 sigmoid(beta))")
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True requires A_log [HV] (g = -exp(A_log) softplus(g + dt_bias))")
    if use_gate_in_kernel and g is None:
        raise ValueError("use_gate_in_kernel=True requires g (the gate's raw input)")


def _check_inputs(q, k, v, g, beta, *, scale, initial_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
                  chunk_indices, A_log, dt_bias, float_dtypes):
    """Shape / dtype / device checks; returns N (number of sequences).  No device sync here.
    g and beta may be None (the recurrent form's defaults)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t is None and name in ("g", "beta"):
            continue
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
    hv, dv = v.shape[2:]
    if h == 0 or hv % h != 0:
        raise ValueError(f"v's head count HV={hv} must be a multiple of q/k's head count H={h}")
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if x is not None and x.shape != (b, t, hv):
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
    for name, x in (("cu_seqlens_cpu", cu_seqlens_cpu), ("chunk_indices", chunk_indices)):
        if x is None:
            continue
        if cu_seqlens is None:
            raise ValueError(f"{name} needs cu_seqlens (it describes the same documents)")
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 or int64 torch.Tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
    if cu_seqlens_cpu is not None and (cu_seqlens_cpu.device.type != "cpu"
                                       or cu_seqlens_cpu.shape != cu_seqlens.shape):
        raise ValueError(f"cu_seqlens_cpu must be a CPU copy of cu_seqlens [{n + 1}], got shape "
                         f"{tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")
    if chunk_indices is not None and (chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2):
        raise ValueError(f"chunk_indices must be [NT, 2] (document, chunk in it), got shape "
                         f"{tuple(chunk_indices.shape)}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        if not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be a float tensor, got {initial_state.dtype}")
        shape, layout = ((n, hv, dv, dk), "[N, HV, V, K] (state_v_first)") if state_v_first else \
            ((n, hv, dk, dv), "[N, HV, K, V]")
        if initial_state.shape != shape:
            raise ValueError(f"initial_state must be {layout} = {shape}, got shape {tuple(initial_state.shape)}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a float torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.shape != (hv,):
            raise ValueError(f"{name} must be [HV] = ({hv},), got shape {tuple(x.shape)}")
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
             ("cu_seqlens", cu_seqlens), ("chunk_indices", chunk_indices), ("A_log", A_log), ("dt_bias", dt_bias)]
    devices = {name: x.device for name, x in named if x is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got mixed devices {devices}")
    return n


def _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, chunk_indices, t: int) -> list[int]:
    """cu_seqlens' values on the host, checked: read from cu_seqlens_cpu when given (no device-to-host
    copy, fla's contract: the serving path under CUDA graphs), else one small copy."""
    cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    if cu[0] != 0 or any(y < x for x, y in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
    if cu[-1] != t:
        raise ValueError(f"cu_seqlens[-1] must equal T = q.shape[1] = {t}, got {cu[-1]}")
    if chunk_indices is not None:
        chunks = sum(-(-(e - s) // CHUNK) for s, e in zip(cu, cu[1:]))
        if chunk_indices.shape[0] != chunks:
            raise ValueError(f"chunk_indices must have one row per chunk of {CHUNK} tokens ({chunks}), "
                             f"got {chunk_indices.shape[0]}")
    return cu


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
    o2, h2 = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    err = max((o1 - o2).abs().max().item(), (h1 - h2).abs().max().item())
    print("chunk vs recurrent max error:", err)
    assert err < 1e-12
