"""Parity of fast/moe.py with ref/moe.py, and of ref/moe.py with transformers' MoE blocks.

1. Router: fast == ref (the same experts; weights under the tolerance rule) for both scorings, norm on and
   off; d logits against the reference's autograd; exact ties go to the lower index (+0.0 / -0.0, -inf,
   all equal); a NaN row stays NaN and still picks k valid experts.
2. Experts: fast (fp32 / fp16) vs ref (fp64) under the rule (ref_lowp: the reference in the test dtype),
   the output (factor 2) and every gradient (factor 3: x, the routing weights, gate_up / down and their
   biases) with NaN-poisoned allocations; T in {1, 7, 75}, H = 40, E in {5, 6, 13}, k 1 / 2 / 4, both
   layouts with either activation, an expert that gets no token, every token on one expert.
3. The layer vs transformers 5's blocks (Qwen3MoeSparseMoeBlock with norm_topk_prob off and on,
   Qwen3_5MoeSparseMoeBlock, GptOssMLP) on tiny random configs with every parameter perturbed and sharp
   routers (the smallest gap between a token's k-th and (k+1)-th logit is measured and asserted), fp32,
   within 1e-5, with the reference's kernels and with the fast ones; the layer's gradients, fast vs ref;
   state dicts load as they are, and from per-expert and MXFP4 checkpoint tensors (bad ones raise).
4. Batch invariance: in the mode a token's output is bitwise the same alone, among 3 and among 40
   tokens, permuted (the reference's and the fast plug-ins).
5. MXFP4: a hand-built example, transformers' convert_moe_packed_tensors, fast == ref bitwise.
6. Contract: bad inputs raise the same errors in both files (the layer's sizes and options too);
   torch.compile(fullgraph=True) traces the fast ops, forward and backward; a NaN token stays in its token;
   T = 0; the backward is bitwise repeatable; where the host check of ids is off (graph capture, compile)
   an id outside [0, E) drops its pair without leaving the tensors (the interpreter's sanitizer).
7. Expert parallelism: the layer over 2, 3 and 6 ranks (decoder_lm.py's LocalGroup threads; each rank holds
   E / ranks experts, loaded from the whole layer's fused or per-expert tensors) equals the one-rank layer:
   bitwise in the mode, to fp32 rounding otherwise, for T = 0, 1 (fewer tokens than ranks) and 7; gradients
   are the one-rank ones (the experts' their slices; x's, the router's and the shared expert's summed over
   the ranks).  parity/test_tensor_parallel.py runs fast/moe.py's copy over gloo processes in the models.
Interpreter tier: fp32 / fp16, small shapes, about a minute on 2 cores.  GPU tier: bf16, and a
Qwen3-30B-A3B layer's shapes (E = 128, k = 8, H = 2048, I = 768) at T = 16, 64, 1000.
"""
from __future__ import annotations

import pytest
import torch

import fast.moe as fast
import ref.moe as ref
from conftest import (DEVICE, INTERPRET, check_close, dtype_params, gpu_case, make_generator, nan_allocations,
                      on_threads, randn)

HF_ATOL = 1e-5
MARGIN = 0.01         # the smallest top-k logit gap the layer tests accept: far above fp32 / fp64 rounding


def expert_tensors(layout, e, h, i, *, bias, gen, dtype=torch.float64):
    """gate_up_proj, down_proj (and biases) in ``layout``: products of order 1 for inputs of order 1."""
    shapes = ref._expert_shapes(layout, e, h, i)
    w1 = randn(*shapes["gate_up_proj"], gen=gen, dtype=dtype, scale=h ** -0.5)
    w2 = randn(*shapes["down_proj"], gen=gen, dtype=dtype, scale=i ** -0.5)
    b1 = randn(*shapes["gate_up_bias"], gen=gen, dtype=dtype, scale=0.5) if bias else None
    b2 = randn(*shapes["down_bias"], gen=gen, dtype=dtype, scale=0.5) if bias else None
    return w1, w2, b1, b2


def lowp(dtype, *tensors):
    return [None if t is None else t.to(dtype) for t in tensors]


