"""Parity of fast/flash_decoding.py with ref/flash_decoding.py and with paged varlen attention.

1. The reference: flash_decode in fp64 equals ``ref.paged_varlen_attention.varlen_attn`` on the
   same cache (bottom-right causal, GQA, softcap, sinks, empty sequences), whatever num_splits.
2. fast vs ref: out and lse under the tolerance rule of CONTRIBUTING.md (``check_close`` against the fp64 reference,
   at most twice the error of the reference run in the test dtype) and against varlen_attn in
   fp64; paged caches from ``build_page_pools`` (shuffled, over-allocated pools, NaN in every
   unused slot, spare block-table columns pointing at random pages) and contiguous caches with
   NaN past seqused_k, so a read past the valid keys turns the output into NaN; num_splits in
   {1, 2, 7, auto} agree; outputs and the partial buffers are NaN-poisoned.  The split merge inside
   the decode kernel equals the merge kernel's bit for bit, whichever split's program merges, and the
   merging program's partial is never written.
3. k_new / v_new land in their slots and nothing else in the cache changes; num_splits=1 is
   batch-invariant (bitwise); batched == each sequence alone.
4. merge_attention_states: exact with an empty side, never NaN, associative, and merging the
   states of two halves of the keys equals attending to all of them.
5. choose_num_splits: the decisions on named shapes for an H100's 132 SMs.
6. The contract: bad input raises the same error in both files (and leaves the cache alone);
   torch.compile(fullgraph=True, backend="aot_eager") traces the ops, out= and k_new included.
Interpreter tier: fp32 / fp16, small shapes.  GPU tier: bf16, contexts up to 128k, B up to 256,
CUDA-graph capture (where the host value checks are skipped).
"""
from __future__ import annotations

import pytest
import torch

import fast.flash_decoding as fast
import ref.flash_decoding as ref
from conftest import (DEVICE, ON_GPU, build_page_pools, check_close, dtype_params, gpu_case, make_generator, poison_,
                      random_lengths, randn, requires_gpu)
from ref.paged_varlen_attention import AuxRequest, varlen_attn
from test_paged_varlen_attention import assert_cpu_calls_raise_clearly, integer_kinds

H100_SMS = 132


# ----------------------------------------------------------------------------- inputs

def build_case(*, batch, s_q, h_q, h_kv, d, page_size, max_len, seed, lengths=None):
    """fp64 inputs on DEVICE: q [B, S_q, H_q, D], a KV cache holding each sequence's keys (NaN in
    every slot past seqused_k), seqused_k, block_table (paged) or None, sinks [H_q].
    page_size None means a contiguous cache [B, S_max, H_kv, D] with a few spare slots."""
    gen = make_generator(seed)
    if lengths is None and batch == 1:
        lengths = [max_len]
    elif lengths is None:
        lengths = random_lengths(batch, max_len, gen=gen, min_len=s_q)   # one empty, one of max_len
    q = randn(batch, s_q, h_q, d, gen=gen, dtype=torch.float64, scale=1.5)
    keys = [randn(n, h_kv, d, gen=gen, dtype=torch.float64) for n in lengths]
    vals = [randn(n, h_kv, d, gen=gen, dtype=torch.float64) for n in lengths]
    if page_size is not None:
        (k_cache, v_cache), table, used = build_page_pools([keys, vals], page_size, gen=gen)
    else:
        s_max = max(lengths + [1]) + 3
        k_cache = torch.full((batch, s_max, h_kv, d), float("nan"), dtype=torch.float64, device=DEVICE)
        v_cache = torch.full_like(k_cache, float("nan"))
        for b, n in enumerate(lengths):
            k_cache[b, :n], v_cache[b, :n] = keys[b], vals[b]
        table, used = None, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    sinks = randn(h_q, gen=gen, dtype=torch.float64, scale=2.0)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, seqused_k=used, block_table=table, sinks=sinks,
                lengths=lengths)


def as_dtype(case, dtype):
    """The case's float tensors in ``dtype`` (index tensors unchanged)."""
    out = dict(case)
    for name in ("q", "k_cache", "v_cache", "sinks"):
        out[name] = case[name].to(dtype)
    return out


def run(module, case, *, out=None, **kw):
    """flash_decode of ``module`` on ``case``; returns (out, lse)."""
    return module.flash_decode(case["q"], case["k_cache"], case["v_cache"], case["seqused_k"],
                               block_table=case["block_table"], return_lse=True, out=out, **kw)


def run_fast(case, **kw):
    out = poison_(torch.empty_like(case["q"]))
    result, lse = run(fast, case, out=out, **kw)
    assert result is out
    return result, lse


def varlen_oracle(case, *, softcap=0.0, sinks=None, left=-1):
    """The same attention through ref/paged_varlen_attention.py: [B * S_q] packed query rows,
    bottom-right causal window (within ``left`` keys back, -1: all), the paged cache (or the contiguous
    cache as packed keys)."""
    q = case["q"]
    batch, s_q, h_q, d = q.shape
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * s_q
    max_k = max(case["lengths"] + [1])
    common = dict(window_size=(left, 0), enable_gqa=True, seqused_k=case["seqused_k"], softcap=softcap,
                  sinks=sinks, return_aux=AuxRequest(lse=True))
    if case["block_table"] is not None:
        out, lse = varlen_attn(q.reshape(batch * s_q, h_q, d), case["k_cache"], case["v_cache"], cu_q, None, s_q,
                               max_k, block_table=case["block_table"], **common)
    else:
        s_max = case["k_cache"].shape[1]
        cu_k = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * s_max
        out, lse = varlen_attn(q.reshape(batch * s_q, h_q, d), case["k_cache"].flatten(0, 1),
                               case["v_cache"].flatten(0, 1), cu_q, cu_k, s_q, s_max, **common)
    return out.reshape(batch, s_q, h_q, d), lse.reshape(h_q, batch, s_q).permute(1, 0, 2)


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that also asks NaN to sit in the same places."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


# ----------------------------------------------------------------------------- 1 + 2: values

