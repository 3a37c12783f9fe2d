"""Parity of paged varlen attention: ref vs an fp64 oracle, fast vs ref, and the contract.

Interpreter tier (no CUDA): small packed batches with empty sequences, fp32 and fp16, head
dims 60/64/100, GQA 1/3/8, page sizes 1/3/16, windows, softcap, sinks.  GPU tier: bf16,
sequences up to 8k, head dims 64/128/256, every autotune config.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fast.paged_varlen_attention as fast
import ref.paged_varlen_attention as ref
from conftest import (DEVICE, ON_GPU, build_page_pools, check_close, cu_seqlens, dtype_params, gpu_case,
                      make_generator, nan_like, randn, random_lengths, requires_gpu)


# ----------------------------------------------------------------------------- inputs

def make_batch(*, seed, n, max_q, max_k=None, h_q=4, h_kv=2, d=64, dtype=torch.float32, same_lengths=False,
               decode_like=False):
    """Packed q/k/v of ``n`` sequences (one empty when n >= 2), each k at least as long as its q."""
    gen = make_generator(seed)
    max_k = max_k or max_q
    q_lens = [max_q] * n if same_lengths else random_lengths(n, max_q, gen=gen)
    if decode_like:
        q_lens = [min(1, length) for length in q_lens]
    k_lens = [q + int(torch.randint(0, max_k - max_q + 1, (1,), generator=gen)) if not same_lengths else max_k
              for q in q_lens]
    q = randn(sum(q_lens), h_q, d, gen=gen, dtype=dtype)
    k = randn(sum(k_lens), h_kv, d, gen=gen, dtype=dtype)
    v = randn(sum(k_lens), h_kv, d, gen=gen, dtype=dtype)
    return dict(q=q, k=k, v=v, cu_q=cu_seqlens(q_lens), cu_k=cu_seqlens(k_lens), q_lens=q_lens, k_lens=k_lens,
                max_q=max(q_lens + [0]), max_k=max(k_lens + [0]), gen=gen)


def paged_view(b, page_size):
    """The same keys and values scattered into a shuffled, over-allocated page pool."""
    k_seqs = list(torch.split(b["k"], b["k_lens"]))
    v_seqs = list(torch.split(b["v"], b["k_lens"]))
    (k_pool, v_pool), table, used = build_page_pools([k_seqs, v_seqs], page_size, gen=b["gen"])
    return k_pool, v_pool, table, used


def run(mod, b, *, dtype=None, paged=None, window=(-1, -1), softcap=0.0, sinks=None, out=None, **extra):
    """Call ``mod.varlen_attn`` (or ``varlen_attn_out`` when out is given); returns (out, lse)."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    q = cast(b["q"])
    if paged is not None:
        k_pool, v_pool, table, used = paged
        k, v, cu_k, kw = cast(k_pool), cast(v_pool), None, dict(block_table=table, seqused_k=used)
    else:
        k, v, cu_k, kw = cast(b["k"]), cast(b["v"]), b["cu_k"], {}
    kw.update(extra)
    h_q, h_kv = q.shape[1], k.shape[-2]
    args = (q, k, v, b["cu_q"], cu_k, b["max_q"], b["max_k"])
    common = dict(return_aux=mod.AuxRequest(lse=True), window_size=window, enable_gqa=h_q != h_kv,
                  softcap=softcap, sinks=sinks, **kw)
    if out is not None:
        result = mod.varlen_attn_out(out, *args, **common)
        assert result[0] is out
        return result
    return mod.varlen_attn(*args, **common)


def check_fast_against_ref(b, dtype, *, paged_size=None, window=(-1, -1), softcap=0.0, with_sinks=False):
    paged = paged_view(b, paged_size) if paged_size else None
    sinks = randn(b["q"].shape[1], gen=b["gen"], dtype=torch.float32) if with_sinks else None
    o64, lse64 = run(ref, b, dtype=torch.float64, paged=paged, window=window, softcap=softcap,
                     sinks=None if sinks is None else sinks.double())
    o_low, lse_low = run(ref, b, dtype=dtype, paged=paged, window=window, softcap=softcap, sinks=sinks, upcast=False)
    out = nan_like(b["q"].to(dtype))
    o_fast, lse_fast = run(fast, b, dtype=dtype, paged=paged, window=window, softcap=softcap, sinks=sinks, out=out)
    check_close("out", o_fast, o64, o_low)
    check_close("lse", lse_fast, lse64, lse_low)
    return o_fast, lse_fast


# ----------------------------------------------------------------------------- the reference itself