def run(fn, tensors, ids, dy, **kw):
    """fn(x, weights, ids, w1, w2, b1, b2) and the gradients of sum(out * dy) w.r.t. its float tensors."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(leaves[0], leaves[1], ids, *leaves[2:], **kw)
    (out.double() * dy).sum().backward()
    return out, [None if t is None else t.grad for t in leaves]


# ----------------------------------------------------------------------------- 1. the router

ROUTINGS = [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)]


@pytest.mark.parametrize("scoring,norm", ROUTINGS)
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.float16))
def test_route_matches_ref(scoring, norm, dtype):
    gen = make_generator(1)
    for t, e, k in [(75, 13, 4), (7, 6, 1), (1, 5, 5)]:
        logits = randn(t, e, gen=gen, scale=2.0).to(dtype)
        kw = dict(scoring=scoring, norm_topk_prob=norm)
        leaf64, leaf_lp, leaf = (logits.double().requires_grad_(), logits.clone().requires_grad_(),
                                 logits.clone().requires_grad_())
        w64, ids64 = ref.route(leaf64, k, **kw)
        w_lp, ids_lp = ref.route(leaf_lp, k, upcast=False, **kw)
        with nan_allocations():
            w, ids = fast.route(leaf, k, **kw)
        assert w.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(ids, ids64) and torch.equal(ids, ids_lp), f"experts differ at T={t}, E={e}, k={k}"
        assert bool((ids.diff(dim=-1) > 0).all()), "each row must list its experts in index order"
        check_close(f"weights T={t} E={e} k={k}", w, w64, w_lp)
        dw = randn(t, k, gen=gen, dtype=torch.float64)
        for out in (w64, w_lp, w):
            (out.double() * dw).sum().backward()
        check_close(f"d logits T={t} E={e} k={k}", leaf.grad, leaf64.grad, leaf_lp.grad, factor=3.0)


@pytest.mark.filterwarnings("ignore:invalid value encountered")     # the all -inf row: -inf - -inf, as softmax's
@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_route_ties_go_to_the_lower_index(module):
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5],          # three equal best: experts 1, 2
                           [0.0, -0.0, 0.0, -1.0, 3.0],         # 3, then 0 (+0.0 == -0.0)
                           [-inf, -inf, -inf, -inf, -inf],      # all equal: 0, 1 (weights NaN, as softmax's)
                           [5.0, 5.0, 5.0, 5.0, 5.0],           # 0, 1: weights 1/2 each
                           [1.0, nan, 2.0, 3.0, 4.0]],          # NaN counts as +inf: 1 and 4, weights NaN
                          device=DEVICE)
    w, ids = module.route(logits, 2, scoring="topk_softmax")
    assert ids.tolist() == [[1, 2], [0, 4], [0, 1], [0, 1], [1, 4]]
    assert torch.equal(w[3], torch.full((2,), 0.5, device=DEVICE))
    assert bool(w[[2, 4]].isnan().all()) and bool(w[:2].isfinite().all())
    assert torch.allclose(w[0], torch.full((2,), 0.5, device=DEVICE))


# ----------------------------------------------------------------------------- 2. the experts

EXPERT_CASES = [  # name, T, E, k, layout, activation, biases, how the tokens are routed
    ("T1-qwen-silu", 1, 6, 1, "qwen", "silu", False, "random"),
    ("T7-gptoss", 7, 13, 4, "gpt_oss", "gpt_oss", True, "random"),
    ("T75-qwen-clamped-an-idle-expert", 75, 13, 2, "qwen", "gpt_oss", True, "idle"),
    ("T75-gptoss-layout-silu", 75, 6, 2, "gpt_oss", "silu", False, "random"),
    ("T7-all-on-one-expert", 7, 5, 1, "qwen", "silu", True, "one"),
]


def routed(t, e, k, how, gen):
    """(weights [T, k] fp64, ids): from random logits; "idle" keeps expert 5 free; "one" sends all to 3."""
    logits = randn(t, e, gen=gen, scale=2.0)
    if how == "idle":
        logits[:, 5] -= 100
    weights, ids = ref.route(logits, k)
    if how == "one":
        ids = torch.full_like(ids, 3)
    counts = torch.bincount(ids.flatten().cpu(), minlength=e)
    assert how != "idle" or counts[5] == 0
    assert how != "one" or counts[3] == t * k
    return weights, ids


@pytest.mark.parametrize("name,t,e,k,layout,activation,bias,how", EXPERT_CASES, ids=[c[0] for c in EXPERT_CASES])
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.float16))
def test_experts_match_ref(name, t, e, k, layout, activation, bias, how, dtype):
    h, i = 40, 24
    gen = make_generator(2)
    weights, ids = routed(t, e, k, how, gen)
    tensors = [randn(t, h, gen=gen, dtype=torch.float64), weights, *expert_tensors(layout, e, h, i, bias=bias, gen=gen)]
    low = lowp(dtype, *tensors)
    low[1] = weights.float()
    dy = randn(t, h, gen=gen, dtype=torch.float64)
    kw = dict(layout=layout, activation=activation, swiglu_limit=1.25)     # a limit the gates and ups cross
    out64, g64 = run(ref.moe_experts, [None if x is None else x.double() for x in low], ids, dy, **kw)
    out_lp, g_lp = run(ref.moe_experts, low, ids, dy, upcast=False, **kw)
    with nan_allocations():
        out, g = run(fast.moe_experts, low, ids, dy, **kw)
    assert out.dtype == dtype
    check_close(f"{name} out", out, out64, out_lp)
    for label, a, b, c in zip(["dx", "dweights", "dgate_up", "ddown", "dgate_up_bias", "ddown_bias"], g, g64, g_lp):
        if b is not None:
            check_close(f"{name} {label}", a, b, c, factor=3.0)


def test_experts_are_deterministic_and_empty_batches_work():
    gen = make_generator(3)
    weights, ids = routed(30, 6, 2, "random", gen)
    tensors = [randn(30, 40, gen=gen), weights.float(), *expert_tensors("gpt_oss", 6, 40, 24, bias=True, gen=gen,
                                                                           dtype=torch.float32)]
    dy = randn(30, 40, gen=gen, dtype=torch.float64)
    kw = dict(layout="gpt_oss", activation="gpt_oss")
    first, second = run(fast.moe_experts, tensors, ids, dy, **kw), run(fast.moe_experts, tensors, ids, dy, **kw)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    empty = [tensors[0][:0], tensors[1][:0], *tensors[2:]]
    assert ref.moe_experts(*empty[:2], ids[:0], *empty[2:], **kw).shape == (0, 40)
    out, grads = run(fast.moe_experts, empty, ids[:0], dy[:0] + tensors[0][:0].sum(), **kw)
    assert out.shape == (0, 40)
    assert all(not bool(gr.any()) for gr in grads[2:]), "no token: zero weight gradients"


def test_strided_inputs_give_the_same_bits():
    """Expert tensors stored in the other memory order (views with strides), a strided x and biases: the
    kernels read them through their strides; the results equal the contiguous inputs' bit for bit."""
    gen = make_generator(16)
    weights, ids = routed(7, 6, 2, "random", gen)
    x = randn(7, 80, gen=gen)
    w1, w2, b1, b2 = expert_tensors("qwen", 6, 40, 24, bias=True, gen=gen, dtype=torch.float32)
    strided = [x[:, ::2], w1.mT.contiguous().mT, w2.mT.contiguous().mT, b1.t().contiguous().t(),
               b2.t().contiguous().t()]
    assert not any(t.is_contiguous() for t in strided)
    got = fast.moe_experts(strided[0], weights, ids, *strided[1:], activation="gpt_oss")
    want = fast.moe_experts(x[:, ::2].contiguous(), weights, ids, w1, w2, b1, b2, activation="gpt_oss")
    assert torch.equal(got, want)


