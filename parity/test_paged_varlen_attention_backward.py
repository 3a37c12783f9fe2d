"""Gradients of fast.varlen_attn (the Triton backward) against autograd through the reference.

1. dq, dk, dv (and dsinks) vs fp64 autograd through ref.varlen_attn, the tolerance rule (check_close) with factor
   3 (``ref_lowp`` = the reference's autograd in the test dtype, upcast=False): GQA 1/3/8, causal,
   two-sided and one-sided windows, softcap, sinks, a gradient reaching the returned lse, head dims
   32/60/100 and an odd 37 (the staged path), seqused_k, decode-like rows, rows that see no key,
   empty sequences.  Every buffer the backward allocates starts as NaN.
2. Structure: varlen equals each sequence alone (bitwise), a NaN in one document's output gradient
   reaches no other document, keys past seqused_k get exactly 0, bitwise repeatable (no atomics),
   other tile shapes give the same answer.
3. Rigor and contract: gradcheck of the fast op (fp32: the kernels take no fp64, so the fp64
   gradcheck is the reference's, test_paged_varlen_attention.py, and section 1 ties the two),
   torch.compile(fullgraph=True) over forward + backward, paged and out= calls refuse gradients,
   a second derivative raises.
Interpreter tier: fp32 / fp16, small shapes.  GPU tier: bf16, sequences up to 8k, head dims to 256,
every autotune config of both backward kernels.
"""
from __future__ import annotations

import pytest
import torch

import fast.paged_varlen_attention as fast
import ref.paged_varlen_attention as ref
from conftest import (DEVICE, check_close, cu_seqlens, dtype_params, gpu_case, make_generator, nan_allocations, randn,
                      requires_gpu)
from test_paged_varlen_attention import config_key, force_tiles, launch_options, make_batch, paged_view

NAMES = ("dq", "dk", "dv", "dsinks")


def grads(mod, b, *, dtype, window=(-1, -1), softcap=0.0, sinks=None, lse_loss=False, out_loss=True,
          seqused_k=None, **extra):
    """Gradients of sum(o * w_o) [+ sum(lse * w_l) over the rows that see something] w.r.t. q, k, v
    (and sinks).  The weights (random output / lse gradients) come from a fixed generator."""
    gen = make_generator(1234)
    q, k, v = (b[x].to(dtype).detach().requires_grad_() for x in ("q", "k", "v"))
    leaves = [q, k, v]
    if sinks is not None:
        sinks = sinks.to(torch.float64 if dtype == torch.float64 else torch.float32).detach().requires_grad_()
        leaves.append(sinks)
    o, lse = mod.varlen_attn(q, k, v, b["cu_q"], b["cu_k"], b["max_q"], b["max_k"], window_size=window,
                             enable_gqa=q.shape[1] != k.shape[1], softcap=softcap, sinks=sinks,
                             seqused_k=seqused_k, return_aux=mod.AuxRequest(lse=True), **extra)
    w_o = randn(*o.shape, gen=gen, dtype=torch.float32).to(o.dtype)
    w_l = randn(*lse.shape, gen=gen, dtype=torch.float32).to(lse.dtype)
    loss = (o * w_o).sum() if out_loss else 0.0
    if lse_loss:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * w_l).sum()
    # allow_unused: with the lse alone in the loss, v is not in the reference's graph (gradient 0)
    found = torch.autograd.grad(loss, leaves, allow_unused=True)
    return {name: torch.zeros_like(t) if g is None else g for name, t, g in zip(NAMES, leaves, found)}


def check_grads(b, dtype, **kw):
    g64 = grads(ref, b, dtype=torch.float64, **kw)
    g_low = grads(ref, b, dtype=dtype, upcast=False, **kw)
    with nan_allocations():
        g_fast = grads(fast, b, dtype=dtype, **kw)
    for name in g64:
        assert g_fast[name].dtype == g_low[name].dtype, name
        # d sink is fp32 but sums products of the stored outputs and output gradients (delta = dO . O):
        # its rounding floor is the input dtype's at its scale, not fp32's.
        scale = g64[name][torch.isfinite(g64[name])].abs().max().item() if g64[name].numel() else 0.0
        floor = torch.finfo(dtype).eps * scale if name == "dsinks" else None
        check_close(name, g_fast[name], g64[name], g_low[name], factor=3.0, floor=floor)
    return g_fast


# ----------------------------------------------------------------------------- fast vs ref

