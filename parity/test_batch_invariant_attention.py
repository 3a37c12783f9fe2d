"""Batch invariance of the attention kernels: a row's out and lse, bit for bit, however it is computed.

With ``batch_invariant=True``, every query row of every sequence (causal, bottom-right aligned,
optionally a left window, softcap, sinks) gets the same bits (``torch.equal``, out and lse) when
it is computed
  (a) in a trainer's packed forward: ``varlen_attn`` over all the sequences at once, packed K/V;
  (b) in paged prefill chunks: ``varlen_attn_out`` with ``block_table``/``seqused_k``, every
      sequence cut at random points, the chunks batched in shuffled orders, page sizes 1/3/16 in
      shuffled, over-allocated pools;
  (c) in decode steps, one row per sequence, the batch reshuffled every step, each step through a
      route drawn at random: ``flash_decode(batch_invariant=True)`` over the pages (its segments split
      over programs, or folded by one) or over a contiguous cache (no window: flash_decode has none),
      or ``varlen_attn`` with one row per sequence over the pages;
and in a batch of one as in the busy batch.  Also: speculative rows (S_q = 3), prefill chunks at
every offset of a row group, every split count and merging program, cache_leftpad's segments; the
two files' shared tables and arithmetic code; gradients through the mode; bad arguments.  The mode
must also be right: (a) is checked against the fp64 reference.  A negative control measures the
default mode on the same inputs.  And, for the GPU the interpreter cannot stand in for: the sm_80 and
sm_90 builds of the trainer's, a prefill's and a decode's launches run the same MMA (mma.sync
m16n8k16), and those of one shape hold the same floating-point instructions, count for count.  The
same checks under other CPU kernel families (the BLAS behind the interpreter's dot) run in
parity/test_bitwise_blas.py.

Interpreter tier: fp32 and fp16, short sequences (16-row groups, 16-key blocks and segments of 8 keys,
so rows cross several blocks, segments and group positions).  GPU tier: the same tests in bf16, plus
sequences up to 700 tokens.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fast.flash_decoding as fast_decoding
import fast.paged_varlen_attention as fast
import ref.paged_varlen_attention as ref
from conftest import (DEVICE, INTERPRET, build_page_pools, check_close, cu_seqlens, dtype_params, gpu_case,
                      make_generator, nan_like, randn, random_lengths)


# ----------------------------------------------------------------------------- inputs and the three routes

def make_sequences(*, seed, n, max_len, h_q, h_kv, d, dtype):
    """Per-sequence q [L, H_q, D], k, v [L, H_kv, D] (one sequence empty, one of max_len), and sinks."""
    gen = make_generator(seed)
    lengths = random_lengths(n, max_len, gen=gen)
    q = [randn(n_, h_q, d, gen=gen, dtype=dtype) for n_ in lengths]
    k = [randn(n_, h_kv, d, gen=gen, dtype=dtype) for n_ in lengths]
    v = [randn(n_, h_kv, d, gen=gen, dtype=dtype) for n_ in lengths]
    sinks = randn(h_q, gen=gen, dtype=torch.float32)
    return dict(q=q, k=k, v=v, lengths=lengths, sinks=sinks, gen=gen)


def trainer_forward(s, attn, *, only=None, batch_invariant=True):
    """(a) One packed forward over the sequences (or just ``only``): per sequence (out [L, H_q, D],
    lse [H_q, L])."""
    ids = range(len(s["lengths"])) if only is None else [only]
    lengths = [s["lengths"][b] for b in ids]
    cu = cu_seqlens(lengths)
    q, k, v = (torch.cat([s[x][b] for b in ids]) for x in ("q", "k", "v"))
    out, lse = fast.varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), return_aux=fast.AuxRequest(lse=True),
                                enable_gqa=True, batch_invariant=batch_invariant, **attn)
    return {b: (out[cu[i]:cu[i + 1]], lse[:, cu[i]:cu[i + 1]]) for i, b in enumerate(ids)}


def paged_cache(s, page_size):
    """The sequences' K/V in a shuffled, over-allocated page pool: (k_pool, v_pool, block_table)."""
    (k_pool, v_pool), table, _ = build_page_pools([s["k"], s["v"]], page_size, gen=s["gen"])
    return k_pool, v_pool, table


