"""Parity of fast/gated_deltanet.py with ref/gated_deltanet.py, and the reference with itself.

1. The reference: chunk form == recurrent form in fp64 (odd T, strong and zero decay, GVA,
   varlen with an empty document), autograd through both forms (gradcheck, and the two forms'
   gradients agree), upcast=False really computes in the low precision.
2. fast vs ref: outputs and final states under the parity rule (conftest's ``check_close``: at
   most twice the error of the reference run in the test dtype) plus fla's RMS-ratio guard; the
   chunk op's saved intermediates (within-chunk gate cumsum, solved triangular blocks) against
   the reference's steps; varlen == each document alone; K = 100 and GVA ratios 1 / 2 / 3.
3. The contract: bad input raises the same error in both files; torch.compile(fullgraph=True)
   traces the fast ops (gradients: test_gated_deltanet_backward.py).
4. The Qwen3.5 layer: with ref kernels == with fast kernels; prefill then one-token decode
   steps == prefill of the whole sequence (dense and varlen).
5. fla 0.6.0's whole signature in both files: positional order and defaults, use_gate_in_kernel,
   use_beta_sigmoid_in_kernel / allow_neg_eigval, state_v_first, cu_seqlens_cpu (no device read),
   tolerated extra keywords; initial_state in any float dtype, fp32 q/k with a 16-bit v; hard
   resets (g = -inf) in the chunk form; B = 0; a clear error for CPU tensors without the interpreter
   (gradients of all of it: test_gated_deltanet_backward.py).
6. The recurrent form is batch and split invariant, bit for bit: one sequence's o, final state and
   gradients alone == in a dense batch == packed with others (any position) == split across calls.
Interpreter tier: fp32 / fp16, small shapes.  GPU tier: bf16, T up to 32k, K = V = 128.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fast.gated_deltanet as fast
import ref.gated_deltanet as ref
from conftest import (DEVICE, ON_GPU, check_close, dtype_params, gpu_case, make_generator, nan_allocations,
                      randn, requires_gpu)

# fla's RMS-ratio metric rms(fast - ref) / rms(ref) for outputs and final states.  fp16: fla's
# 0.005.  bf16 rounds 8x coarser; replaying the kernels' bf16 storage points (A, w, u, v_new,
# per-chunk states) in PyTorch gives 3e-3 .. 5e-3 on these inputs and 1e-2 with positive g, so
# bf16 gets 0.02 (the max-error rule, 2x the plain-bf16 reference, stays the primary check).
RMS_LIMIT = {torch.float16: 0.005, torch.bfloat16: 0.02}


# ----------------------------------------------------------------------------- inputs

def make_inputs(b, t, h, hv, dk, dv, *, seed=0, n_states=None, g_scale=1.0, device=DEVICE):
    """fp64 inputs: q, k [B, T, H, K] (k unit-norm: the delta rule needs |k| <= 1 to stay stable
    when use_qk_l2norm_in_kernel is off), v, g = logsigmoid(.) * g_scale <= 0, beta in (0, 1),
    an initial state for n_states sequences (default B)."""
    gen = make_generator(seed)
    q = randn(b, t, h, dk, gen=gen, dtype=torch.float64, device=device)
    k = F.normalize(randn(b, t, h, dk, gen=gen, dtype=torch.float64, device=device), dim=-1)
    v = randn(b, t, hv, dv, gen=gen, dtype=torch.float64, device=device)
    g = F.logsigmoid(randn(b, t, hv, gen=gen, dtype=torch.float64, device=device)) * g_scale
    beta = torch.sigmoid(randn(b, t, hv, gen=gen, dtype=torch.float64, device=device))
    h0 = randn(b if n_states is None else n_states, hv, dk, dv, gen=gen, dtype=torch.float64, device=device)
    return q, k, v, g, beta, h0


def cast(dtype, q, k, v, g, beta, h0):
    """The test dtype for q, k, v; g in fp32 (as the Qwen3.5 layer makes it), beta in the test dtype."""
    return (q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.to(dtype),
            None if h0 is None else h0.float())


def cu_tensor(lengths):
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def by_keyword(fn):
    """fla's recurrent signature has gk and gv before beta: the tests pass g and beta by keyword."""
    def call(q, k, v, g, beta, *args, **kw):
        return fn(q, k, v, *args, g=g, beta=beta, **kw)
    return call


FNS = {"chunk": (ref.chunk_gated_delta_rule, fast.chunk_gated_delta_rule),
       "recurrent": (by_keyword(ref.fused_recurrent_gated_delta_rule),
                     by_keyword(fast.fused_recurrent_gated_delta_rule))}


@contextlib.contextmanager
def kernel_gate_sums(active=True):
    """The fast chunk op's low-precision baseline: inside, the reference takes each decay's exponent as
    the kernels (and fla) do, D_ij = b_i - b_j from the within-chunk cumulative gates b, rounded at the
    scale of b (up to 64 |g|), instead of its own sum over the stretch (j, i] (ref._GateSums).  The
    fast kernels are held to the rule against the reference computed their way (their dg in fp32
    under strong decay: 1.3e-4 rms, the reference's 2.3e-7; bench/README.md, Limits: Gated DeltaNet);
    the reference's own precision is test_gated_deltanet_backward.py's strong-decay tests'."""
    def forward(ctx, g):
        g0 = F.pad(g, (1, 0))                                  # [.., C + 1]: position 0 = chunk start
        reset = torch.isneginf(g0)
        b = torch.where(reset, torch.zeros_like(g0), g0).cumsum(-1)
        seg = reset.cumsum(-1)                                 # hard resets so far: b_i - b_j within a stretch
        i = torch.arange(g0.shape[-1], device=g.device)
        valid = (i[:, None] >= i[None, :]) & (seg[..., :, None] == seg[..., None, :])
        ctx.save_for_backward(valid)
        diff = b[..., :, None] - b[..., None, :]
        return torch.where(valid, diff, torch.full_like(diff, float("-inf")))

    own = ref._GateSums.forward
    if active:
        ref._GateSums.forward = staticmethod(forward)
    try:
        yield
    finally:
        ref._GateSums.forward = staticmethod(own)


def compare(kind, dtype, inputs, *, low=None, cu_seqlens=None, scale=None, l2norm=False, rms=True, tag="",
            **options):
    """fast(dtype) vs ref(fp64) under the tolerance rule; ref_lowp = the same ref form in dtype (the
    chunk form with the kernels' gate sums, see kernel_gate_sums).  All three see the same inputs,
    rounded to the test dtype first (FlashAttention's and fla's convention: the comparison measures
    the computation, not the rounding of the inputs); ``low`` gives those rounded inputs directly
    (mixed dtypes).  ``options`` go to all three calls."""
    ref_fn, fast_fn = FNS[kind]
    kw = dict(output_final_state=True, cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm_in_kernel=l2norm, **options)
    low = cast(dtype, *inputs) if low is None else low
    o64, h64 = ref_fn(*(x.double() for x in low[:5]), initial_state=low[5].double(), **kw)
    with kernel_gate_sums(kind == "chunk"):
        o_lp, h_lp = ref_fn(*low[:5], initial_state=low[5], upcast=False, **kw)
    with nan_allocations():
        o, ht = fast_fn(*low[:5], initial_state=low[5], **kw)
    assert o.dtype == low[2].dtype and o.shape == o64.shape
    assert ht.dtype == torch.float32 and ht.shape == h64.shape
    limit = RMS_LIMIT.get(dtype) if rms else None
    check_close(f"{kind}{tag} o", o, o64, o_lp, rms_ratio=limit)
    check_close(f"{kind}{tag} final_state", ht, h64, h_lp, rms_ratio=limit)
    return o, ht


