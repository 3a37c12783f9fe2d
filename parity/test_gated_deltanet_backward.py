"""Gradients of fast/gated_deltanet.py against the reference's autograd.

1. Chunk op: dq, dk, dv, dg, dbeta and d initial_state vs the fp64 reference (the parity rule with
   factor 3, ``ref_lowp`` = the reference's autograd run in the test dtype) plus fla's RMS-ratio
   guard (fp16: dq / dk / dv / dh0 < 0.008, dg / dbeta < 0.02); strong decay (exp(g) ~ e^-70 per
   token: the regime where dg loses accuracy when O(1) terms cancel), zero and positive gates, GVA,
   K = 100 / 200, l2norm in the kernel, missing initial / final state, one output unused.
2. Recurrent op: the same against the reference, decode and short sequences, strong decay.
3. Varlen: every gradient element is written (all allocations NaN-poisoned), gradients equal
   per-document runs, including empty and one-token documents, and a NaN in one document's output
   gradient reaches no other document.
4. Rigor and contract: a finite-difference check (gradcheck) of the fast ops themselves; backward
   is deterministic (bitwise repeatable); torch.compile traces forward + backward; a second
   derivative raises clearly.
5. The Qwen3.5 layer trained 5 SGD steps with ref kernels and with fast kernels: the same losses.
6. fla's options and edge numerics: gradients through use_gate_in_kernel (to g's raw input, A_log,
   dt_bias) and use_beta_sigmoid_in_kernel / allow_neg_eigval; state_v_first's d initial_state in
   its layout; hard resets (g = -inf); initial_state in other dtypes and fp32 q/k with a 16-bit v;
   the reference's chunk-form gradients in fp32 as precise as the recurrence's under strong decay.
Interpreter tier: fp32 / fp16, small shapes.  GPU tier: bf16 and T up to 32k.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fast.gated_deltanet as fast
import ref.gated_deltanet as ref
from conftest import DEVICE, ON_GPU, check_close, dtype_params, make_generator, nan_allocations, randn
from test_gated_deltanet import CHUNK_CASES, FNS, RECURRENT_CASES, cast, cu_tensor, kernel_gate_sums, make_inputs

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# fla's gradient tolerances (rms(fast - ref) / rms(ref)) for fp16: dq / dk / dv / dh0, then dg / dbeta.
# bf16 rounds 8x coarser than fp16; it gets twice fla's numbers (not yet measured on a GPU: the
# max-error rule, three times the plain-bf16 reference, is the primary check).
RMS_LIMIT = {torch.float16: (0.008, 0.02), torch.bfloat16: (0.016, 0.04)}


def grads(fn, tensors, *, with_state=True, final=True, use_o=True, use_s=True, seed=99, params=None, **kw):
    """Gradients of sum(o * w_o) + sum(final * w_s) (random weights: random do and dht) w.r.t.
    q, k, v, g, beta (and the initial state, and the keyword tensors ``params``, e.g. A_log), the
    weights drawn in that order from one generator.  ``final``: output_final_state; ``use_o`` /
    ``use_s``: which outputs the loss reads."""
    leaves = [x.detach().clone().requires_grad_() for x in tensors[:5]]
    h0 = tensors[5].detach().clone().requires_grad_() if with_state else None
    params = {name: x.detach().clone().requires_grad_() for name, x in (params or {}).items()}
    o, s = fn(*leaves, initial_state=h0, output_final_state=final, **params, **kw)
    gen = make_generator(seed)
    w_o = randn(*o.shape, gen=gen, dtype=torch.float64, device=o.device)
    loss = (o.double() * w_o).sum() if use_o else 0
    if final and use_s:
        loss = loss + (s.double() * randn(*s.shape, gen=gen, dtype=torch.float64, device=s.device)).sum()
    loss.backward()
    return [x.grad for x in leaves] + ([h0.grad] if with_state else []) + [x.grad for x in params.values()], o, s


def compare_grads(kind, dtype, inputs, *, low=None, params=None, tag="", rms=True, no_rms=(), checked_apart=(),
                  with_state=True, **kw):
    """fast(dtype) gradients vs the fp64 reference; ref_lowp = the same reference form in dtype (the
    chunk form with the kernels' gate sums, see test_gated_deltanet.kernel_gate_sums).
    ``low``: the inputs already in their test dtypes (mixed dtypes); ``params``: keyword tensors to
    differentiate too (A_log, dt_bias).  ``no_rms``: gradients exempt from the RMS guard (the
    max-error rule still applies); ``checked_apart``: gradients the caller checks itself.  Returns
    the fast, fp64 and low-precision gradients."""
    ref_fn, fast_fn = FNS[kind]
    low = list(cast(dtype, *inputs) if low is None else low)
    params = params or {}
    names = NAMES[:5 + with_state] + tuple(f"d{name}" for name in params)
    wide = {name: x.double() for name, x in params.items()}
    g64, _, _ = grads(ref_fn, [x.double() for x in low], with_state=with_state, params=wide, **kw)
    with kernel_gate_sums(kind == "chunk"):
        g_lp, _, _ = grads(ref_fn, low, with_state=with_state, upcast=False, params=params, **kw)
    with nan_allocations():
        g_fast, _, _ = grads(fast_fn, low, with_state=with_state, params=params, **kw)
    limits = RMS_LIMIT.get(dtype) if rms else None
    for name, a, b, c, x in zip(names, g_fast, g64, g_lp, low[:5 + with_state] + list(params.values())):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        if b is None:   # the loss does not depend on it (q when only the final state is used)
            assert c is None and not a.any(), f"{name}: the reference has no gradient, fast has a nonzero one"
            continue
        if name in checked_apart:
            continue
        limit = None if limits is None or name in no_rms else limits[name in ("dg", "dbeta")]
        check_close(f"{kind}{tag} {name}", a, b, c, factor=3.0, rms_ratio=limit)
    return g_fast, g64, g_lp


# ----------------------------------------------------------------------------- 1. chunk

@pytest.mark.parametrize("name,shape,g_scale", CHUNK_CASES)
@pytest.mark.parametrize("dtype", dtype_params())
def test_chunk_grads_match_ref(name, shape, g_scale, dtype):
    b, t, h, hv, dk, dv = shape
    # Strong decay: d initial_state is ~1e-20 (exp(g) ~ e^-70 per token), below fp16's smallest
    # subnormal, so every fp16 intermediate (and the fp16 reference) flushes it: no RMS guard there.
    no_rms = ("dh0",) if g_scale >= 100 else ()
    compare_grads("chunk", dtype, make_inputs(b, t, h, hv, dk, dv, seed=40, g_scale=g_scale), tag=f"[{name}]",
                  no_rms=no_rms)


@pytest.mark.parametrize("dtype", dtype_params())
def test_chunk_grads_l2norm_scale_no_state(dtype):
    """use_qk_l2norm_in_kernel (the l2norm op's backward), a custom scale, no initial / final state."""
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 4, 16, 16, seed=41)
    inputs = (q * 3, k * 0.5, v, g, beta, h0)   # the l2norm must undo the scaling
    compare_grads("chunk", dtype, inputs, tag="[l2norm]", with_state=False, final=False, scale=0.3,
                  use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("used", ["o_only", "final_only"])
def test_chunk_grads_one_output_unused(used):
    """An unused output's gradient arrives as None: the other one's gradient must still be right."""
    compare_grads("chunk", torch.float32, make_inputs(1, 70, 1, 2, 16, 16, seed=42), tag=f"[{used}]",
                  use_o=used == "o_only", use_s=used == "final_only")


# ----------------------------------------------------------------------------- 2. recurrent

@pytest.mark.parametrize("shape,g_scale", RECURRENT_CASES)
@pytest.mark.parametrize("dtype", dtype_params())
def test_recurrent_grads_match_ref(shape, g_scale, dtype, request):
    if ON_GPU and dtype == torch.float32 and g_scale >= 100:
        # Known, open: dh0 under strong decay was 5.6e-24 off at a scale of 6.8e-18 on an H200 (10x the fp32
        # reference's error) with Triton's ex2.approx, and 5.7e-25 (the reference's) with libdevice's exp.
        # Strict: this fails once the kernel is fixed, so the mark must go then.
        request.applymarker(pytest.mark.xfail(strict=True, reason="fp32 exp in the recurrent backward on a GPU"))
    compare_grads("recurrent", dtype, make_inputs(*shape, seed=43, g_scale=g_scale), use_qk_l2norm_in_kernel=True,
                  no_rms=("dh0",) if g_scale >= 100 else ())


# ----------------------------------------------------------------------------- 3. varlen

@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.bfloat16))
def test_varlen_grads_equal_per_document(kind, dtype):
    lengths = [70, 0, 1, 64, 5] if kind == "chunk" else [7, 0, 1, 4]
    if ON_GPU:
        lengths = [3000, 0, 1, 64, 1000, 2047] if kind == "chunk" else [300, 0, 1, 64]
    dk = dv = 128 if ON_GPU else 16
    inputs = make_inputs(1, sum(lengths), 1, 2, dk, dv, seed=44, n_states=len(lengths))
    cu = cu_tensor(lengths)
    g_all, _, _ = compare_grads(kind, dtype, inputs, cu_seqlens=cu, tag="[varlen]", use_qk_l2norm_in_kernel=True)
    low = cast(dtype, *inputs)
    fn = FNS[kind][1]
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=5e-2)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        # the same weights for do / dht as the packed run: slice them out of one packed draw
        one = [x[:, a:b] for x in low[:5]] + [low[5][n:n + 1]]
        leaves = [x.detach().clone().requires_grad_() for x in one]
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
        gen = make_generator(99)
        w_o = randn(1, sum(lengths), *o.shape[2:], gen=gen, dtype=torch.float64)[:, a:b]
        w_s = randn(len(lengths), *s.shape[1:], gen=gen, dtype=torch.float64)[n:n + 1]
        ((o.double() * w_o).sum() + (s.double() * w_s).sum()).backward()
        for i, name in enumerate(NAMES[:5]):
            torch.testing.assert_close(g_all[i][:, a:b], leaves[i].grad, **tol, msg=f"{name} of document {n}")
        torch.testing.assert_close(g_all[5][n:n + 1], leaves[5].grad, **tol, msg=f"dh0 of document {n}")
    # the empty document: its initial state's gradient is the final state's weight (dht passes through)
    gen = make_generator(99)
    randn(1, sum(lengths), 2, dv, gen=gen, dtype=torch.float64)
    w_s = randn(len(lengths), 2, dk, dv, gen=gen, dtype=torch.float64)
    torch.testing.assert_close(g_all[5][1], w_s[1].float(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_empty_input_passes_the_state_gradient_through(kind):
    """T = 0: the final state is the initial state, so d initial_state = d final_state; the other
    gradients are empty."""
    leaves = [x.requires_grad_() for x in cast(torch.float32, *make_inputs(2, 0, 1, 2, 16, 16, seed=53))]
    with nan_allocations():
        o, s = FNS[kind][1](*leaves[:5], initial_state=leaves[5], output_final_state=True)
        w = randn(*s.shape, gen=make_generator(54))
        (o.sum() + (s * w).sum()).backward()
    torch.testing.assert_close(leaves[5].grad, w, rtol=0, atol=0)
    assert all(x.grad.shape == x.shape for x in leaves[:5])


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_varlen_nan_in_one_document_stays_there(kind):
    """Documents are independent: NaN in document 1's output gradient leaves every other document's
    gradients finite and unchanged (a kernel that reads across a boundary would spread it)."""
    lengths = [70, 1, 64, 9] if kind == "chunk" else [5, 1, 3, 4]
    low = cast(torch.float32, *make_inputs(1, sum(lengths), 1, 2, 16, 16, seed=45, n_states=len(lengths)))
    cu = cu_tensor(lengths)
    fn = FNS[kind][1]
    do = randn(1, sum(lengths), 2, 16, gen=make_generator(46))
    results = []
    for poison in (False, True):
        leaves = [x.detach().clone().requires_grad_() for x in low]
        o, _ = fn(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu)
        d = do.clone()
        if poison:
            d[:, lengths[0]:lengths[0] + lengths[1]] = float("nan")
        with nan_allocations():
            o.backward(d)
        results.append([x.grad for x in leaves])
    bad = slice(lengths[0], lengths[0] + lengths[1])
    for i, name in enumerate(NAMES):
        clean, poisoned = results[0][i], results[1][i]
        if name == "dh0":
            keep = torch.ones(len(lengths), dtype=torch.bool)
            keep[1] = False
            assert torch.isnan(poisoned[1]).all(), "the poisoned document's dh0 should be NaN"
            torch.testing.assert_close(poisoned[keep], clean[keep], rtol=0, atol=0, msg=name)
            continue
        keep = torch.ones(sum(lengths), dtype=torch.bool)
        keep[bad] = False
        assert torch.isfinite(poisoned[:, keep]).all(), f"{name}: NaN leaked out of document 1"
        torch.testing.assert_close(poisoned[:, keep], clean[:, keep], rtol=0, atol=0, msg=name)


# ----------------------------------------------------------------------------- 4. rigor and contract

@pytest.mark.filterwarnings("ignore:Input #")   # gradcheck's "not double precision" warning: known, intended
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_fast_gradcheck_fp32(kind):
    """The fast kernels take fp16 / bf16 / fp32 (no fp64), so this is torch.autograd.gradcheck in fp32:
    the fast backward's vector-Jacobian products against central differences of the fast forward
    (random directions, eps 1e-2: fp32 rounding stays far below the tolerance).  The reference's own
    fp64 gradcheck is in test_gated_deltanet.py, and section 1 ties the two together in fp64."""
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(1, 9, 1, 2, 4, 3, seed=47))
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    fn = FNS[kind][1]

    def f(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    assert torch.autograd.gradcheck(f, args, eps=1e-2, atol=2e-3, rtol=2e-2, fast_mode=True)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_backward_is_deterministic(kind):
    """No atomics: two backward passes give bitwise-equal gradients (GVA sums in a fixed order)."""
    shape = (1, 150, 1, 4, 16, 16) if kind == "chunk" else (1, 9, 1, 4, 16, 16)
    if ON_GPU:
        shape = (1, 4096, 4, 16, 128, 128) if kind == "chunk" else (4, 256, 4, 16, 128, 128)
    low = cast(torch.float16 if ON_GPU else torch.float32, *make_inputs(*shape, seed=48))
    first, _, _ = grads(FNS[kind][1], low)
    second, _, _ = grads(FNS[kind][1], low)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical backward passes"


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_compile_traces_backward(kind):
    low = cast(torch.float32, *make_inputs(1, 20, 1, 2, 16, 16, seed=49))
    fn = FNS[kind][1]

    def loss(q, k, v, g, beta, h0):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (o * o).sum() + s.sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    eager_args = [x.clone().requires_grad_() for x in low]
    comp_args = [x.clone().requires_grad_() for x in low]
    loss(*eager_args).backward()
    compiled(*comp_args).backward()
    for name, a, b in zip(NAMES, eager_args, comp_args):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_double_backward_raises_clearly(kind):
    leaves = [x.requires_grad_() for x in cast(torch.float32, *make_inputs(1, 5, 1, 1, 16, 16, seed=50))]
    o, _ = FNS[kind][1](*leaves[:5], initial_state=leaves[5], output_final_state=True)
    (dq,) = torch.autograd.grad(o.square().sum(), leaves[0], create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()


# ----------------------------------------------------------------------------- 5. the layer, trained

def test_layer_trains_the_same_with_fast_kernels():
    """5 SGD steps of the Qwen3.5 layer (varlen, with an empty document) with the reference kernels
    and with the fast ones, from the same weights: the losses and the final weights agree."""
    torch.manual_seed(0)
    cfg = dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, dtype=torch.float32, device=DEVICE)
    layer_ref = ref.GatedDeltaNet(32, **cfg)
    layer_fast = ref.GatedDeltaNet(32, chunk_fn=fast.chunk_gated_delta_rule,
                                   recurrent_fn=fast.fused_recurrent_gated_delta_rule, **cfg)
    layer_fast.load_state_dict(layer_ref.state_dict())
    x = randn(1, 90, 32, gen=make_generator(51))
    target = randn(1, 90, 32, gen=make_generator(52))
    cu = cu_tensor([40, 0, 50])
    losses = {}
    for name, layer in (("ref", layer_ref), ("fast", layer_fast)):
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
        losses[name] = []
        for _ in range(5):
            opt.zero_grad()
            loss = (layer(x, cu_seqlens=cu) - target).square().mean()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    print("losses ref ", losses["ref"])
    print("losses fast", losses["fast"])
    assert losses["ref"][-1] < losses["ref"][0], "the layer should learn something in 5 steps"
    torch.testing.assert_close(torch.tensor(losses["fast"]), torch.tensor(losses["ref"]), rtol=1e-5, atol=0)
    for (name, p_ref), p_fast in zip(layer_ref.named_parameters(), layer_fast.parameters()):
        torch.testing.assert_close(p_fast, p_ref, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kernels", ["ref", "fast"])
def test_layer_in_the_mode_has_the_default_gradients(kernels):
    """The batch-invariant mode (the chunk form with chunks at absolute positions; a continuation runs the
    chunk form over its cache's buffered tokens and its own, the trainer's shared-prompt path) computes
    the default layer's function: two prompts (70 and 5 tokens) as documents with a cache, then two
    completions continued from the forked caches (a copy of each prompt's chunk-start state and chunk
    buffer, as DecoderLM.token_logprobs hands them on), against the default layer on prompt + completion
    whole: outputs and the gradients of every parameter (through the buffered tokens and the kept state
    into the prompt) agree to fp32 rounding."""
    torch.manual_seed(0)
    cfg = dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, dtype=torch.float32, device=DEVICE)
    kw = dict(chunk_fn=fast.chunk_gated_delta_rule) if kernels == "fast" else {}
    plain = ref.GatedDeltaNet(32, **cfg, **kw)
    mode = ref.GatedDeltaNet(32, **cfg, **kw)
    mode.load_state_dict(plain.state_dict())
    mode.set_batch_invariant(lambda x, w: x @ w.t())
    prompts, completions = [70, 5], [61, 66]
    x = [randn(1, p + c, 32, gen=make_generator(60 + i)) for i, (p, c) in enumerate(zip(prompts, completions))]
    w = randn(1, sum(prompts) + sum(completions), 32, gen=make_generator(62))
    y_plain = plain(torch.cat(x, 1), cu_seqlens=cu_tensor([p + c for p, c in zip(prompts, completions)]))
    (y_plain * w).sum().backward()
    cache = mode.new_cache()
    y_p = mode(torch.cat([xi[:, :p] for xi, p in zip(x, prompts)], 1), cu_seqlens=cu_tensor(prompts), cache=cache)
    forked = ref.GatedDeltaNetCache(**{name: t[torch.tensor([0, 1])] for name, t in vars(cache).items()})
    y_c = mode(torch.cat([xi[:, p:] for xi, p in zip(x, prompts)], 1), cu_seqlens=cu_tensor(completions),
               cache=forked)
    assert forked.chunk_len.tolist() == [(70 + 61) % 64, (5 + 66) % 64]
    p_out, c_out = y_p[0].split(prompts), y_c[0].split(completions)
    y_mode = torch.cat([t for pair in zip(p_out, c_out) for t in pair])[None]
    (y_mode * w).sum().backward()
    torch.testing.assert_close(y_mode, y_plain, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(mode.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4, msg=name)


# ----------------------------------------------------------------------------- 6. fla's options, edge numerics

@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.bfloat16))
def test_grads_with_gate_and_beta_in_kernel(kind, dtype):
    """use_gate_in_kernel: gradients to g's raw input, A_log and dt_bias; use_beta_sigmoid_in_kernel with
    allow_neg_eigval: beta's gradient through 2 sigmoid."""
    from test_gated_deltanet import gate_inputs
    q, k, v, _, logit, h0 = make_inputs(1, 70 if kind == "chunk" else 9, 1, 3, 16, 16, seed=70)
    a = randn(*logit.shape, gen=make_generator(71), dtype=torch.float64, scale=3.0)
    a_log, dt_bias = gate_inputs(72, 3)
    # The recurrent backward telescopes dg over the tokens, so each dg_t carries rounding at the scale
    # of its neighbours' dg, not its own; the sums dA_log = sum_t dg_t gate_t and ddt_bias = sum_t dx_t
    # add those errors with the weights |gate_t| (up to ~10 here) and 1.  They are held to that: each
    # dg_t three times as wrong as the plain-PyTorch dg's worst entry, summed with those weights.
    apart = ("dA_log", "ddt_bias") if kind == "recurrent" else ()
    g_fast, g64, g_lp = compare_grads(kind, dtype, (q, k, v, a, logit, h0), params=dict(A_log=a_log, dt_bias=dt_bias),
                                      tag="[gate]", checked_apart=apart, use_gate_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                      use_qk_l2norm_in_kernel=True)
    if apart:
        x = a.to(dtype).double() + dt_bias.double()
        gate = -a_log.double().exp() * F.softplus(x)
        slope = -a_log.double().exp() * torch.sigmoid(x)                   # d gate / dx
        dgate_err = ((g_lp[3].double() - g64[3]) / slope).abs().max().item()
        dx_err = (g_lp[3].double() - g64[3]).abs().max().item()
        for i, (name, weight, err) in enumerate((("dA_log", gate.abs(), dgate_err), ("ddt_bias", 1.0, dx_err)), 6):
            bound = 3 * (weight * torch.ones_like(gate)).sum((0, 1)) * err
            bound += torch.finfo(dtype).eps * g64[i].abs().max()
            got = (g_fast[i].double() - g64[i]).abs()
            print(f"recurrent[gate] {name}: max|fast-ref64| {got.max():.3e} | bound {bound.min():.3e}.."
                  f"{bound.max():.3e}")
            assert (got <= bound).all(), f"{name}: {got.tolist()} > {bound.tolist()}"


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_grads_state_v_first(kind):
    """state_v_first: d initial_state comes back in the [N, HV, V, K] layout, the K-first gradient
    transposed (the final state's gradient is read in that layout too); K != V.  (The reference
    transposes in PyTorch: its gradients are autograd's.)"""
    q, k, v, g, beta, h0 = cast(torch.float32, *make_inputs(1, 40 if kind == "chunk" else 7, 1, 2, 16, 24, seed=73))
    w_s = randn(1, 2, 16, 24, gen=make_generator(74), dtype=torch.float32)
    for fn in FNS[kind][1:]:
        results = []
        for v_first in (False, True):
            leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
            state = (h0.transpose(-1, -2) if v_first else h0).contiguous().clone().requires_grad_()
            o, s = fn(*leaves, initial_state=state, output_final_state=True, state_v_first=v_first)
            with nan_allocations():
                ((o * o).sum() + (s * (w_s.transpose(-1, -2) if v_first else w_s)).sum()).backward()
            results.append([x.grad for x in leaves] + [state.grad.transpose(-1, -2) if v_first else state.grad])
        for name, a, b in zip(NAMES, *results):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.bfloat16))