def prefill_chunks(s, attn, cache, *, batch_invariant=True):
    """(b) Every sequence cut into up to three chunks at random points; round r runs the r-th chunk
    of every sequence that has one, in a shuffled order, as the engine's paged prefill would (the
    chunk's rows are the last rows of seqused_k = chunk end keys).  Returns {(b, position): (out, lse)}."""
    k_pool, v_pool, table = cache
    gen = s["gen"]
    cuts = {}
    for b, length in enumerate(s["lengths"]):
        inner = sorted(torch.randperm(max(length - 1, 0), generator=gen)[:2].add(1).tolist())
        cuts[b] = [0, *inner, length]
    rows = {}
    for r in range(3):
        batch = [b for b in torch.randperm(len(cuts), generator=gen).tolist() if len(cuts[b]) > r + 1]
        if not batch:
            continue
        spans = [(cuts[b][r], cuts[b][r + 1]) for b in batch]
        q = torch.cat([s["q"][b][lo:hi] for b, (lo, hi) in zip(batch, spans)])
        cu_q = cu_seqlens([hi - lo for lo, hi in spans])
        used = torch.tensor([hi for _, hi in spans], dtype=torch.int32, device=DEVICE)
        out = nan_like(q)
        _, lse = fast.varlen_attn_out(out, q, k_pool, v_pool, cu_q, None, max(hi - lo for lo, hi in spans),
                                      int(used.max()), block_table=table[batch], seqused_k=used, enable_gqa=True,
                                      return_aux=fast.AuxRequest(lse=True), batch_invariant=batch_invariant, **attn)
        for i, (b, (lo, hi)) in enumerate(zip(batch, spans)):
            for j, pos in enumerate(range(lo, hi)):
                rows[(b, pos)] = (out[cu_q[i] + j], lse[:, cu_q[i] + j])
    return rows


def decode_steps(s, attn, cache, *, routes, first=0, batch_invariant=True, num_splits=None):
    """(c) Decode: step p (from ``first``) computes row p of every sequence longer than p, one row per
    sequence, the batch in a fresh random order each step, through a route drawn from ``routes``
    each step: "flash_decode" over the pages, "flash_decode, one split" (its segments folded by one
    program), "contiguous" (flash_decode over a [B, S_max] cache) or "varlen" (varlen_attn with one row
    per sequence over the pages); flash_decode gets ``num_splits`` (None: the shape gate, which at these
    batches gives every segment a program, the last to finish merging them).
    Returns {(b, position): (out, lse)}."""
    k_pool, v_pool, table = cache
    gen, lengths = s["gen"], s["lengths"]
    k_dense = torch.full((len(lengths), max(lengths) + 3, *s["k"][0].shape[1:]), float("nan"),
                         dtype=s["k"][0].dtype, device=DEVICE)
    v_dense = k_dense.clone()
    for b, length in enumerate(lengths):
        k_dense[b, :length], v_dense[b, :length] = s["k"][b], s["v"][b]
    rows = {}
    for pos in range(first, max(lengths)):
        route = routes[int(torch.randint(len(routes), (1,), generator=gen))]
        batch = [b for b in torch.randperm(len(lengths), generator=gen).tolist() if lengths[b] > pos]
        q = torch.stack([s["q"][b][pos] for b in batch])                       # [B, H_q, D]
        used = torch.full((len(batch),), pos + 1, dtype=torch.int32, device=DEVICE)
        if route == "varlen":
            out, lse = fast.varlen_attn(q, k_pool, v_pool, cu_seqlens([1] * len(batch)), None, 1, pos + 1,
                                        block_table=table[batch], seqused_k=used, enable_gqa=True,
                                        return_aux=fast.AuxRequest(lse=True), batch_invariant=batch_invariant,
                                        **attn)
        else:
            if route == "contiguous":
                kc, vc, bt = k_dense[batch], v_dense[batch], None
            else:
                kc, vc, bt = k_pool, v_pool, table[batch]
            out, lse = fast_decoding.flash_decode(
                q[:, None], kc, vc, used, block_table=bt, return_lse=True, out=nan_like(q[:, None]),
                batch_invariant=batch_invariant, scale=attn.get("scale"), softcap=attn.get("softcap", 0.0),
                sinks=attn.get("sinks"), num_splits=1 if route == "flash_decode, one split" else num_splits)
            out, lse = out[:, 0], lse[:, :, 0].t()                              # [B, H_q, D], [H_q, B]
        for i, b in enumerate(batch):
            rows[(b, pos)] = (out[i], lse[:, i])
    return rows


