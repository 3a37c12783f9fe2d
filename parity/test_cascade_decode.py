"""Cascade (shared-prefix) decode and ``cache_leftpad``: fast/flash_decoding.py against the reference.

``cascade_decode`` attends groups of sequences whose first pages are shared (a GRPO group's samples
behind their prompt) in one launch of ``_cascade_fwd_kernel``: programs that read each group's prefix
once for all its rows, split across programs, and programs that read each row's own keys from its
group's prefix length on, the last of them to finish a sequence merging its partials.  Checked here, on
the parity grid of ``flash_decode`` (fp32 and fp16; bf16 on a GPU; page sizes 1 / 3 / 16; GQA 1 / 3 / 8;
head dims 32 / 60 / 100 / 128; S_q 1 and 3; softcap; sinks): the reference's cascade equals its
flash_decode in fp64; fast's cascade meets the tolerance rule against it, with groups of several rows,
odd group sizes, a group of one, a prefix of 0, a prefix shorter than the shared pages and not a multiple
of the split size, rows whose own keys are only the query rows' (an empty suffix past them), an empty
sequence, a sequence's rows spread over two prefix tiles and over two query tiles; NaN in every unused
slot.  Forced split counts and either kind of program merging give the same bits; every program's
ticket is counted; the prefix is read once; the split counts follow their traffic budget.
``cache_leftpad`` the same way, with splits, paged and contiguous.  Bad input raises the same errors in
both files.
"""
from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

import fast.flash_decoding as fast
import ref.flash_decoding as ref
from conftest import DEVICE, check_close, dtype_params, gpu_case, make_generator, poison_, randn