# (id, page_size or None, H_q, H_kv, S_q, D, softcap, sinks, num_splits, batch, max_len)
CASES = [
    ("decode-page16-gqa8", 16, 8, 1, 1, 64, 0.0, False, None, 4, 150),
    ("verify-page3-gqa3-softcap", 3, 6, 2, 4, 60, 20.0, False, 2, 4, 90),
    ("page1-mha-sinks-7splits", 1, 2, 2, 2, 32, 0.0, True, 7, 3, 70),
    ("dense-gqa2-d100-all", None, 4, 2, 3, 100, 10.0, True, 1, 4, 80),
    ("dense-mha-d128-7splits", None, 2, 2, 1, 128, 0.0, False, 7, 3, 120),
    ("verify16-gqa8-2tiles", 16, 8, 1, 16, 32, 0.0, True, None, 2, 40),
    gpu_case("gpu-b1-128k-gqa8", 16, 32, 8, 1, 128, 0.0, False, None, 1, 131072, id="gpu-b1-128k-gqa8"),
    gpu_case("gpu-b4-32k-verify16", 16, 64, 8, 16, 128, 0.0, True, None, 4, 32768, id="gpu-b4-32k-verify16"),
    gpu_case("gpu-b256-4k-gqa4", 16, 32, 8, 1, 128, 0.0, False, None, 256, 4096, id="gpu-b256-4k-gqa4"),
    gpu_case("gpu-b16-8k-d256-page3", 3, 16, 2, 2, 256, 30.0, True, None, 16, 8192, id="gpu-b16-8k-d256-page3"),
    gpu_case("gpu-b8-16k-d64-page1", 1, 8, 8, 1, 64, 0.0, True, 7, 8, 16384, id="gpu-b8-16k-d64-page1"),
    gpu_case("gpu-b32-2k-dense-d100", None, 12, 4, 4, 100, 0.0, False, 2, 32, 2048, id="gpu-b32-2k-dense-d100"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name,page,h_q,h_kv,s_q,d,softcap,use_sinks,splits,batch,max_len", [
    pytest.param(*c, id=c[0]) if type(c) is tuple else c for c in CASES])
def test_matches_references(name, page, h_q, h_kv, s_q, d, softcap, use_sinks, splits, batch, max_len, dtype):
    case64 = build_case(batch=batch, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, page_size=page, max_len=max_len,
                        seed=sum(map(ord, name)))
    sinks64 = case64["sinks"] if use_sinks else None
    o64, lse64 = run(ref, case64, softcap=softcap, sinks=sinks64, num_splits=splits)
    o_var, lse_var = varlen_oracle(case64, softcap=softcap, sinks=sinks64)
    # The reference against an independent oracle: the varlen reference on the same cache.
    torch.testing.assert_close(o64, o_var, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse64, lse_var, atol=1e-10, rtol=0)

    case = as_dtype(case64, dtype)
    sinks = case["sinks"] if use_sinks else None
    o_low, lse_low = run(ref, case, softcap=softcap, sinks=sinks, num_splits=splits, upcast=False)
    o_fast, lse_fast = run_fast(case, softcap=softcap, sinks=sinks, num_splits=splits)
    assert o_fast.dtype == dtype and lse_fast.dtype == torch.float32
    assert lse_fast.shape == (batch, h_q, s_q)
    check_close(f"{name} out", o_fast, o64, o_low)
    check_close(f"{name} lse", lse_fast, lse64, lse_low)
    check_close(f"{name} out vs varlen", o_fast, o_var, o_low)


# (id, page_size or None, H_q, H_kv, S_q, D, softcap, sinks, num_splits, lengths, left, cache_leftpad or None)
WINDOW_CASES = [
    ("verify-page3-w5-softcap-sinks", 3, 6, 2, 4, 32, 20.0, True, 2, [17, 0, 9, 40], 5, None),
    ("decode-dense-w0-7splits", None, 4, 1, 1, 16, 0.0, False, 7, [30, 1, 12], 0, None),
    ("verify-page16-w20-leftpad-auto", 16, 8, 2, 5, 64, 0.0, True, None, [70, 5, 33], 20, [10, 0, 30]),
    ("verify-page4-wider-than-keys", 4, 4, 2, 3, 16, 0.0, False, 3, [6, 25], 40, None),
]