def compare(name, rows, trainer):
    """Every row of ``rows`` against the trainer's: bitwise.  Returns the number of rows compared."""
    bad = []
    for (b, pos), (out, lse) in rows.items():
        want_out, want_lse = trainer[b][0][pos], trainer[b][1][:, pos]
        if not (torch.equal(out, want_out) and torch.equal(lse, want_lse)):
            bad.append((b, pos, (out.float() - want_out.float()).abs().max().item(),
                        (lse - want_lse).abs().max().item()))
    assert not bad, f"{name}: {len(bad)} of {len(rows)} rows differ from the trainer's, e.g. " \
                    f"(sequence, position, max |out diff|, max |lse diff|) {bad[:4]}"
    return len(rows)


# ----------------------------------------------------------------------------- the guarantee

# id, H_q, H_kv, D, page size, softcap, sinks, left window
CASES = [
    ("mha-d64-page16", 2, 2, 64, 16, 0.0, False, -1),
    ("gqa4-d60-page3-softcap-sinks", 4, 1, 60, 3, 5.0, True, -1),
    ("gqa4-d100-page1-window-sinks", 4, 1, 100, 1, 0.0, True, 9),
    ("gqa1-d64-page3-softcap-window", 2, 2, 64, 3, 5.0, False, 20),
]


def attention_kwargs(s, softcap, use_sinks, left):
    return dict(window_size=(left, 0), softcap=softcap, sinks=s["sinks"] if use_sinks else None)


def check_every_route(s, attn, *, page_size, left):
    trainer = trainer_forward(s, attn)
    cache = paged_cache(s, page_size)
    rows = sum(s["lengths"])
    assert compare("paged prefill chunks", prefill_chunks(s, attn, cache), trainer) == rows
    routes = ("varlen",) if left >= 0 else ("varlen", "flash_decode", "flash_decode, one split", "contiguous")
    # (flash_decode has no window.)
    assert compare(f"decode steps through {routes}", decode_steps(s, attn, cache, routes=routes), trainer) == rows
    # A batch of one: the longest sequence alone, in the trainer's forward.
    longest = max(range(len(s["lengths"])), key=s["lengths"].__getitem__)
    alone = trainer_forward(s, attn, only=longest)[longest]
    assert torch.equal(alone[0], trainer[longest][0]) and torch.equal(alone[1], trainer[longest][1])
    return trainer


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name,h_q,h_kv,d,page,softcap,use_sinks,left", CASES, ids=[c[0] for c in CASES])
def test_every_route_gives_the_same_bits(name, h_q, h_kv, d, page, softcap, use_sinks, left, dtype):
    s = make_sequences(seed=sum(map(ord, name)), n=4, max_len=33, h_q=h_q, h_kv=h_kv, d=d, dtype=dtype)
    attn = attention_kwargs(s, softcap, use_sinks, left)
    trainer = check_every_route(s, attn, page_size=page, left=left)
    # The mode computes the right thing, too: (a) against the fp64 reference, the usual tolerance rule.
    lengths, cu = s["lengths"], cu_seqlens(s["lengths"])
    packed = {x: torch.cat(s[x]) for x in ("q", "k", "v")}
    ref_args = dict(enable_gqa=True, return_aux=ref.AuxRequest(lse=True), window_size=attn["window_size"],
                    softcap=softcap)
    o64, lse64 = ref.varlen_attn(*(packed[x].double() for x in ("q", "k", "v")), cu, cu, max(lengths), max(lengths),
                                 sinks=attn["sinks"].double() if use_sinks else None, **ref_args)
    o_low, lse_low = ref.varlen_attn(packed["q"], packed["k"], packed["v"], cu, cu, max(lengths), max(lengths),
                                     sinks=attn["sinks"], upcast=False, **ref_args)
    check_close("out", torch.cat([trainer[b][0] for b in range(len(lengths))]), o64, o_low)
    check_close("lse", torch.cat([trainer[b][1] for b in range(len(lengths))], dim=1), lse64, lse_low)