@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 0), (2, 3)], ids=str)
@pytest.mark.parametrize("gqa", [1, 3])
def test_ref_matches_sdpa_per_sequence(window, gqa):
    """The reference against PyTorch SDPA with an explicit bottom-right mask, sequence by sequence."""
    b = make_batch(seed=1, n=3, max_q=9, max_k=13, h_q=3 * gqa, h_kv=3, d=16, dtype=torch.float64)
    o, lse = run(ref, b, window=window)
    left, right = window
    for i, (lq, lk) in enumerate(zip(b["q_lens"], b["k_lens"])):
        q = b["q"][b["cu_q"][i]:b["cu_q"][i + 1]].transpose(0, 1)                   # [H_q, L_q, D]
        k = b["k"][b["cu_k"][i]:b["cu_k"][i + 1]].repeat_interleave(gqa, 1).transpose(0, 1)
        v = b["v"][b["cu_k"][i]:b["cu_k"][i + 1]].repeat_interleave(gqa, 1).transpose(0, 1)
        row = torch.arange(lq)[:, None] + lk - lq
        col = torch.arange(lk)[None, :]
        mask = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            mask &= col >= row - left
        if right >= 0:
            mask &= col <= row + right
        seen = mask.any(1)
        expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(DEVICE)).transpose(0, 1)
        got = o[b["cu_q"][i]:b["cu_q"][i + 1]]
        torch.testing.assert_close(got[seen.to(DEVICE)], expect[seen.to(DEVICE)], rtol=1e-10, atol=1e-10)
        assert torch.all(got[~seen.to(DEVICE)] == 0)
        scores = torch.einsum("hqd,hkd->hqk", q, k) * q.shape[-1] ** -0.5
        expect_lse = scores.masked_fill(~mask.to(DEVICE), float("-inf")).logsumexp(-1)
        torch.testing.assert_close(lse[:, b["cu_q"][i]:b["cu_q"][i + 1]], expect_lse, rtol=1e-10, atol=1e-10)


def test_ref_softcap_and_sinks_by_hand():
    """softcap and sinks against the formulas written out on one sequence."""
    gen = make_generator(2)
    q, k, v = (randn(5, 2, 8, gen=gen, dtype=torch.float64, scale=3.0) for _ in range(3))
    sinks = randn(2, gen=gen, dtype=torch.float64)
    cu = cu_seqlens([5])
    o, lse = ref.varlen_attn(q, k, v, cu, cu, 5, 5, softcap=2.0, sinks=sinks, return_aux=ref.AuxRequest(lse=True))
    s = torch.einsum("qhd,khd->hqk", q, k) * 8 ** -0.5
    s = 2.0 * torch.tanh(s / 2.0)
    denom = s.exp().sum(-1) + sinks.exp()[:, None]                              # [H, L_q]
    expect = torch.einsum("hqk,khd->qhd", s.exp() / denom[..., None], v)
    torch.testing.assert_close(o, expect, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, denom.log(), rtol=1e-12, atol=1e-12)


def test_ref_autograd_gradcheck():
    """Autograd through the packed reference, the spec of the fast backward (fp64 gradcheck; the
    fast kernels take no fp64, test_paged_varlen_attention_backward.py ties them to this)."""
    b = make_batch(seed=3, n=3, max_q=4, max_k=6, h_q=2, h_kv=1, d=4, dtype=torch.float64)
    q, k, v = (b[x].clone().requires_grad_() for x in ("q", "k", "v"))

    def f(q, k, v):
        return ref.varlen_attn(q, k, v, b["cu_q"], b["cu_k"], b["max_q"], b["max_k"], window_size=(2, 0),
                               enable_gqa=True, softcap=1.5)

    assert torch.autograd.gradcheck(f, (q, k, v))


# ----------------------------------------------------------------------------- fast vs ref

