"""Gated DeltaNet: Triton kernels (chunked forward, recurrent decode) with fla's API.

What it computes
    The gated delta rule of ref/gated_deltanet.py (the specification; its docstring derives the
    chunk form from the recurrence): per value head a [K, V] fp32 state h,
        h = exp(g_t) h;  u_t = beta_t (v_t - h^T k_t);  h = h + k_t u_t^T;  o_t = h^T (scale q_t).
    ``chunk_gated_delta_rule`` (training / prefill) runs the chunk form, C = 64 tokens a chunk,
    as five kernels, each with its own launcher (fla's decomposition):
        1. cumsum     gc = within-chunk cumulative gate                       fp32 [B, T, HV]
        2. kkt+solve  A = (I + tril(beta K K^T * exp(gc_i - gc_j), -1))^-1   [B, T, HV, 64]
                      (16x16 diagonal blocks inverted in registers, merged blockwise; fp32)
        3. w/u        w = A (beta exp(gc) K), u = A (beta V)
        4. state h    the sequential pass over chunks: h per chunk start, v_new = u - w h,
                      h = exp(gc_last) h + K^T (exp(gc_last - gc) v_new); final state
        5. output     o = scale (exp(gc) q h + (q K^T * exp(gc_i - gc_j))_causal v_new)
    ``use_qk_l2norm_in_kernel`` runs an l2norm kernel on q and k first (fla does the same).
    ``fused_recurrent_gated_delta_rule`` (decode) is one kernel: a program per (sequence, value
    head, V block) keeps its [K, BV] fp32 state block in registers, reads it once, steps through
    the sequence's tokens (l2norm fused), writes it once.  It also serves T > 1.

Tensors: exactly those of ref/gated_deltanet.py (q, k [B, T, H, K]; v [B, T, HV, V]; g, beta
    [B, T, HV]; initial/final state [N, HV, K, V] fp32; cu_seqlens [N + 1] int32 or int64 with
    B == 1; o [B, T, HV, V] in v's dtype).  q, k, v: fp16 / bf16 / fp32; g, beta: any of those.
    Value head i reads q/k head i // (HV // H); q/k are never repeated in memory.
    Gates are fp32 and log-space throughout: masked entries get exponent -inf before exp.
    Precision (fla's choices): A, w, u, v_new and the per-chunk states are stored in the input
    dtype and multiplied on tensor cores with fp32 accumulation; the carried state, the gates
    and the solve are fp32.  fp32 inputs use IEEE fp32 dots (no silent tf32).

Supported, and what raises
    K <= 256 (any, e.g. 100: blocks are padded and masked), any V, HV a multiple of H, empty
    sequences / documents (final state = initial state), CUDA tensors (CPU tensors run only
    under TRITON_INTERPRET=1).  Same errors as the reference for bad shapes, dtypes, devices,
    cu_seqlens with B > 1, wrong initial_state; fp64 is the reference's only.  g > 0 is allowed
    and unchecked (the caller's gate).  Forward only: both ops are custom ops
    (``twofold::chunk_gated_delta_rule_fwd``, ``twofold::fused_recurrent_gated_delta_rule_fwd``,
    ``twofold::gdn_l2norm_fwd``) whose backward raises NotImplementedError for now.

Saved for a backward (returned by the chunk op, unused by the public function today)
    ``gc`` fp32 [B, T, HV] (within-chunk cumulative gate) and ``A`` [B, T, HV, 64] (the solved
    triangular blocks, row t holds row t mod 64 of its chunk's inverse, upper part zero); the
    l2norm op returns ``rstd`` fp32 [B, T, H].  w, u, h and v_new are recomputed from them by
    ``_chunk_wu`` / ``_chunk_h`` (fla's backward recomputes them the same way).

Cost (per value head; C = 64, T tokens, K / V head dims)
    FLOPs of the chunk forward, per chunk:  K K^T 2C^2K + solve C^3/3 + w 2C^2K + u 2C^2V
        + v_new = u - w h 2CKV + state update K^T v_new 2CKV + q h 2CKV + q K^T 2C^2K + (.)v_new 2C^2V
        = 6C^2K + 4C^2V + 6CKV + C^3/3;  per token 6CK + 4CV + 6KV + C^2/3
        (K = V = 128: 1.82e5 FLOP per token per value head).  Gate exponentials are not counted.
    Minimum bytes, chunk forward: read q, k (B T H K), v (B T HV V), g, beta; write o; read/write
        the states when given.  The decomposition adds its intermediates (gc, A, w, u, v_new,
        per-chunk states): a few times the input bytes, still far below the FLOPs' time.
    Minimum bytes, decode (T = 1): the fp32 state read and written, N HV K V 4 2, plus q, k
        (N H K), v, o (N HV V) and g, beta (N HV) in their dtypes.

References
    fla (flash-linear-attention): chunk_gated_delta_rule / fused_recurrent_gated_delta_rule,
    chunk_scaled_dot_kkt, solve_tril, recompute_w_u, chunk_fwd_h, chunk_fwd_o (the kernel split
    mirrored here, written anew); Yang et al., Gated Delta Networks (ICLR 2025).
"""
from __future__ import annotations