def test_speculative_rows_and_prefill_tiles():
    """flash_decode with S_q = 3 rows per sequence (speculative verification) and a prefill chunk that
    starts at every offset of a tile give the trainer's bits too."""
    s = make_sequences(seed=71, n=4, max_len=37, h_q=6, h_kv=2, d=32, dtype=torch.float32)
    attn = attention_kwargs(s, 0.0, True, -1)
    trainer = trainer_forward(s, attn)
    k_pool, v_pool, table = paged_cache(s, 5)
    batch = [b for b, length in enumerate(s["lengths"]) if length >= 3]
    q = torch.stack([s["q"][b][-3:] for b in batch])                             # [B, 3, H_q, D]
    used = torch.tensor([s["lengths"][b] for b in batch], dtype=torch.int32, device=DEVICE)
    out, lse = fast_decoding.flash_decode(q, k_pool, v_pool, used, block_table=table[batch], sinks=attn["sinks"],
                                          return_lse=True, batch_invariant=True)
    rows = {(b, s["lengths"][b] - 3 + i): (out[j, i], lse[j, :, i]) for j, b in enumerate(batch) for i in range(3)}
    compare("flash_decode S_q = 3", rows, trainer)
    # One sequence, a 5-row chunk starting at each of 0..6 (GQA 3: 15 tile rows, shifted by 3 each time).
    b = max(range(len(s["lengths"])), key=s["lengths"].__getitem__)
    rows = {}
    for start in range(7):
        chunk = s["q"][b][start:start + 5]
        cu_q = cu_seqlens([5])
        used = torch.tensor([start + 5], dtype=torch.int32, device=DEVICE)
        out, lse = fast.varlen_attn(chunk, k_pool, v_pool, cu_q, None, 5, start + 5, block_table=table[b:b + 1],
                                    seqused_k=used, enable_gqa=True, return_aux=fast.AuxRequest(lse=True),
                                    batch_invariant=True, **attn)
        rows.update({(b, start + i): (out[i], lse[:, i]) for i in range(5)})
        compare(f"chunk at {start}", rows, trainer)
        rows.clear()