CASES = [
    # id, batch kwargs, paged page size, window, softcap, sinks
    ("full", dict(n=4, max_q=21, max_k=30, h_q=2, h_kv=2, d=64), None, (-1, -1), 0.0, False),
    ("causal-gqa3", dict(n=4, max_q=23, max_k=23, h_q=6, h_kv=2, d=64), None, (-1, 0), 0.0, False),
    ("causal-gqa8-d60", dict(n=3, max_q=17, max_k=25, h_q=8, h_kv=1, d=60), None, (-1, 0), 0.0, False),
    ("window-d100", dict(n=3, max_q=20, max_k=34, h_q=2, h_kv=1, d=100), None, (5, 3), 0.0, False),
    ("left-only", dict(n=3, max_q=19, max_k=19, h_q=3, h_kv=3, d=32), None, (4, -1), 0.0, False),
    ("softcap-sinks", dict(n=3, max_q=18, max_k=26, h_q=4, h_kv=2, d=64), None, (-1, 0), 5.0, True),
    ("paged1", dict(n=3, max_q=15, max_k=22, h_q=4, h_kv=2, d=64), 1, (-1, 0), 0.0, False),
    ("paged3-gqa3", dict(n=4, max_q=16, max_k=29, h_q=6, h_kv=2, d=64), 3, (-1, -1), 0.0, False),
    ("paged16-window", dict(n=3, max_q=14, max_k=40, h_q=2, h_kv=1, d=64), 16, (7, 0), 0.0, True),
    ("decode-like-paged", dict(n=5, max_q=1, max_k=37, h_q=8, h_kv=2, d=64, decode_like=True), 16, (-1, 0), 0.0,
     False),
    ("odd-d37-staged", dict(n=3, max_q=11, max_k=15, h_q=2, h_kv=1, d=37), 5, (-1, 0), 0.0, False),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fast_matches_ref(case, dtype):
    _, batch, page, window, softcap, sinks = case
    b = make_batch(seed=hash(case[0]) % 1000, dtype=torch.float32, **batch)
    check_fast_against_ref(b, dtype, paged_size=page, window=window, softcap=softcap, with_sinks=sinks)


GPU_CASES = [
    gpu_case(dict(n=6, max_q=2048, h_q=32, h_kv=8, d=128), None, (-1, 0), id="causal-2k-gqa4-d128"),
    gpu_case(dict(n=3, max_q=8192, h_q=8, h_kv=8, d=64), None, (-1, 0), id="causal-8k-d64"),
    gpu_case(dict(n=4, max_q=1024, max_k=4096, h_q=16, h_kv=2, d=256), 16, (-1, 0), id="paged16-d256"),
    gpu_case(dict(n=8, max_q=1, max_k=8192, h_q=32, h_kv=8, d=128, decode_like=True), 16, (-1, 0),
             id="decode-8k-paged16"),
    gpu_case(dict(n=4, max_q=4096, h_q=16, h_kv=4, d=128), 3, (1024, 0), id="sliding-1k-paged3"),
    gpu_case(dict(n=4, max_q=1500, max_k=3000, h_q=12, h_kv=4, d=192), None, (-1, -1), id="full-d192"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("batch,page,window", GPU_CASES)
def test_fast_matches_ref_large(batch, page, window, dtype):
    b = make_batch(seed=11, dtype=torch.float32, **batch)
    check_fast_against_ref(b, dtype, paged_size=page, window=window)


def config_key(d, dtype):
    """The (GPU family, head-dim class, element size) key of the fast file's config tables."""
    return (fast._gpu_family(torch.cuda.current_device()), fast._block_d(d),
            torch.tensor([], dtype=dtype).element_size())


def launch_options(cfg):
    """A triton.Config as the keyword arguments the fast file's _FORCED_* hooks take."""
    return dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def force_tiles(monkeypatch, block_m, block_n):
    """Run every kernel (forward, dK/dV, dQ) with one tile shape: forced configs on a GPU, the
    interpreter's fixed blocks on CPU."""
    if ON_GPU:
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=2)
        monkeypatch.setattr(fast, "_FORCED_CONFIG", cfg)
        monkeypatch.setattr(fast, "_FORCED_BWD_CONFIGS", (cfg, cfg))
    else:
        monkeypatch.setattr(fast, "_INTERPRET_BLOCKS", dict(BLOCK_M=block_m, BLOCK_N=block_n))


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_autotune_config(d, dtype, monkeypatch):
    """Each config the autotuner may pick gives the right answer, not just the fastest one."""
    b = make_batch(seed=5, n=4, max_q=300, max_k=500, h_q=6, h_kv=2, d=d)
    for cfg in fast._TUNED[config_key(d, dtype)].configs:
        monkeypatch.setattr(fast, "_FORCED_CONFIG", launch_options(cfg))
        check_fast_against_ref(b, dtype, paged_size=16, window=(-1, 0))


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (64, 64)], ids=str)
def test_interpreter_tile_shapes(blocks, monkeypatch):
    """Other tile shapes move the tile/segment boundaries: same answer."""
    force_tiles(monkeypatch, *blocks)
    b = make_batch(seed=7, n=4, max_q=40, max_k=70, h_q=6, h_kv=2, d=32)
    check_fast_against_ref(b, torch.float32, window=(9, 2))
    check_fast_against_ref(b, torch.float32, paged_size=5, window=(-1, 0))