# ----------------------------------------------------------------------------- 1. the reference

@pytest.mark.parametrize("t", [1, 63, 75, 130])
@pytest.mark.parametrize("h,hv", [(2, 2), (1, 3)])
def test_ref_chunk_equals_recurrent(t, h, hv):
    q, k, v, g, beta, h0 = make_inputs(2, t, h, hv, 16, 12, seed=t, device="cpu")
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, s1 = ref.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o2, s2 = ref.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=0, atol=1e-12)
    assert s1.dtype == torch.float64


@pytest.mark.parametrize("case", ["strong_decay", "zero_gates", "positive_g_small"])
def test_ref_forms_agree_on_extreme_gates(case):
    g_scale = {"strong_decay": 100.0, "zero_gates": 0.0, "positive_g_small": -0.02}[case]
    q, k, v, g, beta, h0 = make_inputs(1, 130, 1, 2, 16, 16, seed=1, g_scale=g_scale, device="cpu")
    kw = dict(initial_state=h0, output_final_state=True)
    o1, s1 = ref.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o2, s2 = ref.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    assert torch.isfinite(o1).all() and torch.isfinite(s1).all()
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-10)
    if case == "strong_decay":   # exp(-~70) per token: the state forgets everything before each token
        _, s_alone = ref.fused_recurrent_gated_delta_rule(q[:, -1:], k[:, -1:], v[:, -1:], g=g[:, -1:],
                                                          beta=beta[:, -1:], output_final_state=True)
        torch.testing.assert_close(s1, s_alone, rtol=0, atol=1e-12)


def test_ref_varlen_equals_per_document():
    lengths = [5, 0, 70, 64, 1]
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 1, 2, 16, 8, seed=2, n_states=len(lengths), device="cpu")
    cu = torch.tensor([0, 5, 5, 75, 139, 140], dtype=torch.int64)   # int64, like fla's LongTensor
    for fn in (FNS["chunk"][0], FNS["recurrent"][0]):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            o_n, s_n = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[n:n + 1],
                          output_final_state=True)
            torch.testing.assert_close(o[:, a:b], o_n, rtol=0, atol=1e-12)
            torch.testing.assert_close(s[n:n + 1], s_n, rtol=0, atol=1e-12)
        torch.testing.assert_close(s[1], h0[1], rtol=0, atol=0)   # the empty document keeps its state


def test_ref_gradcheck_both_forms():
    q, k, v, g, beta, h0 = make_inputs(1, 6, 1, 2, 4, 3, seed=3, device="cpu")
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    for fn in (FNS["chunk"][0], FNS["recurrent"][0]):
        def f(q, k, v, g, beta, h0, fn=fn):
            o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
            return o, s
        # fast_mode: random directions instead of the full Jacobian (the chunk form pads to 64
        # tokens and runs 63 substitution steps per call; the full Jacobian takes minutes)
        assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, fast_mode=True)


def test_ref_gradients_of_both_forms_agree():
    lengths = [70, 0, 9]
    q, k, v, g, beta, h0 = make_inputs(1, 79, 1, 2, 8, 8, seed=4, n_states=3, device="cpu")
    cu = cu_tensor(lengths).cpu()
    grads = []
    for fn in (FNS["chunk"][0], FNS["recurrent"][0]):
        args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, s = fn(*args[:5], initial_state=args[5], output_final_state=True, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=True)
        (o.sin().sum() + s.cos().sum()).backward()
        grads.append([a.grad for a in args])
    for name, a, b in zip("q k v g beta h0".split(), *grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_ref_upcast_false_is_low_precision():
    inputs = cast(torch.float16, *make_inputs(1, 75, 1, 1, 16, 16, seed=5, device="cpu"))
    o32, _ = ref.chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5])
    o16, _ = ref.chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], upcast=False)
    assert o16.dtype == torch.float16 and not torch.equal(o32, o16)


# ----------------------------------------------------------------------------- 2. fast vs ref

# The case tables, shared with test_gated_deltanet_backward.py (one table: the forward and the
# backward run the same shapes).
CHUNK_CASES = [
    # name, (B, T, H, HV, K, V), g_scale
    pytest.param("T63_gva2", (2, 63, 1, 2, 32, 32), 1.0, id="T63-gva2"),
    pytest.param("T130_K100_gva3", (1, 130, 1, 3, 100, 24), 1.0, id="T130-K100-V24-gva3"),
    pytest.param("T75_strong", (1, 75, 1, 1, 16, 16), 100.0, id="T75-strong-decay"),
    pytest.param("T75_zero", (1, 75, 2, 2, 16, 16), 0.0, id="T75-zero-gates"),
    pytest.param("T75_positive_g", (1, 75, 1, 1, 16, 16), -0.05, id="T75-positive-g"),
    pytest.param("T1_gva8", (2, 1, 1, 8, 16, 16), 1.0, id="T1-gva8"),
    pytest.param("T20_K200", (1, 20, 1, 1, 200, 24), 1.0, id="T20-K200-four-state-tiles"),
    pytest.param("T10_V300", (1, 10, 1, 1, 16, 300), 1.0, id="T10-V300"),
    gpu_case("T2048", (2, 2048, 4, 8, 128, 128), 1.0, id="T2048-K128-gva2"),
    gpu_case("T8192_gva4", (1, 8192, 4, 16, 128, 128), 1.0, id="T8192-K128-gva4"),
    gpu_case("T4096_K256", (1, 4096, 2, 4, 256, 256), 1.0, id="T4096-K256"),
    gpu_case("T4096_strong", (1, 4096, 2, 4, 128, 128), 100.0, id="T4096-strong-decay"),
    gpu_case("T32768", (1, 32768, 2, 4, 128, 128), 1.0, id="T32768-K128"),
]

RECURRENT_CASES = [
    # (B, T, H, HV, K, V), g_scale
    pytest.param((3, 1, 1, 2, 32, 32), 1.0, id="decode-T1"),
    pytest.param((2, 1, 1, 3, 100, 48), 1.0, id="decode-T1-K100-V48-gva3"),
    pytest.param((1, 20, 1, 3, 100, 24), 1.0, id="T20-K100-V24-gva3"),
    pytest.param((1, 16, 1, 2, 16, 16), 100.0, id="T16-strong-decay"),
    pytest.param((1, 3, 1, 1, 256, 20), 1.0, id="T3-K256"),
    gpu_case((256, 1, 16, 32, 128, 128), 1.0, id="decode-B256-K128"),
    gpu_case((2, 512, 4, 8, 128, 128), 1.0, id="T512-K128"),
]


@pytest.mark.parametrize("name,shape,g_scale", CHUNK_CASES)
@pytest.mark.parametrize("dtype", dtype_params())
def test_fast_chunk_matches_ref(name, shape, g_scale, dtype):
    b, t, h, hv, dk, dv = shape
    compare("chunk", dtype, make_inputs(b, t, h, hv, dk, dv, seed=10, g_scale=g_scale), tag=f"[{name}]")