def test_split_count_and_merging_program_do_not_change_the_bits(monkeypatch):
    """The mode's decode cuts a row's keys into segments of SPLIT keys (8 under the interpreter) and spreads
    them over the split launch's programs; the last program to finish folds them in index order.  The bits
    are the trainer's for every split count (one split folding all of them itself, a split per segment,
    more splits than segments) and whichever program merges (``_SPLIT_ROTATE``); and with cache_leftpad,
    whose segments count from the call's first key, as the trainer's packed forward over those keys does
    (the engine's second segment)."""
    s = make_sequences(seed=81, n=3, max_len=45, h_q=4, h_kv=2, d=32, dtype=torch.float16)
    attn = attention_kwargs(s, 5.0, True, -1)
    trainer = trainer_forward(s, attn)
    cache = paged_cache(s, 16)
    last = max(s["lengths"]) - 2
    for splits, rotate in ((None, 0), (None, 1), (1, 0), (2, 1), (3, 2), (7, 0), (7, 5)):
        monkeypatch.setattr(fast_decoding, "_SPLIT_ROTATE", rotate)
        rows = decode_steps(s, attn, cache, routes=("flash_decode", "contiguous"), first=last, num_splits=splits)
        assert compare(f"num_splits={splits}, merger rotated by {rotate}", rows, trainer) > 0
    # cache_leftpad: each sequence's keys from ``first`` on; a trainer's packed forward over the same keys.
    first = 11
    ids = [b for b, length in enumerate(s["lengths"]) if length > first + 2]
    suffix = dict(s, **{x: [s[x][b][first:] for b in ids] for x in ("q", "k", "v")},
                  lengths=[s["lengths"][b] - first for b in ids])
    want = trainer_forward(suffix, attn)
    k_pool, v_pool, table = paged_cache(s, 3)
    for splits in (None, 1, 2):
        for i, b in enumerate(ids):
            pos = s["lengths"][b] - 1
            out, lse = fast_decoding.flash_decode(
                s["q"][b][pos][None, None], k_pool, v_pool, torch.tensor([pos + 1], dtype=torch.int32, device=DEVICE),
                block_table=table[b:b + 1], cache_leftpad=torch.tensor([first], dtype=torch.int32, device=DEVICE),
                return_lse=True, batch_invariant=True, softcap=attn["softcap"], sinks=attn["sinks"], num_splits=splits)
            row = pos - first
            assert torch.equal(out[0, 0], want[i][0][row]), (splits, b)
            assert torch.equal(lse[0, :, 0], want[i][1][:, row]), (splits, b)


GPU_CASES = [
    gpu_case("long-gqa8-d128-page16", 32, 4, 128, 16, 0.0, False, -1, id="long-gqa8-d128-page16"),
    gpu_case("long-gqa4-d256-page3-softcap-sinks", 16, 4, 256, 3, 30.0, True, -1,
             id="long-gqa4-d256-page3-softcap-sinks"),
    gpu_case("long-gqa2-d64-page1-window", 8, 4, 64, 1, 0.0, True, 100, id="long-gqa2-d64-page1-window"),
]