# ----------------------------------------------------------------------------- structure

def test_paged_equals_packed_bitwise():
    """The block table only changes where a key row is read from, never the arithmetic."""
    b = make_batch(seed=8, n=4, max_q=20, max_k=33, h_q=4, h_kv=2, d=64)
    o_packed, lse_packed = run(fast, b, window=(-1, 0))
    for page in (1, 3, 16):
        o_paged, lse_paged = run(fast, b, paged=paged_view(b, page), window=(-1, 0))
        assert torch.equal(o_paged, o_packed), f"page size {page}"
        assert torch.equal(lse_paged, lse_packed), f"page size {page}"


@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
def test_varlen_equals_each_sequence_alone(mod):
    b = make_batch(seed=9, n=4, max_q=19, max_k=27, h_q=6, h_kv=3, d=32)
    paged = paged_view(b, 4)
    o_all, lse_all = run(mod, b, window=(6, 0), paged=paged)
    k_pool, v_pool, table, used = paged
    for i, (lq, lk) in enumerate(zip(b["q_lens"], b["k_lens"])):
        q = b["q"][b["cu_q"][i]:b["cu_q"][i + 1]]
        cu = cu_seqlens([lq])
        o, lse = mod.varlen_attn(q, k_pool, v_pool, cu, None, lq, lk, window_size=(6, 0), enable_gqa=True,
                                 block_table=table[i:i + 1], seqused_k=used[i:i + 1],
                                 return_aux=mod.AuxRequest(lse=True))
        assert torch.equal(o, o_all[b["cu_q"][i]:b["cu_q"][i + 1]]), f"sequence {i}"
        assert torch.equal(lse, lse_all[:, b["cu_q"][i]:b["cu_q"][i + 1]]), f"sequence {i}"


@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
def test_rows_that_see_nothing(mod):
    """More queries than keys under a causal mask: the first rows see no key (out 0, lse -inf;
    with sinks, lse is the sink).  A sequence with no keys at all behaves the same."""
    gen = make_generator(10)
    q = randn(9, 2, 16, gen=gen)
    k, v = randn(4, 2, 16, gen=gen), randn(4, 2, 16, gen=gen)
    cu_q, cu_k = cu_seqlens([6, 3]), cu_seqlens([4, 0])
    o, lse = mod.varlen_attn(q, k, v, cu_q, cu_k, 6, 4, window_size=(-1, 0), return_aux=mod.AuxRequest(lse=True))
    assert torch.all(o[:2] == 0) and torch.all(torch.isneginf(lse[:, :2]))   # rows 0, 1 see j <= -2, -1
    assert torch.isfinite(o[2:6]).all() and torch.isfinite(lse[:, 2:6]).all()
    assert torch.all(o[6:] == 0) and torch.all(torch.isneginf(lse[:, 6:]))   # no keys at all
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    o, lse = mod.varlen_attn(q, k, v, cu_q, cu_k, 6, 4, window_size=(-1, 0), sinks=sinks,
                             return_aux=mod.AuxRequest(lse=True))
    assert torch.all(o[:2] == 0) and torch.all(o[6:] == 0)
    torch.testing.assert_close(lse[:, 6:], sinks[:, None].expand(2, 3))


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
def test_padded_buffers(mod, paged):
    """CUDA-graph serving pads its buffers: cu_seq_q[-1] < T_q and cu_seq_k[-1] < T_k are legal, as in
    PyTorch and FlashAttention.  The real rows equal the unpadded call bitwise; rows past cu_seq_q[-1]
    get out 0 and lse -inf, and varlen_attn_out leaves them as they were."""
    b = make_batch(seed=40, n=3, max_q=9, max_k=14, h_q=4, h_kv=2, d=32)
    pages = paged_view(b, 4) if paged else None
    expect, expect_lse = run(mod, b, window=(-1, 0), paged=pages)
    gen = make_generator(41)
    padded = dict(b, q=torch.cat([b["q"], randn(5, 4, 32, gen=gen)]), k=torch.cat([b["k"], randn(7, 2, 32, gen=gen)]),
                  v=torch.cat([b["v"], randn(7, 2, 32, gen=gen)]))
    t = b["q"].shape[0]
    o, lse = run(mod, padded, window=(-1, 0), paged=pages)
    assert torch.equal(o[:t], expect) and torch.equal(lse[:, :t], expect_lse)
    assert torch.all(o[t:] == 0) and torch.isneginf(lse[:, t:]).all()
    out = torch.full_like(padded["q"], 7.0)
    o, lse = run(mod, padded, window=(-1, 0), paged=pages, out=out)
    assert torch.equal(out[:t], expect) and torch.equal(lse[:, :t], expect_lse)
    assert torch.all(out[t:] == 7.0) and torch.isneginf(lse[:, t:]).all()
    # Every row padding (no sequence at all, or only empty ones).
    for cu in (cu_seqlens([]), cu_seqlens([0, 0])):
        out = torch.full_like(b["q"], 7.0)
        o, lse = mod.varlen_attn_out(out, b["q"], b["k"], b["v"], cu, cu, 0, 0, enable_gqa=True,
                                     return_aux=mod.AuxRequest(lse=True))
        assert torch.all(out == 7.0) and torch.isneginf(lse).all()
        assert torch.all(mod.varlen_attn(b["q"], b["k"], b["v"], cu, cu, 0, 0, enable_gqa=True) == 0)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