def group_case(*, groups, s_q, h_q, h_kv, d, page, seed):
    """fp64 cascade inputs.  ``groups``: per group (shared pages, prefix_len or None for all shared keys,
    [own keys per row]).  A group's rows share its first pages (same ids, same keys); each row's own keys
    fill pages of its own.  The pool is shuffled and over-allocated, unused slots NaN, the block table has
    spare columns pointing at random pages."""
    gen = make_generator(seed)
    rng = random.Random(seed)
    rows, prefixes = [], []                       # per row: (list of page contents); per group: prefix
    for shared, prefix, owns in groups:
        shared_keys = [randn(page, h_kv, d, gen=gen, dtype=torch.float64) for _ in range(2 * shared)]
        for own in owns:
            rows.append((shared, shared_keys, own, shared * page + own))
        prefixes.append(shared * page if prefix is None else prefix)
    n_pages = sum(shared for shared, *_ in groups) + sum(-(-own // page) for _, _, own, _ in rows) + 5
    order = list(range(n_pages))
    rng.shuffle(order)
    k_pool = torch.full((n_pages, page, h_kv, d), float("nan"), dtype=torch.float64, device=DEVICE)
    v_pool = torch.full_like(k_pool, float("nan"))
    max_pages = max(-(-length // page) for *_, length in rows) + 1
    table = torch.tensor([[rng.randrange(n_pages) for _ in range(max_pages)] for _ in rows], dtype=torch.int32)
    taken, first_of_group = iter(order), {}
    for b, (shared, shared_keys, own, _) in enumerate(rows):
        key = id(shared_keys)
        if key not in first_of_group:                               # the group's shared pages, once
            first_of_group[key] = [next(taken) for _ in range(shared)]
            for j, p in enumerate(first_of_group[key]):
                k_pool[p], v_pool[p] = shared_keys[2 * j], shared_keys[2 * j + 1]
        table[b, :shared] = torch.tensor(first_of_group[key], dtype=torch.int32)
        for j in range(-(-own // page)):                            # its own pages, partly filled at the end
            p = next(taken)
            table[b, shared + j] = p
            n = min(page, own - j * page)
            k_pool[p, :n] = randn(n, h_kv, d, gen=gen, dtype=torch.float64)
            v_pool[p, :n] = randn(n, h_kv, d, gen=gen, dtype=torch.float64)
    sizes = [len(owns) for *_, owns in groups]
    return dict(q=randn(len(rows), s_q, h_q, d, gen=gen, dtype=torch.float64, scale=1.5), k_cache=k_pool,
                v_cache=v_pool, seqused_k=torch.tensor([r[3] for r in rows], dtype=torch.int32, device=DEVICE),
                block_table=table.to(DEVICE), sinks=randn(h_q, gen=gen, dtype=torch.float64, scale=2.0),
                cu_groups=torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE),
                prefix_lens=torch.tensor(prefixes, dtype=torch.int32, device=DEVICE))


def cast(case, dtype):
    return {k: v.to(dtype) if k in ("q", "k_cache", "v_cache", "sinks") else v for k, v in case.items()}


def cascade(module, case, **kw):
    out = poison_(torch.empty_like(case["q"])) if module is fast else None
    return module.cascade_decode(case["q"], case["k_cache"], case["v_cache"], case["seqused_k"],
                                 block_table=case["block_table"], cu_groups=case["cu_groups"],
                                 prefix_lens=case["prefix_lens"], return_lse=True, out=out, **kw)


def decode(module, case, **kw):
    return module.flash_decode(case["q"], case["k_cache"], case["v_cache"], case["seqused_k"],
                               block_table=case["block_table"], return_lse=True, **kw)


# (id, page, H_q, H_kv, D, S_q, softcap, sinks, groups: (shared pages, prefix or None, [own keys per row]))
CASES = [
    ("grpo-page16-gqa4", 16, 8, 2, 64, 1, 0.0, False, [(3, None, [5, 1, 17, 9]), (0, None, [12])]),
    ("page3-gqa3-softcap-sinks-verify", 3, 6, 2, 60, 3, 20.0, True,
     [(4, 10, [3, 8, 5]), (2, None, [4]), (1, 0, [7, 9])]),
    ("page1-mha-d100", 1, 2, 2, 100, 1, 0.0, True, [(9, None, [1, 1, 4]), (5, 3, [6])]),
    ("page16-gqa8-d128-empty-suffix", 16, 8, 1, 128, 1, 0.0, False, [(2, 32, [0, 0, 3]), (1, None, [0])]),
    ("page3-gqa1-d32-empty-row", 3, 4, 4, 32, 2, 5.0, True, [(3, None, [2, 6]), (0, 0, [0]), (1, 2, [1, 3])]),
    gpu_case("gpu-grpo-n8-2k", 16, 32, 8, 128, 1, 0.0, False, [(128, None, [256 - 8 * i for i in range(8)])] * 4,
             id="gpu-grpo-n8-2k"),
]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name,page,h_q,h_kv,d,s_q,softcap,use_sinks,groups",
                         [pytest.param(*c, id=c[0]) if type(c) is tuple else c for c in CASES])
def test_cascade_matches_flash_decode(name, page, h_q, h_kv, d, s_q, softcap, use_sinks, groups, dtype):
    case64 = group_case(groups=groups, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, page=page, seed=sum(map(ord, name)))
    kw = dict(softcap=softcap)
    sinks64 = case64["sinks"] if use_sinks else None
    o64, lse64 = decode(ref, case64, sinks=sinks64, **kw)
    # The reference's cascade is its flash_decode, to fp64 rounding.
    c64, clse64 = cascade(ref, case64, sinks=sinks64, **kw)
    torch.testing.assert_close(c64, o64, atol=1e-10, rtol=0)
    torch.testing.assert_close(clse64, lse64, atol=1e-10, rtol=0)
    case = cast(case64, dtype)
    sinks = case["sinks"] if use_sinks else None
    o_low, lse_low = cascade(ref, case, sinks=sinks, upcast=False, **kw)
    o_fast, lse_fast = cascade(fast, case, sinks=sinks, **kw)
    check_close("cascade out", o_fast, o64, o_low)
    check_close("cascade lse", lse_fast, lse64, lse_low)


def test_cascade_writes_k_new_and_reads_each_prefix_once(monkeypatch):
    """k_new / v_new land in every row's own page first (as flash_decode writes them); and the prefix of
    a group of four rows is read once: one launch of the cascade kernel, whose prefix programs (one per
    KV head, the first ones: one split forced) issue one prefix's K/V for their head plus q, the page ids,
    the group's numbers, their partial and their tickets; and the whole cascade moves fewer bytes than
    flash_decode reading the prefix for every row."""
    from observatory import observe
    case = cast(group_case(groups=[(6, None, [3, 2, 5, 1])], s_q=1, h_q=4, h_kv=2, d=32, page=4, seed=3),
                torch.float32)
    gen = make_generator(4)
    k_new, v_new = (randn(4, 1, 2, 32, gen=gen) for _ in range(2))
    for module in (ref, fast):
        c = {k: v.clone() for k, v in case.items()}
        o, lse = cascade(module, c, k_new=k_new, v_new=v_new)
        expect = {k: v.clone() for k, v in case.items()}
        e_o, e_lse = decode(ref, expect, k_new=k_new, v_new=v_new)
        torch.testing.assert_close(o, e_o.to(o.dtype), atol=2e-6, rtol=0)
        assert torch.equal(c["k_cache"].nan_to_num(7), expect["k_cache"].nan_to_num(7))
    monkeypatch.setattr(fast, "_CASCADE_SPLITS", (1, 1))
    with observe() as obs:
        cascade(fast, case)
    with observe() as plain:
        decode(fast, case, num_splits=1)
    (launch,) = obs.launches
    assert launch.kernel == "_cascade_fwd_kernel" and launch.grid == ((1 + 4) * 2, 1, 1)   # 1 prefix + 4 rows
    head_kv = 24 * 2 * 32 * 4                                 # K and V of the 24-key prefix, one KV head
    rows = 4 * 2                                              # the group's rows for one KV head (G = 2)
    q_bytes, page_ids, group_ids = rows * 32 * 4, 24 * 4, 3 * 4        # one page id a key (page 4 < BLOCK_N)
    partial, tickets = rows * (32 * 4 + 4), 4 * 3 * 4        # 4 sequences: seqused_k, a ticket read and written
    for pid in (0, 1):                                        # the prefix programs, KV heads 0 and 1
        assert launch.program_bytes[pid] == head_kv + q_bytes + page_ids + group_ids + partial + tickets, \
            launch.program_bytes
    prefix_kv = 2 * head_kv
    total = sum(launch.issued_bytes for launch in obs.launches)
    once = sum(launch.issued_bytes for launch in plain.launches)
    print(f"cascade issued {total} B (a prefix program {launch.program_bytes[0]} B), flash_decode {once} B")
    assert total < once - 2 * prefix_kv, (total, once)


def test_cache_leftpad_matches_reference():
    """flash_decode with cache_leftpad (keys before it skipped), paged and contiguous, with splits and in
    the batch-invariant mode, against the reference in fp64 (including a row whose keys all lie before
    its leftpad: out 0, lse -inf)."""
    gen = make_generator(5)
    for paged, splits, mode in ((True, None, False), (True, 3, False), (False, 2, False), (True, None, True)):
        b, s_q, h_q, h_kv, d, page = 4, 2, 6, 2, 32, 3
        lengths = [17, 9, 12, 30]
        q = randn(b, s_q, h_q, d, gen=gen, dtype=torch.float64)
        kc = randn(12 if paged else b, page if paged else 31, h_kv, d, gen=gen, dtype=torch.float64)
        vc = randn(*kc.shape, gen=gen, dtype=torch.float64)
        table = torch.randperm(12, generator=gen)[:11].reshape(1, 11).repeat(b, 1).to(torch.int32).to(DEVICE) \
            if paged else None
        used = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        leftpad = torch.tensor([4, 0, 12, 29], dtype=torch.int32, device=DEVICE)
        kw = dict(block_table=table, cache_leftpad=leftpad, return_lse=True)
        o64, lse64 = ref.flash_decode(q, kc, vc, used, **kw)
        o_low, lse_low = ref.flash_decode(q.float(), kc.float(), vc.float(), used, upcast=False, **kw)
        o, lse = fast.flash_decode(q.float(), kc.float(), vc.float(), used, num_splits=splits, batch_invariant=mode,
                                   out=poison_(torch.empty_like(q.float())), **kw)
        check_close("leftpad out", o, o64, o_low)
        check_close("leftpad lse", lse, lse64, lse_low)
        assert torch.isneginf(lse[2]).all() and torch.equal(o[2], torch.zeros_like(o[2]))


@pytest.mark.parametrize("module", [ref, fast], ids=["ref", "fast"])
def test_bad_cascade_inputs(module):
    case = cast(group_case(groups=[(2, None, [3, 2])], s_q=1, h_q=4, h_kv=2, d=16, page=4, seed=6), torch.float32)
    args = (case["q"], case["k_cache"], case["v_cache"], case["seqused_k"])
    good = dict(block_table=case["block_table"], cu_groups=case["cu_groups"], prefix_lens=case["prefix_lens"])

    def call(**kw):
        return module.cascade_decode(*args, **{**good, **kw})

    with pytest.raises(ValueError, match="block_table"):
        call(block_table=None)
    with pytest.raises(TypeError, match="cu_groups"):
        call(cu_groups=case["cu_groups"].long())
    with pytest.raises(ValueError, match="one more entry"):
        call(prefix_lens=torch.tensor([8, 0], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="cu_groups must rise from 0 to B"):
        call(cu_groups=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="prefix_lens"):
        call(prefix_lens=torch.tensor([11], dtype=torch.int32, device=DEVICE))           # past a row's queries
    table = case["block_table"].clone()
    table[1, 0] = (table[0, 0] + 1) % case["k_cache"].shape[0]
    with pytest.raises(ValueError, match="same pages"):
        call(block_table=table)
    with pytest.raises(ValueError, match="cache_leftpad"):
        module.flash_decode(*args, block_table=case["block_table"],
                            cache_leftpad=torch.tensor([0, 11], dtype=torch.int32, device=DEVICE))
    o = call()
    assert o.shape == case["q"].shape


def test_a_long_prefix_is_split_across_programs(monkeypatch):
    """One group with a long prefix and few rows: the shape gate shares the prefix's key blocks out among
    several programs (their partials merged with the suffix's), in one launch, and the result is
    flash_decode's."""
    from observatory import observe
    case64 = group_case(groups=[(32, None, [5, 9])], s_q=1, h_q=4, h_kv=2, d=32, page=16, seed=8)   # 512 keys
    o64, lse64 = decode(ref, case64)
    case = cast(case64, torch.float16)
    o_low, lse_low = cascade(ref, case, upcast=False)
    chosen = []
    gate = fast._cascade_splits
    monkeypatch.setattr(fast, "_cascade_splits", lambda **kw: chosen.append(gate(**kw)) or chosen[-1])
    with observe(unique=False) as obs:
        o, lse = cascade(fast, case)
    [(p_splits, s_splits)] = chosen
    (launch,) = obs.launches
    assert p_splits >= 2 and launch.grid == ((p_splits + 2 * s_splits) * 2, 1, 1), (chosen, launch.grid)
    check_close("split prefix out", o, o64, o_low)
    check_close("split prefix lse", lse, lse64, lse_low)


# (id, page, H_q, H_kv, D, S_q, sinks, softcap, groups) for the launch's corner cases.  fp32 tiles hold 16
# rows, fp16 ones up to 64: "odd" packs a group of 5 sequences of 9 rows (S_q 3, G 3) into 3 fp32 prefix
# tiles (rows of a sequence in two tiles), with a prefix of 10 keys (3 pages of 3 keys: not a multiple of
# anything), a group of one and a prefix of 0; "wide" has 24 rows a sequence (S_q 3, G 8), two fp32 query
# tiles; "empty" has rows with no keys of their own past the prefix, a group of one, an empty sequence.
CORNERS = [
    ("odd", 3, 6, 2, 60, 3, True, 10.0,
     [(4, 10, [3, 8, 5]), (5, None, [2, 6, 2, 3, 4]), (2, None, [4]), (1, 0, [7, 9])]),
    ("wide", 16, 16, 2, 32, 3, False, 0.0, [(2, None, [5, 2]), (1, 7, [3])]),
    ("empty", 16, 8, 1, 32, 1, True, 0.0, [(2, 32, [0, 0, 3]), (1, None, [0]), (0, 0, [0]), (0, 0, [4])]),
]


def _arrivals(case, p_splits, s_splits, block_m, block_n, s_q, group):
    """Expected tickets per (sequence, KV head) counter: _cascade_arrivals in Python."""
    rows = s_q * group
    cu, prefixes, used = case["cu_groups"].tolist(), case["prefix_lens"].tolist(), case["seqused_k"].tolist()
    want = []
    for g, prefix in enumerate(prefixes):
        for b in range(cu[g], cu[g + 1]):
            first = (b - cu[g]) * rows
            tiles = (first + rows - 1) // block_m - first // block_m + 1
            p = min(-(-prefix // block_n), p_splits)
            s = max(1, min(-(-(used[b] - prefix) // block_n), s_splits))
            want.append(p * tiles + s * -(-rows // block_m))
    return want


@pytest.mark.parametrize("dtype", dtype_params(torch.float32, torch.float16))
@pytest.mark.parametrize("name,page,h_q,h_kv,d,s_q,use_sinks,softcap,groups",
                         [pytest.param(*c, id=c[0]) for c in CORNERS])
def test_any_split_count_and_any_merger_give_the_same_bits(name, page, h_q, h_kv, d, s_q, use_sinks, softcap, groups,
                                                          dtype, monkeypatch):
    """The launch's corner cases against the fp64 reference, at the gate's split counts and at forced ones
    (empty splits included: 5 prefix splits of a 10-key prefix); then with the programs in reverse order,
    so that a prefix program, not a row's own, arrives last and merges from memory: the same bits.  Every
    sequence's counter holds as many tickets as _cascade_arrivals counts, and all of them done but the
    merger's own when a suffix program merged (it never stores its partial)."""
    case64 = group_case(groups=groups, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, page=page, seed=sum(map(ord, name)))
    sinks64 = case64["sinks"] if use_sinks else None
    o64, lse64 = decode(ref, case64, sinks=sinks64, softcap=softcap)
    case = cast(case64, dtype)
    sinks = case["sinks"] if use_sinks else None
    o_low, lse_low = cascade(ref, case, sinks=sinks, softcap=softcap, upcast=False)
    counters = []
    make = fast._new_counters
    monkeypatch.setattr(fast, "_new_counters", lambda n, device: counters.append(make(n, device)) or counters[-1])
    group = h_q // h_kv
    largest = max(len(owns) for *_, owns in groups)
    cfg = fast._cascade_config(d, dtype, largest * s_q * group, fast._kv_align(case["k_cache"], case["v_cache"]),
                               case["q"].device)
    for splits in (None, (1, 1), (5, 3)):
        monkeypatch.setattr(fast, "_CASCADE_SPLITS", splits)
        results = []
        for reverse in (False, True):
            monkeypatch.setattr(fast, "_CASCADE_REVERSE", reverse)
            counters.clear()
            o, lse = cascade(fast, case, sinks=sinks, softcap=softcap)
            check_close(f"{name} {splits} {'reversed ' if reverse else ''}out", o, o64, o_low)
            check_close(f"{name} {splits} {'reversed ' if reverse else ''}lse", lse, lse64, lse_low)
            results.append((o, lse))
            (count,) = counters
            tickets, done = (count & 0xFFFF).view(-1, h_kv), (count >> 16).view(-1, h_kv)
            if splits is not None:
                want = torch.tensor(_arrivals(case, *splits, cfg["BLOCK_M"], cfg["BLOCK_N"], s_q, group))
                assert torch.equal(tickets, want[:, None].expand(-1, h_kv).to(tickets.dtype)), (tickets, want)
            assert ((tickets - done == 0) | (tickets - done == 1)).all(), (tickets, done)
            # In order, a row's own program arrives last; reversed, a prefix program does where there is one.
            has_prefix = torch.repeat_interleave(case["prefix_lens"] > 0, case["cu_groups"].diff())
            merged_by_suffix = torch.ones_like(has_prefix) if not reverse else ~has_prefix
            assert torch.equal(tickets - done, merged_by_suffix[:, None].expand(-1, h_kv).to(tickets.dtype)), \
                (tickets, done)
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def padded_groups(case, pad_rows: int):
    """The groups as a captured step may lay them out: an empty group before each real one (a prefix of a
    million keys, never read), ``pad_rows`` rows at the end in groups of their own with no prefix, then two
    empty groups."""
    cu, prefixes = case["cu_groups"].tolist(), case["prefix_lens"].tolist()
    bounds, lens = [0], []
    for g, prefix in enumerate(prefixes):
        bounds += [cu[g], cu[g + 1]]
        lens += [10 ** 6, prefix]
    batch = cu[-1] + pad_rows
    bounds += list(range(cu[-1] + 1, batch + 1)) + [batch, batch]
    lens += [0] * (pad_rows + 2)
    return (torch.tensor(bounds, dtype=torch.int32, device=DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("name,page,h_q,h_kv,d,s_q,use_sinks,softcap,groups",
                         [pytest.param(*c, id=c[0]) for c in CORNERS])
def test_a_capturable_call_reads_nothing_back_and_takes_any_groups(name, page, h_q, h_kv, d, s_q, use_sinks,
                                                                   softcap, groups, monkeypatch):
    """``capturable=True`` (what a CUDA graph captures: the engine's static decode step) sizes the launch from
    shapes alone, so one launch serves any groups: here with empty groups between the real ones (their prefix
    a million keys, never read), two padding rows of S_q keys each (a spare page) in groups of their own and
    empty groups after them, the new keys written first (k_new / v_new).  The group values are never read
    back (their check is made to raise); every row, padding included, is flash_decode's within the tolerance
    rule of the fp64 reference, and the cache holds the new keys as flash_decode writes them."""
    case64 = group_case(groups=groups, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, page=page, seed=sum(map(ord, name)) + 1)
    gen = make_generator(len(name))
    pad = 2
    spare = case64["k_cache"].shape[0]                         # one more page: the padding rows'
    nan_page = torch.full((1, *case64["k_cache"].shape[1:]), float("nan"), dtype=torch.float64, device=DEVICE)
    case64["k_cache"] = torch.cat([case64["k_cache"], nan_page])
    case64["v_cache"] = torch.cat([case64["v_cache"], nan_page])
    width = case64["block_table"].shape[1]
    case64["block_table"] = torch.cat([case64["block_table"],
                                       torch.full((pad, width), spare, dtype=torch.int32, device=DEVICE)])
    case64["seqused_k"] = torch.cat([case64["seqused_k"], torch.full((pad,), s_q, dtype=torch.int32, device=DEVICE)])
    case64["q"] = torch.cat([case64["q"], randn(pad, s_q, h_q, d, gen=gen, dtype=torch.float64)])
    b = case64["q"].shape[0]
    k_new, v_new = (randn(b, s_q, h_kv, d, gen=gen, dtype=torch.float64) for _ in range(2))
    kw = dict(softcap=softcap)
    expect, low = {k: v.clone() for k, v in case64.items()}, cast(case64, torch.float32)
    o64, lse64 = decode(ref, expect, sinks=expect["sinks"] if use_sinks else None, k_new=k_new, v_new=v_new, **kw)
    o_low, lse_low = decode(ref, low, sinks=low["sinks"] if use_sinks else None, upcast=False, k_new=k_new.float(),
                            v_new=v_new.float(), **kw)
    case = cast(case64, torch.float32)
    cu_groups, prefix_lens = padded_groups(case64, pad)
    monkeypatch.setattr(fast, "_check_group_values", lambda *a, **k: pytest.fail("capturable read the groups back"))
    o, lse = fast.cascade_decode(case["q"], case["k_cache"], case["v_cache"], case["seqused_k"],
                                 block_table=case["block_table"], cu_groups=cu_groups, prefix_lens=prefix_lens,
                                 k_new=k_new.float(), v_new=v_new.float(), sinks=case["sinks"] if use_sinks else None,
                                 return_lse=True, capturable=True, out=poison_(torch.empty_like(case["q"])), **kw)
    check_close(f"{name} capturable out", o, o64, o_low)
    check_close(f"{name} capturable lse", lse, lse64, lse_low)
    assert torch.equal(case["k_cache"].nan_to_num(7), low["k_cache"].nan_to_num(7))
    assert torch.equal(case["v_cache"].nan_to_num(7), low["v_cache"].nan_to_num(7))


def test_split_counts_follow_the_traffic_budget():
    """_cascade_splits at the GRPO case (one group of 8, 2k + 256 keys, GQA 8/2, D = 128, fp16, BLOCK_N 16):
    7 prefix splits a KV head and one suffix split, whose extra bytes stay within the budget where 8 would
    not; no prefix: the suffix split like flash_decode, one program per SM at most; a budget of 0: one
    split each."""
    grpo = dict(n_groups=1, p_tiles=1, prefix=2048, p_rows=32, batch=8, s_tiles=1, suffix=256, s_rows=4, h_kv=2,
                head_dim=128, elt=2, block_n=16, num_sms=132)
    assert fast._cascade_splits(**grpo) == (7, 1)
    budget = fast._CASCADE_SPLIT_TRAFFIC * 2 * 128 * 2 * 2 * (2048 + 8 * 256)
    per_split = 2 * 3 * 32 * (128 * 2 + 4)                   # both KV heads' prefix tiles
    assert 6 * per_split <= budget < 7 * per_split
    p_splits, s_splits = fast._cascade_splits(**{**grpo, "p_tiles": 0, "prefix": 0, "batch": 4, "suffix": 8192})
    assert p_splits == 1 and 2 * 4 * s_splits <= 132 < 2 * 4 * (s_splits + 1)
    try:
        old, fast._CASCADE_SPLIT_TRAFFIC = fast._CASCADE_SPLIT_TRAFFIC, 0.0
        assert fast._cascade_splits(**grpo) == (1, 1)
    finally:
        fast._CASCADE_SPLIT_TRAFFIC = old


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, fast._tanh_near_zero(tl.load(x_ptr + o, mask=o < n)), mask=o < n)


def test_tanh_near_zero_is_accurate_everywhere():
    """The cascade's softcap tanh: within 2 ulp of tanh (fp64) at every magnitude from 1e-30 to 100, 0 at
    +-0, +-1 at +-inf, NaN kept (the decode kernel's _tanh loses about eps of absolute accuracy near 0)."""
    x = torch.cat([torch.logspace(-30, 2, 4001), torch.linspace(0.25, 0.35, 1001)])
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])]).float()
    y = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = torch.tanh(x.double())
    finite = x.isfinite()
    ulp = torch.finfo(torch.float32).eps * want[finite].abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((y[finite].double() - want[finite]).abs() <= 2 * ulp).all(), \
        ((y[finite].double() - want[finite]).abs() / ulp).max()
    assert torch.equal(y[-5:-1], torch.tensor([0.0, 0.0, 1.0, -1.0])) and y[-1].isnan()
