"""Parity of fast/gated_deltanet.py with ref/gated_deltanet.py, and the reference with itself.

1. The reference: chunk form == recurrent form in fp64 (odd T, strong and zero decay, GVA,
   varlen with an empty document), autograd through both forms (gradcheck, and the two forms'
   gradients agree), upcast=False really computes in the low precision.
2. fast vs ref: outputs and final states under the DESIGN.md rule (``check_close``: at most
   twice the error of the reference run in the test dtype) plus fla's RMS-ratio guard; the
   chunk op's saved intermediates (within-chunk gate cumsum, solved triangular blocks) against
   the reference's steps; varlen == each document alone; K = 100 and GVA ratios 1 / 2 / 3.
3. The contract: bad input raises the same error in both files; torch.compile(fullgraph=True)
   traces the fast ops (gradients: test_gated_deltanet_backward.py).
4. The Qwen3.5 layer: with ref kernels == with fast kernels; prefill then one-token decode
   steps == prefill of the whole sequence (dense and varlen).
Interpreter tier: fp32 / fp16, small shapes.  GPU tier: bf16, T up to 32k, K = V = 128.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import fast.gated_deltanet as fast
import ref.gated_deltanet as ref
from conftest import (DEVICE, ON_GPU, check_close, dtype_params, gpu_case, make_generator, nan_allocations,
                      randn)

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


FNS = {"chunk": (ref.chunk_gated_delta_rule, fast.chunk_gated_delta_rule),
       "recurrent": (ref.fused_recurrent_gated_delta_rule, fast.fused_recurrent_gated_delta_rule)}


def compare(kind, dtype, inputs, *, cu_seqlens=None, scale=None, l2norm=False, rms=True, tag=""):
    """fast(dtype) vs ref(fp64) under the tolerance rule; ref_lowp = the same ref form in dtype.
    All three see the same inputs, rounded to the test dtype first (FlashAttention's and fla's
    convention: the comparison measures the computation, not the rounding of the inputs)."""
    ref_fn, fast_fn = FNS[kind]
    kw = dict(output_final_state=True, cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm_in_kernel=l2norm)
    low = cast(dtype, *inputs)
    o64, h64 = ref_fn(*(x.double() for x in low[:5]), initial_state=low[5].double(), **kw)
    o_lp, h_lp = ref_fn(*low[:5], initial_state=low[5], upcast=False, **kw)
    with nan_allocations():
        o, ht = fast_fn(*low[:5], initial_state=low[5], **kw)
    assert o.dtype == dtype and o.shape == o64.shape
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
    o2, s2 = ref.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=0, atol=1e-12)
    assert s1.dtype == torch.float64


@pytest.mark.parametrize("case", ["strong_decay", "zero_gates", "positive_g_small"])
def test_ref_forms_agree_on_extreme_gates(case):
    g_scale = {"strong_decay": 100.0, "zero_gates": 0.0, "positive_g_small": -0.02}[case]
    q, k, v, g, beta, h0 = make_inputs(1, 130, 1, 2, 16, 16, seed=1, g_scale=g_scale, device="cpu")
    kw = dict(initial_state=h0, output_final_state=True)
    o1, s1 = ref.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o2, s2 = ref.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    assert torch.isfinite(o1).all() and torch.isfinite(s1).all()
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-10)
    if case == "strong_decay":   # exp(-~70) per token: the state forgets everything before each token
        _, s_alone = ref.fused_recurrent_gated_delta_rule(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:],
                                                          beta[:, -1:], output_final_state=True)
        torch.testing.assert_close(s1, s_alone, rtol=0, atol=1e-12)


def test_ref_varlen_equals_per_document():
    lengths = [5, 0, 70, 64, 1]
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 1, 2, 16, 8, seed=2, n_states=len(lengths), device="cpu")
    cu = torch.tensor([0, 5, 5, 75, 139, 140], dtype=torch.int64)   # int64, like fla's LongTensor
    for fn in (ref.chunk_gated_delta_rule, ref.fused_recurrent_gated_delta_rule):
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
    for fn in (ref.chunk_gated_delta_rule, ref.fused_recurrent_gated_delta_rule):
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
    for fn in (ref.chunk_gated_delta_rule, ref.fused_recurrent_gated_delta_rule):
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


def test_fast_chunk_saved_intermediates_match_ref_steps():
    """The chunk op returns what a backward needs: gc (within-chunk cumsum) and A (solved blocks)."""
    b, t, h, hv, dk, dv = 1, 100, 1, 2, 16, 16
    q, k, v, g, beta, h0 = make_inputs(b, t, h, hv, dk, dv, seed=14)
    with nan_allocations():
        _, _, gc, a = torch.ops.twofold.chunk_gated_delta_rule_fwd(
            q.float(), k.float(), v.float(), g.float(), beta.float(), None, None, dk ** -0.5, False)
    pad = (-t) % ref.CHUNK
    kp = ref._chunked(F.pad(k.repeat_interleave(hv // h, 2), (0, 0, 0, 0, 0, pad)), 2)   # [B, HV, NC, C, K]
    gp, bp = (ref._chunked(F.pad(x, (0, 0, 0, pad)), 2) for x in (g, beta))
    gc_ref = ref._chunk_local_cumsum(gp)
    a_ref = ref._wy_inverse(kp, gc_ref, bp)                               # [B, HV, NC, C, C]
    gc_ref = gc_ref.movedim(1, 3).reshape(b, t + pad, hv)[:, :t]
    a_ref = a_ref.movedim(1, 3).reshape(b, t + pad, hv, ref.CHUNK)[:, :t]
    assert gc.dtype == torch.float32 and a.shape == (b, t, hv, ref.CHUNK)
    torch.testing.assert_close(gc.double(), gc_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.double(), a_ref, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- 3. the contract

def _bad_cases():
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(2, 8, 2, 4, 16, 16, seed=20))
    ok = dict(q=q, k=k, v=v, g=g, beta=beta)
    yield "hv_not_multiple", dict(ok, v=v[:, :, :3], g=g[:, :, :3], beta=beta[:, :, :3]), {}, ValueError, "HV=3"
    yield "cu_with_batch", ok, dict(cu_seqlens=cu_tensor([8])), ValueError, "cu_seqlens requires batch size"
    yield "state_shape", ok, dict(initial_state=h0[:1]), ValueError, "initial_state must be"
    yield "state_dtype", ok, dict(initial_state=h0.half()), TypeError, "initial_state must be fp32"
    big_k = torch.zeros(2, 8, 2, 264, device=DEVICE)
    yield "k_too_big", dict(ok, q=big_k, k=big_k), {}, ValueError, "K must be <= 256"
    yield "qkv_dtypes", dict(ok, v=v.half()), {}, TypeError, "q, k, v must share a dtype"
    yield "g_shape", dict(ok, g=g[:, :4]), {}, ValueError, "g must be"
    yield "cu_dtype", dict(ok, q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1]), \
        dict(cu_seqlens=cu_tensor([8]).float()), TypeError, "cu_seqlens must be an int32 or int64"
    yield "cu_end", dict(ok, q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1]), \
        dict(cu_seqlens=cu_tensor([3, 4])), ValueError, r"cu_seqlens\[-1\] must equal T"
    if ON_GPU:
        yield "mixed_devices", dict(ok, v=v.cpu()), {}, ValueError, "mixed devices"
    else:
        yield "mixed_devices", dict(ok, v=v.to("meta")), {}, ValueError, "mixed devices"


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("name,tensors,kwargs,error,match", list(_bad_cases()), ids=lambda x: x if isinstance(x, str) else "")
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