def test_unchecked_ids_out_of_range_are_dropped_in_bounds():
    """Where the host check is off (CUDA graph capture, torch.compile), an id outside [0, E) drops its pair
    (the interpreter's sanitizer checks that no lane leaves its tensors) instead of reading another expert."""
    gen = make_generator(15)
    weights, ids = routed(7, 6, 2, "random", gen)
    x = randn(7, 40, gen=gen)
    w1, w2, b1, b2 = expert_tensors("gpt_oss", 6, 40, 24, bias=True, gen=gen, dtype=torch.float32)
    bad, zeroed = ids.clone(), weights.float().clone()
    bad[2, 1], bad[5, 0] = 6, -3
    zeroed[2, 1] = zeroed[5, 0] = 0
    opts = ("gpt_oss", "gpt_oss", 7.0, 1.702, False)
    with nan_allocations():
        got = fast._experts_op(x, weights.float(), bad, w1, w2, b1, b2, *opts)
    torch.testing.assert_close(got, fast.moe_experts(x, zeroed, ids, w1, w2, b1, b2, layout="gpt_oss",
                                                     activation="gpt_oss"))


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_a_nan_token_stays_in_its_token(module):
    layer = make_layer(module, "gpt_oss", torch.float32)
    x = randn(9, layer.hidden_size, gen=make_generator(4))
    x[4, 7] = float("nan")
    y = layer(x)
    assert bool(y[4].isnan().all())
    assert bool(y[torch.arange(9) != 4].isfinite().all())


# ----------------------------------------------------------------------------- 3. the layer vs transformers

FAMILIES = ["qwen3_moe", "qwen3_moe_norm", "qwen3_5_moe", "gpt_oss"]
H, E, K, FFN, SHARED = 40, 6, 2, 24, 16