CASES = [
    # id, batch kwargs, grads kwargs
    ("full", dict(n=4, max_q=21, max_k=30, h_q=2, h_kv=2, d=64), dict()),
    ("causal-gqa3", dict(n=4, max_q=23, max_k=23, h_q=6, h_kv=2, d=64), dict(window=(-1, 0))),
    ("causal-gqa8-d60", dict(n=3, max_q=17, max_k=25, h_q=8, h_kv=1, d=60), dict(window=(-1, 0))),
    ("window-d100", dict(n=3, max_q=20, max_k=34, h_q=2, h_kv=1, d=100), dict(window=(5, 3))),
    ("left-only", dict(n=3, max_q=19, max_k=19, h_q=3, h_kv=3, d=32), dict(window=(4, -1))),
    ("softcap-sinks-lse", dict(n=3, max_q=18, max_k=26, h_q=4, h_kv=2, d=64),
     dict(window=(-1, 0), softcap=5.0, sinks=True, lse_loss=True)),
    ("sinks-window", dict(n=3, max_q=14, max_k=20, h_q=2, h_kv=1, d=32), dict(window=(3, 1), sinks=True)),
    ("lse-only", dict(n=3, max_q=12, max_k=16, h_q=2, h_kv=2, d=32), dict(window=(-1, 0), lse_loss=True,
                                                                          out_loss=False)),
    ("decode-like", dict(n=5, max_q=1, max_k=37, h_q=8, h_kv=2, d=64, decode_like=True), dict(window=(-1, 0))),
    ("odd-d37-staged", dict(n=3, max_q=11, max_k=15, h_q=2, h_kv=1, d=37), dict(window=(-1, 0), softcap=3.0)),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_grads_match_ref(case, dtype):
    name, batch, kw = case
    b = make_batch(seed=sum(map(ord, name)), dtype=torch.float32, **batch)
    if kw.get("sinks"):
        kw = dict(kw, sinks=randn(batch["h_q"], gen=b["gen"], dtype=torch.float32))
    check_grads(b, dtype, **kw)


GPU_CASES = [
    gpu_case(dict(n=6, max_q=2048, h_q=32, h_kv=8, d=128), dict(window=(-1, 0)), id="causal-2k-gqa4-d128"),
    gpu_case(dict(n=2, max_q=8192, h_q=8, h_kv=8, d=64), dict(window=(-1, 0)), id="causal-8k-d64"),
    gpu_case(dict(n=4, max_q=1024, max_k=1500, h_q=16, h_kv=2, d=256), dict(window=(-1, 0), softcap=30.0),
             id="causal-softcap-d256"),
    gpu_case(dict(n=4, max_q=4096, h_q=16, h_kv=4, d=128), dict(window=(1024, 0), sinks=True),
             id="sliding-1k-sinks"),
    gpu_case(dict(n=4, max_q=1500, max_k=3000, h_q=12, h_kv=4, d=192), dict(lse_loss=True), id="full-d192-lse"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("batch,kw", GPU_CASES)
def test_grads_match_ref_large(batch, kw, dtype):
    b = make_batch(seed=21, dtype=torch.float32, **batch)
    if kw.get("sinks"):
        kw = dict(kw, sinks=randn(batch["h_q"], gen=b["gen"], dtype=torch.float32))
    check_grads(b, dtype, **kw)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_backward_config(d, dtype, monkeypatch):
    """Each config either backward autotuner may pick gives the right gradients."""
    b = make_batch(seed=22, n=4, max_q=300, max_k=500, h_q=6, h_kv=2, d=d)
    key = config_key(d, dtype)
    dkdv_configs, dq_configs = fast._TUNED_DKDV[key].configs, fast._TUNED_DQ[key].configs
    for i in range(max(len(dkdv_configs), len(dq_configs))):
        pair = [c[min(i, len(c) - 1)] for c in (dkdv_configs, dq_configs)]
        monkeypatch.setattr(fast, "_FORCED_BWD_CONFIGS", tuple(launch_options(c) for c in pair))
        check_grads(b, dtype, window=(-1, 0), softcap=10.0)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (64, 64)], ids=str)
def test_other_tile_shapes(blocks, monkeypatch):
    """Other tiles move every segment boundary (rows of dK/dV's loops, keys of dQ's): same answer."""
    force_tiles(monkeypatch, *blocks)
    b = make_batch(seed=23, n=4, max_q=40, max_k=70, h_q=6, h_kv=2, d=32)
    check_grads(b, torch.float32, window=(9, 2))
    check_grads(b, torch.float32, window=(-1, 0))


# ----------------------------------------------------------------------------- structure

def test_varlen_grads_equal_each_sequence_alone():
    """A document's gradients do not depend on what else is packed with it: bitwise."""
    b = make_batch(seed=24, n=4, max_q=19, max_k=27, h_q=6, h_kv=3, d=32)
    packed = grads(fast, b, dtype=torch.float32, window=(6, 0))
    for i, (lq, lk) in enumerate(zip(b["q_lens"], b["k_lens"])):
        qs, ks = slice(b["cu_q"][i], b["cu_q"][i + 1]), slice(b["cu_k"][i], b["cu_k"][i + 1])
        one = dict(q=b["q"][qs], k=b["k"][ks], v=b["v"][ks], cu_q=cu_seqlens([lq]), cu_k=cu_seqlens([lk]),
                   max_q=lq, max_k=lk)
        q, k, v = (one[x].detach().requires_grad_() for x in ("q", "k", "v"))
        o = fast.varlen_attn(q, k, v, one["cu_q"], one["cu_k"], lq, lk, window_size=(6, 0), enable_gqa=True)
        w_o = randn(*b["q"].shape, gen=make_generator(1234), dtype=torch.float32)[qs]   # the packed run's weights
        dq, dk, dv = torch.autograd.grad((o * w_o).sum(), (q, k, v))
        assert torch.equal(dq, packed["dq"][qs]), f"sequence {i} dq"
        assert torch.equal(dk, packed["dk"][ks]), f"sequence {i} dk"
        assert torch.equal(dv, packed["dv"][ks]), f"sequence {i} dv"


def test_nan_gradient_stays_in_its_document():
    """A NaN in document 1's output gradient: documents 0 and 2 get exactly the clean gradients."""
    b = make_batch(seed=25, n=3, max_q=15, max_k=15, h_q=4, h_kv=2, d=32, same_lengths=True)
    q, k, v = (b[x].detach().requires_grad_() for x in ("q", "k", "v"))
    o = fast.varlen_attn(q, k, v, b["cu_q"], b["cu_k"], 15, 15, window_size=(-1, 0), enable_gqa=True)
    do = randn(*o.shape, gen=make_generator(26))
    clean = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    do[15:30] = float("nan")
    dirty = torch.autograd.grad(o, (q, k, v), do)
    for name, c, d in zip(("dq", "dk", "dv"), clean, dirty):
        assert torch.equal(d[:15], c[:15]) and torch.equal(d[30:], c[30:]), name
        assert torch.isnan(d[15:30]).any(), name


def test_keys_past_seqused_get_zero_gradient():
    """With seqused_k, keys past each sequence's count are unused: their gradient is exactly 0 (the
    buffers start as NaN), and the used keys match the reference."""
    b = make_batch(seed=27, n=3, max_q=10, max_k=18, h_q=4, h_kv=2, d=32)
    used = torch.tensor([max(0, lk - 3) for lk in b["k_lens"]], dtype=torch.int32, device=DEVICE)
    b["max_k"] = max(int(used.max()), 1)
    g = check_grads(b, torch.float32, window=(-1, 0), seqused_k=used)
    for i in range(len(b["k_lens"])):
        tail = slice(b["cu_k"][i] + int(used[i]), b["cu_k"][i + 1])
        assert torch.all(g["dk"][tail] == 0) and torch.all(g["dv"][tail] == 0), f"sequence {i}"


def test_rows_that_see_nothing_and_empty_sequences():
    """More queries than keys under a causal mask (the first rows see nothing), a sequence with no
    keys, an empty sequence: those dq rows are exactly 0, everything finite, all vs the reference."""
    gen = make_generator(28)
    q_lens, k_lens = [6, 3, 0, 4], [4, 0, 5, 4]
    b = dict(q=randn(sum(q_lens), 2, 16, gen=gen), k=randn(sum(k_lens), 2, 16, gen=gen),
             v=randn(sum(k_lens), 2, 16, gen=gen), cu_q=cu_seqlens(q_lens), cu_k=cu_seqlens(k_lens),
             max_q=6, max_k=5, gen=gen)
    for kw in (dict(), dict(sinks=randn(2, gen=gen)), dict(lse_loss=True)):
        g = check_grads(b, torch.float32, window=(-1, 0), **kw)
        assert torch.all(g["dq"][:2] == 0) and torch.all(g["dq"][6:9] == 0)
        for name in ("dq", "dk", "dv"):
            assert torch.isfinite(g[name]).all(), name


def test_padded_buffers():
    """Rows past cu_seq_q[-1] and keys past cu_seq_k[-1] belong to no sequence: their gradients are
    exactly 0 (every buffer starts as NaN), the others equal the unpadded call's (bitwise in fast)."""
    b = make_batch(seed=42, n=3, max_q=9, max_k=14, h_q=4, h_kv=2, d=32)
    gen = make_generator(43)
    extra_q, extra_k = randn(5, 4, 32, gen=gen), randn(7, 2, 32, gen=gen)
    t_q, t_k = b["q"].shape[0], b["k"].shape[0]
    do = randn(t_q + 5, 4, 32, gen=gen)
    dlse = randn(4, t_q + 5, gen=gen)
    sinks = randn(4, gen=gen)

    def grads_of(mod, q, k, v):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        o, lse = mod.varlen_attn(*leaves[:3], b["cu_q"], b["cu_k"], b["max_q"], b["max_k"], window_size=(-1, 0),
                                 enable_gqa=True, sinks=leaves[3], return_aux=mod.AuxRequest(lse=True))
        rows = o.shape[0]
        loss = (o * do[:rows]).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * dlse[:, :rows]).sum()
        return torch.autograd.grad(loss, leaves)

    for mod in (ref, fast):
        expect = grads_of(mod, b["q"], b["k"], b["v"])
        with nan_allocations():
            got = grads_of(mod, torch.cat([b["q"], extra_q]), torch.cat([b["k"], extra_k]),
                           torch.cat([b["v"], 2 * extra_k]))
        for name, g, e, t in zip(("dq", "dk", "dv"), got, expect, (t_q, t_k, t_k)):
            assert torch.equal(g[:t], e) if mod is fast else torch.allclose(g[:t], e, rtol=1e-6, atol=1e-6), name
            assert torch.all(g[t:] == 0), f"{mod.__name__} {name}: padding rows got a gradient"
        torch.testing.assert_close(got[3], expect[3], rtol=1e-6, atol=1e-6)