def test_grads_with_hard_resets(kind, dtype):
    """g = -inf at a token: every gradient equals the recurrence's (dg at the reset is 0), no NaN."""
    from test_gated_deltanet import hard_resets
    inputs = list(make_inputs(1, 130 if kind == "chunk" else 20, 1, 2, 16, 16, seed=75))
    inputs[3] = hard_resets(inputs[3])
    g_fast, _, _ = compare_grads(kind, dtype, inputs, tag="[hard resets]", use_qk_l2norm_in_kernel=True)
    for name, grad in zip(NAMES, g_fast):
        assert torch.isfinite(grad).all(), f"{name}: NaN where the recurrence's gradient is finite"


def test_ref_grads_with_hard_resets_equal_the_recurrence():
    q, k, v, g, beta, h0 = make_inputs(1, 130, 1, 2, 16, 12, seed=76, device="cpu")
    from test_gated_deltanet import hard_resets
    inputs = (q, k, v, hard_resets(g), beta, h0)
    chunk, _, _ = grads(FNS["chunk"][0], inputs, use_qk_l2norm_in_kernel=True)
    recurrent, _, _ = grads(FNS["recurrent"][0], inputs, use_qk_l2norm_in_kernel=True)
    for name, a, b in zip(NAMES, chunk, recurrent):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_grads_with_mixed_dtypes(kind):
    """fp32 q / k with a fp16 v, a fp64 initial state: each gradient in its input's dtype and right."""
    q, k, v, g, beta, h0 = cast(torch.float16, *make_inputs(1, 40 if kind == "chunk" else 9, 1, 2, 16, 16, seed=77))
    compare_grads(kind, torch.float16, None, low=(q.float(), k.float(), v, g, beta, h0.double()), tag="[mixed]",
                  use_qk_l2norm_in_kernel=True)