def hf_block(family: str, seed: int = 0):
    """transformers' block at test size, every parameter perturbed (routers sharp, biases non-zero), and the
    keywords of ref/moe.py's MoE for it."""
    if family.startswith("qwen3_moe"):
        from transformers.models.qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        norm = family.endswith("norm")
        config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=FFN,
                                norm_topk_prob=norm)
        kw = dict(norm_topk_prob=norm)
    elif family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block
        config = Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=FFN,
                                      shared_expert_intermediate_size=SHARED)
        kw = dict(norm_topk_prob=True, shared_intermediate_size=SHARED)
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block
        config = GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K, intermediate_size=FFN,
                              swiglu_limit=1.5)
        kw = dict(scoring="topk_softmax", router_bias=True, expert_bias=True, activation="gpt_oss",
                  swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha, layout="gpt_oss")
    config._experts_implementation = "eager"
    block = Block(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            router = name in ("gate.weight", "router.weight", "router.bias")
            fan_in = p.shape[-1] if p.dim() == 2 and not name.startswith("experts.") else (
                H if "gate_up" in name else FFN)
            scale = 3.0 * H ** -0.5 if router else (0.5 if p.dim() < 2 or "bias" in name else fan_in ** -0.5)
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return block.eval(), dict(num_experts=E, top_k=K, intermediate_size=FFN, **kw)


def top_k_margin(layer, x) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router logit (fp32): how far from a tie."""
    logits = layer.router_linear(x).sort(dim=-1, descending=True).values
    return (logits[:, K - 1] - logits[:, K]).min().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_matches_transformers(family):
    block, kw = hf_block(family)
    x = randn(2, 7, H, gen=make_generator(5), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want               # GptOssMLP returns (out, scores)
    for kernels in ("ref", "fast"):
        plug = {} if kernels == "ref" else dict(route_fn=fast.route, experts_fn=fast.moe_experts)
        layer = ref.MoE(H, **kw, **plug)
        layer.load_state_dict(block.state_dict(), strict=True)      # transformers' names and layouts, as they are
        layer.to(DEVICE)
        margin = top_k_margin(layer, x.to(DEVICE).flatten(0, 1))
        assert margin > MARGIN, f"{family}: routers too flat for the comparison (margin {margin:.3g})"
        with torch.no_grad():
            got = layer(x.to(DEVICE))
        err = (got.cpu() - want).abs().max().item()
        print(f"{family} ({kernels} kernels): max |ours - transformers| {err:.2e}, smallest top-k margin "
              f"{margin:.3f}, output scale {want.abs().max().item():.2f}")
        assert err <= HF_ATOL, f"{family} with {kernels} kernels: {err:.3e} from transformers"


@pytest.mark.parametrize("family", ["qwen3_5_moe", "gpt_oss"])
def test_layer_gradients_fast_vs_ref(family):
    block, kw = hf_block(family, seed=2)
    layers = {}
    for name, dtype, module in (("ref64", torch.float64, ref), ("ref32", torch.float32, ref),
                                ("fast", torch.float32, fast)):
        layers[name] = module.MoE(H, **kw)           # each file's layer on its own functions
        layers[name].load_state_dict(block.state_dict())
        layers[name].to(device=DEVICE, dtype=dtype)
    assert layers["fast"].route_fn is fast.route and layers["fast"].experts_fn is fast.moe_experts
    gen = make_generator(6)
    x = randn(11, H, gen=gen, dtype=torch.float64)
    dy = randn(11, H, gen=gen, dtype=torch.float64)
    margin = top_k_margin(layers["ref32"], x.float())
    print(f"{family}: smallest top-k margin {margin:.3f}")
    assert margin > MARGIN
    grads = {}
    for name, layer in layers.items():
        leaf = x.to(next(layer.parameters()).dtype).clone().requires_grad_(True)
        ctx = nan_allocations() if name == "fast" else torch.enable_grad()
        with ctx:
            (layer(leaf).double() * dy).sum().backward()
        grads[name] = {"x": leaf.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    for n in grads["ref64"]:
        check_close(f"{family} d{n}", grads["fast"][n], grads["ref64"][n], grads["ref32"][n], factor=3.0)


def _per_expert(layer):
    """A checkpoint's per-expert tensors from the layer's fused ones (transformers' qwen2_moe names)."""
    ex, e, i = layer.experts, layer.num_experts, layer.intermediate_size
    if layer.layout == "qwen":
        gate, up, down = ex.gate_up_proj[:, :i], ex.gate_up_proj[:, i:], ex.down_proj
    else:
        gate, up = ex.gate_up_proj[..., 0::2].transpose(1, 2), ex.gate_up_proj[..., 1::2].transpose(1, 2)
        down = ex.down_proj.transpose(1, 2)
    out = {f"experts.{n}.{p}_proj.weight": w[n].clone() for n in range(e)
           for p, w in (("gate", gate), ("up", up), ("down", down))}
    if hasattr(ex, "down_proj_bias"):
        b = ex.gate_up_proj_bias
        parts = (b[:, :i], b[:, i:]) if layer.layout == "qwen" else (b[:, 0::2], b[:, 1::2])
        out.update({f"experts.{n}.{p}_proj.bias": w[n].clone() for n in range(e)
                    for p, w in (("gate", parts[0]), ("up", parts[1]), ("down", ex.down_proj_bias))})
    return out


@pytest.mark.parametrize("layout", ["qwen", "gpt_oss"])
def test_layer_loads_per_expert_checkpoint_tensors(layout):
    torch.manual_seed(7)
    kw = dict(num_experts=5, top_k=2, intermediate_size=12, layout=layout, expert_bias=layout == "gpt_oss")
    source, target = ref.MoE(32, **kw), ref.MoE(32, **kw)
    sd = {k: v for k, v in source.state_dict().items() if not k.startswith("experts.")}
    target.load_state_dict({**sd, **_per_expert(source)}, strict=True)
    for name, p in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], p), name
    bad = {**sd, **_per_expert(source)}
    del bad["experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['experts.3.up_proj.weight'\]"):
        target.load_state_dict(bad)
    bad = {**sd, **_per_expert(source)}
    bad["experts.1.down_proj.weight"] = bad["experts.1.down_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"experts.1.down_proj.weight: expected a float tensor of shape \(32, 12\)"):
        target.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"experts.down_proj: expected shape"):
        target.load_state_dict({**source.state_dict(), "experts.down_proj": torch.zeros(5, 3, 3)})