@pytest.mark.parametrize("dtype", dtype_params())
def test_fast_chunk_l2norm_scale_no_state(dtype):
    q, k, v, g, beta, _ = make_inputs(2, 70, 2, 4, 16, 16, seed=11)
    q, k = q * 3, k * 0.5   # the kernel's l2norm must undo these
    low = cast(dtype, q, k, v, g, beta, None)
    ref_o, _ = ref.chunk_gated_delta_rule(*(x.double() for x in low[:5]), scale=0.3, use_qk_l2norm_in_kernel=True)
    with kernel_gate_sums():
        lp_o, _ = ref.chunk_gated_delta_rule(*low[:5], scale=0.3, use_qk_l2norm_in_kernel=True, upcast=False)
    with nan_allocations():
        o, final = fast.chunk_gated_delta_rule(*low[:5], scale=0.3, use_qk_l2norm_in_kernel=True)
    assert final is None
    check_close("chunk l2norm o", o, ref_o, lp_o)


@pytest.mark.parametrize("shape,g_scale", RECURRENT_CASES)
@pytest.mark.parametrize("dtype", dtype_params())
def test_fast_recurrent_matches_ref(shape, g_scale, dtype):
    compare("recurrent", dtype, make_inputs(*shape, seed=12, g_scale=g_scale), l2norm=True)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.bfloat16))
def test_fast_varlen_equals_per_document(kind, dtype):
    lengths = [70, 0, 5, 64, 1] if kind == "chunk" else [7, 0, 3, 1]
    if ON_GPU:
        lengths = [3000, 0, 64, 1, 1000, 2047] if kind == "chunk" else [300, 0, 1, 64]
    dk = dv = 128 if ON_GPU else 16
    inputs = make_inputs(1, sum(lengths), 1, 2, dk, dv, seed=13, n_states=len(lengths))
    cu = cu_tensor(lengths)
    if kind == "recurrent":
        cu = cu.long()   # fla's LongTensor convention; the chunk case covers int32
    o, ht = compare(kind, dtype, inputs, cu_seqlens=cu, tag="[varlen]")
    low = cast(dtype, *inputs)
    fn = FNS[kind][1]
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, h_n = fn(*(x[:, a:b] for x in low[:5]), initial_state=low[5][n:n + 1], output_final_state=True)
        # the same kernels on the same tokens: equal up to float reassociation (chunks restart per document)
        torch.testing.assert_close(o[:, a:b], o_n, rtol=0, atol=1e-6 if dtype == torch.float32 else 2e-2)
        torch.testing.assert_close(ht[n:n + 1], h_n, rtol=0, atol=1e-5 if dtype == torch.float32 else 5e-2)
    torch.testing.assert_close(ht[1], low[5][1], rtol=0, atol=0)   # empty document: state passes through


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_empty_input_passes_the_state_through(kind):
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(2, 0, 1, 2, 16, 16, seed=15))
    for fn in FNS[kind]:
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert o.shape == (2, 0, 2, 16)
        torch.testing.assert_close(ht, h0, rtol=0, atol=0)


