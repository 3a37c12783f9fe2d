"""Gated DeltaNet: Triton kernels (chunked forward and backward, recurrent decode and its backward)
with fla's API.

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
    The gated delta rule of ref/gated_deltanet.py (the specification; its docstring derives the
    chunk form from the recurrence).  Per value head, a [K, V] fp32 state h:
        h = exp(g_t) h;  u_t = beta_t (v_t - h^T k_t);  h = h + k_t u_t^T;  o_t = h^T (scale q_t).
    ``chunk_gated_delta_rule`` (training, prefill) runs the chunk form, C = 64 tokens a chunk, as
    five kernels (fla's decomposition, written anew):
        1. cumsum     gc = within-chunk cumulative gate, gr = latest hard reset    fp32, int8 [B, T, HV]
        2. kkt+solve  A = (I + tril(beta K K^T * exp(gc_i - gc_j), -1))^-1        [B, T, HV, 64]
        3. w/u        w = A (beta exp(gc) K),  u = A (beta V)
        4. state      the sequential pass over chunks: h at each chunk start, v_new = u - w h,
                      h = exp(gc_last) h + K^T (exp(gc_last - gc) v_new);  the final state
        5. output     o = scale (exp(gc) q h + (q K^T * exp(gc_i - gc_j))_causal v_new)
    ``fused_recurrent_gated_delta_rule`` (decode) is one kernel: a program per (sequence, value
    head, V block) holds its [K, BV] fp32 state block in registers, reads it once, steps through
    the tokens, writes it once.  Both ops are trainable (the backward's math is written above
    ``_chunk_backward`` and above the recurrent backward kernel); deterministic, no atomics.

Map: each kernel (and its host driver), in call order, beside the function of ref/gated_deltanet.py
it computes and that function's line there (the ref has no backward: its autograd through the same
functions is the backward's specification; parity/test_gated_deltanet.py checks this map)
    fast                        ref/gated_deltanet.py        line      what
    _l2norm_kernel              _l2norm                      364       use_qk_l2norm_in_kernel (first)
    _chunk_forward              _chunk                       254       the five kernels in order
    _chunk_cumsum_kernel        _GateSums.forward            180       1. gc, gr (+ the in-kernel gate)
    _chunk_kkt_solve_kernel     _wy_inverse                  210       2. A = (I + tril(..))^-1
    _chunk_wu_kernel            _wy_w_u                      226       3. w, u
    _chunk_h_kernel             _chunk_state_pass            233       4. S per chunk, v_new = u - w S
    _chunk_o_kernel             _chunk_state_pass            233       5. o
    _chunk_backward             _chunk                       254       recompute, then a. .. e.
    _chunk_dv_local_kernel      _chunk_state_pass            233       a. dU from the in-chunk scores
    _chunk_dhu_kernel           _chunk_state_pass            233       b. the reverse pass over chunks
    _chunk_dqkwg_kernel         _chunk_state_pass            233       c. dQ, dK, dW, db
    _chunk_wy_bwd_kernel        _wy_w_u, _wy_inverse         226, 210  d. through w, u and the solve
    _chunk_dg_kernel            _GateSums.backward           192       e. dg from db
    _l2norm_bwd_kernel          _l2norm                      364       through the l2norm
    _recurrent_forward          _recurrent                   147       decode: one kernel
    _recurrent_kernel           _recurrent                   147       the recurrence, state in registers
    _recurrent_backward         _recurrent                   147
    _recurrent_bwd_kernel       _recurrent                   147       reverse pass over the tokens

Batch and split invariance (``fused_recurrent_gated_delta_rule``, guaranteed)
    For each sequence, o and the final state are the same bits whichever other sequences share the
    call (a dense batch or cu_seqlens, at any position in the pack), and however its tokens are split
    across calls that carry the fp32 final state into the next call's initial_state (in either state
    layout; with or without the in-kernel l2norm, gate and beta sigmoid): a decoding engine's steps
    and a trainer's one-call recompute of the same tokens agree exactly.  By construction (see above
    the recurrent kernel): one tile config per (K, V), fixed, never tuned on T or the batch.

Batch and split invariance of the chunk form (``chunk_gated_delta_rule(..., batch_invariant=True)``)
    A token's row of o has the same bits in any call that gives its chunk (chunks of 64 from each
    sequence's start) the same tokens up to that row and the same start state: whichever sequences share
    the call, whether the chunk is whole or ends right after the row (the rest absent), and whether the
    start state was carried from the previous chunk inside the call or passed as initial_state (the fp32
    final state of a call that ended at that chunk boundary: the kernels carry the state in fp32; only
    an exact zero's sign can differ, a -0.0 loading as +0.0).  A chunk's end state (the next chunk's
    start) likewise.  The math is ref/gated_deltanet.py's "A row inside a partial chunk" (an absent
    token's terms are exact zeros); GatedDeltaNet's batch-invariant mode builds on it (the layer keeps a
    chunk's start state and its tokens so far, and a decode step runs its chunk so far).  By
    construction: every kernel has one launch per shape, the first config its pruning keeps
    (``_launch(fixed=True)``: the config the interpreter runs and the observatory measures, never the
    autotuner's timed pick), so a chunk is one program's tiles in every call and a token sits at its
    position in the chunk; absent rows load as zeros (masks with other=0) and decays are masked to
    exp(-inf) = 0 before any product, so no inf * 0 or NaN enters; the gate sums run in token order
    (IN_ORDER: tl.cumsum's parallel scan associates by the [64, heads] block's layout, which the head
    count sets, and tensor parallelism changes the head count).  Call with an initial_state and
    output_final_state=True in every phase (the layer does: the state pass with and without a start
    state differ by a 0 + h0), and with cu_seqlens, or as a dense batch of whole chunks (the layer's
    decode step: no cu_seqlens, so nothing on the host and a CUDA graph can capture it).  The dense and
    varlen builds differ in how a program finds its chunk (integer code); parity/invariant_sass.py
    checks that their floating-point instructions are the same, kernel by kernel, for sm_80 and sm_90.
    The backward gets the same fixed launches (deterministic; its gradients are not promised bitwise
    across packings).
    parity/test_gated_deltanet.py checks the bits in the interpreter.

Tensors: those of ref/gated_deltanet.py, with fla 0.6.0's signature and options (positional order;
use_gate_in_kernel with A_log / dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
state_v_first, cu_seqlens_cpu; extra keywords ignored as fla ignores them)
    q, k            [B, T, H, K]      fp16 / bf16 / fp32      value head i reads q/k head i // (HV // H)
    v               [B, T, HV, V]     fp16 / bf16 / fp32      (q and k share one dtype; v may differ)
    g, beta         [B, T, HV]        any of those
    A_log, dt_bias  [HV]              float (use_gate_in_kernel: the gate is computed in the kernels)
    initial_state   [N, HV, K, V]     any float dtype ([N, HV, V, K] with state_v_first); None = zeros
    cu_seqlens      [N + 1] int32 / int64, B == 1 (varlen); cu_seqlens_cpu its host copy
    o               [B, T, HV, V]     v's dtype
    final_state     [N, HV, K, V]     fp32 ([N, HV, V, K] with state_v_first), or None unless output_final_state
    A hard reset g = -inf zeroes the state, as in the recurrence: the chunk kernels carry each token's
    latest reset in its chunk (gr) beside the cumulative gate (gc) and never take -inf - (-inf).

Supported, and what raises
    CUDA tensors (CPU tensors only under TRITON_INTERPRET=1; else a ValueError that says so); K <= 256,
    any V; the reference's errors for bad shapes, dtypes, devices and options; gradients w.r.t. every
    tensor input (A_log and dt_bias included).  Double backward raises NotImplementedError.  The
    README's "Known limits" lists the rest.

References
    fla (flash-linear-attention): chunk_gated_delta_rule / fused_recurrent_gated_delta_rule and the
    kernels it splits them into (chunk_scaled_dot_kkt, solve_tril, recompute_w_u, chunk_fwd_h,
    chunk_fwd_o; chunk_bwd_dv_local, chunk_gated_delta_rule_bwd_dhu, chunk_bwd_dqkwg,
    prepare_wy_repr_bwd); Yang, Kautz, Hatamizadeh, Gated Delta Networks (ICLR 2025).
"""
from __future__ import annotations

import itertools
import warnings
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]

CHUNK = 64
MAX_HEAD_DIM_K = 256
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


# ----------------------------------------------------------------------------- public API

def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, use_gate_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64,
                           batch_invariant=False, **kwargs):
    """The gated delta rule in chunk form (chunks of 64 tokens), Triton, with fla 0.6.0's signature; see
    the module docstring.  Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] fp32 or None)``.
    ``batch_invariant``: one fixed launch per kernel and shape (never autotuned) and the gate sums in
    token order, so a row of a chunk has the same bits in any call (see "Batch and split invariance")."""
    if g is None or beta is None:
        raise TypeError("chunk_gated_delta_rule needs g and beta (only the recurrent form has defaults)")
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    state_v_first = _fla_extras(kwargs, state_v_first)
    _check_options(gk=None, gv=None, cp_context=cp_context, chunk_size=chunk_size, g=g,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log)
    if not use_gate_in_kernel:
        A_log = dt_bias = None                                 # fla ignores them then
    _check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state, state_v_first=state_v_first,
                  cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, A_log=A_log,
                  dt_bias=dt_bias, float_dtypes=_FLOATS)
    _check_runnable(q)
    if chunk_indices is not None:                              # checked against cu_seqlens; the kernels use their own
        _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, chunk_indices, q.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, _ = _l2norm_op(q)
        k, _ = _l2norm_op(k)
    q, k = q.to(v.dtype), k.to(v.dtype)                        # the chunk kernels compute in one dtype
    if use_beta_sigmoid_in_kernel:                             # as fla's chunk form: a step before the kernels
        beta = beta.float().sigmoid() * (2 if allow_neg_eigval else 1)
    A_log, dt_bias = (None if x is None else x.contiguous() for x in (A_log, dt_bias))
    o, final, *_ = _chunk_op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                             output_final_state, state_v_first, batch_invariant)
    return o, (final if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, cu_seqlens_cpu=None, **kwargs):
    """The gated delta rule token by token in one Triton kernel (decode), with fla 0.6.0's signature:
    g = None means no decay, beta = None means beta = 1.  Returns what ``chunk_gated_delta_rule``
    returns."""
    state_v_first = _fla_extras(kwargs, state_v_first)
    _check_options(gk=gk, gv=gv, cp_context=None, chunk_size=CHUNK, g=g,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    _check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state, state_v_first=state_v_first,
                  cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=None, A_log=A_log,
                  dt_bias=dt_bias, float_dtypes=_FLOATS)
    _check_runnable(q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    b, t, hv = v.shape[:3]
    g = torch.zeros(b, t, hv, dtype=torch.float32, device=v.device) if g is None else g
    beta = torch.ones(b, t, hv, dtype=v.dtype, device=v.device) if beta is None else beta
    beta_act = 0 if not use_beta_sigmoid_in_kernel else (2 if allow_neg_eigval else 1)
    A_log, dt_bias = (None if x is None else x.contiguous() for x in (A_log, dt_bias))
    o, final = _recurrent_op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                             output_final_state, use_qk_l2norm_in_kernel, beta_act, state_v_first)
    return o, (final if output_final_state else None)


# ----------------------------------------------------------------------------- the chunk forward
# Precision (fla's choices): A, w, u, v_new and the per-chunk states are stored in the input dtype and
# multiplied on tensor cores with fp32 accumulation; the carried state, the gates and the solve are
# fp32.  fp32 inputs use IEEE fp32 dots (no silent tf32).
# Cost per value head, per chunk (C = 64; gate exponentials not counted):
#     K K^T 2C^2K + solve C^3/3 + w 2C^2K + u 2C^2V + v_new = u - w h 2CKV + K^T v_new 2CKV + q h 2CKV
#     + q K^T 2C^2K + (.) v_new 2C^2V  =  6C^2K + 4C^2V + 6CKV + C^3/3,
# per token 6CK + 4CV + 6KV + C^2/3 (K = V = 128: 1.82e5 FLOP per token per value head).  Minimum
# bytes: q, k, v, g, beta read, o written (and the states when given); the intermediates (gc, A, w, u,
# v_new, per-chunk states) add a few times the input bytes.  Decode (T = 1) moves at least the fp32
# state twice, N HV K V 4 2 bytes, plus q, k, v, o, g, beta.

