"""Cascade (shared-prefix) decode and ``cache_leftpad``: fast/flash_decoding.py against the reference.

``cascade_decode`` attends groups of sequences whose first pages are shared (a GRPO group's samples
behind their prompt): one kernel reads each group's prefix once for all its rows, the decode kernel
reads each row's own keys from its group's prefix length on (``cache_leftpad``), and the split merge
combines the two states.  Checked here, on the parity grid of ``flash_decode`` (fp32 and fp16; bf16 on
a GPU; page sizes 1 / 3 / 16; GQA 1 / 3 / 8; head dims 32 / 60 / 100 / 128; S_q 1 and 3; softcap;
sinks): the reference's cascade equals its flash_decode in fp64; fast's cascade meets the tolerance rule
against it, with groups of several rows, a group of one, a prefix of 0, a prefix shorter than the
shared pages, rows whose own keys are only the query rows' (an empty suffix past them), and an empty
sequence; NaN in every unused slot.  ``cache_leftpad`` the same way, with splits, paged and contiguous.
Bad input raises the same errors in both files.
"""
from __future__ import annotations

import random

import pytest
import torch

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


def test_cascade_writes_k_new_and_reads_each_prefix_once():
    """k_new / v_new land in every row's own page first (as flash_decode writes them); and the prefix of
    a group of four rows is read once: the Triton interpreter's count of the prefix kernel's loads is
    one prefix's K/V (plus q and the page ids), and the whole cascade moves fewer bytes than flash_decode
    reading the prefix for every row."""
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
    with observe() as obs:
        cascade(fast, case)
    with observe() as plain:
        decode(fast, case, num_splits=1)
    prefix_kv = 2 * 24 * 2 * 32 * 4                                    # K and V of the 24-key prefix, once
    (prefix_launch,) = [launch for launch in obs.launches if launch.kernel == "_cascade_prefix_kernel"]
    q_bytes, page_ids, group_ids = 4 * 4 * 32 * 4, 4 * 24 * 2, 12 * 2       # per KV head: cu_groups x 2, prefix
    assert prefix_kv <= prefix_launch.read_bytes <= prefix_kv + q_bytes + page_ids + group_ids, \
        prefix_launch.read_bytes
    total = sum(launch.issued_bytes for launch in obs.launches)
    once = sum(launch.issued_bytes for launch in plain.launches)
    print(f"cascade issued {total} B (prefix kernel reads {prefix_launch.read_bytes} B), flash_decode {once} B")
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


def test_a_long_prefix_is_split_across_programs():
    """One group with a long prefix and few rows: the shape gate shares the prefix's key blocks out among
    several programs (their partials merged with the suffix's), and the result is flash_decode's."""
    from observatory import observe
    case64 = group_case(groups=[(32, None, [5, 9])], s_q=1, h_q=4, h_kv=2, d=32, page=16, seed=8)   # 512 keys
    o64, lse64 = decode(ref, case64)
    case = cast(case64, torch.float16)
    o_low, lse_low = cascade(ref, case, upcast=False)
    with observe(unique=False) as obs:
        o, lse = cascade(fast, case)
    (prefix,) = [launch for launch in obs.launches if launch.kernel == "_cascade_prefix_kernel"]
    assert prefix.grid[1] >= 2, prefix.grid                       # (groups x KV heads, splits, row tiles)
    check_close("split prefix out", o, o64, o_low)
    check_close("split prefix lse", lse, lse64, lse_low)