# The interpreter evaluates both sides of a tl.where: inf - inf in the side a +inf sink never takes.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
def test_infinite_sinks():
    """Sinks of -inf (no sink) and +inf (all the mass: out 0, lse +inf) have the same gradients in
    fast and ref, finite everywhere: the -inf head's d sink is 0, and so is the +inf head's, whose
    rows' out and lse are constants."""
    gen = make_generator(45)
    q_lens, k_lens = [6, 3, 4], [4, 3, 6]
    b = dict(q=randn(sum(q_lens), 4, 16, gen=gen), k=randn(sum(k_lens), 2, 16, gen=gen),
             v=randn(sum(k_lens), 2, 16, gen=gen), cu_q=cu_seqlens(q_lens), cu_k=cu_seqlens(k_lens),
             max_q=6, max_k=6, gen=gen)
    sinks = torch.tensor([float("-inf"), float("inf"), 0.5, float("-inf")], device=DEVICE)
    g = check_grads(b, torch.float32, window=(-1, 0), sinks=sinks, lse_loss=True)
    for name in NAMES:
        assert torch.isfinite(g[name]).all(), name
    assert g["dsinks"][0] == 0 and g["dsinks"][1] == 0 and g["dsinks"][3] == 0


def test_empty_batch():
    gen = make_generator(29)
    for q_lens, k_lens in (([0, 0], [2, 3]), ([], [])):
        q = randn(sum(q_lens), 2, 16, gen=gen).requires_grad_()
        k, v = (randn(sum(k_lens), 2, 16, gen=gen).requires_grad_() for _ in range(2))
        o = fast.varlen_attn(q, k, v, cu_seqlens(q_lens), cu_seqlens(k_lens), 0, max(k_lens + [0]))
        dq, dk, dv = torch.autograd.grad(o.sum(), (q, k, v), allow_unused=True)
        assert dq.shape == q.shape and torch.all(dk == 0) and torch.all(dv == 0)