def _chunk_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale: float,
                   output_final_state: bool, state_v_first: bool, invariant: bool):
    """The five kernels in order (``invariant``: batch_invariant's fixed launches).  Returns (o, final or
    None, A)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    seqs = _sequences(q.shape[0], q.shape[1], cu_seqlens, cu_seqlens_cpu, q.device)
    gates = _chunk_cumsum(g, A_log, dt_bias, seqs, invariant)
    a = _chunk_kkt_solve(k, gates, beta, v.shape[2], seqs)
    w, u = _chunk_wu(k, v, beta, gates, a, seqs)
    states, v_new, final = _chunk_h(k, w, u, gates, initial_state, output_final_state, state_v_first, seqs, invariant)
    o = _chunk_o(q, k, v_new, states, gates, scale, seqs, invariant)
    return o, final, a


# ----------------------------------------------------------------------------- the chunk backward
# fla's decomposition, written anew.  Per chunk (b = gc, the within-chunk cumulative gate;
# Gam_ij = exp(b_i - b_j) for j <= i; S / S' the state at the chunk's start / end; U = v_new;
# T = A, the solved block), given dO and the gradient dS' of S':
#   0. recompute  the gates (kernel 1), w, u (kernel 3), S per chunk and U (kernel 4), from the saved A
#   a. dv_local   dU_loc = scale (Q K^T * Gam)^T dO                        (chunks in parallel)
#   b. dhu        the reverse pass over chunks, dS' carried in fp32 registers:
#                   dU = dU_loc + exp(b_C - b) * (K dS');   dS = exp(b_C) dS' + (scale exp(b) Q)^T dO - W^T dU
#   c. dqkwg      dQ = scale exp(b) dO S^T + dP K;  dK = exp(b_C - b) U dS'^T + dP^T Q;  dW = -dU S^T,
#                 with dP = scale (dO U^T) * Gam (causal), and db, the gradient of the cumulative gate
#   d. wy         through w = T diag(beta e^b) K, u = T diag(beta) V, T = (I + L)^-1:
#                   dT = dW (beta e^b K)^T + dU (beta V)^T,  dL = -T^T dT T^T (strictly lower),
#                   L_ij = beta_i Gam_ij k_i . k_j  ->  dK, dbeta, db
#   e. dg         dg_t = sum_{i >= t} db_i inside each chunk (b_i = g_1 + .. + g_i), taken as below
# Exact dg under strong decay: every term of db is either a single (its own exp(b_i) factor) or a
# pair P_ij, i > j (+P to db_i, -P to db_j, carrying Gam_ij).  dg_t = sum_{i >= t} db_i would add
# and cancel O(1) pairs (Gam_ij ~ 1 across a weak gate) to leave a tiny result when a strong gate
# sits between; instead dg_t = revcumsum(singles)_t + sum_{i >= t > j} P_ij, each pair counted
# only where it survives (the pairs with i == j cancel exactly and are left out), so dg keeps its
# relative accuracy when exp(g) underflows towards 0.
# GVA: dq / dk are written per value head (fp32) and summed over the value heads of a q/k head
# in a fixed order on the host: deterministic, no atomics anywhere.
# Saved for the backward (activation memory O(T (K + V)) per head, never O(T / 64 K V)): the inputs and
# A [B, T, HV, 64] (row t holds row t mod 64 of its chunk's inverse); the gates (one pass over g), w,
# u, the per-chunk states and v_new are recomputed (fla's choice too, but for the gates).
# Cost per chunk as executed: recompute w, u, states 2C^2K + 2C^2V + 4CKV;  dv_local 2C^2K + 2C^2V;
# dhu 6CKV;  dqkwg 6C^2K + 2C^2V + 6CKV;  wy 10C^2K + 4C^2V (no C^3 term: dL = -(dKbg w^T + dVb u^T))
# = 20C^2K + 10C^2V + 16CKV;  per token 20CK + 10CV + 16KV (K = V = 128: 5.08e5 FLOP per token per
# value head; forward + backward 6.90e5).


def _chunk_backward(q, k, v, g, beta, A_log, dt_bias, a, initial_state, cu_seqlens, cu_seqlens_cpu, scale: float,
                    do, dht, state_v_first: bool, invariant: bool):
    """-> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, d initial_state; empty tensors for what has no
    gradient).  q, k as the chunk op saw them."""
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    h = q.shape[2]
    seqs = _sequences(q.shape[0], q.shape[1], cu_seqlens, cu_seqlens_cpu, q.device)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if dht is not None:
        dht = dht.contiguous()
    gates = _chunk_cumsum(g, A_log, dt_bias, seqs, invariant)                  # 0. recompute
    w, u = _chunk_wu(k, v, beta, gates, a, seqs)
    states, v_new, _ = _chunk_h(k, w, u, gates, initial_state, False, state_v_first, seqs, invariant)
    dv_local = _chunk_dv_local(q, k, gates, do, scale, seqs)                   # a.
    dstates, du, dh0 = _chunk_dhu(q, k, w, gates, do, dv_local, dht, initial_state, scale, state_v_first, seqs,
                                  invariant)                                    # b.
    del dv_local
    dq, dk, dw, db = _chunk_dqkwg(q, k, v_new, gates, states, do, dstates, du, scale, seqs)    # c.
    del states, dstates, v_new
    dv, dbeta, dk = _chunk_wy_bwd(k, v, beta, gates, a, w, u, dw, du, dk, db, seqs)  # d.
    dg, da_log, ddt_bias = _chunk_dg(db, g, A_log, dt_bias, seqs)              # e.
    return _group_sum(dq, h, q.dtype), _group_sum(dk, h, k.dtype), dv, dg, dbeta, da_log, ddt_bias, dh0


# ----------------------------------------------------------------------------- the recurrent op (decode)

def _recurrent_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale: float,
                       output_final_state: bool, use_l2norm: bool, beta_act: int, state_v_first: bool):
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        # The kernel reads an fp32 state whatever the caller's dtype.  On a GPU the register layout of the
        # state tile follows the load that fills it (a 16-bit load is vectorised wider), and the order of
        # the sums over K follows that layout: a 16-bit state read as is would change the bits of every
        # token after it (seen on an H200), where the same values in fp32 must give the same outputs.
        initial_state = initial_state.to(torch.float32).contiguous()
    b, t, h, dk = q.shape
    hv, dv = v.shape[2:]
    n, cu = _recurrent_sequences(b, t, cu_seqlens, cu_seqlens_cpu, q.device)
    o = torch.empty_like(v)
    final = torch.empty(_state_shape(n, hv, dk, dv, state_v_first), dtype=torch.float32,
                        device=q.device) if output_final_state else None
    if n * hv == 0:
        return o, final
    dummy = torch.empty(1, dtype=torch.float32, device=q.device)
    config = _rec_config(dk, dv)                           # fixed: the invariance guarantee above
    _recurrent_kernel[(triton.cdiv(dv, config["BV"]), n * hv)](
        q, k, v, g, beta, _or(A_log, dummy), _or(dt_bias, dummy), o, _or(initial_state, dummy), _or(final, dummy), cu,
        scale, t, H=h, HV=hv, K=dk, V=dv, BK=_pow2(dk), USE_H0=initial_state is not None,
        STORE_FINAL=final is not None, IS_VARLEN=cu_seqlens is not None, L2NORM=use_l2norm, USE_GATE=A_log is not None,
        HAS_BIAS=dt_bias is not None, BETA_ACT=beta_act, STATE_V_FIRST=state_v_first, **config)
    return o, final


def _recurrent_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale: float,
                        use_l2norm: bool, beta_act: int, state_v_first: bool, do, dht):
    """-> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, d initial_state; empty tensors for what has no
    gradient)."""
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if dht is not None:
        dht = dht.contiguous()                                 # (sum()'s gradient is an expanded view)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2:]
    n, cu = _recurrent_sequences(b, t, cu_seqlens, cu_seqlens_cpu, q.device)
    tiles = _rec_bwd_tiles(dk, dv)
    nv = triton.cdiv(dv, tiles["BV"])
    ntok = b * t
    dqk = torch.empty(3, nv, b, t, hv, dk, dtype=torch.float32, device=q.device)    # dq, dk (2 terms) per V block
    dgb = torch.empty(4, nv, b, t, hv, dtype=torch.float32, device=q.device)        # dg, dbeta, scratch, dA_log
    p_buf = torch.empty(2, b, t, hv, dv, dtype=torch.float32, device=q.device)      # p and dp scratch
    dvv = torch.empty_like(v)
    dh0 = _state_grad(initial_state)
    if n * hv:
        dummy = torch.empty(1, dtype=torch.float32, device=q.device)
        _recurrent_bwd_kernel[(nv, n * hv)](
            q, k, v, g, beta, _or(A_log, dummy), _or(dt_bias, dummy), do, _or(initial_state, dummy),
            _or(dht, dummy), dqk[0], dqk[1], dqk[2], dvv, dgb[0], dgb[1], dgb[3], _or(dh0, dummy), p_buf[0],
            p_buf[1], dgb[2], cu, scale, t, ntok, H=h, HV=hv, K=dk, V=dv, BK=_pow2(dk),
            USE_H0=initial_state is not None, USE_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None,
            L2NORM=use_l2norm, USE_GATE=A_log is not None, HAS_BIAS=dt_bias is not None, BETA_ACT=beta_act,
            STATE_V_FIRST=state_v_first, **tiles)
    dq = _group_sum(dqk[0].sum(0), h, torch.float32)
    dkk = _group_sum(dqk[1].sum(0) + dqk[2].sum(0), h, torch.float32)
    if use_l2norm:   # the kernel differentiated w.r.t. the normalized q, k
        dq = _l2norm_bwd(*_l2norm(q.float()), dq)
        dkk = _l2norm_bwd(*_l2norm(k.float()), dkk)
    dg = dgb[0].sum(0)
    da_log, ddt_bias = _gate_param_grads(A_log, dt_bias, dgb[3], dg)
    return (dq.to(q.dtype), dkk.to(k.dtype), dvv, dg.to(g.dtype), dgb[1].sum(0).to(beta.dtype), da_log, ddt_bias,
            _or(dh0, q.new_empty(0, dtype=torch.float32)))


# ============================================================================= kernels, in call order

# ----------------------------------------------------------------------------- l2norm
# y = x / sqrt(|x|^2 + 1e-6) per row, rstd saved.  Cost 3D FLOPs per row; minimum bytes: x read, y and
# rstd (4 bytes a row) written.

@triton.jit
def _l2norm_kernel(x, y, rstd, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < R
    m = m_r[:, None] & (o_d < D)[None, :]
    p = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    b_x = tl.load(x + p, mask=m, other=0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) + 1e-6)          # fla's l2norm eps
    tl.store(y + p, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=m_r)


def _l2norm(x: torch.Tensor):
    """x [..., D] contiguous -> (x * rsqrt(sum x^2 + 1e-6) in x's dtype, rstd fp32 [...])."""
    d = x.shape[-1]
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rows = x.numel() // max(d, 1)
    bd = _pow2(d)
    br = max(1, 4096 // bd)
    if rows:
        _l2norm_kernel[(triton.cdiv(rows, br),)](x, y, rstd, rows, D=d, BR=br, BD=bd, num_warps=4)
    return y, rstd


# ----------------------------------------------------------------------------- 1. cumsum
# gc: the within-chunk cumulative gate; gr: the position in the chunk of the latest hard reset (g = -inf)
# at or before the token, -1 if none.  A reset is left out of gc, and the decay from position j to
# i >= j, exp(gc_i - gc_j), is taken only where no reset lies in (j, i], i.e. j >= gr_i (else it is 0):
# no -inf - (-inf).  (A row of gr is all an [i, j] mask needs.)  gs and ge: the exponents of the
# decays from the chunk's start to the token, gc (-inf after a reset), and from the token to the
# chunk's end, gc_last - gc (-inf across a reset), so that the kernels which need only those (w/u,
# the state passes) read one vector, not gc and gr (the mask costs the state passes registers).
# Rows past a sequence's end load them as 0 (their other operands are zero; a -inf fill costs registers).
# use_gate_in_kernel: the gate -exp(A_log) softplus(g + dt_bias) is computed here from g's raw input.
# Precision: every gate sum is carried as an unevaluated pair of fp32 numbers (hi + lo, each addition's
# rounding error kept by TwoSum), so gc_i, gs and ge = gc_last - gc_i are the exact sums rounded once.
# A plain fp32 running sum rounds at each of up to 64 tokens (mean error 2.5e-7 at |gc| ~ 3 against
# 3.2e-8 rounded once), and exp turns gc's absolute error into a relative error of every decay: under
# positive gates (decays > 1) the chunk backward's dU, dv were 2-7x less precise than the fp32 reference's
# on the same inputs (issue 38).  Registers: the pair doubles the block (HV = 64: 248 per thread, 180 before).
# IN_ORDER (batch_invariant): gc_i = gc_(i-1) + g_i, one (paired) addition per token in token order,
# instead of the parallel scan, whose association follows the [BT, BH] block's layout (a function of the
# head count HV: tensor parallelism changes it per rank); each row is picked out by a sum whose other terms
# are exact zeros, so no layout moves a bit.
# Cost: a few FLOPs per token (no matmul; IN_ORDER: BT passes over the block); minimum bytes: g read
# (4 T HV), gc, gs, ge written in fp32 and gr in int8 (13 T HV).

@triton.jit
def _pair_add(a_hi, a_lo, b_hi, b_lo):
    """(a_hi + a_lo) + (b_hi + b_lo) as a normalized fp32 pair: the sum's rounding error (TwoSum, exact
    without an FMA) joins the low parts.  Returns (hi, lo), hi the sum rounded to fp32."""
    s = a_hi + b_hi
    bb = s - a_hi
    lo = ((a_hi - (s - bb)) + (b_hi - bb)) + (a_lo + b_lo)
    hi = s + lo
    return hi, lo - (hi - s)


@triton.jit(do_not_specialize=["T"])
def _chunk_cumsum_kernel(g, A_log, dt_bias, gc, gr, gs, ge, cu, chunk_idx, T, HV: tl.constexpr, BT: tl.constexpr,
                         BH: tl.constexpr, USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr,
                         IN_ORDER: tl.constexpr):
    i_t, i_b = tl.program_id(0), tl.program_id(1)
    t0, eos, _ = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m = (o_t < eos)[:, None] & (o_h < HV)[None, :]
    p = o_t[:, None] * HV + o_h[None, :]                   # all value heads of the chunk at once
    b_g = tl.load(g + p, mask=m, other=0).to(tl.float32)
    if USE_GATE:
        b_g, _ = _gdn_gate(b_g, A_log, dt_bias, o_h, o_h < HV, HAS_BIAS)
    b_reset = b_g == float("-inf")
    b_g = tl.where(b_reset, 0.0, b_g)
    o_pos = tl.arange(0, BT)
    # Each gate sum carried as an unevaluated fp32 pair hi + lo (TwoSum), so that gc_i is the exact sum
    # rounded about once, not 64 times: exp turns gc's error into a relative error of every decay.
    if IN_ORDER:
        b_hi = tl.zeros([BT, BH], dtype=tl.float32)
        b_lo = tl.zeros([BT, BH], dtype=tl.float32)
        r_hi = tl.zeros([BH], dtype=tl.float32)
        r_lo = tl.zeros([BH], dtype=tl.float32)
        for i in range(BT):
            g_i = tl.sum(tl.where(o_pos[:, None] == i, b_g, 0.0), 0)        # g_i (the other terms: zeros)
            r_hi, r_lo = _pair_add(r_hi, r_lo, g_i, tl.zeros_like(g_i))
            b_hi = tl.where(o_pos[:, None] == i, r_hi[None, :], b_hi)
            b_lo = tl.where(o_pos[:, None] == i, r_lo[None, :], b_lo)
    else:
        b_hi, b_lo = tl.associative_scan((b_g, tl.zeros_like(b_g)), 0, _pair_add)   # [BT, BH] each
    b_gr = tl.associative_scan(tl.where(b_reset, o_pos[:, None], -1), 0, _maximum)
    is_last = (o_t == tl.minimum(t0 + BT, eos) - 1)[:, None]              # the chunk's last token
    last_hi = tl.sum(tl.where(is_last, b_hi, 0.0), 0)                     # [BH] (one nonzero term: exact)
    last_lo = tl.sum(tl.where(is_last, b_lo, 0.0), 0)
    l_last = tl.max(tl.where(is_last, b_gr, -1), 0)
    tl.store(gc + p, b_hi, mask=m)
    tl.store(gr + p, b_gr.to(gr.dtype.element_ty), mask=m)
    tl.store(gs + p, tl.where(b_gr < 0, b_hi, float("-inf")), mask=m)
    b_ge, _ = _pair_add(last_hi[None, :], last_lo[None, :], -b_hi, -b_lo)     # b_C - b_i, rounded once
    tl.store(ge + p, tl.where(o_pos[:, None] >= l_last[None, :], b_ge, float("-inf")), mask=m)


class _Gates(NamedTuple):
    """The chunk form's gates, [B, T, HV] each (see above)."""
    gc: torch.Tensor        # fp32: within-chunk cumulative gate
    gr: torch.Tensor        # int8: chunk position of the latest hard reset, -1 if none
    gs: torch.Tensor        # fp32: exponent of the decay from the chunk's start
    ge: torch.Tensor        # fp32: exponent of the decay to the chunk's end


def _chunk_cumsum(g: torch.Tensor, A_log, dt_bias, seqs: _Seqs, invariant: bool = False) -> _Gates:
    """g [B, T, HV] (the gate's raw input when A_log is given) -> the chunk gates (``invariant``: summed
    in token order)."""
    b, t, hv = g.shape
    gates = _Gates(*(torch.empty(b, t, hv, dtype=torch.int8 if name == "gr" else torch.float32, device=g.device)
                     for name in _Gates._fields))
    if seqs.nt and b:
        dummy = gates.gc[:0]
        _chunk_cumsum_kernel[(seqs.nt, 1 if seqs.varlen else b)](
            g, _or(A_log, dummy), _or(dt_bias, dummy), *gates, seqs.cu, seqs.chunk_idx, t, HV=hv, BT=CHUNK,
            BH=_pow2(hv, 2), USE_GATE=A_log is not None, HAS_BIAS=dt_bias is not None, IS_VARLEN=seqs.varlen,
            IN_ORDER=invariant, num_warps=4)
    return gates


# ----------------------------------------------------------------------------- 2. kkt + solve
# A chunk's 64 rows are four 16-row blocks: the ten lower 16x16 blocks of K K^T are gated, the
# four diagonal ones inverted in registers (_inv_unit_lower16), and the inverse assembled blockwise:
#   Ai_rc = -Ai_rr * sum_{c <= m < r} A_rm Ai_mc   for r > c   (fla's solve_tril merge).
# Cost per chunk: K K^T 2C^2K + the solve ~C^3/3; minimum bytes: k and beta read, A written
# (T HV C e), plus the gates.

@triton.jit
def _rows(ptr, o_t, m_t, o_d, m_d, stride_t, head, D: tl.constexpr):
    """[rows, cols] block of a token-major [T, heads, D] tensor."""
    return tl.load(ptr + (o_t[:, None] * stride_t + head) * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :],
                   other=0)


@triton.jit
def _rows_times_state(x, p_s, o_t, m_t, stride_t, head, o_v, m_v, K: tl.constexpr, V: tl.constexpr,
                      BKR: tl.constexpr, PREC: tl.constexpr):
    """X[rows, :] S: [rows, BV] fp32, S a [K, V] state stored at p_s, read in K blocks of BKR (fp32
    FMA products hold a whole reduction row per thread: short blocks keep that in registers)."""
    b_acc = tl.zeros([o_t.shape[0], o_v.shape[0]], dtype=tl.float32)
    for i_k in range(0, K, BKR):
        o_k = i_k + tl.arange(0, BKR)
        m_k = o_k < K
        b_s = tl.load(p_s + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_acc += tl.dot(_rows(x, o_t, m_t, o_k, m_k, stride_t, head, K), b_s, input_precision=PREC)
    return b_acc


@triton.jit
def _gate_block(b_a, g_r, l_r, beta_r, g_c, C0: tl.constexpr, m_r, DIAG: tl.constexpr):
    """beta_i exp(gc_i - gc_j) * (k_i . k_j) on the strictly lower part, for columns j >= l_i (no hard
    reset in (j, i]; the block's columns start at chunk position C0); exponent -inf (so 0) elsewhere."""
    o = tl.arange(0, 16)
    keep = m_r[:, None] & (o[:, None] > o[None, :]) if DIAG else m_r[:, None] & (o[None, :] >= 0)
    return b_a * beta_r[:, None] * _decay(g_r[:, None] - g_c[None, :], keep & (C0 + o[None, :] >= l_r[:, None]))


@triton.jit
def _inv_unit_lower16(b_a):
    """(I + A)^-1 of a strictly lower 16x16 block by recursive doubling of the block diagonal:
    if X inverts the s x s diagonal blocks, then within each 2s x 2s diagonal block
        [[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]],
    i.e. X <- X - X (A masked to the L21 positions) X.  From X = I: s = 1 needs no product,
    then s = 2, 4, 8: six 16x16 fp32 products (forward substitution would need 15 dependent
    row steps, each a cross-thread reduction)."""
    o = tl.arange(0, 16)
    r, c = o[:, None], o[None, :]
    b_x = (r == c).to(tl.float32) - tl.where((r // 2 == c // 2) & (r != c), b_a, 0.0)
    b_x -= tl.dot(tl.dot(b_x, tl.where((r // 4 == c // 4) & (r // 2 != c // 2), b_a, 0.0), input_precision="ieee"),
                  b_x, input_precision="ieee")
    b_x -= tl.dot(tl.dot(b_x, tl.where((r // 8 == c // 8) & (r // 4 != c // 4), b_a, 0.0), input_precision="ieee"),
                  b_x, input_precision="ieee")
    b_x -= tl.dot(tl.dot(b_x, tl.where(r // 8 != c // 8, b_a, 0.0), input_precision="ieee"), b_x,
                  input_precision="ieee")
    return b_x


@triton.jit(do_not_specialize=["T"])
def _chunk_kkt_solve_kernel(k, gc, gr, beta, A, cu, chunk_idx, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos, _ = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_s = tl.arange(0, 16)
    o_t0 = t0 + o_s
    o_t1, o_t2, o_t3 = o_t0 + 16, o_t0 + 32, o_t0 + 48
    m_t0, m_t1, m_t2, m_t3 = o_t0 < eos, o_t1 < eos, o_t2 < eos, o_t3 < eos
    # the 10 lower 16x16 blocks of K K^T
    b_a00 = tl.zeros([16, 16], dtype=tl.float32)
    b_a10, b_a11, b_a20, b_a21, b_a22 = b_a00, b_a00, b_a00, b_a00, b_a00
    b_a30, b_a31, b_a32, b_a33 = b_a00, b_a00, b_a00, b_a00
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_k0 = _rows(k, o_t0, m_t0, o_k, m_k, H, i_h, K)
        b_k1 = _rows(k, o_t1, m_t1, o_k, m_k, H, i_h, K)
        b_k2 = _rows(k, o_t2, m_t2, o_k, m_k, H, i_h, K)
        b_k3 = _rows(k, o_t3, m_t3, o_k, m_k, H, i_h, K)
        b_a00 += tl.dot(b_k0, tl.trans(b_k0), input_precision=PREC)
        b_a10 += tl.dot(b_k1, tl.trans(b_k0), input_precision=PREC)
        b_a11 += tl.dot(b_k1, tl.trans(b_k1), input_precision=PREC)
        b_a20 += tl.dot(b_k2, tl.trans(b_k0), input_precision=PREC)
        b_a21 += tl.dot(b_k2, tl.trans(b_k1), input_precision=PREC)
        b_a22 += tl.dot(b_k2, tl.trans(b_k2), input_precision=PREC)
        b_a30 += tl.dot(b_k3, tl.trans(b_k0), input_precision=PREC)
        b_a31 += tl.dot(b_k3, tl.trans(b_k1), input_precision=PREC)
        b_a32 += tl.dot(b_k3, tl.trans(b_k2), input_precision=PREC)
        b_a33 += tl.dot(b_k3, tl.trans(b_k3), input_precision=PREC)
    b_g0 = tl.load(gc + o_t0 * HV + i_hv, mask=m_t0, other=0)
    b_g1 = tl.load(gc + o_t1 * HV + i_hv, mask=m_t1, other=0)
    b_g2 = tl.load(gc + o_t2 * HV + i_hv, mask=m_t2, other=0)
    b_g3 = tl.load(gc + o_t3 * HV + i_hv, mask=m_t3, other=0)
    b_l0 = tl.load(gr + o_t0 * HV + i_hv, mask=m_t0, other=-1)
    b_l1 = tl.load(gr + o_t1 * HV + i_hv, mask=m_t1, other=-1)
    b_l2 = tl.load(gr + o_t2 * HV + i_hv, mask=m_t2, other=-1)
    b_l3 = tl.load(gr + o_t3 * HV + i_hv, mask=m_t3, other=-1)
    b_b0 = tl.load(beta + o_t0 * HV + i_hv, mask=m_t0, other=0).to(tl.float32)
    b_b1 = tl.load(beta + o_t1 * HV + i_hv, mask=m_t1, other=0).to(tl.float32)
    b_b2 = tl.load(beta + o_t2 * HV + i_hv, mask=m_t2, other=0).to(tl.float32)
    b_b3 = tl.load(beta + o_t3 * HV + i_hv, mask=m_t3, other=0).to(tl.float32)
    b_a00 = _gate_block(b_a00, b_g0, b_l0, b_b0, b_g0, 0, m_t0, True)
    b_a11 = _gate_block(b_a11, b_g1, b_l1, b_b1, b_g1, 16, m_t1, True)
    b_a22 = _gate_block(b_a22, b_g2, b_l2, b_b2, b_g2, 32, m_t2, True)
    b_a33 = _gate_block(b_a33, b_g3, b_l3, b_b3, b_g3, 48, m_t3, True)
    b_a10 = _gate_block(b_a10, b_g1, b_l1, b_b1, b_g0, 0, m_t1, False)
    b_a20 = _gate_block(b_a20, b_g2, b_l2, b_b2, b_g0, 0, m_t2, False)
    b_a21 = _gate_block(b_a21, b_g2, b_l2, b_b2, b_g1, 16, m_t2, False)
    b_a30 = _gate_block(b_a30, b_g3, b_l3, b_b3, b_g0, 0, m_t3, False)
    b_a31 = _gate_block(b_a31, b_g3, b_l3, b_b3, b_g1, 16, m_t3, False)
    b_a32 = _gate_block(b_a32, b_g3, b_l3, b_b3, b_g2, 32, m_t3, False)
    b_i00, b_i11 = _inv_unit_lower16(b_a00), _inv_unit_lower16(b_a11)
    b_i22, b_i33 = _inv_unit_lower16(b_a22), _inv_unit_lower16(b_a33)
    # the off-diagonal blocks, the same doubling one level up: Ai_rc = -Ai_rr * sum_{c <= m < r} A_rm Ai_mc
    # (fp32 products: this is the solve, where rounding compounds)
    b_i10 = -tl.dot(tl.dot(b_i11, b_a10, input_precision="ieee"), b_i00, input_precision="ieee")
    b_i21 = -tl.dot(tl.dot(b_i22, b_a21, input_precision="ieee"), b_i11, input_precision="ieee")
    b_i32 = -tl.dot(tl.dot(b_i33, b_a32, input_precision="ieee"), b_i22, input_precision="ieee")
    b_s = tl.dot(b_a20, b_i00, input_precision="ieee") + tl.dot(b_a21, b_i10, input_precision="ieee")
    b_i20 = -tl.dot(b_i22, b_s, input_precision="ieee")
    b_s = tl.dot(b_a31, b_i11, input_precision="ieee") + tl.dot(b_a32, b_i21, input_precision="ieee")
    b_i31 = -tl.dot(b_i33, b_s, input_precision="ieee")
    b_s = (tl.dot(b_a30, b_i00, input_precision="ieee") + tl.dot(b_a31, b_i10, input_precision="ieee")
           + tl.dot(b_a32, b_i20, input_precision="ieee"))
    b_i30 = -tl.dot(b_i33, b_s, input_precision="ieee")
    # row block r of the chunk's [64, 64] inverse: [Ai_r0 .. Ai_rr, 0 ..]
    ty = A.dtype.element_ty
    b_z = tl.zeros([16, 16], dtype=ty)
    p_0 = A + (o_t0[:, None] * HV + i_hv) * BT + o_s[None, :]
    p_1 = A + (o_t1[:, None] * HV + i_hv) * BT + o_s[None, :]
    p_2 = A + (o_t2[:, None] * HV + i_hv) * BT + o_s[None, :]
    p_3 = A + (o_t3[:, None] * HV + i_hv) * BT + o_s[None, :]
    m_0, m_1, m_2, m_3 = m_t0[:, None], m_t1[:, None], m_t2[:, None], m_t3[:, None]
    tl.store(p_0, b_i00.to(ty), mask=m_0)
    tl.store(p_0 + 16, b_z, mask=m_0)
    tl.store(p_0 + 32, b_z, mask=m_0)
    tl.store(p_0 + 48, b_z, mask=m_0)
    tl.store(p_1, b_i10.to(ty), mask=m_1)
    tl.store(p_1 + 16, b_i11.to(ty), mask=m_1)
    tl.store(p_1 + 32, b_z, mask=m_1)
    tl.store(p_1 + 48, b_z, mask=m_1)
    tl.store(p_2, b_i20.to(ty), mask=m_2)
    tl.store(p_2 + 16, b_i21.to(ty), mask=m_2)
    tl.store(p_2 + 32, b_i22.to(ty), mask=m_2)
    tl.store(p_2 + 48, b_z, mask=m_2)
    tl.store(p_3, b_i30.to(ty), mask=m_3)
    tl.store(p_3 + 16, b_i31.to(ty), mask=m_3)
    tl.store(p_3 + 32, b_i32.to(ty), mask=m_3)
    tl.store(p_3 + 48, b_i33.to(ty), mask=m_3)


_KKT_WARPS = 8   # ten 16x16 fp32 blocks live at once: 4 warps sit at the 255-register limit


def _chunk_kkt_solve(k, gates: _Gates, beta, hv: int, seqs: _Seqs) -> torch.Tensor:
    """-> A [B, T, HV, 64] in k's dtype: each chunk's (I + strict-lower(beta K K^T decay))^-1."""
    b, t, h, dk = k.shape
    a = torch.empty(b, t, hv, CHUNK, dtype=k.dtype, device=k.device)
    if seqs.nt:
        grid = (seqs.nt, (1 if seqs.varlen else b) * hv)
        _chunk_kkt_solve_kernel[grid](k, gates.gc, gates.gr, beta, a, seqs.cu, seqs.chunk_idx, t, H=h, HV=hv, K=dk,
                                      BT=CHUNK, BK=min(64, _pow2(dk)), IS_VARLEN=seqs.varlen, PREC=_prec(k.dtype),
                                      num_warps=_KKT_WARPS)
    return a


# ----------------------------------------------------------------------------- 3. w / u
# w = T (beta e^gc K), u = T (beta V).  Cost per chunk 2C^2K + 2C^2V; minimum bytes: k, v, beta, A
# and gs read, w (T HV K e) and u (T HV V e) written.

@triton.jit(do_not_specialize=["T"])
def _chunk_wu_kernel(k, v, beta, gs, A, w, u, cu, chunk_idx, T, H: tl.constexpr, HV: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos, _ = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_j = tl.arange(0, BT)
    b_A = _rows(A, o_t, m_t, o_j, o_j < BT, HV, i_hv, BT)                 # [BT, BT]
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    b_gk = b_beta * tl.exp(tl.load(gs + o_t * HV + i_hv, mask=m_t, other=0))   # from the start: <= 1
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_k = _rows(k, o_t, m_t, o_k, m_k, H, i_h, K)                     # [BT, BK]
        b_w = tl.dot(b_A, (b_k * b_gk[:, None]).to(b_k.dtype), input_precision=PREC)
        tl.store(w + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], b_w.to(w.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        b_v = _rows(v, o_t, m_t, o_v, m_v, HV, i_hv, V)                   # [BT, BV]
        b_u = tl.dot(b_A, (b_v * b_beta[:, None]).to(b_v.dtype), input_precision=PREC)
        tl.store(u + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_u.to(u.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])


def _wu_tiles(dtype, dk: int, dv: int) -> dict:
    """Tensor-core tiles for 16-bit inputs; fp32 (IEEE FMA products, operands replicated per
    thread) needs 16-wide tiles and 8 warps to stay within registers."""
    if dtype == torch.float32:
        return dict(BK=16, BV=16, num_warps=8)
    return dict(BK=min(64, _pow2(dk)), BV=min(64, _pow2(dv)), num_warps=4)


def _chunk_wu(k, v, beta, gates: _Gates, a, seqs: _Seqs):
    """-> (w [B, T, HV, K], u [B, T, HV, V]) in k's dtype."""
    b, t, h, dk = k.shape
    hv, dv = v.shape[2:]
    w = torch.empty(b, t, hv, dk, dtype=k.dtype, device=k.device)
    u = torch.empty_like(v)
    if seqs.nt:
        grid = (seqs.nt, (1 if seqs.varlen else b) * hv)
        _chunk_wu_kernel[grid](k, v, beta, gates.gs, a, w, u, seqs.cu, seqs.chunk_idx, t, H=h, HV=hv, K=dk,
                               V=dv, BT=CHUNK, IS_VARLEN=seqs.varlen, PREC=_prec(k.dtype), **_wu_tiles(k.dtype, dk, dv))
    return w, u


# ----------------------------------------------------------------------------- 4. state pass
# One program per (V block, sequence x value head) walks the chunks in order, holding its [K, BV]
# fp32 state block in registers as up to four [BK, BV] row tiles (K <= 4 BK; separate tiles keep
# every product's reduction at BK, which fp32 FMA products need).  A chunk is taken in row blocks
# of BTS; each tile accumulates the decayed state plus what the blocks add, and becomes the state
# after the last block (_state_rows has the tiles).  key: K, V (tile shapes), NHV (how many
# programs fill the GPU); configs are pruned by K, V, the input dtype and the GPU.
# Cost per chunk: v_new = u - w h 2CKV, K^T v_new 2CKV; minimum bytes: k, w, u, gs, ge read, the
# per-chunk states (T / C HV K V e) and v_new (T HV V e) written, initial / final fp32 states 4 N HV K V
# each; every V block past the first re-reads k and w (K = V = 128 fp16: 1.58 MB unique, 2.11 issued
# at BV 64).

def _prune_state_configs(configs, named_args, **kwargs):
    """(Triton passes the positional arguments as named_args and the constexprs as kwargs.)"""
    args = {**named_args, **kwargs}
    return _state_keep(configs, args["k"].dtype, _arch(args["k"]), args["K"], args["V"])


def _state_keep(configs, dtype, arch: int, dk: int, dv: int):
    """What builds without spills (parity/aot_compile.py), the observatory's pick first.  16-bit: BV 64 on
    sm_90 where the K tiles are unmasked and at most two (K = 64 or 128; masked or four tiles spill at BV
    64, and so does sm_80, which has the same registers for fewer of them in flight), else BV 32 / 16
    on 4 warps (BV 32 only where BV 64 is out: at the same occupancy it moves 1.5x BV 64's bytes).
    fp32 (FMA products): BV 16 on 8 warps."""
    if dtype == torch.float32:
        return [c for c in configs if c.num_warps == 8 and c.kwargs["BV"] == 16]
    wide = arch >= 90 and dk in (64, 128)
    keep = [c for c in configs if c.kwargs["BV"] <= _pow2(dv) and
            (c.kwargs["BV"] == 64 and wide or c.kwargs["BV"] < 64 and c.num_warps == 4)]
    if any(c.kwargs["BV"] == 64 for c in keep):
        keep = [c for c in keep if c.kwargs["BV"] != 32]
    return keep or [c for c in configs if c.num_warps == 4][-1:]


# BV 64 first: at K = V = 128 it moves 2.11 MB where BV 16 moves 5.28 (each V block re-reads k and w);
# one stage (24 KB of shared memory; two stages took 96 KB for the same occupancy, 2 blocks per SM).
_STATE_CONFIGS = [triton.Config({"BV": 64}, num_warps=4, num_stages=1),
                  triton.Config({"BV": 64}, num_warps=8, num_stages=1),
                  triton.Config({"BV": 32}, num_warps=4, num_stages=2),
                  triton.Config({"BV": 16}, num_warps=4, num_stages=2),
                  triton.Config({"BV": 16}, num_warps=8, num_stages=1)]


def _state_rows(dtype, dk: int) -> dict:
    """Row block BTS, K tile BK, and BKR: 0 = v_new = u - w h multiplies the register tiles (16-bit:
    whole chunks on tensor cores); else it reads h back from its store in K blocks of BKR.  fp32 does
    the latter on 16-row blocks: its FMA products hold a whole reduction row per thread, and the
    register-tile products over whole chunks spill at K = 256 (parity/aot_compile.py)."""
    if dtype == torch.float32:
        return dict(BTS=16, BK=min(64, _pow2(dk)), BKR=32)
    return dict(BTS=CHUNK, BK=min(64, _pow2(dk)), BKR=0)


@triton.jit
def _state_tile_update(b_e, kt, o_t, m_t, o_k, m_k, i_h, b_vn, H: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr):
    """b_e + K[rows, tile]^T v_new[rows] (v_new already decayed to the chunk end): [BK, BV]."""
    b_kt = tl.load(kt + (o_t[None, :] * H + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0)
    return tl.dot(b_kt, b_vn.to(b_kt.dtype), b_e, input_precision=PREC)


@triton.jit(do_not_specialize=["T"])
def _chunk_h_kernel(k, w, u, gs, ge, h, v_new, h0, ht, cu, chunk_off, T, NHV, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BTS: tl.constexpr, BK: tl.constexpr,
                    BKR: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos, row0 = _seq_span(cu, chunk_off, i_n, T, BT, IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k1 = tl.arange(0, BK)
    o_k2, o_k3, o_k4 = o_k1 + BK, o_k1 + 2 * BK, o_k1 + 3 * BK
    m_k1, m_k2, m_k3, m_k4 = o_k1 < K, o_k2 < K, o_k3 < K, o_k4 < K
    o_kv = o_k1[:, None] * V + o_v[None, :]                 # tile j starts (j - 1) * BK * V further
    b_h1 = tl.zeros([BK, BV], dtype=tl.float32)
    b_h2, b_h3, b_h4 = b_h1, b_h1, b_h1
    o_state = _state_layout(o_k1, o_v, o_kv, K, STATE_V_FIRST)      # the caller's states
    step = BK if STATE_V_FIRST else BK * V
    if USE_H0:                                              # the initial state, in its layout and dtype
        p_h0 = h0 + i_nh.to(tl.int64) * K * V + o_state
        b_h1 += tl.load(p_h0, mask=m_k1[:, None] & m_v[None, :], other=0).to(tl.float32)
        if K > BK:
            b_h2 += tl.load(p_h0 + step, mask=m_k2[:, None] & m_v[None, :], other=0).to(tl.float32)
        if K > 2 * BK:
            b_h3 += tl.load(p_h0 + 2 * step, mask=m_k3[:, None] & m_v[None, :], other=0).to(tl.float32)
        if K > 3 * BK:
            b_h4 += tl.load(p_h0 + 3 * step, mask=m_k4[:, None] & m_v[None, :], other=0).to(tl.float32)
    for i_c in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_c * BT
        d_last = tl.exp(tl.load(gs + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv))   # the whole chunk's decay
        # the state at the chunk's start, for the output kernel
        p_hc = h + ((row0 + i_c).to(tl.int64) * HV + i_hv) * K * V       # this chunk's [K, V] state
        p_h = p_hc + o_kv
        tl.store(p_h, b_h1.to(h.dtype.element_ty), mask=m_k1[:, None] & m_v[None, :])
        if K > BK:
            tl.store(p_h + BK * V, b_h2.to(h.dtype.element_ty), mask=m_k2[:, None] & m_v[None, :])
        if K > 2 * BK:
            tl.store(p_h + 2 * BK * V, b_h3.to(h.dtype.element_ty), mask=m_k3[:, None] & m_v[None, :])
        if K > 3 * BK:
            tl.store(p_h + 3 * BK * V, b_h4.to(h.dtype.element_ty), mask=m_k4[:, None] & m_v[None, :])
        if BKR:
            tl.debug_barrier()                                  # the state stored above is read back below
        # the chunk's end state, per tile: exp(gc_last) h plus what the row blocks add (the products
        # read h at the chunk's start: from its store, or the tiles b_h*, unchanged until the loop ends)
        b_e1, b_e2, b_e3, b_e4 = b_h1 * d_last, b_h2 * d_last, b_h3 * d_last, b_h4 * d_last
        for i_s in range(0, BT, BTS):
            o_t = t0 + i_s + tl.arange(0, BTS)
            m_t = o_t < eos
            # v_new = u - w h
            b_vn = _rows(u, o_t, m_t, o_v, m_v, HV, i_hv, V).to(tl.float32)   # [BTS, BV]
            if BKR:                                             # h read back from its store above
                b_vn -= _rows_times_state(w, p_hc, o_t, m_t, HV, i_hv, o_v, m_v, K, V, BKR, PREC)
            else:
                b_w = _rows(w, o_t, m_t, o_k1, m_k1, HV, i_hv, K)             # [BTS, BK]
                b_vn -= tl.dot(b_w, b_h1.to(b_w.dtype), input_precision=PREC)
                if K > BK:
                    b_w = _rows(w, o_t, m_t, o_k2, m_k2, HV, i_hv, K)
                    b_vn -= tl.dot(b_w, b_h2.to(b_w.dtype), input_precision=PREC)
                if K > 2 * BK:
                    b_w = _rows(w, o_t, m_t, o_k3, m_k3, HV, i_hv, K)
                    b_vn -= tl.dot(b_w, b_h3.to(b_w.dtype), input_precision=PREC)
                if K > 3 * BK:
                    b_w = _rows(w, o_t, m_t, o_k4, m_k4, HV, i_hv, K)
                    b_vn -= tl.dot(b_w, b_h4.to(b_w.dtype), input_precision=PREC)
            tl.store(v_new + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])
            # what the rows write, decayed to the chunk's end: exp(gc_last - gc_j) <= 1
            b_vn = b_vn * tl.exp(tl.load(ge + o_t * HV + i_hv, mask=m_t, other=0))[:, None]
            b_e1 = _state_tile_update(b_e1, k, o_t, m_t, o_k1, m_k1, i_h, b_vn, H, K, PREC)
            if K > BK:
                b_e2 = _state_tile_update(b_e2, k, o_t, m_t, o_k2, m_k2, i_h, b_vn, H, K, PREC)
            if K > 2 * BK:
                b_e3 = _state_tile_update(b_e3, k, o_t, m_t, o_k3, m_k3, i_h, b_vn, H, K, PREC)
            if K > 3 * BK:
                b_e4 = _state_tile_update(b_e4, k, o_t, m_t, o_k4, m_k4, i_h, b_vn, H, K, PREC)
        b_h1, b_h2, b_h3, b_h4 = b_e1, b_e2, b_e3, b_e4
    if STORE_FINAL:                                         # fp32, in the initial state's layout
        p_ht = ht + i_nh.to(tl.int64) * K * V + o_state
        tl.store(p_ht, b_h1, mask=m_k1[:, None] & m_v[None, :])
        if K > BK:
            tl.store(p_ht + step, b_h2, mask=m_k2[:, None] & m_v[None, :])
        if K > 2 * BK:
            tl.store(p_ht + 2 * step, b_h3, mask=m_k3[:, None] & m_v[None, :])
        if K > 3 * BK:
            tl.store(p_ht + 3 * step, b_h4, mask=m_k4[:, None] & m_v[None, :])


_chunk_h_tuned = triton.autotune(_STATE_CONFIGS, key=["K", "V", "NHV"],
                                 prune_configs_by={"early_config_prune": _prune_state_configs})(_chunk_h_kernel)


def _chunk_h(k, w, u, gates: _Gates, initial_state, output_final_state: bool, state_v_first: bool, seqs: _Seqs,
             invariant: bool = False):
    """-> (h [rows, HV, K, V] per-chunk start states in k's dtype, v_new [B, T, HV, V], final fp32 or None).
    The initial and final states are [N, HV, K, V], or [N, HV, V, K] with state_v_first."""
    b, t, h, dk = k.shape
    hv, dv = u.shape[2:]
    states = torch.empty(seqs.rows, hv, dk, dv, dtype=k.dtype, device=k.device)
    v_new = torch.empty_like(u)
    final = torch.empty(_state_shape(seqs.n, hv, dk, dv, state_v_first), dtype=torch.float32,
                        device=k.device) if output_final_state else None
    dummy = torch.empty(1, dtype=torch.float32, device=k.device)
    nhv = seqs.n * hv
    if nhv == 0:
        return states, v_new, final
    args = (k, w, u, gates.gs, gates.ge, states, v_new, _or(initial_state, dummy), _or(final, dummy), seqs.cu,
            seqs.chunk_off, t, triton.next_power_of_2(nhv))
    meta = dict(H=h, HV=hv, K=dk, V=dv, BT=CHUNK, **_state_rows(k.dtype, dk), USE_H0=initial_state is not None,
                STORE_FINAL=final is not None, STATE_V_FIRST=state_v_first, IS_VARLEN=seqs.varlen,
                PREC=_prec(k.dtype))
    _launch(_chunk_h_tuned, lambda c: (triton.cdiv(dv, c["BV"]), nhv), args, meta, fixed=invariant)
    return states, v_new, final


# ----------------------------------------------------------------------------- 5. output
# o = scale (e^gc q S + (q K^T * Gamma) v_new).  Cost per chunk: q S 2CKV, q K^T 2C^2K, (.) v_new
# 2C^2V; minimum bytes: q, k, v_new, the states, gc, gr read, o written; each V block past the
# first re-reads q, k and recomputes q K^T (BV = V: none).

# key: K, V.  16-bit inputs: BV 64 or 128 (128 computes q K^T once for V = 128), 8 warps; fp32
# (FMA products): 32-wide tiles.  Chosen so that no K <= 256 spills (parity/aot_compile.py).
# BV 128 first: for V = 128 it computes q K^T once and moves 1.58 MB where BV 64 moves 2.11.
_OUT_CONFIGS = [triton.Config({"BV": 128}, num_warps=8, num_stages=1),
                triton.Config({"BV": 64}, num_warps=8, num_stages=2),
                triton.Config({"BV": 32}, num_warps=8, num_stages=1)]


def _prune_out_configs(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    if args["q"].dtype == torch.float32:
        return [c for c in configs if c.kwargs["BV"] == 32]
    return [c for c in configs if c.kwargs["BV"] != 32 and c.kwargs["BV"] <= _pow2(args["V"], 64)]


@triton.jit(do_not_specialize=["T"])
def _chunk_o_kernel(q, k, v_new, h, gc, gr, o, cu, chunk_idx, scale, T, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos, i_row = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_s = tl.zeros([BT, BT], dtype=tl.float32)
    p_h = h + (i_row.to(tl.int64) * HV + i_hv) * K * V
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_q = _rows(q, o_t, m_t, o_k, m_k, H, i_h, K)                     # [BT, BK]
        b_kt = tl.load(k + (o_t[None, :] * H + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                       other=0)                                              # [BK, BT]
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_o += tl.dot(b_q, b_h, input_precision=PREC)
        b_s += tl.dot(b_q, b_kt, input_precision=PREC)
    b_g = tl.load(gc + o_t * HV + i_hv, mask=m_t, other=0)
    b_l = tl.load(gr + o_t * HV + i_hv, mask=m_t, other=-1)
    o_j = tl.arange(0, BT)
    keep = m_t[:, None] & (o_j[:, None] >= o_j[None, :]) & (o_j[None, :] >= b_l[:, None])
    b_s = b_s * _decay(b_g[:, None] - b_g[None, :], keep)
    b_vn = _rows(v_new, o_t, m_t, o_v, m_v, HV, i_hv, V)                  # [BT, BV]
    b_o = b_o * _decay(b_g, b_l < 0)[:, None] + tl.dot(b_s.to(b_vn.dtype), b_vn, input_precision=PREC)
    tl.store(o + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


_chunk_o_tuned = triton.autotune(_OUT_CONFIGS, key=["K", "V"],
                                 prune_configs_by={"early_config_prune": _prune_out_configs})(_chunk_o_kernel)


def _chunk_o(q, k, v_new, states, gates: _Gates, scale: float, seqs: _Seqs, invariant: bool = False) -> torch.Tensor:
    b, t, h, dk = q.shape
    hv, dv = v_new.shape[2:]
    o = torch.empty_like(v_new)
    if not seqs.nt or not hv:
        return o
    nbh = (1 if seqs.varlen else b) * hv
    args = (q, k, v_new, states, gates.gc, gates.gr, o, seqs.cu, seqs.chunk_idx, scale, t)
    bk = 32 if q.dtype == torch.float32 else min(64, _pow2(dk))
    meta = dict(H=h, HV=hv, K=dk, V=dv, BT=CHUNK, BK=bk, IS_VARLEN=seqs.varlen, PREC=_prec(q.dtype))
    _launch(_chunk_o_tuned, lambda c: (triton.cdiv(dv, c["BV"]), seqs.nt, nbh), args, meta, fixed=invariant)
    return o


# ----------------------------------------------------------------------------- recurrent (decode)

# Batch and split invariance (the guarantee in the module docstring), by construction: a program reads
# only its own sequence; its tiles are a fixed function of K and V (_rec_config: no autotuner, no
# choice that depends on T, N or the batch); each token runs the same code on the state it holds in
# fp32 registers, which a split carries bit for bit (read as it was written: no "0 + h0", which would
# turn a -0.0 into +0.0).  The constexprs that differ between such calls (IS_VARLEN, USE_H0,
# STORE_FINAL) change only integers and memory traffic, never the floating-point expression of a
# token's step (parity/test_gated_deltanet.py checks the bits in the interpreter).  The backward
# is invariant the same way: fixed tiles (_rec_bwd_tiles), per-token partials summed on the host
# over the V blocks in a fixed order.
# Cost per token and value head: 7KV FLOPs (decay, h^T k, k u^T, h^T q; none of it a matmul) plus
# the gate and norms; minimum bytes: the fp32 state read once and written once per call, 2 HV K V 4
# per sequence, plus q, k, v, g, beta, o (q and k are re-read by each of the V / BV programs of a head).

def _rec_config(dk: int, dv: int) -> dict:
    """The recurrent kernel's tiles: at most 32 fp32 state values per thread (BK BV / (32 num_warps)
    <= 32), which builds to 80 registers on sm_90 (95 for fp32 at K = 256) and <= 96 on sm_80 at
    K <= 256 with every option (parity/aot_compile.py; 64 values a thread took 155).  BV = 32 for
    K <= 128 (16 at K = 256) on up to 4 warps: the least re-reading of q and k among such tiles,
    reductions over K kept within 4 warps.  The same tiles for every dtype and GPU."""
    bk = _pow2(dk)
    bv = min(_pow2(dv, 8), 32, 4096 // bk)
    return dict(BV=bv, num_warps=max(1, bk * bv // 1024), num_stages=1)


@triton.jit(do_not_specialize=["T"])
def _recurrent_kernel(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu, scale, T, H: tl.constexpr,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr,
                      USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, BETA_ACT: tl.constexpr,
                      STATE_V_FIRST: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_state = _state_layout(o_k, o_v, o_k[:, None] * V + o_v[None, :], K, STATE_V_FIRST)
    if USE_H0:                                              # the state, read once, bit for bit
        b_h = tl.load(h0 + i_nh.to(tl.int64) * K * V + o_state, mask=m_kv, other=0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_g, b_beta = _rec_gates(g, beta, A_log, dt_bias, t, i_hv, HV, USE_GATE, HAS_BIAS, BETA_ACT)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_h = b_h * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))              # [BV]
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_FINAL:                                         # written once, fp32, in the initial state's layout
        tl.store(ht + i_nh.to(tl.int64) * K * V + o_state, b_h, mask=m_kv)


# ----------------------------------------------------------------------------- chunk backward kernels

@triton.jit
def _cols(ptr, o_t, m_t, o_d, m_d, stride_t, head, D: tl.constexpr):
    """[cols, rows] block (the transpose) of a token-major [T, heads, D] tensor."""
    return tl.load(ptr + (o_t[None, :] * stride_t + head) * D + o_d[:, None], mask=m_d[:, None] & m_t[None, :],
                   other=0)


# a. dv_local = (K q^T * Gamma^T) dO within each chunk (dv's intra-chunk part, dU's seed).  Cost per chunk
# 2C^2K + 2C^2V; minimum bytes: q, k, dO, gc, gr read, dv_local (T HV V e) written.

@triton.jit(do_not_specialize=["T"])
def _chunk_dv_local_kernel(q, k, gc, gr, do, dv, cu, chunk_idx, scale, T, H: tl.constexpr, HV: tl.constexpr,
                           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos, _ = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    b_s = tl.zeros([BT, BT], dtype=tl.float32)             # [j, i] = k_j . q_i
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_s += tl.dot(_rows(k, o_t, m_t, o_k, m_k, H, i_h, K), _cols(q, o_t, m_t, o_k, m_k, H, i_h, K),
                      input_precision=PREC)
    b_g = tl.load(gc + o_t * HV + i_hv, mask=m_t, other=0)
    b_l = tl.load(gr + o_t * HV + i_hv, mask=m_t, other=-1)
    o_j = tl.arange(0, BT)
    keep = m_t[None, :] & (o_j[:, None] <= o_j[None, :]) & (o_j[:, None] >= b_l[None, :])
    b_s = b_s * scale * _decay(b_g[None, :] - b_g[:, None], keep)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        b_do = _rows(do, o_t, m_t, o_v, m_v, HV, i_hv, V)
        b_dv = tl.dot(b_s.to(b_do.dtype), b_do, input_precision=PREC)
        tl.store(dv + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])


def _bwd_tiles(kernel: str, dtype, arch: int, dk: int, dv: int) -> dict:
    """Tiles of the chunk-parallel backward kernels, per input dtype and GPU: what builds without spills
    (parity/aot_compile.py).  fp32 (IEEE FMA products, a whole reduction row per thread) runs narrow
    tiles; 16-bit runs tensor-core tiles, narrower on sm_80 where the sm_90 ones spill, and for dqkwg
    on sm_90 32 wide in V when V <= 64 (a single V block puts the whole chunk's loads in flight at
    once: it spills) and 128 wide in K where K is a multiple of 128: one K block reads v_new, dO and dU
    once (K = V = 128 fp16: 3.17 MB issued, = unique, where 64-wide blocks issued 3.98) at 250-254
    registers and the same occupancy (1 block of 8 warps per SM), with half the programs; masked
    (K = 100) it spills."""
    if dtype == torch.float32:
        bk, bv, warps = 16, 16, 8
    elif kernel == "dv_local" or (kernel == "dqkwg" and arch >= 90):
        bk, bv, warps = 64, (32 if kernel == "dqkwg" and dv <= 64 else 64), 8
        if kernel == "dqkwg" and dk % 128 == 0:
            bk = 128
    elif kernel == "wy":
        bk, bv, warps = 32, 32, 8
    else:                                   # dqkwg on sm_80
        bk, bv, warps = 32, 32, 4
    return dict(BK=min(bk, _pow2(dk)), BV=min(bv, _pow2(dv)), num_warps=warps, num_stages=2)


def _chunk_dv_local(q, k, gates: _Gates, do, scale: float, seqs: _Seqs) -> torch.Tensor:
    b, t, h, dk = q.shape
    hv, dv = do.shape[2:]
    out = torch.empty_like(do)
    if seqs.nt and hv:
        tiles = _bwd_tiles("dv_local", q.dtype, _arch(q), dk, dv)
        _chunk_dv_local_kernel[(seqs.nt, (1 if seqs.varlen else b) * hv)](
            q, k, gates.gc, gates.gr, do, out, seqs.cu, seqs.chunk_idx, scale, t, H=h, HV=hv, K=dk, V=dv, BT=CHUNK,
            IS_VARLEN=seqs.varlen, PREC=_prec(q.dtype), **tiles)
    return out


# b. the reverse state pass.  One program per (V block, sequence x value head), like kernel 4: dS' as up
# to four [BK, BV] fp32 row tiles.  A chunk is taken in row blocks of BTS (64 for 16-bit inputs; 16 for
# fp32, whose FMA products hold a whole reduction row per thread, and which reads dS' back from its
# store for K dS': _dhu_rows).  key: K, V, NHV; configs pruned by dtype and GPU (sm_80 has fewer
# registers per thread for the BV = 64 tiles than sm_90 needs).
# Cost per chunk 6CKV (dS' += q dO^T - w dU^T per chunk, dU = dv_local + K dS'); minimum bytes: q,
# k, w, dO, dv_local, gs, ge read, dS' per chunk (T / C HV K V e) and dU written; each V block past
# the first re-reads q, k and w (K = V = 128 fp16: 2.11 MB unique, 2.90 issued at BV 64).

@triton.jit
def _k_dstate(k, o_t, m_t, o_k, m_k, i_h, b_dh, H: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr):
    """K[rows, tile] dS'_tile: [BTS, BV]."""
    b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
    return tl.dot(b_k, b_dh.to(b_k.dtype), input_precision=PREC)


@triton.jit
def _dstate_tile_update(b_e, q, w, o_t, m_t, o_k, m_k, i_h, i_hv, b_qs, b_do, b_dv, H: tl.constexpr,
                        HV: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr):
    """b_e + (b_qs * Q[rows, tile])^T dO - W[rows, tile]^T dU: [BK, BV]."""
    b_qt = _cols(q, o_t, m_t, o_k, m_k, H, i_h, K)                      # [BK, BTS]
    b_wt = _cols(w, o_t, m_t, o_k, m_k, HV, i_hv, K)
    b_e = tl.dot((b_qt * b_qs[None, :]).to(b_qt.dtype), b_do, b_e, input_precision=PREC)
    return tl.dot(b_wt, (-b_dv).to(b_wt.dtype), b_e, input_precision=PREC)


@triton.jit(do_not_specialize=["T"])
def _chunk_dhu_kernel(q, k, w, gs, ge, do, dv_local, dv, dh, dht, dh0, cu, chunk_off, scale, T, NHV,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BTS: tl.constexpr, BK: tl.constexpr, BKR: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr,
                      STORE_DH0: tl.constexpr, STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
                      PREC: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos, row0 = _seq_span(cu, chunk_off, i_n, T, BT, IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k1 = tl.arange(0, BK)
    o_k2, o_k3, o_k4 = o_k1 + BK, o_k1 + 2 * BK, o_k1 + 3 * BK
    m_k1, m_k2, m_k3, m_k4 = o_k1 < K, o_k2 < K, o_k3 < K, o_k4 < K
    o_kv = o_k1[:, None] * V + o_v[None, :]                 # tile j starts (j - 1) * BK * V further
    b_dh1 = tl.zeros([BK, BV], dtype=tl.float32)
    b_dh2, b_dh3, b_dh4 = b_dh1, b_dh1, b_dh1
    o_state = _state_layout(o_k1, o_v, o_kv, K, STATE_V_FIRST)      # the caller's states
    step = BK if STATE_V_FIRST else BK * V
    if USE_DHT:                                             # the final state's gradient, in its layout
        p_dht = dht + i_nh.to(tl.int64) * K * V + o_state
        b_dh1 += tl.load(p_dht, mask=m_k1[:, None] & m_v[None, :], other=0)
        if K > BK:
            b_dh2 += tl.load(p_dht + step, mask=m_k2[:, None] & m_v[None, :], other=0)
        if K > 2 * BK:
            b_dh3 += tl.load(p_dht + 2 * step, mask=m_k3[:, None] & m_v[None, :], other=0)
        if K > 3 * BK:
            b_dh4 += tl.load(p_dht + 3 * step, mask=m_k4[:, None] & m_v[None, :], other=0)
    n_c = tl.cdiv(eos - bos, BT)
    for i_r in range(0, n_c):
        i_c = n_c - 1 - i_r                                     # chunks in reverse
        t0 = bos + i_c * BT
        d_last = tl.exp(tl.load(gs + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv))   # the whole chunk's decay
        # this chunk's dS' (the gradient of its end state), for kernel c
        p_dhc = dh + ((row0 + i_c).to(tl.int64) * HV + i_hv) * K * V     # this chunk's [K, V] dS'
        p_dh = p_dhc + o_kv
        ty = dh.dtype.element_ty
        tl.store(p_dh, b_dh1.to(ty), mask=m_k1[:, None] & m_v[None, :])
        if K > BK:
            tl.store(p_dh + BK * V, b_dh2.to(ty), mask=m_k2[:, None] & m_v[None, :])
        if K > 2 * BK:
            tl.store(p_dh + 2 * BK * V, b_dh3.to(ty), mask=m_k3[:, None] & m_v[None, :])
        if K > 3 * BK:
            tl.store(p_dh + 3 * BK * V, b_dh4.to(ty), mask=m_k4[:, None] & m_v[None, :])
        if BKR:
            tl.debug_barrier()                                  # dS' stored above is read back below
        # the previous chunk's dS', per tile: exp(gc_last) dS' plus what the row blocks add (the products
        # read this chunk's dS': from its store, or the tiles b_dh*, unchanged until the loop ends)
        b_e1, b_e2, b_e3, b_e4 = b_dh1 * d_last, b_dh2 * d_last, b_dh3 * d_last, b_dh4 * d_last
        for i_s in range(0, BT, BTS):
            o_t = t0 + i_s + tl.arange(0, BTS)
            m_t = o_t < eos
            b_gs = tl.load(gs + o_t * HV + i_hv, mask=m_t, other=0)   # from the chunk start
            # dU = dU_loc + exp(b_C - b) K dS'
            if BKR:                                             # dS' read back from its store above
                b_dv = _rows_times_state(k, p_dhc, o_t, m_t, H, i_h, o_v, m_v, K, V, BKR, PREC)
            else:
                b_dv = _k_dstate(k, o_t, m_t, o_k1, m_k1, i_h, b_dh1, H, K, PREC)
                if K > BK:
                    b_dv += _k_dstate(k, o_t, m_t, o_k2, m_k2, i_h, b_dh2, H, K, PREC)
                if K > 2 * BK:
                    b_dv += _k_dstate(k, o_t, m_t, o_k3, m_k3, i_h, b_dh3, H, K, PREC)
                if K > 3 * BK:
                    b_dv += _k_dstate(k, o_t, m_t, o_k4, m_k4, i_h, b_dh4, H, K, PREC)
            p_dv = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
            m_dv = m_t[:, None] & m_v[None, :]
            b_dv = (b_dv * tl.exp(tl.load(ge + o_t * HV + i_hv, mask=m_t, other=0))[:, None]
                    + tl.load(dv_local + p_dv, mask=m_dv, other=0).to(tl.float32))
            tl.store(dv + p_dv, b_dv.to(dv.dtype.element_ty), mask=m_dv)
            # dS gets (scale exp(b) Q)^T dO - W^T dU
            b_do = tl.load(do + p_dv, mask=m_dv, other=0)
            b_qs = scale * tl.exp(b_gs)
            b_e1 = _dstate_tile_update(b_e1, q, w, o_t, m_t, o_k1, m_k1, i_h, i_hv, b_qs, b_do, b_dv, H, HV, K, PREC)
            if K > BK:
                b_e2 = _dstate_tile_update(b_e2, q, w, o_t, m_t, o_k2, m_k2, i_h, i_hv, b_qs, b_do, b_dv, H, HV, K,
                                           PREC)
            if K > 2 * BK:
                b_e3 = _dstate_tile_update(b_e3, q, w, o_t, m_t, o_k3, m_k3, i_h, i_hv, b_qs, b_do, b_dv, H, HV, K,
                                           PREC)
            if K > 3 * BK:
                b_e4 = _dstate_tile_update(b_e4, q, w, o_t, m_t, o_k4, m_k4, i_h, i_hv, b_qs, b_do, b_dv, H, HV, K,
                                           PREC)
        b_dh1, b_dh2, b_dh3, b_dh4 = b_e1, b_e2, b_e3, b_e4
    if STORE_DH0:                            # in the initial state's layout (an empty sequence passes dht through)
        p_dh0 = dh0 + i_nh.to(tl.int64) * K * V + o_state
        ty = dh0.dtype.element_ty
        tl.store(p_dh0, b_dh1.to(ty), mask=m_k1[:, None] & m_v[None, :])
        if K > BK:
            tl.store(p_dh0 + step, b_dh2.to(ty), mask=m_k2[:, None] & m_v[None, :])
        if K > 2 * BK:
            tl.store(p_dh0 + 2 * step, b_dh3.to(ty), mask=m_k3[:, None] & m_v[None, :])
        if K > 3 * BK:
            tl.store(p_dh0 + 3 * step, b_dh4.to(ty), mask=m_k4[:, None] & m_v[None, :])


# BV 64 first: at K = V = 128 it moves 2.90 MB where BV 32 moves 4.47 and BV 16 7.64; one stage
# (36 KB of shared memory; two took 128 KB at the same register-bound occupancy).
_DHU_CONFIGS = [triton.Config({"BV": 64}, num_warps=8, num_stages=1),
                triton.Config({"BV": 32}, num_warps=8, num_stages=2),
                triton.Config({"BV": 32}, num_warps=4, num_stages=1),
                triton.Config({"BV": 16}, num_warps=4, num_stages=1),
                triton.Config({"BV": 16}, num_warps=8, num_stages=1)]   # the last: fp32


def _prune_dhu_configs(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    return _dhu_keep(configs, args["k"].dtype, _arch(args["k"]), args["K"], args["V"])


def _dhu_keep(configs, dtype, arch: int, dk: int, dv: int):
    """What builds without spills (parity/aot_compile.py), the observatory's pick first.  fp32: BV 16 on
    8 warps.  16-bit: BV 64 on sm_90 for K <= 128; BV 32 on 8 warps on sm_90, or on sm_80 for unmasked
    K <= 128 (64, 128); BV 32 on 4 warps for K <= 128; BV 16.  On sm_90 at K <= 128 the 4-warp ones
    are dropped: BV 32 on 8 warps moves the same bytes as BV 32 on 4 at a higher occupancy, and
    BV 16's bytes (1.7x) at the same occupancy."""
    if dtype == torch.float32:
        return configs[-1:]
    sm90 = arch >= 90
    ok = {(64, 8): sm90 and dk <= 128, (32, 8): sm90 or dk in (64, 128), (32, 4): dk <= 128, (16, 4): True}
    keep = [c for c in configs if ok.get((c.kwargs["BV"], c.num_warps), False) and c.kwargs["BV"] <= _pow2(dv)]
    if sm90 and dk <= 128 and any(c.kwargs["BV"] == 32 and c.num_warps == 8 for c in keep):
        keep = [c for c in keep if c.num_warps == 8]
    return keep or configs[-2:-1]


def _dhu_rows(dtype, dk: int) -> dict:
    """Row block BTS (a loop, not unrolled: unrolled, the fp32 products' operands all stay live), K tile
    BK, and BKR as in _state_rows: fp32 reads dS' back for dU = K dS' (from the register tiles it spills
    at K = 256 on every config)."""
    if dtype == torch.float32:
        return dict(BTS=16, BK=min(64, _pow2(dk)), BKR=32)
    return dict(BTS=CHUNK, BK=min(64, _pow2(dk)), BKR=0)


_chunk_dhu_tuned = triton.autotune(_DHU_CONFIGS, key=["K", "V", "NHV"],
                                   prune_configs_by={"early_config_prune": _prune_dhu_configs})(_chunk_dhu_kernel)


def _chunk_dhu(q, k, w, gates: _Gates, do, dv_local, dht, initial_state, scale: float, state_v_first: bool,
               seqs: _Seqs, invariant: bool = False):
    """-> (dS' per chunk [rows, HV, K, V] in q's dtype, dU [B, T, HV, V], d initial_state in its dtype and
    layout, or an empty tensor without one)."""
    b, t, h, dk = q.shape
    hv, dv = do.shape[2:]
    dstates = torch.empty(seqs.rows, hv, dk, dv, dtype=q.dtype, device=q.device)
    du = torch.empty_like(do)
    dh0 = _state_grad(initial_state)
    nhv = seqs.n * hv
    if nhv == 0:
        return dstates, du, _or(dh0, q.new_empty(0, dtype=torch.float32))
    dummy = torch.empty(1, dtype=torch.float32, device=q.device)
    args = (q, k, w, gates.gs, gates.ge, do, dv_local, du, dstates, _or(dht, dummy), _or(dh0, dummy), seqs.cu,
            seqs.chunk_off, scale, t, triton.next_power_of_2(nhv))
    meta = dict(H=h, HV=hv, K=dk, V=dv, BT=CHUNK, **_dhu_rows(q.dtype, dk), USE_DHT=dht is not None,
                STORE_DH0=dh0 is not None, STATE_V_FIRST=state_v_first, IS_VARLEN=seqs.varlen, PREC=_prec(q.dtype))
    _launch(_chunk_dhu_tuned, lambda c: (triton.cdiv(dv, c["BV"]), nhv), args, meta, fixed=invariant)
    return dstates, du, dh0


@triton.jit
def _straddling(b_p, BT: tl.constexpr):
    """Pair terms P_ij (i > j; +P to db_i, -P to db_j) reach dg_t only when i >= t > j: their sum over
    that rectangle, computed directly (a reverse cumsum of rowsum - colsum would cancel O(1) terms)."""
    o_j = tl.arange(0, BT)
    return tl.sum(tl.where(o_j[None, :] < o_j[:, None], tl.cumsum(b_p, axis=0, reverse=True), 0.0), 1)


# c. dq, dk (per value head), dw and the gate gradient's local terms.  One program per (K block,
# chunk, value head); db holds NB = 2 (NK + 1) fp32 partials per token, a (single-term sum, pair sum)
# per K block here and one from d.
# Cost per chunk 6C^2K + 2C^2V + 6CKV; minimum bytes: q, k, v_new, dO, dU, the states and dS' read, dq,
# dk, dw (T HV K e each) and db written; each K block past the first re-reads v_new, dO and dU.

@triton.jit(do_not_specialize=["T"])
def _chunk_dqkwg_kernel(q, k, v_new, gc, gr, gs, ge, h, do, dh, dv, dq, dk, dw, db, cu, chunk_idx, scale, T,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr, IS_VARLEN: tl.constexpr,
                        PREC: tl.constexpr):
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos, i_row = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    p_h = h + (i_row.to(tl.int64) * HV + i_hv) * K * V
    p_dh = dh + (i_row.to(tl.int64) * HV + i_hv) * K * V
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgl = tl.zeros([BK], dtype=tl.float32)                # <S, dS'> over this K block, per row of S
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        b_vn = _rows(v_new, o_t, m_t, o_v, m_v, HV, i_hv, V)           # [BT, BV]
        b_do = _rows(do, o_t, m_t, o_v, m_v, HV, i_hv, V)
        b_du = _rows(dv, o_t, m_t, o_v, m_v, HV, i_hv, V)
        m_hv = m_v[:, None] & m_k[None, :]
        b_ht = tl.load(p_h + o_k[None, :] * V + o_v[:, None], mask=m_hv, other=0)     # [BV, BK] = S^T
        b_dht = tl.load(p_dh + o_k[None, :] * V + o_v[:, None], mask=m_hv, other=0)
        b_ds += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dq += tl.dot(b_do, b_ht, input_precision=PREC)
        b_dk += tl.dot(b_vn, b_dht, input_precision=PREC)
        b_dw += tl.dot(b_du, b_ht, input_precision=PREC)
        b_dgl += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), 0)
    b_q = _rows(q, o_t, m_t, o_k, m_k, H, i_h, K)                     # [BT, BK]
    b_k = _rows(k, o_t, m_t, o_k, m_k, H, i_h, K)
    b_g = tl.load(gc + o_t * HV + i_hv, mask=m_t, other=0)
    b_l = tl.load(gr + o_t * HV + i_hv, mask=m_t, other=-1)
    b_gs = tl.load(gs + o_t * HV + i_hv, mask=m_t, other=0)
    t_last = tl.minimum(t0 + BT, eos) - 1
    is_last = o_t == t_last
    # inter-chunk terms: o_i reads exp(b_i) S; S' gets exp(b_C) S (singles) and exp(b_C - b_j) k_j U_j^T
    # (pairs (C, j): x_j; j = C cancels)
    b_dq = b_dq * (scale * tl.exp(b_gs))[:, None]
    b_single = (tl.sum(b_dq * b_q.to(tl.float32), 1)
                + tl.where(is_last, tl.exp(b_gs) * tl.sum(b_dgl), 0.0))
    b_dk = b_dk * tl.exp(tl.load(ge + o_t * HV + i_hv, mask=m_t, other=0))[:, None]
    b_x = tl.sum(b_dk * b_k.to(tl.float32), 1)
    o_j = tl.arange(0, BT)
    strict = o_j[:, None] > o_j[None, :]
    b_pairs = tl.where(is_last[:, None] & strict, b_x[None, :], 0.0)
    # intra-chunk terms: dP_ij = scale (dO_i . U_j) Gam_ij (j <= i); pairs dP_ij (q_i . k_j), i > j
    keep = m_t[:, None] & (o_j[:, None] >= o_j[None, :]) & (o_j[None, :] >= b_l[:, None])
    b_ds = b_ds * scale * _decay(b_g[:, None] - b_g[None, :], keep)
    b_pairs += tl.where(strict, b_ds * tl.dot(b_q, tl.trans(b_k), input_precision=PREC), 0.0)
    b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
    b_dk += tl.dot(tl.trans(b_ds).to(b_q.dtype), b_q, input_precision=PREC)
    p = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    m = m_t[:, None] & m_k[None, :]
    tl.store(dq + p, b_dq.to(dq.dtype.element_ty), mask=m)
    tl.store(dk + p, b_dk.to(dk.dtype.element_ty), mask=m)
    tl.store(dw + p, (-b_dw).to(dw.dtype.element_ty), mask=m)
    tl.store(db + (o_t * HV + i_hv) * NB + 2 * i_k, b_single, mask=m_t)
    tl.store(db + (o_t * HV + i_hv) * NB + 2 * i_k + 1, _straddling(b_pairs, BT), mask=m_t)


def _chunk_dqkwg(q, k, v_new, gates: _Gates, states, do, dstates, du, scale: float, seqs: _Seqs):
    """-> (dq [B, T, HV, K]: q's dtype where HV = H, else fp32 per value head for _group_sum; dk's
    terms from here and dw [B, T, HV, K] in k's dtype (as fla's: d. adds the rest in fp32, rounds once
    more); db fp32 [B, T, HV, 2 (NK + 1)] with slots 0 .. 2 NK - 1 written here)."""
    b, t, h, dk = q.shape
    hv, dv = do.shape[2:]
    tiles = _bwd_tiles("dqkwg", q.dtype, _arch(q), dk, dv)
    nk = triton.cdiv(dk, tiles["BK"])
    dq = torch.empty(b, t, hv, dk, dtype=q.dtype if hv == h else torch.float32, device=q.device)
    dkk = torch.empty(b, t, hv, dk, dtype=k.dtype, device=k.device)
    dw = torch.empty(b, t, hv, dk, dtype=k.dtype, device=k.device)
    db = torch.empty(b, t, hv, 2 * (nk + 1), dtype=torch.float32, device=q.device)
    if seqs.nt and hv:
        _chunk_dqkwg_kernel[(nk, seqs.nt, (1 if seqs.varlen else b) * hv)](
            q, k, v_new, *gates, states, do, dstates, du, dq, dkk, dw, db, seqs.cu, seqs.chunk_idx, scale, t, H=h,
            HV=hv, K=dk, V=dv, BT=CHUNK, NB=2 * (nk + 1), IS_VARLEN=seqs.varlen, PREC=_prec(q.dtype), **tiles)
    return dq, dkk, dw, db


# d. back through the WY representation.  One program per (chunk, value head).  With dKbg = T^T dW and
# dVb = T^T dU (the gradients of beta e^b K and beta V), the solve's gradient needs no [64, 64] x [64, 64]
# product:  dL = -T^T dT T^T = -(dKbg w^T + dVb u^T)  (w = T Kbg, u = T Vb, recomputed in step 0),
# taken on the strictly lower part (T's other entries are constants).
# Cost per chunk 10C^2K + 4C^2V; minimum bytes: k, v, beta, A, w, u, dw, dU, c.'s dk and the gates read,
# dk, dv, dbeta and db written.  16-bit: T^T is loaded once, dw and k are read twice (dKbg recomputed in
# the last loop rather than kept in registers or sent through memory in fp32).

@triton.jit(do_not_specialize=["T"])
def _chunk_wy_bwd_kernel(k, v, beta, gc, gr, gs, A, w, u, dw, du, dk, dk_out, dv, dbeta, db, cu, chunk_idx, T,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr, IS_VARLEN: tl.constexpr,
                         HOLD_T: tl.constexpr, PREC: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    t0, eos, _ = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    o_j = tl.arange(0, BT)
    # T^T: 16-bit, loaded once and held through the three loops (reloaded per block it issued 12 loads
    # per chunk at 32-wide blocks, 1.4 MB of 4.7 at K = V = 128, fp16); fp32 reloads it (held, it spills)
    # and sends dk through dk_out in two passes (HOLD_T is the input's not being fp32)
    p_A = A + (o_t[:, None] * HV + i_hv) * BT + o_j[None, :]
    if HOLD_T:
        b_Th = tl.trans(tl.load(p_A, mask=m_t[:, None], other=0))
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    b_g = tl.load(gc + o_t * HV + i_hv, mask=m_t, other=0)
    b_l = tl.load(gr + o_t * HV + i_hv, mask=m_t, other=-1)
    b_eg = tl.exp(tl.load(gs + o_t * HV + i_hv, mask=m_t, other=0))
    b_bg = b_beta * b_eg
    b_dL = tl.zeros([BT, BT], dtype=tl.float32)                 # -dL until the sign flip below
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)                 # K K^T
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        m = m_t[:, None] & m_k[None, :]
        p_k = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]             # [BT, BK] of a [B, T, HV, K] tensor
        b_kt = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m, other=0)
        b_kk += tl.dot(b_kt, tl.trans(b_kt), input_precision=PREC)
        b_k = b_kt.to(tl.float32)
        if HOLD_T:
            b_At = b_Th
        else:
            b_At = tl.trans(tl.load(p_A, mask=m_t[:, None], other=0))
        b_dkbg = tl.dot(b_At, tl.load(dw + p_k, mask=m, other=0), input_precision=PREC)
        b_dL += tl.dot(b_dkbg.to(w.dtype.element_ty), tl.trans(tl.load(w + p_k, mask=m, other=0)),
                       input_precision=PREC)
        b_x = tl.sum(b_dkbg * b_k, 1)
        b_dbeta += b_x * b_eg
        b_db += b_x * b_bg
        if not HOLD_T:                                          # fp32: dKbg's term goes through dk_out
            tl.store(dk_out + p_k, tl.load(dk + p_k, mask=m, other=0) + b_dkbg * b_bg[:, None], mask=m)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = o_v < V
        m = m_t[:, None] & m_v[None, :]
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        if HOLD_T:
            b_At = b_Th
        else:
            b_At = tl.trans(tl.load(p_A, mask=m_t[:, None], other=0))
        b_dvb = tl.dot(b_At, tl.load(du + p_v, mask=m, other=0), input_precision=PREC)
        b_dL += tl.dot(b_dvb.to(u.dtype.element_ty), tl.trans(tl.load(u + p_v, mask=m, other=0)),
                       input_precision=PREC)
        b_dbeta += tl.sum(b_dvb * tl.load(v + p_v, mask=m, other=0).to(tl.float32), 1)
        tl.store(dv + p_v, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m)
    # L_ij = beta_i Gam_ij k_i . k_j (i > j):  G = dL * Gam; the gradient of k_i . k_j is beta_i G_ij
    strict = m_t[:, None] & (o_j[:, None] > o_j[None, :]) & (o_j[None, :] >= b_l[:, None])
    b_G = -b_dL * _decay(b_g[:, None] - b_g[None, :], strict)
    b_dbeta += tl.sum(b_G * b_kk, 1)
    tl.store(dbeta + o_t * HV + i_hv, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
    tl.store(db + (o_t * HV + i_hv) * NB + NB - 2, b_db, mask=m_t)
    # the gate: pairs beta_i G_ij (k_i . k_j), i > j
    tl.store(db + (o_t * HV + i_hv) * NB + NB - 1, _straddling(b_G * b_beta[:, None] * b_kk, BT), mask=m_t)
    # dk = c.'s terms + dKbg beta e^b + the solve's.  16-bit: dKbg recomputed here (cheaper than a round
    # trip of fp32 dk through memory); fp32: read back from dk_out (recomputed, it spills)
    if not HOLD_T:
        tl.debug_barrier()                                      # dk_out rows stored above are read below
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        m = m_t[:, None] & m_k[None, :]
        p_k = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
        b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m, other=0)
        b_dkl = tl.dot(b_G.to(b_k.dtype), b_k, input_precision=PREC) * b_beta[:, None]     # sum_j beta_i G_ij k_j
        b_dkl += tl.dot(tl.trans(b_G * b_beta[:, None]).to(b_k.dtype), b_k, input_precision=PREC)  # (i <-> j)
        if HOLD_T:
            b_dkbg = tl.dot(b_Th, tl.load(dw + p_k, mask=m, other=0), input_precision=PREC)
            b_dk = tl.load(dk + p_k, mask=m, other=0).to(tl.float32) + b_dkbg * b_bg[:, None] + b_dkl
        else:
            b_dk = tl.load(dk_out + p_k, mask=m, other=0) + b_dkl
        tl.store(dk_out + p_k, b_dk.to(dk_out.dtype.element_ty), mask=m)


def _chunk_wy_bwd(k, v, beta, gates: _Gates, a, w, u, dw, du, dk, db, seqs: _Seqs):
    """Writes db's last two slots; -> (dv, dbeta, dk [B, T, HV, K]: c.'s dk terms plus the WY ones, in
    k's dtype where HV = H, else fp32 per value head for _group_sum)."""
    b, t, h, dkd = k.shape
    hv, dvd = v.shape[2:]
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    dk_out = torch.empty(dk.shape, dtype=k.dtype if hv == h else torch.float32, device=k.device)
    if seqs.nt and hv:
        tiles = _bwd_tiles("wy", k.dtype, _arch(k), dkd, dvd)
        _chunk_wy_bwd_kernel[(seqs.nt, (1 if seqs.varlen else b) * hv)](
            k, v, beta, gates.gc, gates.gr, gates.gs, a, w, u, dw, du, dk, dk_out, dv, dbeta, db, seqs.cu,
            seqs.chunk_idx, t, H=h, HV=hv, K=dkd, V=dvd, BT=CHUNK, NB=db.shape[-1], IS_VARLEN=seqs.varlen,
            HOLD_T=k.dtype != torch.float32, PREC=_prec(k.dtype), **tiles)
    return dv, dbeta, dk_out


# e. dg: sum db's partials in a fixed order, reverse cumulative sum inside each chunk.  With
# use_gate_in_kernel, dg is the gradient of the log decay; the kernel takes it through the gate to the
# gate's raw input (dx = dg * -exp(A_log) sigmoid(x + dt_bias)) and writes each chunk's sums for A_log
# (dg * gate: d gate / d A_log = gate) and dt_bias (dx), summed over the chunks on the host.
# Cost: O(C) FLOPs per chunk (no matmul); minimum bytes: db read (4 NB T HV), dg written.

@triton.jit(do_not_specialize=["T", "NROWS"])
def _chunk_dg_kernel(db, dg, g, A_log, dt_bias, dparams, cu, chunk_idx, T, NROWS, HV: tl.constexpr,
                     NB: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, USE_GATE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_t, i_b = tl.program_id(0), tl.program_id(1)
    t0, eos, i_row = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m_h = o_h < HV
    m = (o_t < eos)[:, None] & m_h[None, :]
    p = o_t[:, None] * HV + o_h[None, :]
    b_single = tl.zeros([BT, BH], dtype=tl.float32)
    b_pairs = tl.zeros([BT, BH], dtype=tl.float32)
    for i in range(0, NB, 2):                                   # slots (single, pairs), in a fixed order
        b_single += tl.load(db + p * NB + i, mask=m, other=0)
        b_pairs += tl.load(db + p * NB + i + 1, mask=m, other=0)
    b_dg = tl.cumsum(b_single, axis=0, reverse=True) + b_pairs
    if USE_GATE:
        b_gate, b_slope = _gdn_gate(tl.load(g + p, mask=m, other=0).to(tl.float32), A_log, dt_bias, o_h, m_h,
                                    HAS_BIAS)
        b_da = tl.sum(tl.where(m, b_dg * b_gate, 0.0), 0)         # [BH]
        b_dg = b_dg * b_slope
        tl.store(dparams + i_row * HV + o_h, b_da, mask=m_h)
        tl.store(dparams + (NROWS + i_row) * HV + o_h, tl.sum(tl.where(m, b_dg, 0.0), 0), mask=m_h)
    tl.store(dg + p, b_dg.to(dg.dtype.element_ty), mask=m)


def _chunk_dg(db, g, A_log, dt_bias, seqs: _Seqs):
    """-> (dg in g's dtype, dA_log, ddt_bias: each in its parameter's dtype, or an empty tensor)."""
    b, t, hv = g.shape
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    dparams = torch.zeros(2, seqs.rows, hv, dtype=torch.float32, device=g.device)   # per chunk: A_log, dt_bias
    if seqs.nt and hv and b:
        dummy = dparams[:0]
        _chunk_dg_kernel[(seqs.nt, 1 if seqs.varlen else b)](
            db, dg, g, _or(A_log, dummy), _or(dt_bias, dummy), dparams, seqs.cu, seqs.chunk_idx, t, seqs.rows, HV=hv,
            NB=db.shape[-1], BT=CHUNK, BH=_pow2(hv, 2), USE_GATE=A_log is not None, HAS_BIAS=dt_bias is not None,
            IS_VARLEN=seqs.varlen, num_warps=4, num_stages=2)
    return (dg, *_gate_param_grads(A_log, dt_bias, dparams[0], dparams[1]))


def _group_sum(x: torch.Tensor, h: int, dtype) -> torch.Tensor:
    """[B, T, HV, K] per value head -> [B, T, H, K]: the value heads of each q/k head summed in a fixed
    order (a plain reduction: deterministic)."""
    b, t, hv, d = x.shape
    if hv == h:
        return x.to(dtype)
    return x.view(b, t, h, hv // h, d).sum(3).to(dtype)


# ----------------------------------------------------------------------------- recurrent backward

# A reverse recurrence.  Per token (h_a = exp(g_t) h_{t-1}, p_t = h_a^T k_t, h_t = h_a + k_t u_t^T,
# u_t = beta_t (v_t - p_t)), with F the gradient reaching h_t from later tokens (dht at the end):
#     dH = F + scale q_t do_t^T;  du = dH^T k_t;  dv_t = beta_t du;  dbeta_t = du . (v_t - p_t);
#     dp = -beta_t du;  dk_t = dH u_t + h_a dp;  dq_t = scale h_t do_t;  dg_t = <dH + k_t dp^T, h_a>;
#     F <- exp(g_t) (dH + k_t dp^T)
# One program per (V block, sequence x value head) (the columns of h evolve independently), three
# passes over the tokens, the state never stored per token:
#   A (forward)  recompute h: dq_t, p_t (stored, fp32), and the h_a terms of dg (below)
#   B (reverse)  F: dv_t, dbeta_t, dp_t (stored), dk_t's first term, dg_t
#   C (forward)  recompute h_a: dk_t's second term h_a dp_t
# dg without h_a in pass B: <dH + k dp^T, h_a> telescopes (F_t = exp(g_{t+1}) (..)_{t+1}) into
#     dg_t = dg_{t+1} + scale do_t . (h_a^T q_t) - beta_t scale (q_t . k_t)(do_t . p_t) - beta_t v_t . (F_t^T k_t)
# (the O(1) terms cancelled by hand, so no cancellation in floating point when exp(g) -> 0); the
# last token's dg is computed directly, and where exp(g_t) is 0 (a hard reset, g = -inf, or an
# underflow) dg_t = <., h_a = 0> is exactly 0, so the sum restarts there.  use_gate_in_kernel and
# use_beta_sigmoid_in_kernel take dg and dbeta on through their activations.  dq, dk, dg, dbeta
# are per-V-block partials summed on the host in a fixed order (deterministic).
# Cost per token and value head ~20KV FLOPs (three passes, none a matmul); minimum bytes: q, k, v, g,
# beta, dO (and h0, dht) read, dq, dk, dv, dg, dbeta (and dh0) written; the passes re-read the inputs
# (3x) and the p / dp scratch (fp32 [T, HV, V]), and dq, dk, dg, dbeta go through fp32 per-V-block partials.

@triton.jit
def _rec_gates(g, beta, A_log, dt_bias, t, i_hv, HV: tl.constexpr, USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
               BETA_ACT: tl.constexpr):
    """Token t's log decay and beta, from their inputs (the gate's raw input with use_gate_in_kernel;
    beta's logit with use_beta_sigmoid_in_kernel)."""
    b_g = tl.load(g + t * HV + i_hv).to(tl.float32)
    if USE_GATE:
        b_g, _ = _gdn_gate(b_g, A_log, dt_bias, i_hv, i_hv < HV, HAS_BIAS)
    return b_g, _beta_act(tl.load(beta + t * HV + i_hv).to(tl.float32), BETA_ACT)

@triton.jit
def _rec_qk(q, k, t, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr):
    b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
    b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
    if L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q, b_k


@triton.jit(do_not_specialize=["T", "NTOK"])
def _recurrent_bwd_kernel(q, k, v, g, beta, A_log, dt_bias, do, h0, dht, dq, dk1, dk2, dv, dg, dbeta, da, dh0, p_buf,
                          dp_buf, z_buf, cu, scale, T, NTOK, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                          V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                          USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BETA_ACT: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    # this V block's slice of the partial outputs [NV, NTOK, HV, ...]
    part = i_v.to(tl.int64) * NTOK * HV
    dq, dk1, dk2 = dq + part * K, dk1 + part * K, dk2 + part * K
    dg, dbeta, da, z_buf = dg + part, dbeta + part, da + part, z_buf + part
    m_kv = m_k[:, None] & m_v[None, :]
    o_state = _state_layout(o_k, o_v, o_k[:, None] * V + o_v[None, :], K, STATE_V_FIRST)
    p_h0 = h0 + i_nh.to(tl.int64) * K * V + o_state            # the caller's states, in its layout
    b_dht = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dht += tl.load(dht + i_nh.to(tl.int64) * K * V + o_state, mask=m_kv, other=0)

    # A: forward
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(p_h0, mask=m_kv, other=0).to(tl.float32)
    b_ha = tl.zeros([BK, BV], dtype=tl.float32)
    b_qa = tl.zeros([BV], dtype=tl.float32)                     # do_t * (h_a^T q_t) of the latest token
    for t in range(bos, eos):
        b_q, b_k = _rec_qk(q, k, t, i_h, o_k, m_k, H, K, L2NORM)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_do = tl.load(do + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_g, b_beta = _rec_gates(g, beta, A_log, dt_bias, t, i_hv, HV, USE_GATE, HAS_BIAS, BETA_ACT)
        b_ha = b_h * tl.exp(b_g)
        b_p = tl.sum(b_ha * b_k[:, None], 0)                             # [BV]
        b_qa = b_do * tl.sum(b_ha * b_q[:, None], 0)
        tl.store(p_buf + (t * HV + i_hv) * V + o_v, b_p, mask=m_v)
        b_h = b_ha + b_k[:, None] * (b_beta * (b_v - b_p))[None, :]
        tl.store(dq + (t * HV + i_hv) * K + o_k, scale * tl.sum(b_h * b_do[None, :], 1), mask=m_k)
        b_z = scale * (tl.sum(b_qa) - b_beta * tl.sum(b_q * b_k) * tl.sum(b_do * b_p))
        tl.store(z_buf + t * HV + i_hv, b_z)
    # the last token's dg, directly: <dht + scale q do^T + k dp^T, h_a>; dp . p is added in pass B
    b_dg = tl.sum(b_dht * b_ha) + scale * tl.sum(b_qa)
    tl.debug_barrier()                                          # p_buf / z_buf written above are read below

    # B: reverse
    b_f = b_dht
    for i in range(0, eos - bos):
        t = eos - 1 - i
        b_q, b_k = _rec_qk(q, k, t, i_h, o_k, m_k, H, K, L2NORM)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_do = tl.load(do + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_g, b_beta = _rec_gates(g, beta, A_log, dt_bias, t, i_hv, HV, USE_GATE, HAS_BIAS, BETA_ACT)
        b_p = tl.load(p_buf + (t * HV + i_hv) * V + o_v, mask=m_v, other=0)
        b_dh = b_f + scale * b_q[:, None] * b_do[None, :]
        b_du = tl.sum(b_dh * b_k[:, None], 0)                           # [BV]
        b_r = b_v - b_p
        b_dp = -b_beta * b_du
        tl.store(dv + (t * HV + i_hv) * V + o_v, (b_beta * b_du).to(dv.dtype.element_ty), mask=m_v)
        tl.store(dp_buf + (t * HV + i_hv) * V + o_v, b_dp, mask=m_v)
        b_dbeta = tl.sum(b_du * b_r)
        if BETA_ACT:                                            # beta = a sigmoid(x): d beta / dx = beta (1 - beta / a)
            b_dbeta = b_dbeta * b_beta * (1 - b_beta / BETA_ACT)
        tl.store(dbeta + t * HV + i_hv, b_dbeta)
        tl.store(dk1 + (t * HV + i_hv) * K + o_k, tl.sum(b_dh * (b_beta * b_r)[None, :], 1), mask=m_k)
        b_fk = tl.sum(b_f * b_k[:, None], 0)                            # F^T k
        b_dg = tl.where(i == 0, b_dg + tl.sum(b_dp * b_p),
                        b_dg + tl.load(z_buf + t * HV + i_hv) - b_beta * tl.sum(b_v * b_fk))
        b_dg = tl.where(tl.exp(b_g) == 0, 0.0, b_dg)                    # h_a = 0: the sum restarts
        if USE_GATE:                                            # through the gate to its raw input
            b_gate, b_slope = _gdn_gate(tl.load(g + t * HV + i_hv).to(tl.float32), A_log, dt_bias, i_hv, i_hv < HV,
                                        HAS_BIAS)
            tl.store(da + t * HV + i_hv, b_dg * b_gate)         # d gate / d A_log = gate
            tl.store(dg + t * HV + i_hv, b_dg * b_slope)
        else:
            tl.store(dg + t * HV + i_hv, b_dg)
        b_f = (b_dh + b_k[:, None] * b_dp[None, :]) * tl.exp(b_g)
    if USE_H0:                                                  # in the initial state's layout and dtype
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_state, b_f.to(dh0.dtype.element_ty), mask=m_kv)
    tl.debug_barrier()                                          # dp_buf written above is read below

    # C: forward again, dk's h_a dp term
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(p_h0, mask=m_kv, other=0).to(tl.float32)
    for t in range(bos, eos):
        b_q, b_k = _rec_qk(q, k, t, i_h, o_k, m_k, H, K, L2NORM)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_g, b_beta = _rec_gates(g, beta, A_log, dt_bias, t, i_hv, HV, USE_GATE, HAS_BIAS, BETA_ACT)
        b_p = tl.load(p_buf + (t * HV + i_hv) * V + o_v, mask=m_v, other=0)
        b_dp = tl.load(dp_buf + (t * HV + i_hv) * V + o_v, mask=m_v, other=0)
        b_h = b_h * tl.exp(b_g)
        tl.store(dk2 + (t * HV + i_hv) * K + o_k, tl.sum(b_h * b_dp[None, :], 1), mask=m_k)
        b_h += b_k[:, None] * (b_beta * (b_v - b_p))[None, :]


def _rec_bwd_tiles(dk: int, dv: int) -> dict:
    """Three [K, BV] fp32 tiles live in pass B: BV 16 for K > 128, else 32 (no spills, aot-checked)."""
    return dict(BV=min(16 if dk > 128 else 32, _pow2(dv)), num_warps=4, num_stages=1)


# ----------------------------------------------------------------------------- l2norm backward
# dx = rstd (dy - y (y . dy)).  Cost ~4D FLOPs per row; minimum bytes: y, rstd, dy read, dx written.

@triton.jit
def _l2norm_bwd_kernel(y, rstd, dy, dx, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """y = x r, r = rsqrt(|x|^2 + eps):  dx = r (dy - y (y . dy))."""
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < R
    m = m_r[:, None] & (o_d < D)[None, :]
    p = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    b_y = tl.load(y + p, mask=m, other=0).to(tl.float32)
    b_dy = tl.load(dy + p, mask=m, other=0).to(tl.float32)
    b_r = tl.load(rstd + o_r, mask=m_r, other=0)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, 1)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


def _l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """-> dx in y's dtype.  y [..., D], rstd [...] fp32, dy like y (any float dtype)."""
    y, dy = y.contiguous(), dy.contiguous()
    d = y.shape[-1]
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    rows = y.numel() // max(d, 1)
    bd = _pow2(d)
    br = max(1, 4096 // bd)
    if rows:
        _l2norm_bwd_kernel[(triton.cdiv(rows, br),)](y, rstd, dy, dx, rows, D=d, BR=br, BD=bd, num_warps=4,
                                                     num_stages=2)
    return dx


# ----------------------------------------------------------------------------- shared device helpers

@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _decay(b_exponent, b_keep):
    """exp(b_exponent) where b_keep, else 0: masked to -inf before exp (no inf * 0, no -inf - (-inf))."""
    return tl.exp(tl.where(b_keep, b_exponent, float("-inf")))


@triton.jit
def _softplus(b_x):
    """log(1 + exp(x)), x above 20 (torch's threshold); log1p written out with Goldberg's correction
    (log(u) * e / (u - 1), u = 1 + e rounded), exact to rounding for tiny e = exp(-|x|)."""
    b_e = tl.exp(-tl.abs(b_x))
    b_u = 1.0 + b_e
    b_tiny = b_u == 1.0
    b_log1p = tl.where(b_tiny, b_e, tl.log(b_u) * (b_e / tl.where(b_tiny, 1.0, b_u - 1.0)))
    return tl.where(b_x > 20.0, b_x, tl.maximum(b_x, 0.0) + b_log1p)


@triton.jit
def _gdn_gate(b_x, A_log, dt_bias, o_h, m_h, HAS_BIAS: tl.constexpr):
    """Qwen3.5's gate from its raw input x (fla's use_gate_in_kernel), for heads o_h: the log decay
    -exp(A_log) softplus(x + dt_bias) and its derivative in x, -exp(A_log) sigmoid(x + dt_bias)."""
    b_neg_a = -tl.exp(tl.load(A_log + o_h, mask=m_h, other=0).to(tl.float32))
    if HAS_BIAS:
        b_x = b_x + tl.load(dt_bias + o_h, mask=m_h, other=0).to(tl.float32)
    return b_neg_a * _softplus(b_x), b_neg_a * tl.sigmoid(b_x)


@triton.jit
def _beta_act(b_x, BETA_ACT: tl.constexpr):
    """beta from its input: as given (BETA_ACT 0), sigmoid(x) (1), 2 sigmoid(x) (2, allow_neg_eigval)."""
    if BETA_ACT:
        b_x = BETA_ACT * tl.sigmoid(b_x)
    return b_x


@triton.jit
def _state_layout(o_k, o_v, o_kv, K: tl.constexpr, V_FIRST: tl.constexpr):
    """Offsets of the tile (rows o_k, columns o_v) of a caller's [K, V] state (initial or final state,
    or their gradients): o_kv, the offsets of the kernels' own [K, V] layout, or the [V, K] layout
    when V_FIRST (vLLM / SGLang / FlashInfer state pools).  The next row tile starts BK rows further:
    BK elements with V_FIRST, BK V without."""
    if V_FIRST:
        return o_k[:, None] + o_v[None, :] * K
    return o_kv


@triton.jit
def _chunk_span(cu, chunk_idx, i_t, i_b, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chunk program i_t of batch row i_b: (first token, end of its sequence, its chunk row)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_idx + 2 * i_t)
        i_c = tl.load(chunk_idx + 2 * i_t + 1)
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
        i_row = i_t
    else:
        i_c = i_t
        bos = i_b.to(tl.int64) * T
        eos = bos + T
        i_row = i_b * tl.cdiv(T, BT) + i_t
    return bos + i_c * BT, eos, i_row


@triton.jit
def _seq_span(cu, chunk_off, i_n, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence i_n: (first token, end, first chunk row)."""
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
        row0 = tl.load(chunk_off + i_n)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        row0 = i_n * tl.cdiv(T, BT)
    return bos, eos, row0


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


def _check_runnable(x: torch.Tensor):
    """Kernels built for a GPU need CUDA tensors: say so on the host, before Triton looks for a driver."""
    if x.device.type != "cuda" and _kernels_compiled():
        raise ValueError(f"fast/gated_deltanet.py runs Triton kernels on CUDA tensors, got tensors on {x.device}.  "
                         f"Ways out: move the tensors to a CUDA device; or set TRITON_INTERPRET=1 before triton is "
                         f"imported, to run the kernels in Triton's interpreter on CPU tensors (slow: for tests); or "
                         f"use ref/gated_deltanet.py, the PyTorch reference with the same API, for CPU work")


# ----------------------------------------------------------------------------- launch plumbing

class _Seqs(NamedTuple):
    """Where the sequences are.  Dense: B sequences of T tokens.  Varlen: cu (int32), and for the
    chunk kernels a [NT, 2] table (sequence, chunk in it) and each sequence's first chunk row."""
    n: int
    nt: int                 # chunk programs per batch row (dense: cdiv(T, 64); varlen: all chunks)
    rows: int               # chunk rows in total (rows of the per-chunk state tensor)
    cu: torch.Tensor        # int32 [N + 1], or a 1-element dummy when dense
    chunk_idx: torch.Tensor
    chunk_off: torch.Tensor
    varlen: bool


def _sequences(b: int, t: int, cu_seqlens, cu_seqlens_cpu, device) -> _Seqs:
    """The chunk kernels' view of the batch.  Varlen: the chunk table is built on the host from
    cu_seqlens' values (read from cu_seqlens_cpu when given: no device-to-host copy) and goes to the
    device in one asynchronous copy from pinned memory, with cu itself, so that the kernels see one
    consistent set of bounds and the host never waits for the device."""
    if cu_seqlens is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        nt = triton.cdiv(t, CHUNK)
        return _Seqs(b, nt, b * nt, dummy, dummy, dummy, False)
    if _capturing(device):
        raise ValueError("chunk_gated_delta_rule with cu_seqlens builds its chunk table on the host for each call, "
                         "which a CUDA graph cannot replay: capture decode steps with fused_recurrent_gated_delta_rule")
    cu = _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, None, t)
    per_seq = [triton.cdiv(e - s, CHUNK) for s, e in zip(cu, cu[1:])]
    table = [x for n, count in enumerate(per_seq) for c in range(count) for x in (n, c)] or [0, 0]
    offsets = [0, *itertools.accumulate(per_seq)][:max(1, len(per_seq))]   # each sequence's first chunk row
    # one int32 copy to the device, each part starting 16-byte aligned (what the kernels are built for)
    parts = [cu, offsets, table]
    starts = list(itertools.accumulate((-(-len(x) // 4) * 4 for x in parts), initial=0))
    packed = torch.zeros(starts[-1], dtype=torch.int32)
    for x, s in zip(parts, starts):
        packed[s:s + len(x)] = torch.tensor(x, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    cu_d, off_d, idx_d = (packed[s:s + len(x)] for x, s in zip(parts, starts))
    return _Seqs(len(per_seq), sum(per_seq), sum(per_seq), cu_d, idx_d, off_d, True)


def _recurrent_sequences(b: int, t: int, cu_seqlens, cu_seqlens_cpu, device):
    """(N, cu_seqlens as int32 on the device or a dummy when dense) for the recurrent kernels, which
    read each sequence's bounds themselves.  The value checks read cu_seqlens_cpu when given; without
    it they cost one small device-to-host copy, skipped inside CUDA-graph capture (the serving path:
    a captured call trusts its inputs)."""
    if cu_seqlens is None:
        return b, torch.zeros(1, dtype=torch.int32, device=device)
    if cu_seqlens_cpu is not None or not _capturing(device):
        _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, None, t)
    return cu_seqlens.numel() - 1, cu_seqlens.to(torch.int32)


def _capturing(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def _or(x, default):
    return default if x is None else x


def _state_shape(n: int, hv: int, dk: int, dv: int, v_first: bool) -> tuple:
    return (n, hv, dv, dk) if v_first else (n, hv, dk, dv)


def _state_grad(initial_state):
    """The initial state's gradient buffer: its shape, layout and dtype; None without one."""
    return None if initial_state is None else torch.empty_like(initial_state, memory_format=torch.contiguous_format)


def _gate_param_grads(A_log, dt_bias, da_parts: torch.Tensor, dx_parts: torch.Tensor):
    """dA_log, ddt_bias [HV] from partial sums [..., HV] (per chunk, or per token and V block), summed
    in a fixed order, each in its parameter's dtype; empty tensors for absent parameters."""
    def total(parts, param):
        return parts.new_empty(0) if param is None else parts.reshape(-1, parts.shape[-1]).sum(0).to(param.dtype)
    return total(da_parts, A_log), total(dx_parts, dt_bias if A_log is not None else None)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(x))


def _kernels_compiled() -> bool:
    """True when this file's kernels were built for a GPU, False when triton.jit made them for Triton's
    interpreter (TRITON_INTERPRET=1 when this file was imported)."""
    return isinstance(_l2norm_kernel, triton.runtime.JITFunction)


def _prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"   # tf32 is moot for 16-bit operands


def _arch(x: torch.Tensor) -> int:
    """Compute capability as 80, 90, ...; 90 under the interpreter (which has no GPU: it runs the
    sm_90 choices, the benchmark target)."""
    if x.device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(x.device)
    return 10 * major + minor


def _launch(tuned, grid, args: tuple, meta: dict, fixed: bool = False):
    """Launch an autotuned kernel.  CUDA: the autotuner (key and pruning documented at each kernel).
    Interpreter, or ``fixed`` (batch_invariant: one launch per shape whatever the batch, never a timed
    choice): the same pruning call Triton makes (positional arguments as named_args, the rest as
    keywords), then the first surviving config launched directly (the one each config list puts
    first: the observatory's pick, which the report measures too): the autotuner cannot benchmark on
    a CPU, and this way the tests run the pruning and grid code the GPU runs."""
    if _kernels_compiled() and not fixed:
        tuned[grid](*args, **meta)
        return
    configs = tuned.early_config_prune(tuned.configs, dict(zip(tuned.arg_names, args)), **meta)
    cfg = configs[0]
    tuned.fn[grid(cfg.kwargs)](*args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------- custom ops

# Forward ops save only their inputs (plus A for the chunk op, y and rstd for l2norm); the backward
# ops recompute the rest.  A and rstd are outputs without gradients.  The backward
# ops are custom ops too (torch.compile traces them); a second derivative raises.

def _no_double_backward(ctx, *grads):
    raise NotImplementedError("fast gated_deltanet: gradients of the gradients (double backward) are not "
                              "supported; use ref/gated_deltanet.py")


def _no_context(ctx, inputs, output):
    pass


@torch.library.custom_op("twofold::gdn_l2norm_fwd", mutates_args=())
def _l2norm_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_runnable(x)
    return _l2norm(x.contiguous())


@_l2norm_op.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("twofold::gdn_l2norm_bwd", mutates_args=())
def _l2norm_bwd_op(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    _check_runnable(y)
    return _l2norm_bwd(y, rstd, dy)


@_l2norm_bwd_op.register_fake
def _(y, rstd, dy):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _l2norm_setup(ctx, inputs, output):
    y, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(y, rstd)


def _l2norm_backward(ctx, dy, _drstd):
    y, rstd = ctx.saved_tensors
    return None if dy is None else _l2norm_bwd_op(y, rstd, dy)


@torch.library.custom_op("twofold::chunk_gated_delta_rule_fwd", mutates_args=())
def _chunk_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], cu_seqlens_cpu: Optional[torch.Tensor], scale: float,
              output_final_state: bool, state_v_first: bool,
              batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (o, final_state or an empty tensor, A [B, T, HV, 64] the solved blocks, kept for the backward)."""
    _check_runnable(q)
    o, final, a = _chunk_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                                 output_final_state, state_v_first, batch_invariant)
    return o, _or(final, q.new_empty(0, dtype=torch.float32)), a


def _num_seqs(q, cu_seqlens) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@_chunk_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      state_v_first, batch_invariant):
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    final_shape = _state_shape(_num_seqs(q, cu_seqlens), hv, dk, dv, state_v_first) if output_final_state else (0,)
    return v.new_empty(b, t, hv, dv), q.new_empty(final_shape, dtype=torch.float32), q.new_empty(b, t, hv, CHUNK)


@torch.library.custom_op("twofold::chunk_gated_delta_rule_bwd", mutates_args=())
def _chunk_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], A: torch.Tensor,
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  cu_seqlens_cpu: Optional[torch.Tensor], do: torch.Tensor, dht: Optional[torch.Tensor],
                  scale: float, state_v_first: bool, batch_invariant: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, d initial_state; empty tensors for absent inputs)."""
    _check_runnable(q)
    return _chunk_backward(q, k, v, g, beta, A_log, dt_bias, A, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                           do, dht, state_v_first, batch_invariant)


def _grads_fake(q, k, v, g, beta, A_log, dt_bias, initial_state):
    """The gradients' shapes: the inputs', contiguous; an empty tensor for an absent input."""
    def like(x):
        return q.new_empty(0, dtype=torch.float32) if x is None else torch.empty_like(
            x, memory_format=torch.contiguous_format)
    return tuple(like(x) for x in (q, k, v, g, beta, A_log, dt_bias, initial_state))


@_chunk_bwd_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, A, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht, scale, state_v_first,
      batch_invariant):
    return _grads_fake(q, k, v, g, beta, A_log, dt_bias, initial_state)


def _chunk_setup(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, _, state_v_first,
     batch_invariant) = inputs
    _, _, a = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(a)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, a)
    ctx.scale, ctx.state_v_first, ctx.batch_invariant = scale, state_v_first, batch_invariant


def _output_grads(v, do, dht):
    """None / empty output gradients (an unused o or final state) as the kernels want them."""
    do = torch.zeros_like(v) if do is None else do
    return do, (dht if dht is not None and dht.numel() else None)


def _input_grads(grads, saved):
    """The op's gradients as autograd wants them: None for the inputs that were None."""
    return tuple(None if x is None else dx for dx, x in zip(grads, saved))


def _chunk_backward_fn(ctx, do, dht, _da):
    q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, cu_seqlens_cpu, a = ctx.saved_tensors
    do, dht = _output_grads(v, do, dht)
    grads = _chunk_bwd_op(q, k, v, g, beta, A_log, dt_bias, a, h0, cu_seqlens, cu_seqlens_cpu, do, dht, ctx.scale,
                          ctx.state_v_first, ctx.batch_invariant)
    return _input_grads(grads, (q, k, v, g, beta, A_log, dt_bias, h0)) + (None,) * 6


@torch.library.custom_op("twofold::fused_recurrent_gated_delta_rule_fwd", mutates_args=())
def _recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  cu_seqlens_cpu: Optional[torch.Tensor], scale: float, output_final_state: bool, use_l2norm: bool,
                  beta_act: int, state_v_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (o, final_state or an empty tensor)."""
    _check_runnable(q)
    o, final = _recurrent_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                                  output_final_state, use_l2norm, beta_act, state_v_first)
    return o, _or(final, q.new_empty(0, dtype=torch.float32))


@_recurrent_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      use_l2norm, beta_act, state_v_first):
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    final_shape = _state_shape(_num_seqs(q, cu_seqlens), hv, dk, dv, state_v_first) if output_final_state else (0,)
    return v.new_empty(b, t, hv, dv), q.new_empty(final_shape, dtype=torch.float32)


@torch.library.custom_op("twofold::fused_recurrent_gated_delta_rule_bwd", mutates_args=())
def _recurrent_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                      initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                      cu_seqlens_cpu: Optional[torch.Tensor], do: torch.Tensor, dht: Optional[torch.Tensor],
                      scale: float, use_l2norm: bool, beta_act: int, state_v_first: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, d initial_state; empty tensors for absent inputs)."""
    _check_runnable(q)
    return _recurrent_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                               use_l2norm, beta_act, state_v_first, do, dht)


@_recurrent_bwd_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht, scale, use_l2norm,
      beta_act, state_v_first):
    return _grads_fake(q, k, v, g, beta, A_log, dt_bias, initial_state)


def _recurrent_setup(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, _, use_l2norm, beta_act,
     state_v_first) = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
    ctx.scale, ctx.use_l2norm, ctx.beta_act, ctx.state_v_first = scale, use_l2norm, beta_act, state_v_first


def _recurrent_backward_fn(ctx, do, dht):
    q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    do, dht = _output_grads(v, do, dht)
    grads = _recurrent_bwd_op(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, cu_seqlens_cpu, do, dht, ctx.scale,
                              ctx.use_l2norm, ctx.beta_act, ctx.state_v_first)
    return _input_grads(grads, (q, k, v, g, beta, A_log, dt_bias, h0)) + (None,) * 7


_l2norm_op.register_autograd(_l2norm_backward, setup_context=_l2norm_setup)
_chunk_op.register_autograd(_chunk_backward_fn, setup_context=_chunk_setup)
_recurrent_op.register_autograd(_recurrent_backward_fn, setup_context=_recurrent_setup)
_l2norm_bwd_op.register_autograd(_no_double_backward, setup_context=_no_context)
_chunk_bwd_op.register_autograd(_no_double_backward, setup_context=_no_context)
_recurrent_bwd_op.register_autograd(_no_double_backward, setup_context=_no_context)


if __name__ == "__main__":
    # A tiny self-check under the interpreter: TRITON_INTERPRET=1 python fast/gated_deltanet.py
    gen = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b, t, h, hv, dk, dv = 2, 75, 1, 2, 32, 32
    q, k = (torch.randn(b, t, h, dk, generator=gen).to(dev) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen).to(dev)
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, hv, generator=gen)).to(dev)
    beta = torch.rand(b, t, hv, generator=gen).to(dev)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, h1 = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o2, h2 = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    print("chunk vs recurrent max error:", (o1 - o2).abs().max().item(), (h1 - h2).abs().max().item())