@pytest.mark.parametrize("dtype", dtype_params(torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("name,h_q,h_kv,d,page,softcap,use_sinks,left", GPU_CASES)
def test_every_route_gives_the_same_bits_long(name, h_q, h_kv, d, page, softcap, use_sinks, left, dtype):
    """GPU tier: sequences up to 700 tokens, so rows cross many 64-key blocks and 64-row tiles."""
    s = make_sequences(seed=sum(map(ord, name)), n=6, max_len=700, h_q=h_q, h_kv=h_kv, d=d, dtype=dtype)
    check_every_route(s, attention_kwargs(s, softcap, use_sinks, left), page_size=page, left=left)


# ----------------------------------------------------------------------------- the negative control

def max_difference(rows, trainer):
    """Largest |difference| from the trainer's rows (out, lse) and how many rows differ at all."""
    worst_out = worst_lse = 0.0
    differ = 0
    for (b, pos), (out, lse) in rows.items():
        d_out = (out.float() - trainer[b][0][pos].float()).abs().max().item()
        d_lse = (lse - trainer[b][1][:, pos]).abs().max().item()
        worst_out, worst_lse = max(worst_out, d_out), max(worst_lse, d_lse)
        differ += d_out > 0 or d_lse > 0
    return worst_out, worst_lse, differ


@pytest.mark.parametrize("dtype", dtype_params())
def test_default_mode_is_not_invariant(dtype):
    """The same routes with ``batch_invariant=False``.  Measured, not assumed: flash_decode's default
    mode with split partials (3 splits: at these 40-key caches the shape gate's traffic cap keeps one)
    rounds differently from the trainer's forward, so this asserts a difference.  The default varlen
    kernel's prefill and decode are printed: under the interpreter both modes run one 16 x 16 tile, so
    whether the default comes out invariant depends on whether the BLAS rounds every slot of a tile
    alike (OpenBLAS's generic and AVX-512 kernels do, its Haswell kernels do not); on a GPU the
    autotuner picks tiles by row count, and the unmasked loop fuses scale and max-subtraction into one
    FMA."""
    s = make_sequences(seed=5, n=4, max_len=40, h_q=8, h_kv=2, d=64, dtype=dtype)
    attn = attention_kwargs(s, 5.0, True, -1)
    trainer = trainer_forward(s, attn, batch_invariant=False)
    cache = paged_cache(s, 16)
    # Decode the last 8 positions (the rows with the most key blocks).
    results = {"varlen prefill chunks": prefill_chunks(s, attn, cache, batch_invariant=False)}
    for label, route in (("flash_decode (3 splits)", "flash_decode"),
                         ("varlen_attn one row per sequence", "varlen")):
        results[label] = decode_steps(s, attn, cache, routes=(route,), first=max(s["lengths"]) - 8,
                                      batch_invariant=False, num_splits=3)
    measured = {}
    for label, rows in results.items():
        d_out, d_lse, differ = measured[label] = max_difference(rows, trainer)
        print(f"default {label} vs the trainer's forward: max |out diff| {d_out:.3e}, max |lse diff| {d_lse:.3e}, "
              f"{differ} of {len(rows)} rows differ ({'interpreter' if INTERPRET else 'GPU'}, "
              f"{str(dtype).removeprefix('torch.')})")
    assert measured["flash_decode (3 splits)"][2] > 0, \
        "the default flash_decode gave the trainer's bits: the control cannot see a difference"


# ----------------------------------------------------------------------------- the two files agree, the contract

def function_sources(module) -> dict:
    """{name: source} of the top-level functions of a module's file."""
    text = Path(module.__file__).read_text()
    return {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef)}


def test_the_two_files_hold_the_same_arithmetic_and_tiles():
    """flash_decode rounds like varlen_attn only if both files run the same row group, key blocks and
    segments and the same code for a row's arithmetic: the tables and the helpers (and the score
    transform) are equal."""
    assert fast._INVARIANT_CONFIG_TABLE == fast_decoding._INVARIANT_CONFIG_TABLE
    assert fast._INTERPRET_INVARIANT_CONFIG == fast_decoding._INTERPRET_INVARIANT_CONFIG
    assert fast._LOG2E.value == fast_decoding._LOG2E.value and fast._ROWS.value == fast_decoding._ROWS.value == 16
    varlen, decoding = function_sources(fast), function_sources(fast_decoding)
    for name in ("_inv_block_step", "_inv_segment_state", "_inv_fold_step", "_inv_fold_finish", "_tanh"):
        assert varlen[name] == decoding[name], name
    transform = textwrap.dedent("""\
        if HAS_SOFTCAP:                                                # log2-domain scores
            b_s = softcap * _tanh(b_s * qk_scale) * _LOG2E     # qk_scale = scale / softcap
        else:
            b_s = b_s * qk_scale                                          # qk_scale = scale * log2(e)
    """)
    assert textwrap.indent(transform, " " * 8) in varlen["_inv_key_blocks"]
    assert textwrap.indent(transform, " " * 12) in decoding["_decode_invariant_kernel"]


@pytest.mark.parametrize("mod", ["ref", "fast"])
def test_bad_batch_invariant_arguments(mod):
    import ref.flash_decoding as ref_decoding
    attn, decode = (ref, ref_decoding) if mod == "ref" else (fast, fast_decoding)
    gen = make_generator(72)
    q, k = randn(5, 2, 16, gen=gen), randn(5, 2, 16, gen=gen)
    cu = cu_seqlens([5])
    with pytest.raises(TypeError, match="batch_invariant"):
        attn.varlen_attn(q, k, k, cu, cu, 5, 5, batch_invariant=1)
    with pytest.raises(TypeError, match="batch_invariant"):
        attn.varlen_attn_out(torch.empty_like(q), q, k, k, cu, cu, 5, 5, batch_invariant="yes")
    used = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="batch_invariant"):
        decode.flash_decode(q[None, :1], k[None], k[None], used, batch_invariant=None)
    with pytest.raises(ValueError, match="num_splits"):
        decode.flash_decode(q[None, :1], k[None], k[None], used, num_splits=0, batch_invariant=True)
    for splits in (1, 2):      # the split count is the launch's choice in the mode too (the same bits)
        out = decode.flash_decode(q[None, :1], k[None], k[None], used, num_splits=splits, batch_invariant=True)
        assert out.shape == (1, 1, 2, 16)