def test_layer_loads_mxfp4_checkpoint_tensors():
    gen = torch.Generator().manual_seed(8)
    layer = ref.MoE(64, num_experts=3, top_k=2, intermediate_size=32, scoring="topk_softmax", router_bias=True,
                    expert_bias=True, activation="gpt_oss", layout="gpt_oss", dtype=torch.bfloat16)
    sd = {k: v for k, v in layer.state_dict().items() if k not in ("experts.gate_up_proj", "experts.down_proj")}
    packed = {}
    for proj, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):     # checkpoint: [E, out, in/32, 16]
        packed[f"experts.{proj}_blocks"] = torch.randint(0, 256, (3, rows, cols // 32, 16), generator=gen,
                                                         dtype=torch.uint8)
        packed[f"experts.{proj}_scales"] = torch.randint(118, 136, (3, rows, cols // 32), generator=gen,
                                                         dtype=torch.uint8)
    layer.load_state_dict({**sd, **packed}, strict=True)
    for proj in ("gate_up_proj", "down_proj"):
        want = ref.dequantize_mxfp4(packed[f"experts.{proj}_blocks"], packed[f"experts.{proj}_scales"])
        assert torch.equal(getattr(layer.experts, proj), want)
    bad = dict(packed, **{"experts.down_proj_scales": packed["experts.down_proj_scales"][:, :, :0]})
    with pytest.raises(ValueError, match="experts.down_proj_blocks / experts.down_proj_scales: scales must be"):
        layer.load_state_dict({**sd, **bad})
    qwen = ref.MoE(64, num_experts=3, top_k=2, intermediate_size=32)
    with pytest.raises(ValueError, match="gpt_oss layout only"):
        qwen.load_state_dict({**qwen.state_dict(), **packed})


# ----------------------------------------------------------------------------- 4. batch invariance

def make_layer(module, layout: str, dtype, seed: int = 9):
    """A layer with everything on (router and expert biases, the clamped activation, a shared expert), the
    reference's or the fast plug-ins, weights drawn in fp64 and cast."""
    plug = {} if module is ref else dict(route_fn=fast.route, experts_fn=fast.moe_experts)
    torch.manual_seed(seed)
    layer = ref.MoE(H, num_experts=E, top_k=K, intermediate_size=FFN, scoring="topk_softmax", router_bias=True,
                    expert_bias=True, activation="gpt_oss", swiglu_limit=1.5, shared_intermediate_size=SHARED,
                    layout=layout, dtype=torch.float64, **plug)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5))
    return layer.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.float16))
def test_batch_invariant_mode_is_bitwise(module, dtype):
    from fast.decoder_lm import _invariant_linear
    layer = make_layer(module, "gpt_oss", dtype)
    layer.set_batch_invariant(_invariant_linear)
    gen = make_generator(10)
    x = randn(40, H, gen=gen, dtype=dtype)
    perm = torch.randperm(40, generator=gen).tolist()
    with torch.no_grad():
        y40 = layer(x[perm])
        y40_again = layer(x[perm[::-1]])
        picked = perm[:2] + [perm[-1]]
        alone = {j: layer(x[j:j + 1])[0] for j in picked}
        y3 = layer(x[[picked[2], picked[0], picked[1]]])
    rows40 = {j: y40[perm.index(j)] for j in range(40)}
    assert all(torch.equal(y40_again[n], rows40[j]) for n, j in enumerate(perm[::-1])), "40 tokens, two orders"
    for n, j in enumerate([picked[2], picked[0], picked[1]]):
        assert torch.equal(y3[n], alone[j]), f"token {j}: among 3 != alone"
        assert torch.equal(rows40[j], alone[j]), f"token {j}: among 40 != alone"
    assert not torch.equal(alone[picked[0]], alone[picked[1]])