def test_nan_in_query_reaches_its_row(mod, with_sinks):
    """A NaN is never read as "no keys": one NaN in q makes that row of that head NaN in out and lse;
    every other element is exactly what the clean input gives."""
    b = make_batch(seed=43, n=3, max_q=9, max_k=14, h_q=4, h_kv=2, d=32, same_lengths=True)
    sinks = randn(4, gen=b["gen"]) if with_sinks else None
    clean, clean_lse = run(mod, b, window=(-1, 0), sinks=sinks)
    row, head = 13, 2
    b["q"] = b["q"].clone()
    b["q"][row, head, 5] = float("nan")
    o, lse = run(mod, b, window=(-1, 0), sinks=sinks)
    assert torch.isnan(o[row, head]).all() and torch.isnan(lse[head, row])
    o[row, head], lse[head, row], clean[row, head], clean_lse[head, row] = 0, 0, 0, 0
    assert torch.equal(o, clean) and torch.equal(lse, clean_lse)


# The interpreter evaluates both sides of a tl.where: inf - inf in the side a +inf sink never takes.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
def test_infinite_sinks(mod):
    """A sink of -inf is no sink (a row that sees no key: out 0, lse -inf, never NaN); a sink of +inf
    takes all the mass (out 0, lse +inf).  Rows 0-1 see no key under the causal mask."""
    gen = make_generator(44)
    q, k, v = randn(9, 4, 16, gen=gen), randn(7, 2, 16, gen=gen), randn(7, 2, 16, gen=gen)
    cu_q, cu_k = cu_seqlens([6, 3]), cu_seqlens([4, 3])
    sinks = torch.tensor([float("-inf"), float("inf"), 0.5, float("-inf")], device=DEVICE)
    kw = dict(window_size=(-1, 0), enable_gqa=True, return_aux=mod.AuxRequest(lse=True))
    plain, plain_lse = mod.varlen_attn(q, k, v, cu_q, cu_k, 6, 4, **kw)
    o, lse = mod.varlen_attn(q, k, v, cu_q, cu_k, 6, 4, sinks=sinks, **kw)
    for h in (0, 3):
        assert torch.equal(o[:, h], plain[:, h]) and torch.equal(lse[h], plain_lse[h])
    assert torch.isneginf(lse[0, :2]).all() and torch.all(o[:2] == 0)
    assert torch.all(o[:, 1] == 0) and torch.isposinf(lse[1]).all()
    o_ref, lse_ref = ref.varlen_attn(q.double(), k.double(), v.double(), cu_q, cu_k, 6, 4, sinks=sinks.double(), **kw)
    check_close("out", o, o_ref, None, atol=1e-5)
    check_close("lse", lse, lse_ref, None, atol=1e-5)