def test_backward_is_deterministic():
    b = make_batch(seed=30, n=3, max_q=20, max_k=24, h_q=6, h_kv=2, d=32)
    first = grads(fast, b, dtype=torch.float32, window=(-1, 0), sinks=randn(6, gen=b["gen"]))
    second = grads(fast, b, dtype=torch.float32, window=(-1, 0), sinks=first["dsinks"] * 0 + 0.25)
    again = grads(fast, b, dtype=torch.float32, window=(-1, 0), sinks=first["dsinks"] * 0 + 0.25)
    for name in NAMES:
        assert torch.equal(second[name], again[name]), name


# ----------------------------------------------------------------------------- rigor and contract

@pytest.mark.filterwarnings("ignore:Input #")   # gradcheck's "not double precision" warning: known, intended
def test_fast_gradcheck_fp32():
    """torch.autograd.gradcheck of the fast op in fp32 (its kernels take fp16 / bf16 / fp32), with
    finite-difference tolerances fp32 allows: q, k, v and sinks, causal with softcap, GQA 2."""
    b = make_batch(seed=31, n=2, max_q=5, max_k=7, h_q=2, h_kv=1, d=8)
    sinks = randn(2, gen=b["gen"])
    args = tuple(t.detach().clone().requires_grad_() for t in (b["q"], b["k"], b["v"], sinks))

    def f(q, k, v, s):
        o, lse = fast.varlen_attn(q, k, v, b["cu_q"], b["cu_k"], b["max_q"], b["max_k"], window_size=(-1, 0),
                                  enable_gqa=True, softcap=2.0, sinks=s, return_aux=fast.AuxRequest(lse=True))
        return o, torch.where(torch.isinf(lse), 0.0, lse)

    assert torch.autograd.gradcheck(f, args, eps=1e-2, atol=2e-3, rtol=2e-2, fast_mode=True)