def test_gradients_in_the_mode():
    """A trainer differentiates through the invariant forward: the backward (deterministic, shared
    with the default mode) gets the same gradients to rounding."""
    s = make_sequences(seed=73, n=3, max_len=20, h_q=4, h_kv=2, d=32, dtype=torch.float32)
    cu = cu_seqlens(s["lengths"])
    grads = []
    for mode in (True, False):
        q, k, v = (torch.cat(s[x]).requires_grad_() for x in ("q", "k", "v"))
        sinks = s["sinks"].clone().requires_grad_()
        out, lse = fast.varlen_attn(q, k, v, cu, cu, max(s["lengths"]), max(s["lengths"]), window_size=(-1, 0),
                                    enable_gqa=True, sinks=sinks, softcap=5.0, batch_invariant=mode,
                                    return_aux=fast.AuxRequest(lse=True))
        (out.square().sum() + lse.sum()).backward()
        grads.append([t.grad for t in (q, k, v, sinks)])
    for name, a, b in zip("q k v sinks".split(), *grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


# The interpreter evaluates both sides of a tl.where: inf - inf in the side a +inf sink never takes.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_edge_cases_in_the_mode():
    """The mode keeps the contract's edge cases: rows that see no key (out 0, lse -inf), an empty
    sequence, padding rows past cu_seq_q[-1], a NaN that reaches only its row, sinks of -inf (none)
    and +inf (all the mass), and a head dim (37) that takes the staging path.  Against the fp64
    reference, NaN and inf in the same places."""
    import ref.flash_decoding as ref_decoding
    gen = make_generator(74)
    d = 37
    q, k, v = randn(13, 4, d, gen=gen), randn(9, 2, d, gen=gen), randn(9, 2, d, gen=gen)
    q[7, 1, 3] = float("nan")
    cu_q, cu_k = cu_seqlens([6, 0, 4]), cu_seqlens([4, 2, 3])      # 6 queries on 4 keys; rows 10..12: padding
    sinks = torch.tensor([float("-inf"), float("inf"), 0.5, -1.0], device=DEVICE)
    kw = dict(window_size=(-1, 0), enable_gqa=True, sinks=sinks)
    out = torch.full_like(q, 7.0)
    got, lse = fast.varlen_attn_out(out, q, k, v, cu_q, cu_k, 6, 4, batch_invariant=True,
                                    return_aux=fast.AuxRequest(lse=True), **kw)
    o64, lse64 = ref.varlen_attn(q.double(), k.double(), v.double(), cu_q, cu_k, 6, 4,
                                 return_aux=ref.AuxRequest(lse=True), **{**kw, "sinks": sinks.double()})
    assert torch.all(got[10:] == 7.0), "varlen_attn_out must leave the padding rows"
    check_close("edge out", got[:10], o64[:10], None, atol=1e-5)
    check_close("edge lse", lse, lse64, None, atol=1e-5)
    assert torch.all(got[:2] == 0) and torch.isneginf(lse[0, :2]).all()     # rows 0, 1 see no key
    # flash_decode: an empty sequence (seqused_k = 0) and the same sinks.
    cache_k, cache_v = randn(3, 8, 2, d, gen=gen), randn(3, 8, 2, d, gen=gen)
    used = torch.tensor([5, 0, 8], dtype=torch.int32, device=DEVICE)
    qd = randn(3, 1, 4, d, gen=gen)
    o, l_ = fast_decoding.flash_decode(qd, cache_k, cache_v, used, sinks=sinks, return_lse=True, batch_invariant=True)
    o64, l64 = ref_decoding.flash_decode(qd.double(), cache_k.double(), cache_v.double(), used, sinks=sinks.double(),
                                         return_lse=True)
    check_close("decode edge out", o, o64, None, atol=1e-5)
    check_close("decode edge lse", l_, l64, None, atol=1e-5)


# ----------------------------------------------------------------------------- the GPU build, without a GPU

@pytest.mark.parametrize("arch", [80, 90], ids=lambda a: f"sm{a}")
def test_gpu_builds_run_the_same_arithmetic(arch):
    """What the interpreter cannot show: on a GPU, the trainer's, a prefill's and a decode's launches of the mode
    (different compiled kernels, and different spreads of the same rows over warps) must round alike.
    parity/invariant_sass.py builds them for ``arch`` (sm_80 or sm_90: a case each) in bf16 D = 64 and fp16
    D = 128 (a packed forward, paged prefill chunks and a one-sequence prefill that Triton specializes, with one row
    group a program and with SUB of them; flash_decode over pages and over a contiguous cache in one split, and
    split with the fused merge), the invariant matmul at M = 1, 37 and 64 rows and fast/moe.py's expert GEMMs
    for calls of 1, 37 and 2048 tokens, and Gated DeltaNet's five chunk-forward kernels in the mode, varlen (a
    trainer, a prefill) against dense (the engine's decode step, capturable: no cu_seqlens), and counts each
    SASS's floating-point instructions. Launches of the same shape agree count for count (the one-group launches
    of both kernels: the same code); every attention launch of an arch and dtype runs the same MMA, mma.sync
    m16n8k16 (HMMA.16816) on sm_80 and on sm_90 (the mode's 16-row groups: no wgmma), so a row's sums, all MMAs
    or maxima, do not depend on the warps. The matmul and the expert GEMMs: HMMA.16816 on sm_80, one wgmma shape
    set (HGMMA.64xNx16) on sm_90, FFMA only in fp32. (The default kernels would not: their unmasked loop fuses
    scale and max-subtraction into FFMAs the masked loop does not have, and the autotuner picks tiles by row
    count.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = Path(__file__).resolve().parent / "invariant_sass.py"
    proc = subprocess.run([sys.executable, str(probe), "--arch", str(arch)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    groups = json.loads(proc.stdout.splitlines()[-1])
    assert len(groups) == 17 and all(f"sm_{arch}" in group for group in groups), sorted(groups)
    for group, launches in groups.items():
        mma = {label: {op: n for op, n in ops.items() if "MMA" in op} for label, ops in launches.items()}
        print(f"{group}: MMA {sorted(set().union(*mma.values()))}")
        if group.endswith("(MMA)"):
            kinds = {label: set(ops) for label, ops in mma.items()}
            first_kinds = next(iter(kinds.values()))
            assert all(k == first_kinds for k in kinds.values()), (group, kinds)
            assert first_kinds and all(op.startswith("HMMA.16816.") for op in first_kinds), (group, first_kinds)
            continue
        first = next(iter(launches.values()))
        assert all(ops == first for ops in launches.values()), (group, launches)
        if group.startswith("gated deltanet"):   # (the varlen and dense builds agree; which MMA each kernel runs is
            assert first, group                  # parity/aot_compile.py's check: kkt_solve's 16-row blocks mma.sync)
            continue
        kinds = set(mma[next(iter(mma))])
        if "fp32" in group:
            assert not kinds and first.get("FFMA", 0) > 0, (group, first)
        elif "sm_80" in group or group.startswith("attention"):
            assert kinds and all(op.startswith("HMMA.16816.") for op in kinds), (group, kinds)
        else:
            assert kinds and all(re.fullmatch(r"HGMMA\.64x\d+x16\.F32.*", op) for op in kinds), (group, kinds)