@requires_gpu
@pytest.mark.gpu
def test_padded_buffers_under_cuda_graph_capture():
    """Captured in a CUDA graph the offsets are never read on the host, so the padding kernel always
    runs: replaying with fewer real rows zeroes the rest (varlen_attn) or leaves them (out=)."""
    b = make_batch(seed=46, n=3, max_q=9, max_k=14, h_q=4, h_kv=2, d=64, dtype=torch.bfloat16)
    k_pool, v_pool, table, used = paged_view(b, 16)
    t = b["q"].shape[0]
    q = torch.cat([b["q"], torch.randn(7, 4, 64, device=DEVICE, dtype=torch.bfloat16)])
    cu_q = b["cu_q"].clone()
    kw = dict(window_size=(-1, 0), enable_gqa=True, block_table=table, seqused_k=used,
              return_aux=fast.AuxRequest(lse=True))
    expect, expect_lse = fast.varlen_attn(q, k_pool, v_pool, cu_q, None, b["max_q"], b["max_k"], **kw)
    out = torch.full_like(q, 7.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # warm-up: compiles and autotunes outside the capture
        fast.varlen_attn(q, k_pool, v_pool, cu_q, None, b["max_q"], b["max_k"], **kw)
        fast.varlen_attn_out(out, q, k_pool, v_pool, cu_q, None, b["max_q"], b["max_k"], **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = fast.varlen_attn(q, k_pool, v_pool, cu_q, None, b["max_q"], b["max_k"], **kw)
        _, lse_out = fast.varlen_attn_out(out, q, k_pool, v_pool, cu_q, None, b["max_q"], b["max_k"], **kw)
    out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, expect) and torch.equal(lse, expect_lse)
    assert torch.all(o[t:] == 0) and torch.isneginf(lse[:, t:]).all()
    assert torch.equal(out[:t], expect[:t]) and torch.all(out[t:] == 7.0) and torch.isneginf(lse_out[:, t:]).all()


def test_empty_batch_and_empty_queries():
    gen = make_generator(12)
    k, v = randn(5, 2, 16, gen=gen), randn(5, 2, 16, gen=gen)
    q = randn(0, 2, 16, gen=gen)
    for mod in (ref, fast):
        o, lse = mod.varlen_attn(q, k, v, cu_seqlens([0, 0]), cu_seqlens([2, 3]), 0, 3,
                                 return_aux=mod.AuxRequest(lse=True))
        assert o.shape == (0, 2, 16) and lse.shape == (2, 0)


def test_strided_inputs_and_out():
    """Non-contiguous q/k/v (a slice of a wider buffer) and an out with a non-unit last stride
    take the staging path and still match the contiguous call."""
    b = make_batch(seed=20, n=3, max_q=9, max_k=12, h_q=2, h_kv=2, d=16)
    expect, expect_lse = run(fast, b, window=(-1, 0))
    wide = {x: torch.cat([b[x], b[x]], dim=-1)[..., 3:19] for x in ("q", "k", "v")}
    for x in wide:
        wide[x].copy_(b[x])
    out = nan_like(torch.empty(b["q"].shape[0], 2, 32, device=DEVICE))[..., ::2]
    got, lse = fast.varlen_attn_out(out, wide["q"], wide["k"], wide["v"], b["cu_q"], b["cu_k"], b["max_q"],
                                    b["max_k"], window_size=(-1, 0), return_aux=fast.AuxRequest(lse=True))
    assert got is out
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=0)


def test_num_splits_does_not_change_the_result():
    b = make_batch(seed=13, n=3, max_q=12, max_k=20, h_q=2, h_kv=2, d=32)
    base = run(fast, b, window=(-1, 0))[0]
    for splits in (1, 2, 7):
        assert torch.equal(run(fast, b, window=(-1, 0), num_splits=splits)[0], base)


def test_returns_plain_output_without_aux():
    b = make_batch(seed=14, n=2, max_q=5, h_q=2, h_kv=2, d=16)
    for mod in (ref, fast):
        o = mod.varlen_attn(b["q"], b["k"], b["v"], b["cu_q"], b["cu_k"], b["max_q"], b["max_k"])
        assert isinstance(o, torch.Tensor) and o.shape == b["q"].shape
        out = nan_like(b["q"])
        assert mod.varlen_attn_out(out, b["q"], b["k"], b["v"], b["cu_q"], b["cu_k"], b["max_q"],
                                   b["max_k"]) is out
        torch.testing.assert_close(out, o)


def test_torch_compile_fullgraph():
    b = make_batch(seed=16, n=3, max_q=9, max_k=12, h_q=4, h_kv=2, d=32)
    paged = paged_view(b, 3)

    def attend(q, k, v, cu_q, table, used, out):
        o, lse = fast.varlen_attn(q, k, v, cu_q, None, b["max_q"], b["max_k"], window_size=(-1, 0), enable_gqa=True,
                                  block_table=table, seqused_k=used, return_aux=fast.AuxRequest(lse=True))
        fast.varlen_attn_out(out, q, k, v, cu_q, None, b["max_q"], b["max_k"], window_size=(-1, 0),
                             enable_gqa=True, block_table=table, seqused_k=used)
        return o * 2, lse

    args = (b["q"], paged[0], paged[1], b["cu_q"], paged[2], paged[3])
    out_eager, out_compiled = nan_like(b["q"]), nan_like(b["q"])
    expect = attend(*args, out_eager)
    torch._dynamo.reset()
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(*args, out_compiled)
    torch.testing.assert_close(got[0], expect[0])
    torch.testing.assert_close(got[1], expect[1])
    torch.testing.assert_close(out_compiled, out_eager)