@pytest.mark.parametrize("ranks", [2, 3, 6])
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_expert_parallel_layer_equals_one_rank(ranks, invariant):
    from fast.decoder_lm import LocalGroup, _invariant_linear
    whole = make_layer(ref, "gpt_oss", torch.float32)            # E = 6 experts, a shared expert, biases
    state = whole.state_dict()
    per_expert = {**{k: v for k, v in state.items() if not k.startswith("experts.")}, **_per_expert(whole)}
    shards = []
    for n, group in enumerate(LocalGroup(ranks).ranks()):
        shard = ref.MoE(H, num_experts=E, top_k=K, intermediate_size=FFN, scoring="topk_softmax", router_bias=True,
                        expert_bias=True, activation="gpt_oss", swiglu_limit=1.5, shared_intermediate_size=SHARED,
                        layout="gpt_oss", expert_group=group)
        shard.load_state_dict(per_expert if n % 2 else state, strict=True)     # either layout, whole-layer tensors
        shards.append(shard)
    for layer in [whole, *shards] if invariant else []:
        layer.set_batch_invariant(_invariant_linear)
    local = E // ranks
    assert all(s.experts.gate_up_proj.shape[0] == local and s.first_expert == n * local for n, s in enumerate(shards))
    gen = make_generator(11)
    for t in (0, 1, 7):
        x = randn(t, H, gen=gen, dtype=torch.float32)
        dy = randn(t, H, gen=gen, dtype=torch.float32)

        def step(layer):
            layer.zero_grad()
            xs = x.clone().requires_grad_(True)
            out = layer(xs)
            (out * dy).sum().backward()
            return out.detach(), xs.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad    # (T = 0)
                                           for n, p in layer.named_parameters()}
        want, want_dx, want_grads = step(whole)
        got = on_threads([lambda s=s: step(s) for s in shards])
        for n, (out, _, grads) in enumerate(got):
            if invariant:
                assert torch.equal(out, want), (t, n)
            else:
                torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            for name, g in grads.items():
                if name.startswith("experts."):              # this rank's experts: every token's pairs came here
                    torch.testing.assert_close(g, want_grads[name][n * local:(n + 1) * local], atol=1e-5, rtol=1e-5)
        summed_dx = sum(dx for _, dx, _ in got)               # each rank's tokens' part (Megatron's f sums them)
        torch.testing.assert_close(summed_dx, want_dx, atol=1e-5, rtol=1e-5)
        for name in want_grads:
            if not name.startswith("experts."):              # router and shared expert: replicated, partial
                summed = sum(grads[name] for _, _, grads in got)
                torch.testing.assert_close(summed, want_grads[name], atol=1e-5, rtol=1e-5)


def test_expert_parallel_layer_refuses_what_it_cannot_split():
    from fast.decoder_lm import LocalGroup
    for module in (ref, fast):
        with pytest.raises(ValueError, match="expert parallelism over 4 ranks.*num_experts=6"):
            module.MoE(H, num_experts=6, top_k=2, intermediate_size=8, expert_group=LocalGroup(4).ranks()[0])
        with pytest.raises(TypeError, match="expert_group must be a process group"):
            module.MoE(H, num_experts=6, top_k=2, intermediate_size=8, expert_group=2)


# ----------------------------------------------------------------------------- 5. MXFP4

def test_mxfp4_hand_built_example():
    # expert 0, row 0: bytes 0x21 (codes 1, 2: 0.5, 1.0), 0xF8 (codes 8, 15: -0.0, -6.0), the rest 0x77 (6, 6);
    # scale 128 (x 2).  Row 1: byte 0x3C (codes 12, 3: -2.0, 1.5), the rest 0x00; scale 0 (x 2^-127).
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    blocks[0, 0] = torch.tensor([0x21, 0xF8] + [0x77] * 14, dtype=torch.uint8)
    blocks[0, 1, 0, 0] = 0x3C
    scales = torch.tensor([[[128], [0]]], dtype=torch.uint8)
    want = torch.zeros(1, 32, 2, dtype=torch.float32)
    want[0, :, 0] = torch.tensor([0.5, 1.0, -0.0, -6.0] + [6.0] * 28) * 2
    want[0, :2, 1] = torch.tensor([-2.0, 1.5]) * 2.0 ** -127
    for module in (ref, fast):
        got = module.dequantize_mxfp4(blocks.to(DEVICE), scales.to(DEVICE), dtype=torch.float32).cpu()
        assert torch.equal(got, want) and got.shape == (1, 32, 2)
        assert torch.equal(got.signbit(), want.signbit()), "-0.0 keeps its sign"


