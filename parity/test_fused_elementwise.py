"""fast/decoder_lm.py's fused elementwise kernels (the default mode's decode step on a GPU: the residual add and
RMSNorm, a head's q/k norm and rotary embedding, SwiGLU, one kernel each), under the Triton interpreter: each
equals the torch expressions it replaces (``_rms_norm``, ``_rotate``, ``_silu``) to fp32 rounding (fp16: its
rounding) on odd widths, strided views, partial rotary, zero-centred norms and empty inputs; and the whole
model's forward and an engine's completions are the same with them as without (``FUSED_KERNELS="always"``
runs them on CPU tensors).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import fast.decoder_lm as lm
import fast.generator_engine as ge
from conftest import INTERPRET

pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs Triton's interpreter")]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,zero", [(200, False), (64, True), (1024, False)])
def test_add_rms_norm(dtype, n, zero):
    gen = torch.Generator().manual_seed(n)
    x, delta = (torch.randn(7, n, generator=gen).to(DEV, dtype) for _ in range(2))
    w = (torch.randn(n, generator=gen) * 0.1 + (0 if zero else 1)).to(DEV, dtype)
    h, y = lm.fused_add_rms_norm(x, delta, w, 1e-6, zero)
    assert torch.equal(h, x + delta)                             # the add rounds as torch's
    torch.testing.assert_close(y, lm._rms_norm(x + delta, w, 1e-6, False, zero), **TOL[dtype])
    same, y0 = lm.fused_add_rms_norm(x, None, w, 1e-6, zero)     # no residual: the norm of x
    assert same is x
    torch.testing.assert_close(y0, lm._rms_norm(x, w, 1e-6, False, zero), **TOL[dtype])
    h, y = lm.fused_add_rms_norm(x[:0], delta[:0], w, 1e-6, zero)
    assert h.shape == y.shape == (0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,rotary,norm,zero", [(16, 16, True, False), (32, 8, True, True), (16, 16, False, False)])
def test_norm_rope(dtype, d, rotary, norm, zero):
    """On a view of a fused qkv product (unit stride in D, token stride past the heads): the head norm, then
    the rotary embedding on the first ``rotary`` dims, the rest as normed."""
    gen = torch.Generator().manual_seed(d + rotary)
    t, heads = 5, 3
    qkv = torch.randn(t, heads * d * 2 + 7, generator=gen).to(DEV, dtype)
    x = qkv[:, 3:3 + heads * d].view(t, heads, d)                 # (a view: strides (2 H D + 7, D, 1))
    angles = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(rotary // 2, generator=gen)[None]
    cos, sin = angles.cos()[:, None].to(DEV), angles.sin()[:, None].to(DEV)      # [T, 1, R/2]
    w = (torch.randn(d, generator=gen) * 0.1 + (0 if zero else 1)).to(DEV, dtype)
    got = lm.fused_norm_rope(x, w if norm else None, 1e-6, cos, sin, zero)
    want = lm._rotate(lm._rms_norm(x, w, 1e-6, False, zero) if norm else x, cos, sin)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert lm.fused_norm_rope(x[:0], w, 1e-6, cos[:0], sin[:0]).shape == (0, heads, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm,zero", [(True, False), (True, True), (False, False)])
def test_qk_norm_rope_is_two_launches_in_one(dtype, norm, zero):
    """q's and k's heads side by side in a qkv product, each with its own norm weight: one launch gives each the
    bits of its own ``fused_norm_rope`` (partial rotary, a view with a token stride past the heads)."""
    gen = torch.Generator().manual_seed(7)
    t, h_q, h_kv, d, rotary = 5, 4, 2, 16, 8
    qkv = torch.randn(t, (h_q + 2 * h_kv) * d, generator=gen).to(DEV, dtype)
    q, k, _ = qkv.split([h_q * d, h_kv * d, h_kv * d], dim=-1)
    q, k = q.view(t, h_q, d), k.view(t, h_kv, d)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(rotary // 2, generator=gen)[None]
    cos, sin = angles.cos()[:, None].to(DEV), angles.sin()[:, None].to(DEV)
    wq, wk = ((torch.randn(d, generator=gen) * 0.1 + (0 if zero else 1)).to(DEV, dtype) for _ in range(2))
    norms = None
    if norm:
        norms = SimpleNamespace(q_norm=SimpleNamespace(weight=wq, eps=1e-6, zero_centered=zero),
                                k_norm=SimpleNamespace(weight=wk, eps=1e-6, zero_centered=zero))
    assert lm._side_by_side(q, k, norms) and not lm._side_by_side(k, q, norms)
    got_q, got_k = lm._norm_rotate_qk(q, k, norms, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, lm.fused_norm_rope(q, wq if norm else None, 1e-6 if norm else 0.0, cos, sin, zero))
    assert torch.equal(got_k, lm.fused_norm_rope(k, wk if norm else None, 1e-6 if norm else 0.0, cos, sin, zero))
    # one token, one KV head (a decode step of a model with H_kv = 1): views of size-1 dims carry any stride
    q1, k1, _ = qkv[:1, :(h_q + 2) * d].split([h_q * d, d, d], dim=-1)
    q1, k1 = q1.view(1, h_q, d), k1.view(1, 1, d)
    assert lm._side_by_side(q1, k1, norms)
    got_q, got_k = lm._norm_rotate_qk(q1, k1, norms, cos[:1], sin[:1])
    assert torch.equal(got_q, lm.fused_norm_rope(q1, wq if norm else None, 1e-6 if norm else 0.0, cos[:1], sin[:1],
                                                 zero))
    assert torch.equal(got_k, lm.fused_norm_rope(k1, wk if norm else None, 1e-6 if norm else 0.0, cos[:1], sin[:1],
                                                 zero))
    if norm:                                              # norms that differ in eps: not one kernel
        norms.k_norm.eps = 1e-5
        assert not lm._side_by_side(q, k, norms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(6, 2 * 1500, generator=gen) * 3).to(DEV, dtype)      # more columns than a block
    gate, up = gate_up.split(1500, dim=-1)
    torch.testing.assert_close(lm.fused_swiglu(gate, up), F.silu(gate) * up, **TOL[dtype])
    assert lm.fused_swiglu(gate[:0], up[:0]).shape == (0, 1500)


def test_the_model_and_engine_are_the_same_fused(monkeypatch):
    """A Qwen3.5-style model (q/k norms, zero-centred norms, partial rotary, the attention gate, o_proj bias off:
    q's and k's norms and rotary in a launch each), a Qwen2-style one (q/k/v biases, no head norms) and a
    Qwen3-style one (head norms, no gate: q's and k's heads in one launch): the packed forward's logits to fp32
    rounding, an engine's greedy tokens equal, with the kernels (on CPU tensors) and without; the
    batch-invariant mode never takes them."""
    both = {"fused_add_rms_norm", "fused_qk_norm_rope", "fused_swiglu"}
    configs = [(lm.ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=16, qk_norm=True, zero_centered_norm=True,
                               partial_rotary_factor=0.5, attn_output_gate=True, max_seq_len=64),
                {"fused_add_rms_norm", "fused_norm_rope", "fused_swiglu"}),
               (lm.ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=12, qkv_bias=True, max_seq_len=64), both),
               (lm.ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
                               num_kv_heads=2, head_dim=8, qk_norm=True, max_seq_len=64), both)]
    for config, kernels in configs:
        model = lm.DecoderLM(config, seed=4, device=DEV)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_((0.05 * torch.randn(p.shape, generator=gen)).to(p.device))
        ids = torch.randint(0, 96, (2, 11), generator=gen).to(DEV)
        reqs = [ge.Request([5, 7, 9, 11, 2], ge.SamplingParams(max_new_tokens=8)),
                ge.Request([1, 2, 3], ge.SamplingParams(max_new_tokens=8))]
        runs = {}
        for fused in (False, "always"):
            monkeypatch.setattr(lm, "FUSED_KERNELS", fused)
            calls = []
            for name in ("fused_add_rms_norm", "fused_norm_rope", "fused_qk_norm_rope", "fused_swiglu"):
                original = getattr(lm, name)
                monkeypatch.setattr(lm, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
            with torch.no_grad():
                logits = model(ids)
            with ge.Generator(model, page_size=4) as engine:
                tokens = [c.token_ids for c in engine.generate(reqs)]
            runs[fused] = (logits, tokens, set(calls))
        assert runs[False][2] == set() and runs["always"][2] == kernels, runs["always"][2]
        torch.testing.assert_close(runs["always"][0], runs[False][0], rtol=1e-5, atol=1e-5)
        assert runs["always"][1] == runs[False][1]
    monkeypatch.setattr(lm, "FUSED_KERNELS", "always")
    x = torch.zeros(2, 2, device=DEV)
    assert not lm._fused(x, invariant=True)                   # the mode keeps its own numerics
    with torch.no_grad():
        assert lm._fused(x, invariant=False)
    assert not lm._fused(x, invariant=False)                  # training: torch's ops (they have a backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
def test_the_kv_append_rides_the_qk_launch(dtype, norm):
    """``fused_qk_norm_rope`` with a KV pool (a decode step's append in the same launch): q as without it, token
    t's k rows at k_cache[slots[t]] equal to the k it would return, its v rows copied to v_cache[slots[t]], every
    other slot untouched (NaN-poisoned pools: a stray write or read shows); the arguments checked."""
    gen = torch.Generator().manual_seed(11)
    t, h_q, h_kv, d, rotary, n_slots = 5, 6, 2, 16, 8, 13
    qkv = torch.randn(t, (h_q + 2 * h_kv) * d, generator=gen).to(DEV, dtype)
    q, k, v = qkv.split([h_q * d, h_kv * d, h_kv * d], dim=-1)
    q, k, v = q.view(t, h_q, d), k.view(t, h_kv, d), v.view(t, h_kv, d)
    angles = torch.arange(3, 3 + t, dtype=torch.float32)[:, None] * torch.rand(rotary // 2, generator=gen)[None]
    cos, sin = angles.cos()[:, None].to(DEV), angles.sin()[:, None].to(DEV)
    wq, wk = ((torch.randn(d, generator=gen) * 0.1 + 1).to(DEV, dtype) for _ in range(2))
    norms = None if not norm else SimpleNamespace(q_norm=SimpleNamespace(weight=wq, eps=1e-6, zero_centered=False),
                                                  k_norm=SimpleNamespace(weight=wk, eps=1e-6, zero_centered=False))
    want_q, want_k = lm._norm_rotate_qk(q, k, norms, cos, sin)
    k_cache = torch.full((n_slots, h_kv, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor([9, 0, 12, 4, 7], device=DEV)               # out of order, the first and last slot
    got_q, got_k = lm._norm_rotate_qk(q, k, norms, cos, sin, v, (k_cache, v_cache, slots))
    assert got_k is None and torch.equal(got_q, want_q)
    assert torch.equal(k_cache[slots], want_k) and torch.equal(v_cache[slots], v)
    rest = torch.ones(n_slots, dtype=torch.bool)
    rest[slots.cpu()] = False
    assert k_cache[rest.to(DEV)].isnan().all() and v_cache[rest.to(DEV)].isnan().all()
    qk = q.as_strided((t, h_q + h_kv, d), (qkv.stride(0), d, 1))
    call = dict(v=v, k_cache=k_cache, v_cache=v_cache, slots=slots)
    bad = [dict(call, v=None), dict(call, slots=None), dict(call, k_cache=k_cache.to(torch.float64)),
           dict(call, v_cache=v_cache[:, :1]), dict(call, k_cache=k_cache.transpose(0, 1).contiguous().transpose(0, 1)),
           dict(call, slots=slots.int()), dict(call, slots=slots[:4]), dict(call, v=v[:, :, :8])]
    for kwargs in bad:
        with pytest.raises(ValueError):
            lm.fused_qk_norm_rope(qk, h_q, None, None, 0.0, cos, sin, **kwargs)


def recording(fn, calls: list, name: str):
    """``fn`` (an attention plug-in), recording (name, whether it was given k_new) per call; the signature kept
    (the engine reads it: ``window_size``, ``capturable``)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        calls.append((name, kwargs.get("k_new") is not None))
        return fn(*args, **kwargs)
    return call


def test_engine_steps_append_kv_in_the_qk_launch(monkeypatch):
    """An engine over this repo's flash_decode and cascade_decode (the interpreter), a Qwen3-style model with an
    MTP head (head norms, no gate: q's and k's heads in one launch): with the fused kernels the model writes
    each step's new K / V into the pool itself (``kv_slots``), for every layer and the head's, and no decode,
    cascade or draft call appends; without them the decode steps' calls append.  Eagerly and through the static
    step (uncompiled: the code a CUDA graph captures), greedy and sampled, a group (cascade), MTP drafts
    verified: the same tokens, logprobs to the fused norms' rounding, and the KV pools the same at the end
    (every slot, the head's and the padding's too)."""
    from fast.flash_decoding import cascade_decode, flash_decode
    config = lm.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, qk_norm=True, max_seq_len=64, mtp_layers=1,
                            tie_embeddings=False)
    model = lm.DecoderLM(config, seed=2, device=DEV, mtp=True)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_((0.05 * torch.randn(p.shape, generator=gen)).to(p.device))
    sp = ge.SamplingParams
    reqs = [ge.Request([3, 1, 4, 1, 5, 9, 2], sp(max_new_tokens=6)),           # (alone after the group's end)
            ge.Request([2, 7, 1, 8], sp(max_new_tokens=3, temperature=1.0, seed=4, n=2))]
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    destination = lm._kv_destination
    runs = {}
    for fused in (False, "always"):
        monkeypatch.setattr(lm, "FUSED_KERNELS", fused)
        static = dict(compile=True, capture_sizes=(4,))
        for knobs in ({}, static, dict(static, speculative="mtp", num_speculative_tokens=2)):
            calls, written = [], set()
            monkeypatch.setattr(lm, "_kv_destination", lambda attend, i, k: written.add(i) or destination(attend, i, k))
            plug = dict(flash_decode=recording(flash_decode, calls, "decode"),
                        cascade_decode=recording(cascade_decode, calls, "cascade"))
            with ge.Generator(model, page_size=4, **plug, **knobs) as engine:
                done = [c for d in engine.generate(reqs) for c in (d if isinstance(d, list) else [d])]
                stats, pools = engine.stats(), (engine.runner.pools.k.clone(), engine.runner.pools.v.clone())
            if knobs.get("compile"):
                assert stats["static_decode_steps"] > 0 and stats["static_cascade_steps"] > 0, stats
            if "speculative" in knobs:
                assert stats["draft_tokens"] > 0 and stats["static_draft_steps" if "compile" in knobs else
                                                          "draft_tokens"] > 0, stats
            assert {name for name, _ in calls} >= {"decode", "cascade"}, calls
            assert any(appended for _, appended in calls) == (not fused), (fused, knobs, calls)
            assert written == ({0, 1, 2} if fused and "speculative" in knobs else {0, 1} if fused else set())
            runs[fused, tuple(knobs)] = done, pools
    first = runs[False, ()][0]
    for (_, knobs), (done, pools) in runs.items():
        for a, b in zip(first, done, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)
        for got, want in zip(pools, runs[False, knobs][1]):
            torch.testing.assert_close(got, want, equal_nan=True)