# ----------------------------------------------------------------------------- bad input

def _bad_inputs():
    gen = make_generator(17)
    q, k, v = randn(6, 4, 16, gen=gen), randn(8, 2, 16, gen=gen), randn(8, 2, 16, gen=gen)
    cu_q, cu_k = cu_seqlens([2, 4]), cu_seqlens([3, 5])
    pool_k, pool_v = randn(5, 4, 2, 16, gen=gen), randn(5, 4, 2, 16, gen=gen)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    base = dict(args=(q, k, v, cu_q, cu_k, 4, 5), kw=dict(enable_gqa=True))
    paged = dict(args=(q, pool_k, pool_v, cu_q, None, 4, 5), kw=dict(enable_gqa=True, block_table=table,
                                                                     seqused_k=used))

    def with_(spec, i=None, value=None, **kw):
        args = list(spec["args"])
        if i is not None:
            args[i] = value
        return dict(args=tuple(args), kw={**spec["kw"], **kw})

    return [
        ("gqa-without-flag", with_(base, enable_gqa=False), ValueError, "enable_gqa"),
        ("heads-not-multiple", with_(with_(base, 1, randn(8, 3, 16, gen=gen)), 2, randn(8, 3, 16, gen=gen)),
         ValueError, "multiple"),
        ("table-without-seqused", with_(paged, seqused_k=None), ValueError, "seqused_k"),
        ("cu_q-not-int32", with_(base, 3, cu_q.long()), TypeError, "cu_seq_q"),
        ("cu_k-not-int32", with_(base, 4, cu_k.long()), TypeError, "cu_seq_k"),
        ("table-not-int32", with_(paged, block_table=table.long()), TypeError, "block_table"),
        ("seqused-not-int32", with_(paged, seqused_k=used.long()), TypeError, "seqused_k"),
        ("cu_q-last-past-T_q", with_(base, 3, cu_seqlens([2, 5])), ValueError, "cu_seq_q"),
        ("cu_k-last-past-T_k", with_(base, 4, cu_seqlens([3, 6])), ValueError, "cu_seq_k"),
        ("head-dim-mismatch", with_(with_(base, 1, randn(8, 2, 8, gen=gen)), 2, randn(8, 2, 8, gen=gen)),
         ValueError, "head dim"),
        ("seqused-beyond-pages", with_(paged, seqused_k=torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)),
         ValueError, "seqused_k"),
        ("page-outside-pool", with_(paged, block_table=torch.tensor([[0, 1], [2, 7]], dtype=torch.int32,
                                                                    device=DEVICE)), ValueError, "block_table"),
        ("max_q-too-small", with_(base, 5, 3), ValueError, "max_q"),
        ("max_q-bool", with_(base, 5, True), TypeError, "max_q"),
        ("max_k-float", with_(base, 6, 5.0), TypeError, "max_k"),
        ("window-bool", with_(base, window_size=(True, 0)), TypeError, "window_size"),
        ("window-float", with_(base, window_size=(2.0, 0)), TypeError, "window_size"),
        ("num_splits-bool", with_(base, num_splits=True), TypeError, "num_splits"),
        ("dtype-mismatch", with_(base, 1, k.half()), TypeError, "dtype"),
        ("cu_k-none-unpaged", with_(base, 4, None), ValueError, "cu_seq_k"),
        ("bad-window", with_(base, window_size=(-2, 0)), ValueError, "window_size"),
        ("bad-sinks-shape", with_(base, sinks=torch.zeros(3, device=DEVICE)), ValueError, "sinks"),
        ("negative-softcap", with_(base, softcap=-1.0), ValueError, "softcap"),
        ("mixed-devices", with_(base, 3, cu_q.to("meta")), ValueError, "device"),
        ("query-rank", with_(base, 0, q[None]), ValueError, "query"),
    ]


BAD = _bad_inputs()


@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises(mod, case):
    _, spec, exc, match = case
    with pytest.raises(exc, match=match):
        mod.varlen_attn(*spec["args"], **spec["kw"])