def test_ref_chunk_dg_keeps_its_digits_under_strong_decay():
    """The chunk form's dg in fp32 against fp64 when g reaches -236 per token (T = 130, K = 64): autograd
    through the differences of cumulative gates lost it to cancellation (rms ratio 4e-3); summing each
    pair where it straddles a gate brought it to the fast kernels' level (2.5e-5 here), and summing each
    decay's exponent over its own stretch (the next test) to 1.7e-7."""
    from conftest import rms_ratio
    inputs = make_inputs(1, 130, 1, 1, 64, 64, seed=0, g_scale=100, device="cpu")
    dg64 = grads(FNS["chunk"][0], [x.double() for x in inputs])[0][3]
    dg32 = grads(FNS["chunk"][0], [x.float() for x in inputs], upcast=False)[0][3]
    assert rms_ratio(dg32, dg64) < 1e-4


@pytest.mark.parametrize("g_scale,resets", [(100, False), (289, False), (100, True)],
                         ids=["g-69", "g-200", "g-69-hard-resets"])
def test_ref_chunk_grads_as_precise_as_fp32_under_strong_decay(g_scale, resets):
    """Issue 30's case: the chunk form in fp32 (T = 130, K = 64, V = 16, an initial state, no l2norm,
    median log decay -69 or -200 per token) against autograd through the per-token recurrence in fp64,
    on the same fp32 inputs.  Every gradient within 1e-6 rms (8 fp32 eps; the recurrence in fp32 gets
    up to 1.3e-7 here, the chunk form up to 2.3e-7).  Decays taken as b_i - b_j, differences of
    within-chunk cumulative gates of magnitude up to ~64 |g|, left dg at 1.5e-4 / 6.9e-5 / 4.2e-4."""
    from conftest import rms_ratio
    from test_gated_deltanet import hard_resets
    inputs = list(make_inputs(1, 130, 1, 1, 64, 16, seed=99, g_scale=g_scale, device="cpu"))
    if resets:
        inputs[3] = hard_resets(inputs[3])
    inputs = [x.float() for x in inputs]
    exact, _, _ = grads(FNS["recurrent"][0], [x.double() for x in inputs])
    chunk, _, _ = grads(FNS["chunk"][0], inputs)
    ratios = {name: rms_ratio(a, b) for name, a, b in zip(NAMES, chunk, exact)}
    print(" ".join(f"{name} {r:.2e}" for name, r in ratios.items()))
    assert all(r < 1e-6 for r in ratios.values()), ratios