@pytest.mark.filterwarnings("ignore:overflow encountered")     # 6 * 2^127 is inf, as in ref and transformers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_mxfp4_matches_transformers_and_fast_matches_ref(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (3, 40, 3, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 40, 3), generator=gen, dtype=torch.uint8)     # every exponent but 0xFF
    ours = ref.dequantize_mxfp4(blocks, scales, dtype=dtype)
    assert ours.shape == (3, 96, 40) and ours.dtype == dtype
    # the interpreter's fp32 -> bf16 cast flushes bf16's subnormals (2^-133 .. 2^-127), a GPU's does not:
    # there fast is compared where every value is normal (scales >= 8)
    fast_scales = scales.clamp(min=8) if INTERPRET and dtype == torch.bfloat16 else scales
    fast_out = fast.dequantize_mxfp4(blocks.to(DEVICE), fast_scales.to(DEVICE), dtype=dtype).cpu()
    want = ref.dequantize_mxfp4(blocks, fast_scales, dtype=dtype)
    assert torch.equal(fast_out, want) and torch.equal(fast_out.signbit(), want.signbit())
    # transformers computes in dtype; fp16's range cuts its exponents short, so compare where fp16 is exact
    keep = scales.clamp(115, 135) if dtype == torch.float16 else scales
    theirs = convert_moe_packed_tensors(blocks, keep, dtype=dtype)
    assert torch.equal(ref.dequantize_mxfp4(blocks, keep, dtype=dtype), theirs)


# ----------------------------------------------------------------------------- 6. the contract

def _bad_cases():
    gen = make_generator(12)
    x = randn(5, 8, gen=gen)
    logits = randn(5, 4, gen=gen)
    weights, ids = ref.route(logits.double(), 2)
    weights = weights.float()
    w1, w2, b1, b2 = expert_tensors("qwen", 4, 8, 6, bias=True, gen=gen, dtype=torch.float32)
    args = dict(x=x, weights=weights, ids=ids, gate_up_proj=w1, down_proj=w2, gate_up_bias=b1, down_bias=b2)
    route_args = dict(logits=logits, top_k=2)
    yield "route_logits_1d", "route", dict(route_args, logits=logits[0]), {}, TypeError, "logits must be a float tensor"
    yield "route_logits_int", "route", dict(route_args, logits=ids), {}, TypeError, "logits must be a float tensor"
    yield "route_top_k_big", "route", dict(route_args, top_k=5), {}, ValueError, r"top_k must be an int in \[1, E=4\]"
    yield "route_top_k_0", "route", dict(route_args, top_k=0), {}, ValueError, "top_k must be"
    yield "route_top_k_bool", "route", dict(route_args, top_k=True), {}, ValueError, "top_k must be"
    yield "route_scoring", "route", route_args, dict(scoring="sigmoid"), ValueError, "scoring must be one of"
    yield "route_norm", "route", route_args, dict(norm_topk_prob=1), TypeError, "norm_topk_prob must be a bool"
    yield "layout", "experts", args, dict(layout="llama"), ValueError, "layout must be one of"
    yield "activation", "experts", args, dict(activation="gelu"), ValueError, "activation must be one of"
    yield "limit", "experts", args, dict(swiglu_limit=0.0), ValueError, "swiglu_limit must be a finite number"
    yield "invariant", "experts", args, dict(batch_invariant="yes"), TypeError, "batch_invariant must be a bool"
    yield "x_3d", "experts", dict(args, x=x[None]), {}, ValueError, r"x must be \[T, H\]"
    yield "ids_float", "experts", dict(args, ids=ids.float()), {}, TypeError, "ids must be an integer tensor"
    yield "weights_int", "experts", dict(args, weights=ids), {}, TypeError, "weights must be a float tensor"
    yield "weights_shape", "experts", dict(args, weights=weights[:, :1]), {}, ValueError, r"weights must be \(5, 2\)"
    yield "gate_up_hidden", "experts", dict(args, gate_up_proj=w1[..., :7]), {}, ValueError, "gate_up_proj must be"
    yield "gate_up_odd", "experts", dict(args, gate_up_proj=w1[:, :11]), {}, ValueError, "must be 2I > 0"
    yield "gate_up_2d", "experts", dict(args, gate_up_proj=w1[0]), {}, ValueError, "gate_up_proj must be 3-D"
    yield "down_shape", "experts", dict(args, down_proj=w2.mT), {}, ValueError, r"down_proj must be \(4, 8, 6\)"
    yield "layout_mismatch", "experts", args, dict(layout="gpt_oss"), ValueError, "must be"
    yield "bias_shape", "experts", dict(args, down_bias=b2[:, :3]), {}, ValueError, r"down_bias must be \(4, 8\)"
    yield "weight_dtype", "experts", dict(args, down_proj=w2.half()), {}, TypeError, "must have x's dtype"
    yield "ids_too_big", "experts", dict(args, ids=ids + 3), {}, ValueError, r"ids must lie in \[0, E=4\)"
    yield "ids_negative", "experts", dict(args, ids=ids - 2), {}, ValueError, r"ids must lie in \[0, E=4\)"
    yield "ids_k0", "experts", dict(args, ids=ids[:, :0], weights=weights[:, :0]), {}, ValueError, "k >= 1"
    blocks, scales = torch.zeros(2, 3, 4, 16, dtype=torch.uint8), torch.full((2, 3, 4), 127, dtype=torch.uint8)
    mx = dict(blocks=blocks, scales=scales)
    yield "mx_blocks_float", "mxfp4", dict(mx, blocks=blocks.float()), {}, TypeError, "blocks must be a uint8 tensor"
    yield "mx_blocks_15", "mxfp4", dict(mx, blocks=blocks[..., :15]), {}, ValueError, r"blocks must be \[E, R, G, 16\]"
    yield "mx_scales_shape", "mxfp4", dict(mx, scales=scales[:, :2]), {}, ValueError, r"scales must be \[E, R, G\]"
    yield "mx_scales_nan", "mxfp4", dict(mx, scales=scales.clone().fill_(255)), {}, ValueError, "0xFF"
    yield "mx_dtype", "mxfp4", mx, dict(dtype=torch.int32), TypeError, "dtype must be a float"