def window_oracle(case, left, leftpad, *, softcap, sinks):
    """Each row's attention written out (fp64): row i of sequence b, at position L - S_q + i, over the keys
    max(cache_leftpad, L - S_q + i - left) .. L - S_q + i, read from the cache key by key; out [B, S_q, H_q, D]
    and lse [B, H_q, S_q] (a row with no key: 0 and -inf; the sink as one more logit of value 0)."""
    q, kc, vc, table = case["q"], case["k_cache"], case["v_cache"], case["block_table"]
    batch, s_q, h_q, d = q.shape
    group = h_q // kc.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((batch, h_q, s_q), float("-inf"), dtype=q.dtype, device=q.device)
    for b, length in enumerate(case["lengths"]):
        slots = [(int(table[b, j // kc.shape[1]]), j % kc.shape[1]) if table is not None else (b, j)
                 for j in range(length)]
        for i in range(s_q):
            pos = length - s_q + i                                # (an empty sequence's rows: negative, no key)
            keys = range(max(leftpad[b] if leftpad else 0, pos - left, 0), pos + 1)
            for h in range(h_q):
                k = torch.stack([kc[slots[j][0], slots[j][1], h // group] for j in keys]) if keys else q.new_zeros(0, d)
                v = torch.stack([vc[slots[j][0], slots[j][1], h // group] for j in keys]) if keys else q.new_zeros(0, d)
                s = k @ q[b, i, h] * d ** -0.5
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                logits = torch.cat([s, sinks[h:h + 1]]) if sinks is not None else s
                if len(logits):
                    lse[b, h, i] = torch.logsumexp(logits, 0)
                    out[b, i, h] = torch.exp(s - lse[b, h, i]) @ v
    return out, lse


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name,page,h_q,h_kv,s_q,d,softcap,use_sinks,splits,lengths,left,leftpad",
                         [pytest.param(*c, id=c[0]) for c in WINDOW_CASES])
def test_sliding_window_matches_references(name, page, h_q, h_kv, s_q, d, softcap, use_sinks, splits, lengths, left,
                                           leftpad, dtype):
    """window_size=(left, 0): each row sees its own last left + 1 keys (a sliding layer's verification rows).
    The reference against a row-by-row oracle and against varlen_attn's window (the engine's prefill); fast
    against the reference; a window wider than every sequence is no window, bit for bit; at S_q = 1 the
    window is cache_leftpad = L - left - 1, bit for bit (the engine's decode and verification agree)."""
    case64 = build_case(batch=len(lengths), s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, page_size=page, max_len=max(lengths),
                        seed=sum(map(ord, name)), lengths=lengths)
    sinks64 = case64["sinks"] if use_sinks else None
    pad = torch.tensor(leftpad, dtype=torch.int32, device=DEVICE) if leftpad else None
    kw = dict(softcap=softcap, window_size=(left, 0), cache_leftpad=pad)
    o64, lse64 = run(ref, case64, sinks=sinks64, num_splits=splits, **kw)
    o_row, lse_row = window_oracle(case64, left, leftpad, softcap=softcap, sinks=sinks64)
    torch.testing.assert_close(o64, o_row, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse64, lse_row, atol=1e-10, rtol=0)
    if leftpad is None:
        o_var, lse_var = varlen_oracle(case64, softcap=softcap, sinks=sinks64, left=left)
        torch.testing.assert_close(o64, o_var, atol=1e-10, rtol=0)
        torch.testing.assert_close(lse64, lse_var, atol=1e-10, rtol=0)

    case = as_dtype(case64, dtype)
    sinks = case["sinks"] if use_sinks else None
    o_low, lse_low = run(ref, case, sinks=sinks, num_splits=splits, upcast=False, **kw)
    o_fast, lse_fast = run_fast(case, sinks=sinks, num_splits=splits, **kw)
    check_close(f"{name} out", o_fast, o64, o_low)
    check_close(f"{name} lse", lse_fast, lse64, lse_low)
    splits = splits or 2
    wide = run_fast(case, sinks=sinks, num_splits=splits, **{**kw, "window_size": (10_000, 0)})
    plain = run_fast(case, sinks=sinks, num_splits=splits, **{**kw, "window_size": (-1, -1)})
    assert all(nan_equal(a, b) for a, b in zip(wide, plain))
    if s_q == 1 and leftpad is None:
        first = (case["seqused_k"] - left - 1).clamp(min=0).to(torch.int32)
        as_leftpad = run_fast(case, sinks=sinks, num_splits=splits, softcap=softcap, cache_leftpad=first)
        windowed = run_fast(case, sinks=sinks, num_splits=splits, **kw)
        assert all(nan_equal(a, b) for a, b in zip(as_leftpad, windowed))


def test_window_reads_only_its_keys():
    """A window's sequence starts at row 0's first key: the launch issues the K/V of the left + S_q keys a
    sequence's rows can see (the interpreter's count of active lanes), not the whole cache, and the shape gate
    sizes its splits for those keys."""
    from observatory import observe
    left, s_q, h_kv, d, length = 20, 4, 2, 32, 400
    case = as_dtype(build_case(batch=2, s_q=s_q, h_q=4, h_kv=h_kv, d=d, page_size=16, max_len=length, seed=8,
                               lengths=[length, length - 37]), torch.float32)
    with observe() as windowed:
        run_fast(case, window_size=(left, 0))
    with observe() as plain:
        run_fast(case)
    (launch,) = [x for x in windowed.launches if x.kernel == "_decode_fwd_kernel"]
    kv = 2 * 2 * (left + s_q) * h_kv * d * 4                 # 2 sequences, K and V, fp32
    total = sum(x.issued_bytes for x in windowed.launches)
    everything = sum(x.issued_bytes for x in plain.launches)
    print(f"window {left}: issued {total} B (its keys' K/V {kv} B); no window {everything} B")
    assert kv < total < 1.5 * kv and everything > 8 * total
    assert launch.grid[1] <= -(-(left + s_q) // 16), launch.grid     # splits: at most a key block each


def test_empty_rows_and_sinks():
    """An empty sequence: out 0, lse -inf; with a sink, lse = sink (the sink counts once)."""
    case = as_dtype(build_case(batch=3, s_q=2, h_q=4, h_kv=2, d=32, page_size=5, max_len=24, seed=3,
                               lengths=[0, 24, 2]), torch.float32)
    for module in (ref, fast):
        out, lse = run(module, case, num_splits=3)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isneginf(lse[0]).all()
        out, lse = run(module, case, sinks=case["sinks"], num_splits=3)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(lse[0], case["sinks"][:, None].expand(4, 2).float(), atol=1e-6, rtol=0)
        # A sink only lowers the weights: lse with the sink = logaddexp(lse without, sink).
        _, lse_plain = run(module, case, num_splits=1)
        torch.testing.assert_close(lse[1:], torch.logaddexp(lse_plain[1:], case["sinks"][None, :, None].float()))
        # An empty batch: empty outputs, no launch.
        out, lse = module.flash_decode(case["q"][:0], case["k_cache"], case["v_cache"], case["seqused_k"][:0],
                                       block_table=case["block_table"][:0], return_lse=True)
        assert out.shape == (0, 2, 4, 32) and lse.shape == (0, 4, 2)


@pytest.mark.parametrize("page", [4, None], ids=["paged", "dense"])
@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.float16, torch.bfloat16))
def test_num_splits_agree(page, dtype):
    case64 = build_case(batch=3, s_q=2, h_q=6, h_kv=3, d=48, page_size=page, max_len=80, seed=11)
    o64, lse64 = run(ref, case64)
    case = as_dtype(case64, dtype)
    o_low, lse_low = run(ref, case, upcast=False)
    results = {}
    for splits in (1, 2, 7, None):
        results[splits] = run_fast(case, num_splits=splits)
        check_close(f"num_splits={splits} out", results[splits][0], o64, o_low)
        check_close(f"num_splits={splits} lse", results[splits][1], lse64, lse_low)
    # The ref's own split-and-merge agrees with its single pass.
    for splits in (2, 7):
        o_r, lse_r = run(ref, case64, num_splits=splits)
        torch.testing.assert_close(o_r, o64, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse_r, lse64, atol=1e-12, rtol=0)


def test_poisoned_partials(monkeypatch):
    """The partial buffers of a split launch (out in the input dtype, lse fp32) start as NaN: every slot
    the merge reads is written."""
    calls = []

    def poisoned(o_shape, lse_shape, dtype, device):
        calls.append((o_shape, lse_shape, dtype))
        return (torch.full(o_shape, float("nan"), dtype=dtype, device=device),
                torch.full(lse_shape, float("nan"), device=device))

    monkeypatch.setattr(fast, "_new_partials", poisoned)
    for dtype in (torch.float32, torch.float16):
        calls.clear()
        case64 = build_case(batch=4, s_q=3, h_q=4, h_kv=2, d=40, page_size=7, max_len=100 * blocks_of_16(40, dtype),
                            seed=5)               # (at least 5 key blocks: a split count is capped at the blocks)
        case = as_dtype(case64, dtype)
        o64, lse64 = run(ref, case64, sinks=case64["sinks"])
        o_low, lse_low = run(ref, case, sinks=case["sinks"], upcast=False)
        o_fast, lse_fast = run_fast(case, sinks=case["sinks"], num_splits=5)
        assert calls and calls[0][0][3] == 5 and calls[0][2] == dtype, "the split path did not run"
        check_close(f"poisoned partials out {dtype}", o_fast, o64, o_low)
        check_close(f"poisoned partials lse {dtype}", lse_fast, lse64, lse_low)


# The fused split merge (flash_decode's default): (id, page_size or None, H_q, H_kv, S_q, D, softcap, sinks,
# num_splits, lengths).  Lengths 0 and shorter than a split (fewer key blocks than splits leaves splits empty),
# GQA, MHA, speculative rows over two query tiles, sinks, softcap.  Lengths count 16-key blocks (the
# interpreter's); on a GPU, whose key blocks hold 16 to 128 keys by dtype and head dim, they are scaled
# to the same number of blocks (blocks_of_16).
FUSED_CASES = [
    ("page16-gqa4-auto", 16, 8, 2, 1, 64, 0.0, False, None, [150, 0, 77, 9]),
    ("page5-gqa2-sinks-3", 5, 4, 2, 2, 32, 0.0, True, 3, [40, 31, 0, 2]),
    ("page3-gqa3-softcap-7", 3, 6, 2, 4, 40, 20.0, True, 7, [90, 17, 4, 0]),
    ("dense-mha-d100-5", None, 2, 2, 3, 100, 0.0, True, 5, [80, 3, 0, 64]),
    ("dense-gqa8-2tiles-2", None, 8, 1, 4, 16, 0.0, True, 2, [33, 0, 6, 48]),
    ("page1-gqa4-9", 1, 4, 1, 1, 32, 0.0, True, 9, [200, 1, 0, 130]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name,page,h_q,h_kv,s_q,d,softcap,use_sinks,splits,lengths", FUSED_CASES,
                         ids=[c[0] for c in FUSED_CASES])
def test_fused_merge_is_the_merge_kernel(monkeypatch, name, page, h_q, h_kv, s_q, d, softcap, use_sinks, splits,
                                         lengths, dtype):
    """The split merge inside the decode kernel (the last program of each tile merges, its own state kept
    in registers) gives out and lse bit for bit equal to the separate _merge_splits_kernel launch, whichever
    program arrives last (``_SPLIT_ROTATE`` shifts the split each program computes, so that the interpreter,
    which runs programs in order, makes other splits' programs the merger); and agrees with the
    reference."""
    lengths = [n * blocks_of_16(d, dtype) for n in lengths]
    case = as_dtype(build_case(batch=len(lengths), s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, page_size=page,
                               max_len=max(lengths), seed=sum(map(ord, name)), lengths=lengths), dtype)
    kw = dict(softcap=softcap, sinks=case["sinks"] if use_sinks else None, num_splits=splits)
    fused = assert_fused_is_merge_kernel(monkeypatch, case, kw)
    case64 = as_dtype(case, torch.float64)
    o64, lse64 = run(ref, case64, softcap=softcap, sinks=case64["sinks"] if use_sinks else None)
    o_low, lse_low = run(ref, case, softcap=softcap, sinks=kw["sinks"], upcast=False)
    check_close(f"{name} out", fused[0], o64, o_low)
    check_close(f"{name} lse", fused[1], lse64, lse_low)


def test_fused_merge_with_cache_leftpad(monkeypatch):
    """The same with cache_leftpad (keys before it skipped): split shares follow the remaining keys."""
    x = blocks_of_16(32, torch.float16)
    case = as_dtype(build_case(batch=3, s_q=2, h_q=4, h_kv=2, d=32, page_size=8, max_len=90 * x, seed=33,
                               lengths=[90 * x, 41 * x, 0]), torch.float16)
    leftpad = torch.tensor([7 * x, 30 * x, 0], dtype=torch.int32, device=DEVICE)
    assert_fused_is_merge_kernel(monkeypatch, case, dict(sinks=case["sinks"], num_splits=4, cache_leftpad=leftpad))


def assert_fused_is_merge_kernel(monkeypatch, case, kw):
    """flash_decode(**kw) on ``case``: the fused merge's result, checked against the merge kernel's and
    against itself with other splits' programs merging (all of them up to 4 splits; else the first, a
    middle one, the last and the next-to-last); returns (out, lse)."""
    seen = []
    monkeypatch.setattr(fast, "_new_counters", lambda n, device: seen.append(torch.zeros(n, dtype=torch.int32,
                                                                                         device=device)) or seen[-1])
    fused = run_fast(case, **kw)
    assert seen, "the fused merge did not run"
    s = run_splits(monkeypatch, case, **kw)     # the launch's split count (at most the cache's key blocks)
    # Every program took a ticket (low 16 bits); all but the last counted themselves done (high bits).
    assert torch.equal(seen[0], torch.full_like(seen[0], ((s - 1) << 16) + s))
    monkeypatch.setattr(fast, "_FUSED_MERGE", False)                # (the shape gate's cap differs: pass s)
    two_kernels = run_fast(case, **dict(kw, num_splits=s))
    monkeypatch.setattr(fast, "_FUSED_MERGE", True)
    for name_, a, b in (("out", fused[0], two_kernels[0]), ("lse", fused[1], two_kernels[1])):
        assert nan_equal(a, b), f"{name_}: the fused merge differs from the merge kernel"
    for rotate in sorted({1, s // 2, s - 1} - {0}):   # the first, a middle and the next-to-last split merge
        monkeypatch.setattr(fast, "_SPLIT_ROTATE", rotate)
        other = run_fast(case, **kw)
        assert nan_equal(other[0], fused[0]) and nan_equal(other[1], fused[1]), \
            f"the result depends on which program merges (split {(s - 1 + rotate) % s} merged)"
    monkeypatch.setattr(fast, "_SPLIT_ROTATE", 0)
    return fused


def run_splits(monkeypatch, case, **kw) -> int:
    """The split count a launch on ``case`` runs: the split axis of the partials it asks for (1 when it
    asks for none)."""
    shapes, new_partials = [], fast._new_partials
    monkeypatch.setattr(fast, "_new_partials", lambda o, lse, *a: shapes.append(lse) or new_partials(o, lse, *a))
    run_fast(case, **kw)
    monkeypatch.setattr(fast, "_new_partials", new_partials)
    return shapes[0][-1] if shapes else 1


def blocks_of_16(d: int, dtype: torch.dtype) -> int:
    """How many 16-key blocks one of the decode kernel's key blocks holds at head dim ``d`` (1 under the
    interpreter): a test that needs n key blocks asks for 16 n times this many keys."""
    return fast._fwd_config(d, dtype, 1, False, 1, DEVICE)["BLOCK_N"] // 16


def test_fused_merge_stores_no_partial_of_its_own(monkeypatch):
    """With NaN-poisoned partial buffers, exactly one split per query row is never written: the merging
    program's, whose state stays in registers; the rows come out right all the same."""
    held = []

    def poisoned(o_shape, lse_shape, dtype, device):
        held.append((torch.full(o_shape, float("nan"), dtype=dtype, device=device),
                     torch.full(lse_shape, float("nan"), device=device)))
        return held[-1]

    monkeypatch.setattr(fast, "_new_partials", poisoned)
    x = blocks_of_16(32, torch.float32)
    case = as_dtype(build_case(batch=3, s_q=2, h_q=4, h_kv=2, d=32, page_size=8, max_len=90 * x, seed=31,
                               lengths=[90 * x, 40 * x, 0]), torch.float32)
    out, lse = run_fast(case, sinks=case["sinks"], num_splits=4)
    _, lse_part = held[0]                                       # [B, S_q, H_q, splits]
    assert lse_part.shape[-1] == 4
    assert torch.equal(torch.isnan(lse_part).sum(-1).cpu(), torch.ones(lse_part.shape[:-1], dtype=torch.int64))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def test_auto_splits_use_the_gate(monkeypatch):
    """num_splits=None asks choose_num_splits with the device's SM count (132 under the interpreter)."""
    seen, gate = [], fast.choose_num_splits

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return gate(*args, **kwargs)

    monkeypatch.setattr(fast, "choose_num_splits", spy)
    case = as_dtype(build_case(batch=2, s_q=1, h_q=4, h_kv=2, d=32, page_size=16, max_len=64, seed=2),
                    torch.float32)
    run_fast(case)
    assert len(seen) == 1
    args, kwargs = seen[0]
    capacity = case["block_table"].shape[1] * 16
    assert args == (2, 2, capacity)
    expected_sms = torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else H100_SMS
    assert kwargs["num_sms"] == expected_sms and kwargs["num_q_tiles"] == 1


# The interpreter's max over a row that is all NaN warns (numpy's nanmax); the row is NaN all the same.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_nan_in_query_reaches_its_row(module, splits):
    """A NaN is never read as "no keys", with or without splits: one NaN in q makes that row of that
    head NaN in out and lse; everything else is exactly what the clean input gives."""
    case = as_dtype(build_case(batch=3, s_q=2, h_q=4, h_kv=2, d=32, page_size=5, max_len=40, seed=27,
                               lengths=[40, 31, 17]), torch.float32)
    clean, clean_lse = run(module, case, sinks=case["sinks"], num_splits=splits)
    q = case["q"].clone()
    q[1, 1, 3, 7] = float("nan")
    out, lse = run(module, dict(case, q=q), sinks=case["sinks"], num_splits=splits)
    assert torch.isnan(out[1, 1, 3]).all() and torch.isnan(lse[1, 3, 1])
    out[1, 1, 3], lse[1, 3, 1], clean[1, 1, 3], clean_lse[1, 3, 1] = 0, 0, 0, 0
    assert torch.equal(out, clean) and torch.equal(lse, clean_lse)


# The interpreter evaluates both sides of a tl.where: inf - inf in the side a +inf sink never takes.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_infinite_sinks(module, splits):
    """A sink of -inf is no sink (an empty sequence: out 0, lse -inf); a sink of +inf takes all the mass
    (out 0, lse +inf); ref and fast agree."""
    case = as_dtype(build_case(batch=3, s_q=2, h_q=4, h_kv=2, d=32, page_size=5, max_len=40, seed=28,
                               lengths=[40, 0, 17]), torch.float32)
    sinks = torch.tensor([float("-inf"), float("inf"), 0.5, float("-inf")], device=DEVICE)
    plain, plain_lse = run(module, case, num_splits=splits)
    out, lse = run(module, case, sinks=sinks, num_splits=splits)
    for h in (0, 3):
        assert torch.equal(out[:, :, h], plain[:, :, h]) and torch.equal(lse[:, h], plain_lse[:, h])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1, [0, 3]]).all()
    assert torch.all(out[:, :, 1] == 0) and torch.isposinf(lse[:, 1]).all()
    o64, lse64 = run(ref, as_dtype(case, torch.float64), sinks=sinks.double())
    check_close("out", out, o64, None, atol=1e-5)
    check_close("lse", lse, lse64, None, atol=1e-5)


def test_integral_num_splits():
    case = as_dtype(build_case(batch=2, s_q=1, h_q=4, h_kv=2, d=16, page_size=4, max_len=30, seed=29),
                    torch.float32)
    for module in (ref, fast):
        expect = run(module, case, num_splits=2)
        for kind in integer_kinds():
            got = run(module, case, num_splits=kind(2))
            assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
        with pytest.raises(TypeError, match="num_splits"):
            run(module, case, num_splits=True)


def test_cpu_tensors_without_the_interpreter(tmp_path):
    """flash_decode and merge_attention_states, called on CPU tensors without TRITON_INTERPRET=1,
    raise a ValueError on the host that names the ways out, instead of dying inside Triton."""
    assert_cpu_calls_raise_clearly("flash_decoding.py", """
        import torch
        from flash_decoding import flash_decode, merge_attention_states
        q = torch.randn(2, 1, 4, 16)
        cache = torch.randn(2, 8, 2, 16)
        used = torch.tensor([8, 5], dtype=torch.int32)
        o, lse = torch.randn(2, 1, 4, 16), torch.randn(2, 4, 1)
        """, ["flash_decode(q, cache, cache, used)", "merge_attention_states(o, lse, o, lse)"], tmp_path)


# ----------------------------------------------------------------------------- 3: cache writes, invariance

@pytest.mark.parametrize("page", [3, None], ids=["paged", "dense"])
@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_k_new_written_in_place(module, page):
    s_q = 3
    full = as_dtype(build_case(batch=4, s_q=s_q, h_q=4, h_kv=2, d=24, page_size=page, max_len=50, seed=7),
                    torch.float32)
    gen = make_generator(8)
    k_new = randn(4, s_q, 2, 24, gen=gen)
    v_new = randn(4, s_q, 2, 24, gen=gen)
    # Where each new row goes; the empty sequence (length 0) takes none.
    slots = []
    for b, n in enumerate(full["lengths"]):
        for i in range(s_q if n else 0):
            pos = n - s_q + i
            if page is None:
                slots.append((b, i, b, pos))
            else:
                slots.append((b, i, int(full["block_table"][b, pos // page]), pos % page))
    # The cache before the call holds garbage (not NaN: a write of NaN would be invisible) there.
    before = dict(full, k_cache=full["k_cache"].clone(), v_cache=full["v_cache"].clone())
    expect_k, expect_v = full["k_cache"].clone(), full["v_cache"].clone()
    for b, i, p, s in slots:
        before["k_cache"][p, s] = 1e4
        before["v_cache"][p, s] = -1e4
        expect_k[p, s], expect_v[p, s] = k_new[b, i], v_new[b, i]
    out, lse = run(module, before, k_new=k_new, v_new=v_new, num_splits=2)
    assert nan_equal(before["k_cache"], expect_k), "k_cache differs from the expected writes"
    assert nan_equal(before["v_cache"], expect_v), "v_cache differs from the expected writes"
    o_ref, lse_ref = run(ref, dict(full, k_cache=expect_k, v_cache=expect_v), num_splits=1)
    torch.testing.assert_close(out, o_ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("page", [5, None], ids=["paged", "dense"])
def test_batch_invariance_one_split(page):
    """num_splits=1: a sequence's output is bitwise the same alone or inside any batch."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    big = as_dtype(build_case(batch=4, s_q=2, h_q=6, h_kv=2, d=32, page_size=page, max_len=80, seed=9), dtype)
    o_all, lse_all = run(fast, big, num_splits=1)
    o_auto, _ = run(fast, big)
    for b in range(4):
        alone = dict(big, q=big["q"][b:b + 1], seqused_k=big["seqused_k"][b:b + 1], lengths=big["lengths"][b:b + 1])
        if page is None:
            alone.update(k_cache=big["k_cache"][b:b + 1], v_cache=big["v_cache"][b:b + 1])
        else:
            alone.update(block_table=big["block_table"][b:b + 1])
        o_one, lse_one = run(fast, alone, num_splits=1)
        assert torch.equal(o_one[0], o_all[b]), f"sequence {b}: out differs alone vs in the batch"
        assert torch.equal(lse_one[0], lse_all[b]), f"sequence {b}: lse differs alone vs in the batch"
        # With the gate the split count may change with the batch: equal up to rounding.
        o_one_auto, _ = run(fast, alone)
        torch.testing.assert_close(o_one_auto[0], o_auto[b], atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------- 4: merge

def random_state(shape_o, *, gen, dtype, empty_rows=0.0):
    """out [..., T, H, D] in dtype and lse [..., H, T] fp32; a fraction of rows empty (lse -inf)."""
    o = randn(*shape_o, gen=gen, dtype=torch.float64)
    lse_shape = (*shape_o[:-3], shape_o[-2], shape_o[-3])
    lse = randn(*lse_shape, gen=gen, dtype=torch.float64, scale=3.0)
    if empty_rows:
        mask = torch.rand(lse_shape, generator=gen) < empty_rows
        lse[mask.to(lse.device)] = float("-inf")
    return o.to(dtype), lse.float()


@pytest.mark.parametrize("dtype", dtype_params())
def test_merge_matches_reference(dtype):
    gen = make_generator(21)
    oa, la = random_state((3, 5, 4, 40), gen=gen, dtype=dtype, empty_rows=0.2)
    ob, lb = random_state((3, 5, 4, 40), gen=gen, dtype=dtype, empty_rows=0.2)
    o64, l64 = ref.merge_attention_states(oa.double(), la.double(), ob.double(), lb.double())
    o_low, l_low = ref.merge_attention_states(oa, la, ob, lb, upcast=False)
    o_fast, l_fast = fast.merge_attention_states(oa, la, ob, lb)
    assert o_fast.dtype == dtype and l_fast.dtype == torch.float32
    check_close("merge out", o_fast, o64, o_low)
    check_close("merge lse", l_fast, l64, l_low)


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_merge_edge_cases(module):
    gen = make_generator(22)
    oa, la = random_state((2, 3, 4, 16), gen=gen, dtype=torch.float16)
    ob, lb = random_state((2, 3, 4, 16), gen=gen, dtype=torch.float16)
    empty_o = torch.full_like(ob, float("nan"))       # garbage beside lse = -inf must not leak
    empty_l = torch.full_like(lb, float("-inf"))
    # Exact with an empty side, on either side.
    o, lse = module.merge_attention_states(oa, la, empty_o, empty_l)
    assert torch.equal(o, oa) and torch.equal(lse, la)
    o, lse = module.merge_attention_states(empty_o, empty_l, ob, lb)
    assert torch.equal(o, ob) and torch.equal(lse, lb)
    # Two empty sides: out 0, lse -inf, no NaN.
    o, lse = module.merge_attention_states(empty_o, empty_l, empty_o.clone(), empty_l.clone())
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    # Varlen layout [T, H, D] / [H, T] works too.
    o, lse = module.merge_attention_states(oa[0], la[0], ob[0], lb[0])
    o2, lse2 = module.merge_attention_states(oa, la, ob, lb)
    assert torch.equal(o, o2[0]) and torch.equal(lse, lse2[0])


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_merge_associative_and_commutative(module):
    gen = make_generator(23)
    a, b, c = (random_state((2, 3, 5, 32), gen=gen, dtype=torch.float32, empty_rows=0.3) for _ in range(3))
    left = module.merge_attention_states(*module.merge_attention_states(*a, *b), *c)
    right = module.merge_attention_states(*a, *module.merge_attention_states(*b, *c))
    swapped = module.merge_attention_states(*b, *a)
    plain = module.merge_attention_states(*a, *b)
    for x, y in ((left, right), (swapped, plain)):
        torch.testing.assert_close(x[0], y[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(x[1], y[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_merge_of_halves_is_attention_over_all(module):
    """Cascade attention: the states over keys [0, a) and [a, L) merge into the state over [0, L)."""
    gen = make_generator(24)
    length, cut, h_q, h_kv, d = 90, 37, 4, 2, 32
    q = randn(2, 1, h_q, d, gen=gen)
    k = randn(2, length, h_kv, d, gen=gen)
    v = randn(2, length, h_kv, d, gen=gen)

    def attend(k_part, v_part):
        used = torch.full((2,), k_part.shape[1], dtype=torch.int32, device=DEVICE)
        return module.flash_decode(q, k_part.contiguous(), v_part.contiguous(), used, return_lse=True)

    whole = attend(k, v)
    merged = module.merge_attention_states(*attend(k[:, :cut], v[:, :cut]), *attend(k[:, cut:], v[:, cut:]))
    torch.testing.assert_close(merged[0], whole[0], atol=2e-6, rtol=0)
    torch.testing.assert_close(merged[1], whole[1], atol=2e-6, rtol=0)


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_merge_nan_and_infinite_lse(module):
    """A NaN lse makes the merged row NaN (it never reads as "no keys"); an lse of +inf, what PyTorch's
    CUDA varlen_attn (FlashAttention-2) writes for a row that sees no key, is an empty side."""
    gen = make_generator(26)
    oa, la = random_state((2, 3, 4, 16), gen=gen, dtype=torch.float32)
    ob, lb = random_state((2, 3, 4, 16), gen=gen, dtype=torch.float32)
    nan_l = la.clone()
    nan_l[0, 1, 2] = float("nan")
    for o, lse in (module.merge_attention_states(oa, nan_l, ob, lb), module.merge_attention_states(ob, lb, oa, nan_l)):
        assert torch.isnan(o[0, 2, 1]).all() and torch.isnan(lse[0, 1, 2])
        o[0, 2, 1], lse[0, 1, 2] = 0, 0
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    posinf = torch.full_like(lb, float("inf"))
    garbage = torch.full_like(ob, 1e30)
    o, lse = module.merge_attention_states(oa, la, garbage, posinf)
    assert torch.equal(o, oa) and torch.equal(lse, la)
    o, lse = module.merge_attention_states(garbage, posinf, garbage, posinf)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_merge_large_lse(module):
    """Outputs 1 and 2 with lse 1e8 on both sides merge to 1.5, lse 1e8 + log 2: the max is subtracted
    before exponentiating (log(exp(a) + exp(b)) rounds to a in fp32 there)."""
    o1, o2 = (torch.full((1, 2, 4), value, device=DEVICE) for value in (1.0, 2.0))
    for big in (1e8, -1e8, 3e38):
        lse = torch.full((2, 1), big, device=DEVICE)
        o, merged = module.merge_attention_states(o1, lse, o2, lse)
        assert torch.all(o == 1.5), (big, o)
        assert torch.equal(merged, (lse.double() + torch.log(torch.tensor(2.0, dtype=torch.float64))).float())


def test_merge_bad_inputs():
    gen = make_generator(25)
    oa, la = random_state((2, 3, 4, 16), gen=gen, dtype=torch.float32)
    for module in (ref, fast):
        with pytest.raises(ValueError, match="out_b must match"):
            module.merge_attention_states(oa, la, oa[:, :2], la)
        with pytest.raises(ValueError, match="lse_b must be"):
            module.merge_attention_states(oa, la, oa, la.transpose(-1, -2))
        with pytest.raises(TypeError, match="lse_a must be torch.float32"):
            module.merge_attention_states(oa, la.half(), oa, la)
        with pytest.raises(ValueError, match="out_a must be"):
            module.merge_attention_states(oa[0, 0], la[0, 0], oa[0, 0], la[0, 0])


# ----------------------------------------------------------------------------- 5: the shape gate

@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_choose_num_splits_named_shapes(module):
    gate = module.choose_num_splits
    # The benchmark's shapes: B in {1, 4, 16, 64, 256}, 8 KV heads (32/8 and 64/8 query heads give
    # 4 or 8 rows per KV head: one query tile), D = 128 (64-key blocks), H100 with 132 SMs.
    assert gate(1, 8, 131072, num_sms=H100_SMS) == 29     # 232 programs of 264 slots: 88% of a wave
    assert gate(1, 8, 32768, num_sms=H100_SMS) == 29
    assert gate(4, 8, 32768, num_sms=H100_SMS) == 7       # 224 programs: 85% of a wave
    assert gate(16, 8, 32768, num_sms=H100_SMS) == 2
    assert gate(64, 8, 32768, num_sms=H100_SMS) == 1      # 512 programs already fill the GPU
    assert gate(256, 8, 131072, num_sms=H100_SMS) == 1
    assert gate(256, 8, 1024, num_sms=H100_SMS) == 1
    # B = 1 with 1k keys (16 blocks): every block its own split, never more splits than blocks.
    assert gate(1, 8, 1024, num_sms=H100_SMS) == 16
    assert gate(1, 1, 100, num_sms=H100_SMS) == 2
    assert gate(1, 8, 64, num_sms=H100_SMS) == 1          # one block: nothing to split
    assert gate(0, 8, 4096, num_sms=H100_SMS) == 1        # an empty batch
    # Speculative verification with 16 rows x G = 8: two query tiles double the programs.
    assert gate(4, 8, 32768, num_sms=H100_SMS, num_q_tiles=2) == 4
    # One program per SM instead of two halves the wave.
    assert gate(16, 8, 32768, num_sms=H100_SMS, programs_per_sm=1) == 1
    for b in (1, 2, 3, 5, 8, 13, 33, 100, 257):
        for blocks in (1, 2, 3, 7, 16, 100, 2048):
            s = gate(b, 8, blocks * 64, num_sms=H100_SMS)
            assert 1 <= s <= blocks
            assert s == ref.choose_num_splits(b, 8, blocks * 64, num_sms=H100_SMS)
            if b * 8 >= 2 * H100_SMS:
                assert s == 1
    with pytest.raises(ValueError, match="num_sms"):
        gate(1, 8, 1024, num_sms=0)
    with pytest.raises(ValueError, match="batch"):
        gate(-1, 8, 1024, num_sms=H100_SMS)
    # Any integral number (numpy's too), never a bool.
    for kind in integer_kinds():
        assert gate(kind(4), kind(8), kind(32768), num_sms=kind(H100_SMS), block_n=kind(64)) == 7
    with pytest.raises(TypeError, match="batch"):
        gate(True, 8, 1024, num_sms=H100_SMS)
    with pytest.raises(TypeError, match="num_sms"):
        gate(4, 8, 1024, num_sms=132.0)


# ----------------------------------------------------------------------------- 6: the contract

def _bad_input_cases():
    """(id, mutate(kwargs) -> kwargs, exception, match)."""
    def with_(**changes):
        return lambda kw: {**kw, **changes}

    def bad_used(values):
        return lambda kw: {**kw, "seqused_k": torch.tensor(values, dtype=torch.int32, device=DEVICE)}

    def page_out_of_pool(kw):
        table = kw["block_table"].clone()
        table[1, 0] = kw["k_cache"].shape[0] + 5
        return {**kw, "block_table": table}

    return [
        ("q-rank", lambda kw: {**kw, "q": kw["q"][0]}, ValueError, r"q must be \[B, S_q, H_q, D\]"),
        ("cache-rank", lambda kw: {**kw, "k_cache": kw["k_cache"][0], "v_cache": kw["v_cache"][0]}, ValueError,
         "k_cache must be"),
        ("kv-shape", lambda kw: {**kw, "v_cache": kw["v_cache"][:-1]}, ValueError, "k_cache and v_cache"),
        ("heads", lambda kw: {**kw, "q": kw["q"][:, :, :3]}, ValueError, "multiple of the KV heads"),
        ("head-dim", lambda kw: {**kw, "q": kw["q"][..., :8]}, ValueError, "head dim mismatch"),
        ("dtype", lambda kw: {**kw, "q": kw["q"].half()}, TypeError, "share a dtype"),
        ("seqused-dtype", lambda kw: {**kw, "seqused_k": kw["seqused_k"].long()}, TypeError,
         "seqused_k must be int32"),
        ("table-dtype", lambda kw: {**kw, "block_table": kw["block_table"].long()}, TypeError,
         "block_table must be int32"),
        ("seqused-shape", lambda kw: {**kw, "seqused_k": kw["seqused_k"][:2]}, ValueError, r"seqused_k must be \[B="),
        ("beyond-capacity", bad_used([4, 10_000, 5]), ValueError, r"seqused_k\[1\] = 10000 is beyond"),
        ("negative", bad_used([4, -1, 5]), ValueError, r"seqused_k\[1\] = -1 is beyond"),
        ("shorter-than-s_q", bad_used([4, 1, 5]), ValueError, r"seqused_k\[1\] = 1 is smaller than S_q"),
        ("page-outside-pool", page_out_of_pool, ValueError, r"block_table\[1\] points at page"),
        ("k_new-alone", lambda kw: {**kw, "k_new": kw["q"][:, :, :2]}, ValueError, "k_new and v_new"),
        ("k_new-shape", lambda kw: {**kw, "k_new": kw["q"], "v_new": kw["q"]}, ValueError, "k_new must be"),
        ("sinks-shape", with_(sinks=torch.zeros(3, device=DEVICE)), ValueError, "sinks must be"),
        ("out-shape", lambda kw: {**kw, "out": kw["q"][:, :1].clone()}, ValueError, "out must be"),
        ("num_splits", with_(num_splits=0), ValueError, "num_splits"),
        ("softcap", with_(softcap=-1.0), ValueError, "softcap"),
        ("window-shape", with_(window_size=(4,)), ValueError, r"window_size must be \(left, right\)"),
        ("window-below", with_(window_size=(-2, 0)), ValueError, "window_size must be an integer >= -1"),
        ("window-float", with_(window_size=(4.0, 0)), TypeError, "window_size must be an integer"),
        ("window-right", with_(window_size=(4, 1)), ValueError, "causal, right must be -1 or 0"),
        ("window-invariant", with_(window_size=(4, 0), batch_invariant=True), NotImplementedError,
         "batch_invariant=True. takes no window_size"),
    ]


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
@pytest.mark.parametrize("cid,mutate,exc,match", [pytest.param(*c, id=c[0]) for c in _bad_input_cases()])
def test_bad_inputs_raise(module, cid, mutate, exc, match):
    case = as_dtype(build_case(batch=3, s_q=2, h_q=4, h_kv=2, d=16, page_size=4, max_len=20, seed=1,
                               lengths=[4, 20, 5]), torch.float32)
    kw = dict(q=case["q"], k_cache=case["k_cache"], v_cache=case["v_cache"], seqused_k=case["seqused_k"],
              block_table=case["block_table"])
    kw = mutate(kw)
    if cid in ("beyond-capacity", "shorter-than-s_q", "page-outside-pool"):
        # With new keys to write, a failing check must leave the cache untouched.
        kw.setdefault("k_new", torch.ones(3, 2, 2, 16, device=DEVICE))
        kw.setdefault("v_new", torch.ones(3, 2, 2, 16, device=DEVICE))
    k_before, v_before = kw["k_cache"].clone(), kw["v_cache"].clone()
    q, k_cache, v_cache, used = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"), kw.pop("seqused_k")
    with pytest.raises(exc, match=match):
        module.flash_decode(q, k_cache, v_cache, used, **kw)
    assert nan_equal(k_cache, k_before) and nan_equal(v_cache, v_before), "a rejected call wrote the cache"


def test_contiguous_cache_batch_mismatch():
    case = as_dtype(build_case(batch=3, s_q=1, h_q=2, h_kv=2, d=16, page_size=None, max_len=10, seed=1),
                    torch.float32)
    for module in (ref, fast):
        with pytest.raises(ValueError, match=r"k_cache must be \[B=2, S_max"):
            module.flash_decode(case["q"][:2], case["k_cache"], case["v_cache"], case["seqused_k"][:2])


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the ops: out= is written, k_new lands in the cache, merge runs."""
    case = as_dtype(build_case(batch=3, s_q=2, h_q=4, h_kv=2, d=32, page_size=8, max_len=40, seed=12),
                    torch.float32)
    gen = make_generator(13)
    k_new, v_new = randn(3, 2, 2, 32, gen=gen), randn(3, 2, 2, 32, gen=gen)

    def step(q, k_cache, v_cache, used, table, k_new, v_new, out):
        o, lse = fast.flash_decode(q, k_cache, v_cache, used, block_table=table, k_new=k_new, v_new=v_new,
                                   out=out, return_lse=True, num_splits=2)
        o2, lse2 = fast.merge_attention_states(o, lse, o, lse)
        return o2, lse2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    k_eager, v_eager = case["k_cache"].clone(), case["v_cache"].clone()
    out_eager = torch.empty_like(case["q"])
    expect = step(case["q"], k_eager, v_eager, case["seqused_k"], case["block_table"], k_new, v_new, out_eager)
    k_comp, v_comp = case["k_cache"].clone(), case["v_cache"].clone()
    out_comp = poison_(torch.empty_like(case["q"]))
    got = compiled(case["q"], k_comp, v_comp, case["seqused_k"], case["block_table"], k_new, v_new, out_comp)
    assert nan_equal(k_comp, k_eager) and nan_equal(v_comp, v_eager), "k_new did not land in the cache"
    assert not nan_equal(k_comp, case["k_cache"])
    assert torch.equal(out_comp, out_eager)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    # Merging a state with itself keeps out exactly and adds log 2 to lse.
    assert torch.equal(got[0], out_comp)
    _, lse = fast.flash_decode(case["q"], k_eager, v_eager, case["seqused_k"], block_table=case["block_table"],
                               return_lse=True, num_splits=2)
    torch.testing.assert_close(got[1], lse + torch.log(torch.tensor(2.0)))


# ----------------------------------------------------------------------------- GPU only

@requires_gpu
@pytest.mark.gpu
def test_cuda_graph_capture():
    """Captured in a CUDA graph (host value checks skipped), replay == eager; k_new writes replay too."""
    case = as_dtype(build_case(batch=8, s_q=2, h_q=32, h_kv=8, d=128, page_size=16, max_len=5000, seed=31,
                               lengths=[5000, 4000, 2, 300, 4999, 17, 1024, 64]), torch.bfloat16)
    gen = make_generator(32)
    k_new, v_new = randn(8, 2, 8, 128, gen=gen, dtype=torch.bfloat16), randn(8, 2, 8, 128, gen=gen,
                                                                          dtype=torch.bfloat16)
    k_eager, v_eager = case["k_cache"].clone(), case["v_cache"].clone()
    o_eager, lse_eager = fast.flash_decode(case["q"], k_eager, v_eager, case["seqused_k"],
                                           block_table=case["block_table"], k_new=k_new, v_new=v_new,
                                           return_lse=True)
    k_graph, v_graph = case["k_cache"].clone(), case["v_cache"].clone()
    out = torch.empty_like(case["q"])
    # Warm up (compiles the kernels) on a side stream, then capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fast.flash_decode(case["q"], k_graph, v_graph, case["seqused_k"], block_table=case["block_table"],
                          k_new=k_new, v_new=v_new, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = fast.flash_decode(case["q"], k_graph, v_graph, case["seqused_k"], block_table=case["block_table"],
                                   k_new=k_new, v_new=v_new, out=out, return_lse=True)
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o_eager) and torch.equal(lse, lse_eager)
    assert nan_equal(k_graph, k_eager) and nan_equal(v_graph, v_eager)