def test_fast_chunk_gates_and_saved_blocks_match_ref_steps():
    """The chunk kernels' gates, gc (within-chunk cumsum, hard resets left out), gr (the chunk position of
    the latest hard reset, -1 if none) and ge (the exponent of the decay to the chunk's end), and the
    solved blocks A the chunk op keeps for its backward, against the reference's steps; the gates summed in
    token order (batch_invariant's) are the same bits as tl.cumsum's in the interpreter (sequential too)."""
    b, t, h, hv, dk, dv = 1, 100, 1, 2, 16, 16
    q, k, v, g, beta, h0 = make_inputs(b, t, h, hv, dk, dv, seed=14)
    g[0, [3, 70, 71], 0] = float("-inf")                                  # hard resets, two in a row
    with nan_allocations():
        seqs = fast._sequences(b, t, None, None, g.device)
        gates = fast._chunk_cumsum(g.float(), None, None, seqs)
        in_order = fast._chunk_cumsum(g.float(), None, None, seqs, True)
        _, _, a = torch.ops.twofold.chunk_gated_delta_rule_fwd(
            q.float(), k.float(), v.float(), g.float(), beta.float(), None, None, None, None, None, dk ** -0.5,
            False, False, False)
    for name, x, y in zip(gates._fields, gates, in_order):
        assert torch.equal(x, y), name
    pad = (-t) % ref.CHUNK
    kp = ref._chunked(F.pad(k.repeat_interleave(hv // h, 2), (0, 0, 0, 0, 0, pad)), 2)   # [B, HV, NC, C, K]
    gp, bp = (ref._chunked(F.pad(x, (0, 0, 0, pad)), 2) for x in (g, beta))
    reset = torch.isneginf(gp)
    gc_ref = torch.where(reset, 0, gp).cumsum(-1)
    gr_ref = torch.where(reset, torch.arange(ref.CHUNK, device=gp.device), -1).cummax(-1).values
    _, pair_decay, end_decay, _ = ref._decays(gp)
    a_ref = ref._wy_inverse(kp, pair_decay, bp)                           # [B, HV, NC, C, C]

    def unchunk(x, *tail):
        return x.movedim(1, 3).reshape(b, t + pad, hv, *tail)[:, :t]
    assert gates.gc.dtype == torch.float32 and gates.gr.dtype == torch.int8 and a.shape == (b, t, hv, ref.CHUNK)
    torch.testing.assert_close(gates.gc.double(), unchunk(gc_ref), rtol=0, atol=1e-5)
    torch.testing.assert_close(gates.gr.long(), unchunk(gr_ref), rtol=0, atol=0)
    # (the padding's g = 0 adds nothing, so the padded chunk end is the last token's)
    torch.testing.assert_close(gates.ge.double().exp(), unchunk(end_decay), rtol=0, atol=1e-5)
    torch.testing.assert_close(a.double(), unchunk(a_ref, ref.CHUNK), rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- 3. the contract

def _bad_cases():
    """(name, tensors, keywords, error, message, the forms it applies to)."""
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(2, 8, 2, 4, 16, 8, seed=20))
    ok = dict(q=q, k=k, v=v, g=g, beta=beta)
    one = dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1])                  # B = 1, for varlen
    both, chunk, recurrent = ("chunk", "recurrent"), ("chunk",), ("recurrent",)
    hv = v.shape[2]
    yield "hv_not_multiple", dict(ok, v=v[:, :, :3], g=g[:, :, :3], beta=beta[:, :, :3]), {}, ValueError, "HV=3", both
    yield "cu_with_batch", ok, dict(cu_seqlens=cu_tensor([8])), ValueError, "cu_seqlens requires batch size", both
    yield "state_shape", ok, dict(initial_state=h0[:1]), ValueError, "initial_state must be", both
    yield "state_v_first_shape", ok, dict(initial_state=h0, state_v_first=True), ValueError, r"\[N, HV, V, K\]", both
    yield "state_dtype", ok, dict(initial_state=h0.int()), TypeError, "initial_state must be a float tensor", both
    big_k = torch.zeros(2, 8, 2, 264, device=DEVICE)
    yield "k_too_big", dict(ok, q=big_k, k=big_k), {}, ValueError, "K must be <= 256", both
    yield "qk_dtypes", dict(ok, k=k.half()), {}, TypeError, "q and k must share a dtype", both
    yield "g_shape", dict(ok, g=g[:, :4]), {}, ValueError, "g must be", both
    yield "cu_dtype", one, dict(cu_seqlens=cu_tensor([8]).float()), TypeError, "cu_seqlens must be an int32", both
    yield "cu_end", one, dict(cu_seqlens=cu_tensor([3, 4])), ValueError, r"cu_seqlens\[-1\] must equal T", both
    yield "cu_cpu_without_cu", one, dict(cu_seqlens_cpu=torch.tensor([0, 8])), ValueError, "needs cu_seqlens", both
    yield "cu_cpu_shape", one, dict(cu_seqlens=cu_tensor([8]), cu_seqlens_cpu=torch.tensor([0, 4, 8])), ValueError, \
        "cu_seqlens_cpu must be a CPU copy", both
    yield "chunk_indices_rows", one, dict(cu_seqlens=cu_tensor([3, 5]), chunk_indices=cu_tensor([0]).new_zeros(3, 2)), \
        ValueError, "one row per chunk", chunk
    yield "chunk_size", ok, dict(chunk_size=32), ValueError, "chunk_size must be 64", chunk
    yield "batch_invariant_type", ok, dict(batch_invariant=1), TypeError, "batch_invariant must be a bool", chunk
    yield "cp_context", ok, dict(cp_context=object()), NotImplementedError, "cp_context", chunk
    yield "gk", ok, dict(gk=g[..., None].expand(*g.shape, 16)), NotImplementedError, "gk / gv", recurrent
    yield "neg_eigval_alone", ok, dict(allow_neg_eigval=True), ValueError, "requires use_beta_sigmoid_in_kernel", both
    yield "gate_without_A_log", ok, dict(use_gate_in_kernel=True), ValueError, "requires A_log", both
    yield "A_log_shape", ok, dict(use_gate_in_kernel=True, A_log=g.new_zeros(hv + 1)), ValueError, \
        r"A_log must be \[HV\]", both
    yield "dt_bias_dtype", ok, dict(use_gate_in_kernel=True, A_log=g.new_zeros(hv), dt_bias=g.new_zeros(hv).int()), \
        TypeError, "dt_bias must be a float", both
    yield "head_first", ok, dict(head_first=True), ValueError, "head_first", both
    if ON_GPU:
        yield "mixed_devices", dict(ok, v=v.cpu()), {}, ValueError, "mixed devices", both
    else:
        yield "mixed_devices", dict(ok, v=v.to("meta")), {}, ValueError, "mixed devices", both


@pytest.mark.parametrize("kind,name,tensors,kwargs,error,match",
                         [(kind, *case[:5]) for case in _bad_cases() for kind in case[5]],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_in_both(kind, name, tensors, kwargs, error, match):
    for fn in FNS[kind]:
        with pytest.raises(error, match=match):
            fn(tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"], **kwargs)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_fast_compiles_without_graph_break(kind):
    inputs = cast(torch.float32, *make_inputs(1, 20, 1, 2, 16, 16, seed=21))
    fn = FNS[kind][1]

    def f(q, k, v, g, beta, h0):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o * 2, s

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    o_c, s_c = compiled(*inputs)
    o_e, s_e = f(*inputs)
    torch.testing.assert_close(o_c, o_e)
    torch.testing.assert_close(s_c, s_e)



def test_the_fast_files_map_is_true():
    """fast/gated_deltanet.py's docstring maps each kernel (and host driver) to the function of
    ref/gated_deltanet.py it computes, with that function's line: every name on both sides exists,
    every line is the ref function's ``def``, and every kernel of the fast file is on the map."""
    doc = fast.__doc__
    rows = doc[doc.index("\nMap:"):].split("\n\n", 1)[0].splitlines()
    header = next(i for i, line in enumerate(rows) if line.split()[:2] == ["fast", "ref/gated_deltanet.py"])
    ref_text = Path(ref.__file__).read_text()
    ref_defs = {}                                    # "name" or "Class.method" -> the line of its def
    for node in ast.parse(ref_text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            ref_defs[node.name] = node.lineno
        if isinstance(node, ast.ClassDef):
            ref_defs.update({f"{node.name}.{m.name}": m.lineno for m in node.body if isinstance(m, ast.FunctionDef)})
    mapped = set()
    for row in rows[header + 1:]:
        name, ref_names, lines = re.split(r"\s{2,}", row.strip())[:3]
        assert hasattr(fast, name), f"map row {row.strip()!r}: fast has no {name}"
        for ref_name, line in zip(ref_names.split(", "), lines.split(", "), strict=True):
            assert ref_name in ref_defs, f"map row {row.strip()!r}: ref/gated_deltanet.py has no {ref_name}"
            assert ref_defs[ref_name] == int(line), (
                f"map row {row.strip()!r}: {ref_name} is at line {ref_defs[ref_name]} of ref/gated_deltanet.py")
        mapped.add(name)
    kernels = {name for name, obj in vars(fast).items() if name.endswith("_kernel") and callable(obj)}
    assert kernels <= mapped, f"kernels missing from the map: {sorted(kernels - mapped)}"


# ----------------------------------------------------------------------------- 4. the layer

def _layers(dtype, hv=4):
    torch.manual_seed(0)
    cfg = dict(num_k_heads=2, num_v_heads=hv, head_k_dim=16, head_v_dim=16, dtype=dtype, device=DEVICE)
    layer_ref = ref.GatedDeltaNet(32, **cfg)
    layer_fast = ref.GatedDeltaNet(32, chunk_fn=fast.chunk_gated_delta_rule,
                                   recurrent_fn=fast.fused_recurrent_gated_delta_rule, **cfg)
    layer_fast.load_state_dict(layer_ref.state_dict())
    return layer_ref, layer_fast


def test_layer_ref_kernels_vs_fast_kernels():
    layer64, _ = _layers(torch.float64)
    layer_ref, layer_fast = _layers(torch.float32)
    layer64.load_state_dict(layer_ref.state_dict())
    x = randn(1, 90, 32, gen=make_generator(30), dtype=torch.float64)
    cu = cu_tensor([40, 0, 50])
    y64 = layer64(x, cu_seqlens=cu)
    with kernel_gate_sums():          # the fp32 baseline takes the decays' exponents as the kernels do
        y_lp = layer_ref(x.float(), cu_seqlens=cu)
    y = layer_fast(x.float(), cu_seqlens=cu)
    check_close("layer (fast kernels)", y, y64, y_lp)


@pytest.mark.parametrize("kernels", ["ref", "fast"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_layer_prefill_then_decode_equals_full_prefill(kernels, varlen):
    dtype = torch.float64 if kernels == "ref" else torch.float32
    layer = _layers(dtype)[0 if kernels == "ref" else 1]
    steps = 3
    prompt = [5, 70] if varlen else [9, 9]
    x = randn(2, max(prompt) + steps, 32, gen=make_generator(31), dtype=dtype)
    full = [layer(x[i:i + 1, :prompt[i] + steps]) for i in range(2)]   # each sequence alone, whole
    cache = ref.GatedDeltaNetCache()
    if varlen:
        packed = torch.cat([x[i, :prompt[i]] for i in range(2)])[None]
        y = layer(packed, cu_seqlens=cu_tensor(prompt), cache=cache)
        starts = [0, prompt[0]]
        for i in range(2):
            torch.testing.assert_close(y[0, starts[i]:starts[i] + prompt[i]], full[i][0, :prompt[i]])
    else:
        y = layer(x[:, :prompt[0]], cache=cache)
        for i in range(2):
            torch.testing.assert_close(y[i], full[i][0, :prompt[i]])
    assert cache.recurrent_state.shape == (2, 4, 16, 16) and cache.conv_state.shape == (2, layer.conv_dim, 3)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    for s in range(steps):
        step = torch.stack([x[i, prompt[i] + s] for i in range(2)])[:, None]   # [N, 1, D]
        y = layer(step, cache=cache)
        for i in range(2):
            torch.testing.assert_close(y[i, 0], full[i][0, prompt[i] + s], **tol)


# ----------------------------------------------------------------------------- 5. fla's signature, edge numerics

# fla 0.6.0's parameters, in order, with their defaults (fla/ops/gated_delta_rule/chunk.py and
# fused_recurrent.py; both end in **kwargs).  Ours may add keyword-only ones after them.
FLA_CHUNK = [("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
             ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
             ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("state_v_first", False),
             ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("chunk_indices", None), ("cp_context", None)]
FLA_RECURRENT = [("q", None), ("k", None), ("v", None), ("g", None), ("gk", None), ("gv", None), ("beta", None),
                 ("scale", None), ("initial_state", None), ("output_final_state", False),
                 ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False), ("A_log", None),
                 ("dt_bias", None), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
                 ("state_v_first", False), ("cu_seqlens", None)]
# keyword arguments fla's chunk form reads from **kwargs, with their defaults
FLA_CHUNK_KWARGS = {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None, "chunk_size": 64}


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_signatures_match_fla(module):
    for fn, fla_params in ((module.chunk_gated_delta_rule, FLA_CHUNK),
                           (module.fused_recurrent_gated_delta_rule, FLA_RECURRENT)):
        params = inspect.signature(fn).parameters.values()
        positional = [(p.name, None if p.default is p.empty else p.default) for p in params
                      if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert positional == fla_params, fn.__name__
        assert any(p.kind == p.VAR_KEYWORD for p in params), f"{fn.__name__} must take **kwargs, as fla"
    chunk = inspect.signature(module.chunk_gated_delta_rule).parameters
    assert {name: chunk[name].default for name in FLA_CHUNK_KWARGS} == FLA_CHUNK_KWARGS


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_fla_positional_calls_and_defaults(module):
    """fla's positional calls mean what they mean in fla; the recurrent form's g = None is no decay
    and beta = None is beta = 1; HF's extra keywords are ignored."""
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(1, 20, 1, 2, 16, 16, seed=60))
    chunk, rec = module.chunk_gated_delta_rule, module.fused_recurrent_gated_delta_rule
    by_name = chunk(q, k, v, g, beta, scale=0.2, initial_state=h0, output_final_state=True)
    for a, b in zip(chunk(q, k, v, g, beta, 0.2, h0, True), by_name):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    hf_extras = dict(max_length_q=20, cu_seq_lens_k=cu_tensor([20]), position_ids=torch.arange(20)[None])
    for a, b in zip(chunk(q, k, v, g, beta, 0.2, h0, True, chunk_size=64, **hf_extras), by_name):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    by_name = rec(q, k, v, g=g, beta=beta, scale=0.2, initial_state=h0, output_final_state=True)
    for a, b in zip(rec(q, k, v, g, None, None, beta, 0.2, h0, True, **hf_extras), by_name):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(rec(q, k, v, g=g, initial_state=h0, output_final_state=True),
                    rec(q, k, v, g=g, beta=torch.ones_like(beta), initial_state=h0, output_final_state=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(rec(q, k, v, beta=beta, initial_state=h0, output_final_state=True),
                    rec(q, k, v, g=torch.zeros_like(g), beta=beta, initial_state=h0, output_final_state=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="state_v_first"):        # fla's old name still works
        _, s_t = rec(q, k, v, g=g, beta=beta, initial_state=h0.transpose(-1, -2), output_final_state=True,
                     transpose_state_layout=True)
    torch.testing.assert_close(s_t.transpose(-1, -2), by_name[1], rtol=0, atol=1e-6)


def gate_inputs(seed, hv, dtype=torch.float32):
    """The gate's raw input a (as Qwen3.5's in_proj_a gives it), A_log and dt_bias [HV]."""
    gen = make_generator(seed)
    return (randn(hv, gen=gen, dtype=dtype).abs().add(0.5).log(),      # A_log: exp(A_log) in [0.5, 3.5]
            randn(hv, gen=gen, dtype=dtype))


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.bfloat16))
def test_fast_matches_ref_with_gate_and_beta_in_kernel(kind, dtype):
    """use_gate_in_kernel (g = -exp(A_log) softplus(g + dt_bias) from g's raw input), then
    use_beta_sigmoid_in_kernel with and without allow_neg_eigval (beta = sigmoid / 2 sigmoid of a logit)."""
    inputs = make_inputs(1, 70 if kind == "chunk" else 9, 1, 3, 16, 16, seed=61)
    q, k, v, _, logit, h0 = inputs
    a = randn(*logit.shape, gen=make_generator(62), dtype=torch.float64, scale=3.0)   # raw gate input, wide
    a_log, dt_bias = gate_inputs(63, 3)
    raw = cast(dtype, q, k, v, a, logit, h0)
    for options in (dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True),
                    dict(use_gate_in_kernel=True, A_log=a_log, use_beta_sigmoid_in_kernel=True,
                         allow_neg_eigval=True)):
        compare(kind, dtype, None, low=raw, tag=f"[{sorted(options)}]", **options)
    # the reference's definition: the same as the activations applied outside
    low = cast(torch.float64, *raw)
    g = -a_log.double().exp() * F.softplus(low[3] + dt_bias.double())
    ref_fn = FNS[kind][0]
    inside = ref_fn(*low[:5], initial_state=low[5], output_final_state=True, use_gate_in_kernel=True, A_log=a_log,
                    dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    outside = ref_fn(*low[:3], g, 2 * low[4].sigmoid(), initial_state=low[5], output_final_state=True)
    for x, y in zip(inside, outside):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
    # A_log / dt_bias without use_gate_in_kernel are ignored, as fla ignores them
    plain = ref_fn(*low[:5], initial_state=low[5], output_final_state=True)
    for x, y in zip(ref_fn(*low[:5], initial_state=low[5], output_final_state=True, A_log=a_log), plain):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_state_v_first(kind, varlen):
    """state_v_first: initial and final states stored [N, HV, V, K] (vLLM / SGLang / FlashInfer state
    pools), the same numbers as [N, HV, K, V] transposed; K != V so a wrong layout cannot pass."""
    lengths = [40, 0, 5] if varlen else None
    b, t = (1, sum(lengths)) if varlen else (1, 40 if kind == "chunk" else 7)
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(b, t, 1, 2, 16, 24, seed=64,
                                                            n_states=len(lengths) if varlen else None))
    cu = cu_tensor(lengths) if varlen else None
    for fn in FNS[kind]:
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        with nan_allocations():
            o_t, s_t = fn(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                          cu_seqlens=cu, state_v_first=True)
        assert s_t.shape == (h0.shape[0], 2, 24, 16) and s_t.is_contiguous() and s_t.dtype == torch.float32
        torch.testing.assert_close(o_t, o, rtol=0, atol=1e-6)
        torch.testing.assert_close(s_t.transpose(-1, -2), s, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_cu_seqlens_cpu_is_read_instead_of_the_device_copy(kind):
    """With cu_seqlens_cpu the values come from the host copy: cu_seqlens itself is never read back
    (.tolist / .cpu / .item on it would be a device-to-host sync on a GPU)."""
    lengths = [40, 0, 5, 64] if kind == "chunk" else [3, 0, 5, 1]
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(1, sum(lengths), 1, 2, 16, 16, seed=65,
                                                            n_states=len(lengths)))
    cu = cu_tensor(lengths)
    cu_cpu = cu.cpu().long()
    chunks = sum(-(-n // 64) for n in lengths)
    extra = dict(chunk_indices=cu.new_zeros(chunks, 2)) if kind == "chunk" else {}
    for fn in FNS[kind]:
        expected = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        read_back = []
        real = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "item", "numpy")}

        def spy(name):
            def read(self, *args, **kwargs):
                if self.data_ptr() == cu.data_ptr():
                    read_back.append(name)
                return real[name](self, *args, **kwargs)
            return read
        try:
            for name in real:
                setattr(torch.Tensor, name, spy(name))
            got = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                     cu_seqlens_cpu=cu_cpu, **extra)
        finally:
            for name, method in real.items():
                setattr(torch.Tensor, name, method)
        assert not read_back, f"cu_seqlens was read back with {read_back} although cu_seqlens_cpu was given"
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@requires_gpu
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_fast_with_cu_seqlens_cpu_never_waits_for_the_device(kind):
    """The serving path: with cu_seqlens_cpu, a varlen call (forward and backward) makes no host-device
    synchronization (torch's sync debug mode turns one into an error); autotuning done beforehand."""
    lengths = [300, 0, 64, 1000] if kind == "chunk" else [1, 1, 0, 1]
    leaves = [x.requires_grad_() for x in cast(torch.bfloat16, *make_inputs(1, sum(lengths), 2, 4, 128, 128,
                                                                               seed=78, n_states=len(lengths)))]
    cu = cu_tensor(lengths)
    kw = dict(initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
              use_qk_l2norm_in_kernel=True)

    def step():
        o, s = FNS[kind][1](*leaves[:5], **kw)
        torch.autograd.grad((o.float().sum() + s.sum()), leaves)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_fast_matches_ref_with_mixed_dtypes(kind, dtype):
    """fp32 q and k with a 16-bit v (o in v's dtype), and an initial state in any float dtype (the
    final state stays fp32)."""
    inputs = make_inputs(1, 40 if kind == "chunk" else 9, 1, 2, 16, 16, seed=66)
    q, k, v, g, beta, h0 = cast(dtype, *inputs)
    if dtype != torch.float32:
        compare(kind, dtype, None, low=(q.float(), k.float(), v, g, beta, h0), tag="[fp32 q/k]", l2norm=True)
    for state_dtype in (torch.float16, torch.float64) + ((torch.bfloat16,) if ON_GPU else ()):
        expected = FNS[kind][1](q, k, v, g, beta, initial_state=h0.to(state_dtype).float(), output_final_state=True)
        with nan_allocations():
            o, s = FNS[kind][1](q, k, v, g, beta, initial_state=h0.to(state_dtype), output_final_state=True)
        assert s.dtype == torch.float32
        torch.testing.assert_close(o, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(s, expected[1], rtol=0, atol=0)
        o_ref, s_ref = FNS[kind][0](q, k, v, g, beta, initial_state=h0.to(state_dtype), output_final_state=True)
        assert s_ref.dtype == torch.float32 and o_ref.dtype == dtype


def hard_resets(g):
    """g with hard resets (g = -inf: the state is zeroed) where the chunk form is most fragile: a
    chunk's first and last tokens, two in a row, the first token, one head only, the padded last chunk."""
    g = g.clone()
    t = g.shape[1]
    for pos in (0, 17, 18, 63, 64, 100, t - 1):
        if pos < t:
            g[:, pos, 0] = float("-inf")
    g[:, min(40, t - 1), :] = float("-inf")
    return g


def test_ref_chunk_equals_recurrent_with_hard_resets():
    """g = -inf at a token: the chunk form (-inf - (-inf) = NaN before) equals the recurrence."""
    q, k, v, g, beta, h0 = make_inputs(2, 130, 1, 2, 16, 12, seed=67, device="cpu")
    g = hard_resets(g)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, s1 = ref.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o2, s2 = ref.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    assert torch.isfinite(o1).all() and torch.isfinite(s1).all()
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", dtype_params())
def test_fast_matches_ref_with_hard_resets(kind, dtype):
    inputs = list(make_inputs(1, 130 if kind == "chunk" else 20, 1, 2, 16, 16, seed=68))
    inputs[3] = hard_resets(inputs[3])
    o, ht = compare(kind, dtype, inputs, tag="[hard resets]", l2norm=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all(), "NaN where the recurrence is finite"


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_empty_batch(kind):
    """B = 0 (the reference's chunk form used to fail reshaping 0 elements)."""
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(0, 70, 1, 2, 16, 8, seed=69))
    for fn in FNS[kind]:
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert o.shape == (0, 70, 2, 8) and s.shape == (0, 2, 16, 8)


def test_fast_on_cpu_without_the_interpreter_says_what_to_do():
    """The fast file imported without TRITON_INTERPRET and called on CPU tensors: a clear error on the
    host that names the ways out, not a driver error from inside Triton (a fresh process: conftest
    sets TRITON_INTERPRET for this one)."""
    code = """
import torch
import gated_deltanet as gdn
q = torch.randn(1, 4, 1, 16); v = torch.randn(1, 4, 1, 16); g = -torch.rand(1, 4, 1); b = torch.rand(1, 4, 1)
for call in (lambda: gdn.chunk_gated_delta_rule(q, q, v, g, b, use_qk_l2norm_in_kernel=True),
             lambda: gdn.fused_recurrent_gated_delta_rule(q, q, v, g=g, beta=b)):
    try:
        call()
    except ValueError as e:
        print("ERROR:", e)
"""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""                       # CPU tensors even on a GPU machine
    folder = Path(fast.__file__).parent                    # the fast file imported alone, as a user copies it
    out = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                         timeout=120)
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 2, out.stdout + out.stderr
    for line in errors:
        for way_out in ("CUDA", "TRITON_INTERPRET=1", "ref/gated_deltanet.py"):
            assert way_out in line, line


# ----------------------------------------------------------------------------- 6. the recurrent form's invariance

def same_bits(what, a, b):
    """a and b hold the same bits (torch.equal would call -0.0 and +0.0 equal, and NaN unequal)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    differ = a.contiguous().view(ints) != b.contiguous().view(ints)
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {differ.numel()} elements differ, max |a - b| = "
                              f"{(a.double() - b.double()).abs().nan_to_num(float('inf')).max().item():.3g}")


@pytest.mark.parametrize("options", ["plain", "all-options"])
@pytest.mark.parametrize("dtype", dtype_params())
def test_recurrent_is_batch_and_split_invariant(dtype, options):
    """fused_recurrent_gated_delta_rule's guarantee (issue 17: a trainer recomputes what a decoding
    engine produced): one sequence's o and final state hold the same bits (i) alone, (ii) in a dense
    batch, (iii) packed with cu_seqlens among other documents (empty ones too) at either end, (iv) split
    at several points with the fp32 state carried to the next call, and (v) decoded token by token in
    batches whose other members change every step, as an engine's continuous batching does.  fp32 state;
    "all-options": in-kernel l2norm, gate (A_log, dt_bias) and 2 sigmoid(beta), states [N, HV, V, K].
    K = 32, V = 48: two V blocks of the fixed 32-wide tile, the second masked."""
    h, hv, dk, dv, t = 1, 1, 32, 48, 8
    gen = make_generator(70)
    kw = dict(output_final_state=True)
    if options == "all-options":
        a_log, dt_bias = gate_inputs(71, hv)
        kw.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                  use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True)

    def sequence(length):
        """One sequence's (q, k, v, g, beta) [1, length, ...] in the test dtype (g, beta fp32 / dtype),
        and its fp32 initial state [1, HV, K, V] (or [1, HV, V, K])."""
        q, k, v, g, beta, h0 = make_inputs(1, length, h, hv, dk, dv, seed=int(torch.randint(1 << 30, (1,),
                                                                                             generator=gen)))
        if options == "all-options":     # the gate's raw input and beta's logit take any sign
            g = randn(*g.shape, gen=gen, dtype=torch.float64) * 2
            beta = randn(*beta.shape, gen=gen, dtype=torch.float64)
            h0 = h0.transpose(-1, -2)
        return cast(dtype, q, k, v, g, beta, h0.contiguous())

    def run(seqs, *, varlen):
        """All of seqs in one call: a dense batch (equal lengths) or packed with cu_seqlens."""
        with nan_allocations():
            if varlen:
                cu = cu_tensor([s[0].shape[1] for s in seqs])
                o, ht = fast.fused_recurrent_gated_delta_rule(
                    *(torch.cat([s[i] for s in seqs], 1) for i in range(3)), g=torch.cat([s[3] for s in seqs], 1),
                    beta=torch.cat([s[4] for s in seqs], 1), initial_state=torch.cat([s[5] for s in seqs]),
                    cu_seqlens=cu, **kw)
                return [(o[:, a:b], ht[n:n + 1]) for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))]
            o, ht = fast.fused_recurrent_gated_delta_rule(
                *(torch.cat([s[i] for s in seqs]) for i in range(3)), g=torch.cat([s[3] for s in seqs]),
                beta=torch.cat([s[4] for s in seqs]), initial_state=torch.cat([s[5] for s in seqs]), **kw)
            return [(o[n:n + 1], ht[n:n + 1]) for n in range(len(seqs))]

    x = sequence(t)
    o_ref, h_ref = run([x], varlen=False)[0]
    assert torch.isfinite(o_ref).all() and torch.isfinite(h_ref).all()

    def check(what, o, ht):
        same_bits(f"{what}: o", o, o_ref)
        same_bits(f"{what}: final state", ht, h_ref)

    check("(i) alone, varlen", *run([x], varlen=True)[0])
    check("(ii) dense batch of 3", *run([sequence(t), x, sequence(t)], varlen=False)[1])
    check("(iii) packed last", *run([sequence(3), sequence(0), sequence(2), x], varlen=True)[3])
    check("(iii) packed first", *run([x, sequence(1), sequence(0)], varlen=True)[0])
    for split in (1, 4, t - 1):                           # (iv) [0, split) then [split, t), the state carried
        first = tuple(y[:, :split] for y in x[:5]) + (x[5],)
        (o1, h1), = run([first], varlen=False)
        rest = tuple(y[:, split:] for y in x[:5]) + (h1,)
        (o2, h2), = run([rest], varlen=True)
        check(f"(iv) split at {split}", torch.cat([o1, o2], 1), h2)
    state, outs = x[5], []                               # (v) token by token in changing batches
    for step in range(t):
        token = tuple(y[:, step:step + 1] for y in x[:5]) + (state,)
        others = [sequence(1) for _ in range(step % 3)]
        row = step % (len(others) + 1)
        o_step, state = run(others[:row] + [token] + others[row:], varlen=step % 2 == 1)[row]
        outs.append(o_step)
    check("(v) decoded token by token", torch.cat(outs, 1), state)


@pytest.mark.parametrize("options", ["plain", "all-options"])
def test_recurrent_backward_is_batch_invariant(options):
    """The recurrent backward's guarantee: one sequence's gradients (q, k, v, g, beta, initial state)
    hold the same bits alone and packed with cu_seqlens between two other documents, with the same
    upstream gradients for its o and final state.  fp32, K = 32, V = 48 (two V blocks: the per-block
    partials summed on the host)."""
    h, hv, dk, dv = 1, 2, 32, 48
    kw = dict(output_final_state=True)
    if options == "all-options":
        a_log, dt_bias = gate_inputs(81, hv)
        kw.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                  use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    lengths = (5, 7, 4)                                   # the sequence under test is the middle one
    seqs = [cast(torch.float32, *make_inputs(1, n, h, hv, dk, dv, seed=82 + i)) for i, n in enumerate(lengths)]
    grads_out = [(randn(1, n, hv, dv, gen=make_generator(90 + i)), randn(1, hv, dk, dv, gen=make_generator(95 + i)))
                 for i, n in enumerate(lengths)]

    def grads(chosen):
        """Gradients of the chosen sequences' inputs, all run in one packed call, per sequence."""
        leaves = [tuple(x.clone().requires_grad_() for x in seqs[i]) for i in chosen]
        cat = [torch.cat([leaf[j] for leaf in leaves], 0 if j == 5 else 1) for j in range(6)]
        with nan_allocations():
            o, ht = fast.fused_recurrent_gated_delta_rule(*cat[:3], g=cat[3], beta=cat[4], initial_state=cat[5],
                                                          cu_seqlens=cu_tensor([lengths[i] for i in chosen]), **kw)
            torch.autograd.backward((o, ht), (torch.cat([grads_out[i][0] for i in chosen], 1),
                                              torch.cat([grads_out[i][1] for i in chosen])))
        return [[x.grad for x in leaf] for leaf in leaves]

    alone, = grads([1])
    packed = grads([0, 1, 2])[1]
    assert all(torch.isfinite(x).all() for x in alone)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), alone, packed):
        same_bits(name, b, a)


# ----------------------------------------------------------------------------- 7. the chunk form's invariance

# Positions of the sequence under test whose rows are computed inside a partial chunk: the first rows of
# a chunk, the middle, the last ones, and the next chunk's first rows (a state carried over its boundary).
ROW_POSITIONS = (0, 1, 31, 62, 63, 64, 65, 128)


@pytest.mark.parametrize("kind,dtype", [("ref", torch.float32), ("fast", torch.float32), ("fast", torch.float16)],
                         ids=["ref-fp32", "fast-fp32", "fast-fp16"])
def test_chunk_rows_are_batch_and_split_invariant(kind, dtype):
    """chunk_gated_delta_rule(..., batch_invariant=True)'s guarantee (issue 34: the batch-invariant mode
    runs the chunk form in every phase): a token's row of o holds the same bits (i) in one call over its
    whole sequence (130 tokens: chunks of 64, 64, 2), (ii) packed among other documents, and (iii) in a
    call over its chunk's tokens up to itself only (a partial chunk, the rest absent), from the state at
    the chunk's start carried by an earlier call; (iv) the same with the rest present as zero tokens
    (q = k = v = beta = g = 0: the layer's decode step lays a chunk out so); (v) a chunk's end state is
    the same bits carried inside one call or across calls cut at chunk boundaries.  In-kernel l2norm
    (as the layer calls it), a hard reset in the second chunk, K = V = 16."""
    fn = {"ref": ref.chunk_gated_delta_rule, "fast": fast.chunk_gated_delta_rule}[kind]
    h, hv, dk, dv, t = 1, 2, 16, 16, 130
    x = cast(dtype, *make_inputs(1, t, h, hv, dk, dv, seed=101))[:5]
    g = x[3].clone()
    g[0, 70, 1] = float("-inf")                             # a hard reset: head 1 forgets at token 70
    x = (*x[:3], g, x[4])
    others = [cast(dtype, *make_inputs(1, n, h, hv, dk, dv, seed=102 + n))[:5] for n in (37, 0, 64)]
    kw = dict(use_qk_l2norm_in_kernel=True, batch_invariant=True)

    def run(docs, states=None, final=False):
        """docs (each a tuple q, k, v, g, beta [1, n, ...]) packed in one call -> (o per doc, final)."""
        lengths = [d[0].shape[1] for d in docs]
        cu = cu_tensor(lengths)
        with nan_allocations():
            o, ht = fn(*(torch.cat([d[i] for d in docs], 1) for i in range(5)), initial_state=states,
                       output_final_state=final, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), **kw)
        return o[0].split(lengths), ht

    def part(a, b):
        return tuple(y[:, a:b] for y in x)

    (whole,), _ = run([x])
    assert torch.isfinite(whole).all()
    packed, _ = run([others[0], x, others[1], others[2]])
    same_bits("(ii) packed", packed[1], whole)
    # the states at the chunk starts, by calls cut at chunk boundaries (v): [0, 64), then [64, 128)
    _, s64 = run([part(0, 64)], final=True)
    _, s128 = run([part(64, 128)], states=s64, final=True)
    _, s128_whole = run([part(0, 128)], final=True)
    same_bits("(v) the state at 128", s128, s128_whole)
    starts = {0: torch.zeros_like(s64), 64: s64, 128: s128}
    # (iii) each position's chunk so far, all in one call (one document per position)
    chunk0 = [p - p % 64 for p in ROW_POSITIONS]
    rows, _ = run([part(c, p + 1) for c, p in zip(chunk0, ROW_POSITIONS)],
                  states=torch.cat([starts[c] for c in chunk0]))
    # (iv) the same chunks laid out whole, zero tokens after the row
    padded = [tuple(torch.cat([y, y.new_zeros(1, c + 64 - p - 1, *y.shape[2:])], 1) for y in part(c, p + 1))
              for c, p in zip(chunk0, ROW_POSITIONS)]
    rows_padded, _ = run(padded, states=torch.cat([starts[c] for c in chunk0]))
    for p, c, r, rp in zip(ROW_POSITIONS, chunk0, rows, rows_padded):
        same_bits(f"(iii) row {p} in its partial chunk", r[-1], whole[p])
        same_bits(f"(iv) row {p} before zero tokens", rp[p - c], whole[p])
    # Negative control: chunks aligned elsewhere (a call cut at token 2, the next one's chunks from there)
    # round the later rows differently, so the checks above can fail.
    _, s2 = run([part(0, 2)], final=True)
    (shifted,), _ = run([part(2, t)], states=s2)
    assert not torch.equal(shifted[63:], whole[65:]), "rows computed in shifted chunks gave the same bits"
    torch.testing.assert_close(shifted[63:].float(), whole[65:].float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("impl", ["ref", "fast"])
def test_the_decode_steps_dense_call_is_the_varlen_continuation_bitwise(impl):
    """The mode's decode step (ref._aligned_decode_step) runs its N chunks as one dense batch, with no
    cu_seqlens (nothing on the host: a CUDA graph can capture it).  Its rows, states and buffers must be the
    bits of the general continuation (ref._aligned_chunks, a varlen call) for one token per sequence: 5
    sequences whose current chunks hold 0, 1, 37, 62 and 63 tokens (the last completes its chunk), from
    nonzero start states; the Qwen3.5 layer's chunk rule, ref or fast kernels (fp32; the interpreter)."""
    layer = ref.GatedDeltaNet(64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                              chunk_fn=(ref if impl == "ref" else fast).chunk_gated_delta_rule).to(DEVICE)
    n, counts = 5, [0, 1, 37, 62, 63]
    gen = make_generator(7)

    def inputs(*rows):                                       # qkv, g <= 0, beta in (0, 1): [*rows, ...]
        return (randn(*rows, layer.conv_dim, gen=gen, device=DEVICE),
                -F.softplus(randn(*rows, 4, gen=gen, device=DEVICE)), randn(*rows, 4, gen=gen, device=DEVICE).sigmoid())

    token = inputs(n)
    held = torch.arange(ref.CHUNK - 1, device=DEVICE)[None, :] < torch.tensor(counts, device=DEVICE)[:, None]
    buffered = tuple(torch.where(held.view(n, -1, *[1] * (x.dim() - 2)), x, 0) for x in inputs(n, ref.CHUNK - 1))
    state = 0.1 * randn(n, 4, 16, 16, gen=gen, device=DEVICE)
    o_d, state_d, buf_d, count_d = ref._aligned_decode_step(layer._chunk_rule, token, state, buffered,
                                                            torch.tensor(counts, device=DEVICE))
    o_v, state_v, buf_v, count_v = ref._aligned_chunks(layer._chunk_rule, token, [1] * n, state, buffered, counts)
    assert count_d.tolist() == count_v == [1, 2, 38, 63, 0]
    assert torch.equal(o_d, o_v) and torch.equal(state_d, state_v)
    assert not torch.equal(state_d[4], state[4]) and torch.equal(state_d[:4], state[:4])   # the 5th chunk ended
    for d, v in zip(buf_d, buf_v):
        assert torch.equal(d, v)


def test_aligned_chunks_equal_the_recurrence():
    """The reference's statement of the mode's continuation (ref._aligned_chunks, ref._aligned_decode_step:
    the chunk form over [the current chunk's buffered tokens, the new ones], whole chunks first, the
    state kept at the current chunk's start) against the recurrence in fp64: one sequence of 150 tokens
    fed as a prefill of 37, decode steps up to 70 (over the boundary at 64), then a continuation of 80
    (over 128): every output within fp32 rounding of the recurrence, and the kept state is the
    recurrence's state at 128, the buffer the tokens 128..149."""
    h, hv, dk, dv, t = 1, 2, 16, 16, 150
    inputs = make_inputs(1, t, h, hv, dk, dv, seed=111)[:5]
    o64, _ = ref.fused_recurrent_gated_delta_rule(*inputs[:3], g=inputs[3], beta=inputs[4],
                                                  use_qk_l2norm_in_kernel=True)
    _, h128 = ref.fused_recurrent_gated_delta_rule(*(y[:, :128] for y in inputs[:3]), g=inputs[3][:, :128],
                                                   beta=inputs[4][:, :128], use_qk_l2norm_in_kernel=True,
                                                   output_final_state=True)
    x = cast(torch.float32, *inputs, None)[:5]
    tokens = tuple(y[0] for y in x)                          # [T, ...] per input

    def rule(pieces, lengths, state, final):
        if lengths is None:                                  # the decode step's dense batch of chunks
            return ref.chunk_gated_delta_rule(*pieces, initial_state=state, output_final_state=final,
                                              use_qk_l2norm_in_kernel=True, batch_invariant=True)
        cu = cu_tensor(lengths)
        o, ht = ref.chunk_gated_delta_rule(*(y[None] for y in pieces), initial_state=state, output_final_state=final,
                                           cu_seqlens=cu, use_qk_l2norm_in_kernel=True, batch_invariant=True)
        return o[0], ht

    buffered = tuple(y.new_zeros(1, ref.CHUNK - 1, *y.shape[1:]) for y in tokens)
    outs = []
    o, state, buffered, counts = ref._aligned_chunks(rule, tuple(y[:37] for y in tokens), [37], None, buffered, [0])
    outs.append(o)
    assert state is None and counts == [37]
    count = torch.tensor(counts, device=DEVICE)
    state = torch.zeros(1, hv, dk, dv, device=DEVICE)
    for p in range(37, 70):
        o, state, buffered, count = ref._aligned_decode_step(rule, tuple(y[p:p + 1] for y in tokens), state, buffered,
                                                             count)
        outs.append(o)
    assert count.tolist() == [70 - 64]
    o, state, buffered, counts = ref._aligned_chunks(rule, tuple(y[70:] for y in tokens), [80], state, buffered,
                                                     count.tolist())
    outs.append(o)
    assert counts == [150 - 128]
    o = torch.cat(outs)
    err = ((o.double() - o64[0]).abs().max() / o64.abs().max()).item()
    assert err < 1e-5, err
    torch.testing.assert_close(state.double(), h128, rtol=1e-5, atol=1e-5)
    for y, b in zip(tokens, buffered):
        assert torch.equal(b[0, :22], y[128:]) and not b[0, 22:].any()