def _call(module, kind, tensors, kwargs):
    t = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    if kind == "route":
        return module.route(t["logits"], t["top_k"], **kwargs)
    if kind == "mxfp4":
        return module.dequantize_mxfp4(t["blocks"], t["scales"], **kwargs)
    return module.moe_experts(*t.values(), **kwargs)


@pytest.mark.parametrize("name,kind,tensors,kwargs,error,match", list(_bad_cases()), ids=lambda v: v if isinstance(
    v, str) else "")
def test_bad_inputs_raise_in_both(name, kind, tensors, kwargs, error, match):
    for module in (ref, fast):
        with pytest.raises(error, match=match):
            _call(module, kind, tensors, kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(top_k=7), ValueError, "top_k=7 must be <= num_experts=6"),
    (dict(hidden_size=0), ValueError, "hidden_size must be an int >= 1"),
    (dict(num_experts=2000, top_k=2), ValueError, "num_experts must be <= 1024"),
    (dict(scoring="sparsemax"), ValueError, "scoring must be one of"),
    (dict(layout="mixtral"), ValueError, "layout must be one of"),
    (dict(norm_topk_prob=None), TypeError, "norm_topk_prob must be a bool"),
    (dict(shared_intermediate_size=-1), ValueError, "shared_intermediate_size must be an int >= 0"),
    (dict(experts_fn="fast"), TypeError, "experts_fn must be functions"),
])
def test_layer_bad_sizes_and_options_raise(kwargs, error, match):
    kw = dict(dict(hidden_size=8, num_experts=6, top_k=2, intermediate_size=4), **kwargs)
    with pytest.raises(error, match=match):
        ref.MoE(kw.pop("hidden_size"), **kw)
    layer = ref.MoE(8, num_experts=6, top_k=2, intermediate_size=4)
    with pytest.raises(ValueError, match=r"x must be \[..., hidden_size=8\]"):
        layer(torch.zeros(3, 9))
    with pytest.raises(TypeError, match="linear and out_linear must be functions"):
        layer.set_batch_invariant("bmm")


def test_fast_ops_compile_without_graph_break():
    gen = make_generator(13)
    x = randn(9, 40, gen=gen)
    logits = randn(9, 6, gen=gen, scale=2.0)
    tensors = expert_tensors("gpt_oss", 6, 40, 24, bias=True, gen=gen, dtype=torch.float32)

    def f(x, logits, w1, w2, b1, b2):
        weights, ids = fast.route(logits, 2, scoring="topk_softmax")
        return fast.moe_experts(x, weights, ids, w1, w2, b1, b2, layout="gpt_oss", activation="gpt_oss") * 2

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, logits, *tensors)]
        out = fn(*leaves)
        out.sum().backward()
        return [out, *(t.grad for t in leaves)]

    torch._dynamo.reset()
    compiled = grads(torch.compile(f, fullgraph=True, backend="aot_eager"))
    eager = grads(f)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- GPU tier

@pytest.mark.parametrize("t", [gpu_case(16, id="decode16"), gpu_case(64, id="decode64"), gpu_case(1000, id="prefill")])
def test_qwen3_30b_a3b_layer_shapes_on_gpu(t):
    e, k, h, i = 128, 8, 2048, 768
    gen = make_generator(14)
    weights, ids = ref.route(randn(t, e, gen=gen, dtype=torch.float64), k)
    tensors = [randn(t, h, gen=gen, dtype=torch.float64), weights, *expert_tensors("qwen", e, h, i, bias=False,
                                                                                    gen=gen)]
    for dtype in (torch.bfloat16, torch.float16):
        low = lowp(dtype, *tensors)
        low[1] = weights.float()
        out64 = ref.moe_experts(*[None if v is None else v.double() for v in low[:2]], ids,
                                *[None if v is None else v.double() for v in low[2:]])
        out_lp = ref.moe_experts(low[0], low[1], ids, *low[2:], upcast=False)
        with nan_allocations():
            out = fast.moe_experts(low[0], low[1], ids, *low[2:])
        check_close(f"T={t} {dtype}", out, out64, out_lp)