import itertools
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]

CHUNK = 64
MAX_HEAD_DIM_K = 256
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


# ----------------------------------------------------------------------------- input checks
# (the same checks and messages as ref/gated_deltanet.py; each file stands alone)

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
    if cu[0] != 0 or any(y < x for x, y in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
    if cu[-1] != t:
        raise ValueError(f"cu_seqlens[-1] must equal T = q.shape[1] = {t}, got {cu[-1]}")


def _check_runnable(x: torch.Tensor):
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(f"fast gated_deltanet runs on CUDA tensors (or any tensors under TRITON_INTERPRET=1), "
                         f"got device {x.device}")


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


def _sequences(b: int, t: int, cu_seqlens: Optional[torch.Tensor], device) -> _Seqs:
    dummy = torch.zeros(1, dtype=torch.int32, device=device)
    if cu_seqlens is None:
        nt = triton.cdiv(t, CHUNK)
        return _Seqs(b, nt, b * nt, dummy, dummy, dummy, False)
    cu = cu_seqlens.tolist()   # one small device-to-host copy: the chunk table is built on the host
    _check_cu_seqlens_values(cu, t)
    per_seq = [triton.cdiv(e - s, CHUNK) for s, e in zip(cu, cu[1:])]
    table = [(n, c) for n, count in enumerate(per_seq) for c in range(count)]
    offsets = [0, *itertools.accumulate(per_seq)][:max(1, len(per_seq))]   # each sequence's first chunk row
    chunk_idx = torch.tensor(table or [(0, 0)], dtype=torch.int32).to(device)
    chunk_off = torch.tensor(offsets, dtype=torch.int32).to(device)
    return _Seqs(len(per_seq), len(table), len(table), cu_seqlens.to(torch.int32), chunk_idx, chunk_off, True)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(x))


def _interpreting(x: torch.Tensor) -> bool:
    return x.device.type != "cuda"


def _prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"   # tf32 is moot for 16-bit operands