def test_torch_compile_fullgraph_forward_backward():
    b = make_batch(seed=32, n=3, max_q=9, max_k=12, h_q=4, h_kv=2, d=32)
    sinks = randn(4, gen=b["gen"])

    def loss(q, k, v, s):
        o, lse = fast.varlen_attn(q, k, v, b["cu_q"], b["cu_k"], b["max_q"], b["max_k"], window_size=(-1, 0),
                                  enable_gqa=True, sinks=s, softcap=4.0, return_aux=fast.AuxRequest(lse=True))
        return (o * o).sum() + lse.sum()

    def run(fn):
        leaves = tuple(t.detach().clone().requires_grad_() for t in (b["q"], b["k"], b["v"], sinks))
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    expect = run(loss)
    torch._dynamo.reset()
    got = run(torch.compile(loss, fullgraph=True, backend="aot_eager"))
    for name, e, g in zip(NAMES, expect, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
def test_inference_only_paths_refuse_gradients(mod):
    """As in PyTorch: the paged path and varlen_attn_out are inference-only.  With grad they raise;
    under no_grad they run."""
    b = make_batch(seed=33, n=2, max_q=5, max_k=7, h_q=2, h_kv=2, d=16)
    k_pool, v_pool, table, used = paged_view(b, 4)
    q = b["q"].clone().requires_grad_()
    paged_args = (q, k_pool, v_pool, b["cu_q"], None, b["max_q"], b["max_k"])
    with pytest.raises(NotImplementedError, match="block_table"):
        mod.varlen_attn(*paged_args, block_table=table, seqused_k=used)
    with pytest.raises(NotImplementedError, match="varlen_attn_out"):
        mod.varlen_attn_out(torch.empty_like(q), q, b["k"], b["v"], b["cu_q"], b["cu_k"], b["max_q"], b["max_k"])
    with torch.no_grad():
        mod.varlen_attn(*paged_args, block_table=table, seqused_k=used)
        mod.varlen_attn_out(torch.empty_like(q), q, b["k"], b["v"], b["cu_q"], b["cu_k"], b["max_q"], b["max_k"])


def test_double_backward_raises():
    b = make_batch(seed=34, n=2, max_q=5, max_k=7, h_q=2, h_kv=2, d=16)
    q = b["q"].clone().requires_grad_()
    o = fast.varlen_attn(q, b["k"], b["v"], b["cu_q"], b["cu_k"], b["max_q"], b["max_k"])
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()


def test_strided_inputs_grads():
    """q, k, v that are slices of wider buffers (rows not 16-element aligned) take the padded path:
    the same gradients, bitwise, as contiguous inputs."""
    b = make_batch(seed=35, n=3, max_q=9, max_k=12, h_q=4, h_kv=2, d=32)
    expect = grads(fast, b, dtype=torch.float32, window=(-1, 0))
    wide = dict(b)
    for x in ("q", "k", "v"):
        wide[x] = torch.cat([b[x], b[x][..., :8]], dim=-1)[..., 5:37]           # rows 40 apart
        wide[x].copy_(b[x])
        assert wide[x].stride(1) % 16 != 0
    got = grads(fast, wide, dtype=torch.float32, window=(-1, 0))
    for name in ("dq", "dk", "dv"):
        assert torch.equal(got[name], expect[name]), name