def test_ref_and_fast_share_the_input_checks():
    """The contract's checks are one piece of code held by both files (each file copies alone), so
    both raise the same error, message included, for the same bad input; fast adds only its own
    limits (_check_fast_limits)."""
    def sources(module):
        text = Path(module.__file__).read_text()
        return {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
                if isinstance(node, ast.FunctionDef)}

    ref_src, fast_src = sources(ref), sources(fast)
    for name in ("_check_meta", "_check_tensors", "_check_scalars", "_integer", "_check_values", "_offsets"):
        assert ref_src[name] == fast_src[name], f"{name} differs between ref/ and fast/"
    assert ref._SIZES == fast._SIZES


@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
def test_bad_out_raises(mod):
    b = make_batch(seed=18, n=2, max_q=5, h_q=2, h_kv=2, d=16)
    args = (b["q"], b["k"], b["v"], b["cu_q"], b["cu_k"], b["max_q"], b["max_k"])
    with pytest.raises(ValueError, match="out"):
        mod.varlen_attn_out(torch.empty(3, 2, 16, device=DEVICE), *args)
    with pytest.raises(ValueError, match="out"):
        mod.varlen_attn_out(torch.empty_like(b["q"], dtype=torch.float16), *args)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        mod.varlen_attn_out(None, *args)


class Index:
    """An integer that is not a Python int, like numpy's: it only implements ``__index__``."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


def integer_kinds():
    kinds = [Index]
    try:
        import numpy
        kinds += [numpy.int64, numpy.int32]
    except ImportError:   # numpy is not a dependency of the files; the protocol above is what they accept
        pass
    return kinds


@pytest.mark.parametrize("mod", [ref, fast], ids=["ref", "fast"])
def test_integral_arguments(mod):
    """window_size, max_q, max_k and num_splits take any integral number (numpy's too), not only int."""
    b = make_batch(seed=19, n=3, max_q=7, max_k=11, h_q=4, h_kv=2, d=16)
    expect = run(mod, b, window=(3, 0), num_splits=2)
    for kind in integer_kinds():
        args = (b["q"], b["k"], b["v"], b["cu_q"], b["cu_k"], kind(b["max_q"]), kind(b["max_k"]))
        got = mod.varlen_attn(*args, window_size=(kind(3), kind(0)), num_splits=kind(2), enable_gqa=True,
                              return_aux=mod.AuxRequest(lse=True))
        assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1]), kind


def test_fast_limits_raise():
    gen = make_generator(19)
    cu = cu_seqlens([3])
    q = randn(3, 1, 300, gen=gen)
    with pytest.raises(ValueError, match="256"):
        fast.varlen_attn(q, q, q, cu, cu, 3, 3)
    q = randn(3, 1, 16, gen=gen, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        fast.varlen_attn(q, q, q, cu, cu, 3, 3)


# ----------------------------------------------------------------------------- CPU tensors, no interpreter

def assert_cpu_calls_raise_clearly(fast_file: str, setup: str, calls: list[str], tmp_path: Path):
    """Copy ``fast/<fast_file>`` alone into ``tmp_path`` and, in a fresh Python without
    TRITON_INTERPRET (this test session sets it), run ``setup`` and then each expression of ``calls``
    on CPU tensors: each must raise a ValueError on the host that names the ways out (a CUDA tensor,
    TRITON_INTERPRET=1, the reference file), instead of dying inside Triton ("0 active drivers")."""
    shutil.copy(Path(__file__).resolve().parents[1] / "fast" / fast_file, tmp_path)
    probe = textwrap.dedent(setup) + textwrap.dedent(f"""
        for call in ({", ".join(f"lambda: {c}" for c in calls)},):
            try:
                call()
                print("no error")
            except ValueError as e:
                print(" ".join(str(e).split()))
        """)
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "TRITON_INTERPRET"}}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == len(calls), lines
    for line in lines:
        assert "CUDA" in line and "TRITON_INTERPRET=1" in line and "ref/" in line, line


def test_cpu_tensors_without_the_interpreter(tmp_path):
    """Both entry points, called on CPU tensors without TRITON_INTERPRET=1, raise a clear error."""
    assert_cpu_calls_raise_clearly("paged_varlen_attention.py", """
        import torch
        from paged_varlen_attention import varlen_attn, varlen_attn_out
        q = torch.randn(4, 2, 16)
        cu = torch.tensor([0, 4], dtype=torch.int32)
        """, ["varlen_attn(q, q, q, cu, cu, 4, 4)", "varlen_attn_out(torch.empty_like(q), q, q, q, cu, cu, 4, 4)"],
        tmp_path)