def _launch(tuned, grid, args: tuple, meta: dict):
    """Launch an autotuned kernel.  CUDA: the autotuner (key and pruning documented at each kernel).
    Interpreter: the same pruning call Triton makes (positional arguments as named_args, the rest
    as keywords), then the last surviving config launched directly: the autotuner cannot benchmark
    on a CPU, and this way the tests run the pruning and grid code the GPU runs."""
    if not _interpreting(args[0]):
        tuned[grid](*args, **meta)
        return
    configs = tuned.early_config_prune(tuned.configs, dict(zip(tuned.arg_names, args)), **meta)
    cfg = configs[-1]
    tuned.fn[grid(cfg.kwargs)](*args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------- shared device helpers

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


# ----------------------------------------------------------------------------- l2norm

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

@triton.jit(do_not_specialize=["T"])
def _chunk_cumsum_kernel(g, gc, cu, chunk_idx, T, HV: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                         IS_VARLEN: tl.constexpr):
    i_t, i_b = tl.program_id(0), tl.program_id(1)
    t0, eos, _ = _chunk_span(cu, chunk_idx, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m = (o_t < eos)[:, None] & (o_h < HV)[None, :]
    p = o_t[:, None] * HV + o_h[None, :]                   # all value heads of the chunk at once
    b_g = tl.load(g + p, mask=m, other=0).to(tl.float32)
    tl.store(gc + p, tl.cumsum(b_g, axis=0), mask=m)


def _chunk_cumsum(g: torch.Tensor, seqs: _Seqs) -> torch.Tensor:
    """g [B, T, HV] -> within-chunk cumulative sum, fp32."""
    b, t, hv = g.shape
    gc = torch.empty(b, t, hv, dtype=torch.float32, device=g.device)
    grid = (seqs.nt, 1 if seqs.varlen else b)
    if seqs.nt:
        _chunk_cumsum_kernel[grid](g, gc, seqs.cu, seqs.chunk_idx, t, HV=hv, BT=CHUNK, BH=_pow2(hv, 2),
                                   IS_VARLEN=seqs.varlen, num_warps=4)
    return gc


# ----------------------------------------------------------------------------- 2. kkt + solve
# A chunk's 64 rows are four 16-row blocks: the ten lower 16x16 blocks of K K^T are gated, the
# four diagonal ones inverted in registers (_inv_unit_lower16), and the inverse assembled blockwise:
#   Ai_rc = -Ai_rr * sum_{c <= m < r} A_rm Ai_mc   for r > c   (fla's solve_tril merge).

@triton.jit
def _rows(ptr, o_t, m_t, o_d, m_d, stride_t, head, D: tl.constexpr):
    """[rows, cols] block of a token-major [T, heads, D] tensor."""
    return tl.load(ptr + (o_t[:, None] * stride_t + head) * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :],
                   other=0)


@triton.jit
def _gate_block(b_a, g_r, beta_r, g_c, m_r, DIAG: tl.constexpr):
    """beta_i exp(gc_i - gc_j) * (k_i . k_j): exponent -inf (so 0) off the strictly lower part."""
    o = tl.arange(0, 16)
    keep = m_r[:, None] & (o[:, None] > o[None, :]) if DIAG else m_r[:, None] & (o[None, :] >= 0)
    return b_a * beta_r[:, None] * tl.exp(tl.where(keep, g_r[:, None] - g_c[None, :], float("-inf")))


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
def _chunk_kkt_solve_kernel(k, gc, beta, A, cu, chunk_idx, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
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
    b_b0 = tl.load(beta + o_t0 * HV + i_hv, mask=m_t0, other=0).to(tl.float32)
    b_b1 = tl.load(beta + o_t1 * HV + i_hv, mask=m_t1, other=0).to(tl.float32)
    b_b2 = tl.load(beta + o_t2 * HV + i_hv, mask=m_t2, other=0).to(tl.float32)
    b_b3 = tl.load(beta + o_t3 * HV + i_hv, mask=m_t3, other=0).to(tl.float32)
    b_a00 = _gate_block(b_a00, b_g0, b_b0, b_g0, m_t0, True)
    b_a11 = _gate_block(b_a11, b_g1, b_b1, b_g1, m_t1, True)
    b_a22 = _gate_block(b_a22, b_g2, b_b2, b_g2, m_t2, True)
    b_a33 = _gate_block(b_a33, b_g3, b_b3, b_g3, m_t3, True)
    b_a10 = _gate_block(b_a10, b_g1, b_b1, b_g0, m_t1, False)
    b_a20 = _gate_block(b_a20, b_g2, b_b2, b_g0, m_t2, False)
    b_a21 = _gate_block(b_a21, b_g2, b_b2, b_g1, m_t2, False)
    b_a30 = _gate_block(b_a30, b_g3, b_b3, b_g0, m_t3, False)
    b_a31 = _gate_block(b_a31, b_g3, b_b3, b_g1, m_t3, False)
    b_a32 = _gate_block(b_a32, b_g3, b_b3, b_g2, m_t3, False)
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


def _chunk_kkt_solve(k, gc, beta, hv: int, seqs: _Seqs) -> torch.Tensor:
    """-> A [B, T, HV, 64] in k's dtype: each chunk's (I + strict-lower(beta K K^T decay))^-1."""
    b, t, h, dk = k.shape
    a = torch.empty(b, t, hv, CHUNK, dtype=k.dtype, device=k.device)
    if seqs.nt:
        grid = (seqs.nt, (1 if seqs.varlen else b) * hv)
        _chunk_kkt_solve_kernel[grid](k, gc, beta, a, seqs.cu, seqs.chunk_idx, t, H=h, HV=hv, K=dk, BT=CHUNK,
                                      BK=min(64, _pow2(dk)), IS_VARLEN=seqs.varlen, PREC=_prec(k.dtype),
                                      num_warps=_KKT_WARPS)
    return a


# ----------------------------------------------------------------------------- 3. w / u

@triton.jit(do_not_specialize=["T"])
def _chunk_wu_kernel(k, v, beta, gc, A, w, u, cu, chunk_idx, T, H: tl.constexpr, HV: tl.constexpr,
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
    b_gk = b_beta * tl.exp(tl.load(gc + o_t * HV + i_hv, mask=m_t, other=0))   # gc <= 0: exp <= 1
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


def _chunk_wu(k, v, beta, gc, a, seqs: _Seqs):
    """-> (w [B, T, HV, K], u [B, T, HV, V]) in k's dtype."""
    b, t, h, dk = k.shape
    hv, dv = v.shape[2:]
    w = torch.empty(b, t, hv, dk, dtype=k.dtype, device=k.device)
    u = torch.empty_like(v)
    if seqs.nt:
        grid = (seqs.nt, (1 if seqs.varlen else b) * hv)
        _chunk_wu_kernel[grid](k, v, beta, gc, a, w, u, seqs.cu, seqs.chunk_idx, t, H=h, HV=hv, K=dk, V=dv,
                               BT=CHUNK, IS_VARLEN=seqs.varlen, PREC=_prec(k.dtype), **_wu_tiles(k.dtype, dk, dv))
    return w, u


# ----------------------------------------------------------------------------- 4. state pass
# One program per (V block, sequence x value head) walks the chunks in order, holding its [K, BV]
# fp32 state block in registers as up to four [BK, BV] row tiles (K <= 4 BK; separate tiles keep
# every product's reduction at BK, which fp32 FMA products need).  key: K, V (tile shapes),
# NHV (how many programs fill the GPU); configs are pruned by K, V and the input dtype.

def _prune_state_configs(configs, named_args, **kwargs):
    """16-bit: BV 16 / 32 on 4 warps, and 64 where the K tiles are unmasked and at most two (K = 64
    or 128; masked or four tiles spill at BV 64).  fp32 (FMA products): BV 16 on 8 warps.
    (Triton passes the positional arguments as named_args and the constexprs as kwargs.)"""
    args = {**named_args, **kwargs}
    dk, dv = args["K"], args["V"]
    if args["k"].dtype == torch.float32:
        return [c for c in configs if c.num_warps == 8]
    keep = [c for c in configs if c.num_warps == 4 and c.kwargs["BV"] <= _pow2(dv)
            and (c.kwargs["BV"] < 64 or dk in (64, 128))]
    return keep or [c for c in configs if c.num_warps == 4][:1]


_STATE_CONFIGS = [triton.Config({"BV": 16}, num_warps=4, num_stages=2), triton.Config({"BV": 32}, num_warps=4, num_stages=2),
                  triton.Config({"BV": 64}, num_warps=4, num_stages=2), triton.Config({"BV": 16}, num_warps=8, num_stages=1)]


@triton.jit
def _state_tile_update(b_h, kt, o_t, m_t, o_k, m_k, i_h, b_vn, g_last, H: tl.constexpr, K: tl.constexpr,
                       PREC: tl.constexpr):
    """h_tile = exp(g_last) h_tile + K[:, tile]^T v_new (v_new already decayed to the chunk end)."""
    b_kt = tl.load(kt + (o_t[None, :] * H + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0)
    return b_h * tl.exp(g_last) + tl.dot(b_kt, b_vn.to(b_kt.dtype), input_precision=PREC)


@triton.jit(do_not_specialize=["T"])
def _chunk_h_kernel(k, w, u, gc, h, v_new, h0, ht, cu, chunk_off, T, NHV, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
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
    if USE_H0:
        p_h0 = h0 + i_nh.to(tl.int64) * K * V + o_kv
        b_h1 += tl.load(p_h0, mask=m_k1[:, None] & m_v[None, :], other=0)
        if K > BK:
            b_h2 += tl.load(p_h0 + BK * V, mask=m_k2[:, None] & m_v[None, :], other=0)
        if K > 2 * BK:
            b_h3 += tl.load(p_h0 + 2 * BK * V, mask=m_k3[:, None] & m_v[None, :], other=0)
        if K > 3 * BK:
            b_h4 += tl.load(p_h0 + 3 * BK * V, mask=m_k4[:, None] & m_v[None, :], other=0)
    for i_c in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_c * BT
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < eos
        # the state at the chunk's start, for the output kernel; v_new = u - w h
        p_h = h + ((row0 + i_c).to(tl.int64) * HV + i_hv) * K * V + o_kv
        b_vn = _rows(u, o_t, m_t, o_v, m_v, HV, i_hv, V).to(tl.float32)   # [BT, BV]
        tl.store(p_h, b_h1.to(h.dtype.element_ty), mask=m_k1[:, None] & m_v[None, :])
        b_w = _rows(w, o_t, m_t, o_k1, m_k1, HV, i_hv, K)                 # [BT, BK]
        b_vn -= tl.dot(b_w, b_h1.to(b_w.dtype), input_precision=PREC)
        if K > BK:
            tl.store(p_h + BK * V, b_h2.to(h.dtype.element_ty), mask=m_k2[:, None] & m_v[None, :])
            b_w = _rows(w, o_t, m_t, o_k2, m_k2, HV, i_hv, K)
            b_vn -= tl.dot(b_w, b_h2.to(b_w.dtype), input_precision=PREC)
        if K > 2 * BK:
            tl.store(p_h + 2 * BK * V, b_h3.to(h.dtype.element_ty), mask=m_k3[:, None] & m_v[None, :])
            b_w = _rows(w, o_t, m_t, o_k3, m_k3, HV, i_hv, K)
            b_vn -= tl.dot(b_w, b_h3.to(b_w.dtype), input_precision=PREC)
        if K > 3 * BK:
            tl.store(p_h + 3 * BK * V, b_h4.to(h.dtype.element_ty), mask=m_k4[:, None] & m_v[None, :])
            b_w = _rows(w, o_t, m_t, o_k4, m_k4, HV, i_hv, K)
            b_vn -= tl.dot(b_w, b_h4.to(b_w.dtype), input_precision=PREC)
        tl.store(v_new + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        # decay the state over the chunk and add what the chunk wrote: exp(gc_last - gc_j) <= 1
        g_last = tl.load(gc + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        b_g = tl.load(gc + o_t * HV + i_hv, mask=m_t, other=0)
        b_vn = b_vn * tl.exp(tl.where(m_t, g_last - b_g, float("-inf")))[:, None]
        b_h1 = _state_tile_update(b_h1, k, o_t, m_t, o_k1, m_k1, i_h, b_vn, g_last, H, K, PREC)
        if K > BK:
            b_h2 = _state_tile_update(b_h2, k, o_t, m_t, o_k2, m_k2, i_h, b_vn, g_last, H, K, PREC)
        if K > 2 * BK:
            b_h3 = _state_tile_update(b_h3, k, o_t, m_t, o_k3, m_k3, i_h, b_vn, g_last, H, K, PREC)
        if K > 3 * BK:
            b_h4 = _state_tile_update(b_h4, k, o_t, m_t, o_k4, m_k4, i_h, b_vn, g_last, H, K, PREC)
    if STORE_FINAL:
        p_ht = ht + i_nh.to(tl.int64) * K * V + o_kv
        tl.store(p_ht, b_h1, mask=m_k1[:, None] & m_v[None, :])
        if K > BK:
            tl.store(p_ht + BK * V, b_h2, mask=m_k2[:, None] & m_v[None, :])
        if K > 2 * BK:
            tl.store(p_ht + 2 * BK * V, b_h3, mask=m_k3[:, None] & m_v[None, :])
        if K > 3 * BK:
            tl.store(p_ht + 3 * BK * V, b_h4, mask=m_k4[:, None] & m_v[None, :])


_chunk_h_tuned = triton.autotune(_STATE_CONFIGS, key=["K", "V", "NHV"],
                                 prune_configs_by={"early_config_prune": _prune_state_configs})(_chunk_h_kernel)


def _chunk_h(k, w, u, gc, initial_state, output_final_state: bool, seqs: _Seqs):
    """-> (h [rows, HV, K, V] per-chunk start states in k's dtype, v_new [B, T, HV, V], final fp32 or None)."""
    b, t, h, dk = k.shape
    hv, dv = u.shape[2:]
    states = torch.empty(seqs.rows, hv, dk, dv, dtype=k.dtype, device=k.device)
    v_new = torch.empty_like(u)
    final = torch.empty(seqs.n, hv, dk, dv, dtype=torch.float32, device=k.device) if output_final_state else None
    dummy = torch.empty(1, dtype=torch.float32, device=k.device)
    nhv = seqs.n * hv
    if nhv == 0:
        return states, v_new, final
    args = (k, w, u, gc, states, v_new, initial_state if initial_state is not None else dummy,
            final if final is not None else dummy, seqs.cu, seqs.chunk_off, t, triton.next_power_of_2(nhv))
    meta = dict(H=h, HV=hv, K=dk, V=dv, BT=CHUNK, BK=min(64, _pow2(dk)), USE_H0=initial_state is not None,
                STORE_FINAL=final is not None, IS_VARLEN=seqs.varlen, PREC=_prec(k.dtype))
    _launch(_chunk_h_tuned, lambda c: (triton.cdiv(dv, c["BV"]), nhv), args, meta)
    return states, v_new, final


# ----------------------------------------------------------------------------- 5. output

# key: K, V.  16-bit inputs: BV 64 or 128 (128 computes q K^T once for V = 128), 8 warps; fp32
# (FMA products): 32-wide tiles.  Chosen so that no K <= 256 spills (parity/aot_compile.py).
_OUT_CONFIGS = [triton.Config({"BV": 64}, num_warps=8, num_stages=2), triton.Config({"BV": 128}, num_warps=8, num_stages=1),
                triton.Config({"BV": 32}, num_warps=8, num_stages=1)]


def _prune_out_configs(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    if args["q"].dtype == torch.float32:
        return [c for c in configs if c.kwargs["BV"] == 32]
    return [c for c in configs if c.kwargs["BV"] != 32 and c.kwargs["BV"] <= _pow2(args["V"], 64)]


@triton.jit(do_not_specialize=["T"])
def _chunk_o_kernel(q, k, v_new, h, gc, o, cu, chunk_idx, scale, T, H: tl.constexpr, HV: tl.constexpr,
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
    o_j = tl.arange(0, BT)
    keep = m_t[:, None] & (o_j[:, None] >= o_j[None, :])
    b_s = b_s * tl.exp(tl.where(keep, b_g[:, None] - b_g[None, :], float("-inf")))
    b_vn = _rows(v_new, o_t, m_t, o_v, m_v, HV, i_hv, V)                  # [BT, BV]
    b_o = b_o * tl.exp(b_g)[:, None] + tl.dot(b_s.to(b_vn.dtype), b_vn, input_precision=PREC)
    tl.store(o + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


_chunk_o_tuned = triton.autotune(_OUT_CONFIGS, key=["K", "V"],
                                 prune_configs_by={"early_config_prune": _prune_out_configs})(_chunk_o_kernel)


def _chunk_o(q, k, v_new, states, gc, scale: float, seqs: _Seqs) -> torch.Tensor:
    b, t, h, dk = q.shape
    hv, dv = v_new.shape[2:]
    o = torch.empty_like(v_new)
    if not seqs.nt or not hv:
        return o
    nbh = (1 if seqs.varlen else b) * hv
    args = (q, k, v_new, states, gc, o, seqs.cu, seqs.chunk_idx, scale, t)
    bk = 32 if q.dtype == torch.float32 else min(64, _pow2(dk))
    meta = dict(H=h, HV=hv, K=dk, V=dv, BT=CHUNK, BK=bk, IS_VARLEN=seqs.varlen, PREC=_prec(q.dtype))
    _launch(_chunk_o_tuned, lambda c: (triton.cdiv(dv, c["BV"]), seqs.nt, nbh), args, meta)
    return o


def _chunk_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale: float, output_final_state: bool):
    """The five kernels in order.  Returns (o, final or None, gc, A)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    seqs = _sequences(q.shape[0], q.shape[1], cu_seqlens, q.device)
    gc = _chunk_cumsum(g, seqs)
    a = _chunk_kkt_solve(k, gc, beta, v.shape[2], seqs)
    w, u = _chunk_wu(k, v, beta, gc, a, seqs)
    states, v_new, final = _chunk_h(k, w, u, gc, initial_state, output_final_state, seqs)
    o = _chunk_o(q, k, v_new, states, gc, scale, seqs)
    return o, final, gc, a


# ----------------------------------------------------------------------------- recurrent (decode)

# key: K, V, NHV (decode wants enough programs to keep many state reads in flight).
_REC_CONFIGS = [triton.Config({"BV": bv}, num_warps=w, num_stages=1) for bv, w in ((16, 1), (32, 2), (64, 4))]


def _prune_rec_configs(configs, named_args, **kwargs):
    dv = {**named_args, **kwargs}["V"]
    return [c for c in configs if c.kwargs["BV"] <= _pow2(dv)] or configs[:1]


@triton.jit(do_not_specialize=["T"])
def _recurrent_kernel(q, k, v, g, beta, o, h0, ht, cu, scale, T, NHV, H: tl.constexpr, HV: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                      STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr):
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
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0)   # the state, read once
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_g = tl.load(g + t * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_h = b_h * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))              # [BV]
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_FINAL:
        tl.store(ht + i_nh.to(tl.int64) * K * V + o_kv, b_h, mask=m_kv)      # written once


_recurrent_tuned = triton.autotune(_REC_CONFIGS, key=["K", "V", "NHV"],
                                   prune_configs_by={"early_config_prune": _prune_rec_configs})(_recurrent_kernel)


def _recurrent_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale: float, output_final_state: bool,
                       use_l2norm: bool):
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    b, t, h, dk = q.shape
    hv, dv = v.shape[2:]
    dummy = torch.empty(1, dtype=torch.float32, device=q.device)
    if cu_seqlens is None:
        n, cu = b, torch.zeros(1, dtype=torch.int32, device=q.device)
    else:
        _check_cu_seqlens_values(cu_seqlens.tolist(), t)
        n, cu = cu_seqlens.numel() - 1, cu_seqlens.to(torch.int32)
    o = torch.empty_like(v)
    final = torch.empty(n, hv, dk, dv, dtype=torch.float32, device=q.device) if output_final_state else None
    if n * hv == 0:
        return o, final
    args = (q, k, v, g, beta, o, initial_state.contiguous() if initial_state is not None else dummy,
            final if final is not None else dummy, cu, scale, t, triton.next_power_of_2(n * hv))
    meta = dict(H=h, HV=hv, K=dk, V=dv, BK=_pow2(dk), USE_H0=initial_state is not None,
                STORE_FINAL=final is not None, IS_VARLEN=cu_seqlens is not None, L2NORM=use_l2norm)
    _launch(_recurrent_tuned, lambda c: (triton.cdiv(dv, c["BV"]), n * hv), args, meta)
    return o, final


# ----------------------------------------------------------------------------- custom ops

def _no_backward(name):
    def backward(ctx, *grads):
        raise NotImplementedError(f"fast {name} has no backward yet; for gradients use ref/gated_deltanet.py "
                                  f"(the Triton backward is part 2 of this feature)")
    return backward


def _no_context(ctx, inputs, output):
    pass


@torch.library.custom_op("twofold::gdn_l2norm_fwd", mutates_args=())
def _l2norm_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_runnable(x)
    return _l2norm(x.contiguous())


@_l2norm_op.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("twofold::chunk_gated_delta_rule_fwd", mutates_args=())
def _chunk_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
              output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (o, final_state or an empty tensor, gc fp32 [B, T, HV], A [B, T, HV, 64])."""
    _check_runnable(q)
    o, final, gc, a = _chunk_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state)
    return o, final if final is not None else q.new_empty(0, dtype=torch.float32), gc, a


@_chunk_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state):
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty(n, hv, dk, dv, dtype=torch.float32) if output_final_state else q.new_empty(0, dtype=torch.float32)
    return (v.new_empty(b, t, hv, dv), final, q.new_empty(b, t, hv, dtype=torch.float32),
            q.new_empty(b, t, hv, CHUNK))


@torch.library.custom_op("twofold::fused_recurrent_gated_delta_rule_fwd", mutates_args=())
def _recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                  output_final_state: bool, use_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (o, final_state or an empty tensor)."""
    _check_runnable(q)
    o, final = _recurrent_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2norm)
    return o, final if final is not None else q.new_empty(0, dtype=torch.float32)


@_recurrent_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2norm):
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty(n, hv, dk, dv, dtype=torch.float32) if output_final_state else q.new_empty(0, dtype=torch.float32)
    return v.new_empty(b, t, hv, dv), final


_l2norm_op.register_autograd(_no_backward("l2norm (use_qk_l2norm_in_kernel)"), setup_context=_no_context)
_chunk_op.register_autograd(_no_backward("chunk_gated_delta_rule"), setup_context=_no_context)
_recurrent_op.register_autograd(_no_backward("fused_recurrent_gated_delta_rule"), setup_context=_no_context)


# ----------------------------------------------------------------------------- public API

def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """The gated delta rule in chunk form (chunks of 64 tokens), Triton; see the module docstring.

    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] fp32 or None)``."""
    _check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                  float_dtypes=_FLOATS)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, _ = _l2norm_op(q)
        k, _ = _l2norm_op(k)
    o, final, _, _ = _chunk_op(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state)
    return o, (final if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """The gated delta rule token by token in one Triton kernel (decode); same arguments and result
    as ``chunk_gated_delta_rule``."""
    _check_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                  float_dtypes=_FLOATS)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, final = _recurrent_op(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                             use_qk_l2norm_in_kernel)
    return o, (final if output_final_state else None)


# ----------------------------------------------------------------------------- ahead-of-time build cases

def _compile_cases():
    """Every kernel at the shapes that decide its code: fp16 / bf16 / fp32 at K = V = 128, and bf16
    at K = V = 100 (padded, masked) and 256 (four state tiles); varlen, initial and final state
    on (the superset of the code paths); autotuned kernels with every config their pruning keeps.
    fp16 compiles like bf16 (the same registers in every build compared), so it builds one config
    per kernel, to keep the check's time down."""
    cases = []
    shapes = [(torch.bfloat16, 128, 128), (torch.float32, 128, 128), (torch.bfloat16, 100, 100),
              (torch.bfloat16, 256, 256), (torch.float16, 128, 128)]
    heads = dict(H=16, HV=32)
    for dtype, dk, dv in shapes:
        dt = _TL_DTYPES[dtype]
        tag = f"[{dt},K={dk},V={dv}]"
        tc = dtype != torch.float32
        prec = _prec(dtype)
        ptr, f32, i32 = f"*{dt}", "*fp32", "*i32"
        named = dict(K=dk, V=dv, k=torch.empty(0, dtype=dtype), q=torch.empty(0, dtype=dtype))
        bk_full = _pow2(dk)
        cases.append(dict(kernel=_l2norm_kernel, name="l2norm" + tag, signature=dict(x=ptr, y=ptr, rstd=f32, R="i32"),
                          constexprs=dict(D=dk, BR=4096 // bk_full, BD=bk_full), num_warps=4))
        # 16-row blocks: mma.sync, too few rows for wgmma
        cases.append(dict(kernel=_chunk_kkt_solve_kernel, name="kkt_solve" + tag, tensor_cores=tc, wgmma=False,
                          signature=dict(k=ptr, gc=f32, beta=f32, A=ptr, cu=i32, chunk_idx=i32, T="i32"),
                          constexprs=dict(**heads, K=dk, BT=CHUNK, BK=min(64, bk_full), IS_VARLEN=True, PREC=prec),
                          num_warps=_KKT_WARPS))
        wu = _wu_tiles(dtype, dk, dv)
        cases.append(dict(kernel=_chunk_wu_kernel, name="wu" + tag, tensor_cores=tc,
                          signature=dict(k=ptr, v=ptr, beta=f32, gc=f32, A=ptr, w=ptr, u=ptr, cu=i32, chunk_idx=i32,
                                         T="i32"),
                          constexprs=dict(**heads, K=dk, V=dv, BT=CHUNK, BK=wu["BK"], BV=wu["BV"], IS_VARLEN=True,
                                          PREC=prec), num_warps=wu["num_warps"]))
        cases.append(dict(kernel=_chunk_h_tuned, name="state" + tag, tensor_cores=tc,
                          configs=_prune_state_configs(_STATE_CONFIGS, named)[:1 if dtype == torch.float16 else None],
                          signature=dict(k=ptr, w=ptr, u=ptr, gc=f32, h=ptr, v_new=ptr, h0=f32, ht=f32, cu=i32,
                                         chunk_off=i32, T="i32", NHV="i32"),
                          constexprs=dict(**heads, K=dk, V=dv, BT=CHUNK, BK=min(64, bk_full), USE_H0=True,
                                          STORE_FINAL=True, IS_VARLEN=True, PREC=prec)))
        cases.append(dict(kernel=_chunk_o_tuned, name="output" + tag, tensor_cores=tc,
                          configs=_prune_out_configs(_OUT_CONFIGS, named)[:1 if dtype == torch.float16 else None],
                          signature=dict(q=ptr, k=ptr, v_new=ptr, h=ptr, gc=f32, o=ptr, cu=i32, chunk_idx=i32,
                                         scale="fp32", T="i32"),
                          constexprs=dict(**heads, K=dk, V=dv, BT=CHUNK, BK=32 if not tc else min(64, bk_full),
                                          IS_VARLEN=True, PREC=prec)))
        cases.append(dict(kernel=_recurrent_tuned, name="recurrent" + tag,
                          configs=_prune_rec_configs(_REC_CONFIGS, named)[:1 if dtype == torch.float16 else None],
                          signature=dict(q=ptr, k=ptr, v=ptr, g=f32, beta=ptr, o=ptr, h0=f32, ht=f32, cu=i32,
                                         scale="fp32", T="i32", NHV="i32"),
                          constexprs=dict(**heads, K=dk, V=dv, BK=bk_full, USE_H0=True, STORE_FINAL=True,
                                          IS_VARLEN=True, L2NORM=True)))
    for hv in (16, 64):
        cases.append(dict(kernel=_chunk_cumsum_kernel, name=f"cumsum[HV={hv}]",
                          signature=dict(g="*fp32", gc="*fp32", cu="*i32", chunk_idx="*i32", T="i32"),
                          constexprs=dict(HV=hv, BT=CHUNK, BH=hv, IS_VARLEN=True), num_warps=4))
    return cases


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
    o2, h2 = fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    print("chunk vs recurrent max error:", (o1 - o2).abs().max().item(), (h1 - h2).abs().max().item())
