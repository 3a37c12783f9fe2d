"""Index arithmetic past 2^31 elements, in every kernel family, caught on CPU.

A Triton kernel that forms an offset in int32 (``i * stride`` with both int32) wraps past 2^31
elements and reads or writes someone else's memory on a GPU.  Here each family runs with a tensor
argument of more than 2^31 elements whose first and last elements are used: a K/V page pool with
pages at both ends, a batch of caches, a packed tensor with many heads, a batch of recurrent
states.  The tensors come from ``torch.empty`` (4-9 GB each, allocated lazily: only the pages
the test touches cost memory).  The Triton interpreter computes indices in numpy int32 wherever
Triton would (parity/test_observatory.py shows a planted int32 product failing), and the
observatory's sanitizer (parity/observatory.py) stops any lane outside the launch's tensors.

Where a grid would have millions of programs, only the programs within a few of either end of
the large axis run (``both_ends``): those compute the largest offsets; every program skipped
computes the same expressions with smaller values.  Each result at the far end is compared,
bit for bit, with the same kernel run on a small copy of the same data (same tiles, same order
of operations: only the addresses differ).
"""
from __future__ import annotations

import gc

import pytest
import torch

from conftest import INTERPRET, make_generator, randn
from observatory import both_ends, observe

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the bounds sanitizer instruments the Triton interpreter")

BIG = 2 ** 31
fp16 = torch.float16


@pytest.fixture(autouse=True)
def _free_memory():
    """The tensors here are gigabytes of address space: release them before the next test."""
    yield
    gc.collect()


def huge(*shape, dtype=fp16) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    assert numel > BIG
    need_address_space(numel * torch.finfo(dtype).bits // 8)
    return torch.empty(*shape, dtype=dtype)       # lazily backed: untouched pages cost nothing


def need_address_space(nbytes: int):
    """Linux reserves address space lazily, but its default (heuristic) overcommit refuses a single
    allocation larger than RAM + swap: on a machine that small the test cannot run, and says so."""
    try:
        torch.empty(nbytes, dtype=torch.uint8)       # reserved, never touched, released at once
    except RuntimeError as e:
        pytest.skip(f"cannot reserve {nbytes / 2**30:.1f} GiB of address space in one allocation here: {e}")


def assert_same(name: str, big: torch.Tensor, small: torch.Tensor):
    assert big.shape == small.shape, f"{name}: shape {tuple(big.shape)} != {tuple(small.shape)}"
    nan = torch.isnan(small)
    assert not nan.all(), f"{name}: nothing computed"
    same = (big == small) | (nan & torch.isnan(big))
    assert same.all(), f"{name}: {int((~same).sum())} elements differ at large offsets, first at " \
                       f"{(~same).nonzero()[:3].tolist()}"


def launched(obs, kernel: str) -> list:
    runs = [r for r in obs.launches if r.kernel == kernel]
    assert runs, f"{kernel} did not run: {sorted({r.kernel for r in obs.launches})}"
    return runs


# ----------------------------------------------------------------------------- attention

def test_varlen_forward_paged_pool_past_2_31():
    """Two sequences whose pages are the first and the last of a 524,290-page pool (2^31 + 8192
    fp16 elements per K and V)."""
    from fast.paged_varlen_attention import varlen_attn
    page, h_kv, group, d, length = 16, 2, 4, 128, 32
    pages = BIG // (page * h_kv * d) + 2
    gen = make_generator(40)
    k_pool, v_pool = huge(pages, page, h_kv, d), huge(pages, page, h_kv, d)
    table = torch.tensor([[0, 1], [pages - 2, pages - 1]], dtype=torch.int32)
    small_k, small_v = torch.empty(4, page, h_kv, d, dtype=fp16), torch.empty(4, page, h_kv, d, dtype=fp16)
    for i, p in enumerate(table.flatten().tolist()):
        k_pool[p] = small_k[i] = randn(page, h_kv, d, gen=gen, dtype=fp16)
        v_pool[p] = small_v[i] = randn(page, h_kv, d, gen=gen, dtype=fp16)
    q = randn(2 * length, h_kv * group, d, gen=gen, dtype=fp16)
    cu = torch.tensor([0, length, 2 * length], dtype=torch.int32)
    used = torch.tensor([length, length - 5], dtype=torch.int32)
    kwargs = dict(window_size=(-1, 0), enable_gqa=True, seqused_k=used)
    with observe(unique=False) as obs:
        big = varlen_attn(q, k_pool, v_pool, cu, None, length, length, block_table=table, **kwargs)
    assert max(r.args["k_ptr"][1] for r in launched(obs, "_attn_fwd_kernel")) > BIG
    small = varlen_attn(q, small_k, small_v, cu, None, length, length,
                        block_table=torch.arange(4, dtype=torch.int32).view(2, 2), **kwargs)
    assert_same("out", big, small)


def test_varlen_backward_packed_past_2_31():
    """Packed q, k, v of 32 tokens x 270,601 heads x 256 (2.2e9 elements): the last token's row starts
    past 2^31.  The heads at both ends run (every head is independent of the others)."""
    from fast.paged_varlen_attention import varlen_attn
    t, d = 32, 256
    heads = BIG // ((t - 1) * d) + 1
    gen = make_generator(41)
    ends = [0, 1, heads - 2, heads - 1]
    big = [huge(t, heads, d) for _ in range(4)]                     # q, k, v, dO
    small = [torch.empty(t, 4, d, dtype=fp16) for _ in range(4)]
    for b, s in zip(big, small):
        for j, h in enumerate(ends):
            b[:, h] = s[:, j] = randn(t, d, gen=gen, dtype=fp16)
    cu = torch.tensor([0, 16, t], dtype=torch.int32)

    def attention(q, k, v, do):
        leaves = [x.requires_grad_(True) for x in (q, k, v)]
        out = varlen_attn(*leaves, cu, cu, 16, 16, window_size=(-1, 0))
        return (out, *torch.autograd.grad(out, leaves, do))

    with observe(unique=False, programs=both_ends(2, axes=(1,))) as obs:
        got = attention(*big)
    for kernel in ("_attn_fwd_kernel", "_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
        assert launched(obs, kernel)[0].programs_run < 20
    want = attention(*small)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_same(name, g[:, ends].detach(), w.detach())


# ----------------------------------------------------------------------------- decoding and merging

def test_flash_decode_contiguous_batch_past_2_31():
    """131,073 caches of 64 keys (2^31 + 16,384 fp16 elements in K and in V); the first and the last
    sequence get a new key appended and attend (one split: batch-invariant, so bitwise comparable)."""
    from fast.flash_decoding import flash_decode
    b, s_max, h_kv, group, d = BIG // (64 * 2 * 128) + 1, 64, 2, 4, 128
    gen = make_generator(42)
    caches = [huge(b, s_max, h_kv, d) for _ in range(2)]
    small = [torch.empty(2, s_max, h_kv, d, dtype=fp16) for _ in range(2)]
    for c, s in zip(caches, small):
        c[0] = s[0] = randn(s_max, h_kv, d, gen=gen, dtype=fp16)
        c[-1] = s[1] = randn(s_max, h_kv, d, gen=gen, dtype=fp16)
    q, new = torch.empty(b, 1, h_kv * group, d, dtype=fp16), [torch.empty(b, 1, h_kv, d, dtype=fp16) for _ in range(2)]
    for x in (q, *new):
        x[0], x[-1] = randn(*x.shape[1:], gen=gen, dtype=fp16), randn(*x.shape[1:], gen=gen, dtype=fp16)
    used = torch.full((b,), 40, dtype=torch.int32)
    used[-1] = s_max
    with observe(unique=False, programs=both_ends(2, axes=(0,))) as obs:
        out = flash_decode(q, *caches, used, k_new=new[0], v_new=new[1], num_splits=1)
    assert launched(obs, "_append_kv_kernel")[0].programs_run == 8    # rows 0, 1, B-2, B-1 x 2 heads
    assert launched(obs, "_decode_fwd_kernel")[0].programs_run == 4
    want = flash_decode(q[[0, -1]], *small, used[[0, -1]], k_new=new[0][[0, -1]], v_new=new[1][[0, -1]],
                        num_splits=1)
    assert_same("out", out[[0, -1]], want)
    for c, s in zip(caches, small):
        assert_same("appended cache", c[[0, -1]], s)


def test_flash_decode_paged_pool_past_2_31():
    """Two sequences on the first and the last pages of a 524,290-page pool, split four ways and merged (by
    the decode kernel's last program of each tile)."""
    from fast.flash_decoding import flash_decode
    page, h_kv, group, d = 16, 2, 4, 128
    pages = BIG // (page * h_kv * d) + 2
    gen = make_generator(43)
    pools = [huge(pages, page, h_kv, d) for _ in range(2)]
    table = torch.tensor([[0, 1, 2, 3], [pages - 4, pages - 3, pages - 2, pages - 1]], dtype=torch.int32)
    small = [torch.empty(8, page, h_kv, d, dtype=fp16) for _ in range(2)]
    for pool, s in zip(pools, small):
        for i, p in enumerate(table.flatten().tolist()):
            pool[p] = s[i] = randn(page, h_kv, d, gen=gen, dtype=fp16)
    q = randn(2, 2, h_kv * group, d, gen=gen, dtype=fp16)                 # two query rows (speculative)
    used = torch.tensor([50, 64], dtype=torch.int32)
    with observe(unique=False) as obs:
        out = flash_decode(q, *pools, used, block_table=table, num_splits=4)
    assert launched(obs, "_decode_fwd_kernel")[0].grid[1] == 4
    assert not [r for r in obs.launches if r.kernel == "_merge_splits_kernel"]    # merged in the decode kernel
    want = flash_decode(q, *small, used, block_table=torch.arange(8, dtype=torch.int32).view(2, 4), num_splits=4)
    assert_same("out", out, want)


def test_merges_past_2_31(monkeypatch):
    """merge_attention_states on 524,289 rows of head dim 4096 (2^31 + 4,096 elements; a wide head
    keeps the grid small: the interpreter visits every grid point, even skipped ones), and
    flash_decode's split merge over fp16 partials of 2^31 + 65,536 elements (32,769 sequences x 4
    query rows x 4 heads x 32 splits x 128), the first and the last sequence computed: merged in the
    decode kernel (the default) and by _merge_splits_kernel (cascade_decode's merge)."""
    import fast.flash_decoding as fd
    from fast.flash_decoding import flash_decode, merge_attention_states
    gen = make_generator(44)
    d = 4096
    rows = BIG // d + 1
    outs = [huge(1, rows, 1, d) for _ in range(2)]
    lses = [torch.empty(1, 1, rows) for _ in range(2)]
    ends = [0, 1, rows - 2, rows - 1]
    for o, lse in zip(outs, lses):
        o[0, ends] = randn(4, 1, d, gen=gen, dtype=fp16)
        lse[0, 0, ends] = randn(4, gen=gen)
    with observe(unique=False, programs=both_ends(2)) as obs:
        out, lse = merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    assert launched(obs, "_merge_states_kernel")[0].programs_run == 4
    want_out, want_lse = merge_attention_states(outs[0][0, ends][None], lses[0][..., ends],
                                                outs[1][0, ends][None], lses[1][..., ends])
    assert_same("merged out", out[0, ends][None], want_out)
    assert_same("merged lse", lse[..., ends], want_lse)
    del outs, lses, out, lse
    gc.collect()

    s_q, group, splits, d = 4, 4, 32, 128
    b, s_max = BIG // (s_q * group * splits * d) + 1, 512
    need_address_space(b * s_q * group * splits * d * 2)             # flash_decode's fp16 partials
    caches = [torch.empty(b, s_max, 1, d, dtype=fp16) for _ in range(2)]
    small = [torch.empty(2, s_max, 1, d, dtype=fp16) for _ in range(2)]
    for c, s in zip(caches, small):
        c[0] = s[0] = randn(s_max, 1, d, gen=gen, dtype=fp16)
        c[-1] = s[1] = randn(s_max, 1, d, gen=gen, dtype=fp16)
    q = torch.empty(b, s_q, group, d, dtype=fp16)
    q[0], q[-1] = randn(s_q, group, d, gen=gen, dtype=fp16), randn(s_q, group, d, gen=gen, dtype=fp16)
    used = torch.full((b,), s_max, dtype=torch.int32)
    used[0] = s_max - 100
    decode_ends = both_ends(1, axes=(0,), kernels=("_decode_fwd_kernel",))     # sequences 0 and B-1
    merge_ends = both_ends(s_q * group, kernels=("_merge_splits_kernel",))       # their rows
    for fused in (True, False):
        monkeypatch.setattr(fd, "_FUSED_MERGE", fused)
        with observe(unique=False, programs=lambda *at: decode_ends(*at) and merge_ends(*at)) as obs:
            out = flash_decode(q, *caches, used, num_splits=splits)
        [decode] = launched(obs, "_decode_fwd_kernel")
        assert decode.grid[1] == splits
        # fp16 partials: bytes > 2 x 2^31, read by the decode kernel's last programs or the merge kernel
        merges = [r for r in obs.launches if r.kernel == "_merge_splits_kernel"]
        assert len(merges) == (0 if fused else 1)
        assert (decode.args["o_ptr"] if fused else merges[0].args["po_ptr"])[1] > 2 * BIG
        want = flash_decode(q[[0, -1]], *small, used[[0, -1]], num_splits=splits)
        assert_same(f"split-merged out ({'fused' if fused else 'merge kernel'})", out[[0, -1]], want)


# ----------------------------------------------------------------------------- Gated DeltaNet

def _gdn_batch(gen, n_seqs: int, lengths: dict, h: int, hv: int, dk: int):
    """Varlen GDN inputs: ``n_seqs`` sequences, empty except those in ``lengths`` {index: length};
    a batch of initial states [n_seqs, HV, K, K] fp32 with > 2^31 elements, filled at those."""
    cu = torch.zeros(n_seqs + 1, dtype=torch.int64)
    for i, n in lengths.items():
        cu[i + 1] = n
    cu = cu.cumsum(0)
    t = int(cu[-1])
    q, k = randn(1, t, h, dk, gen=gen, dtype=fp16), randn(1, t, h, dk, gen=gen, dtype=fp16)
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(fp16)
    v, do = randn(1, t, hv, dk, gen=gen, dtype=fp16), randn(1, t, hv, dk, gen=gen, dtype=fp16)
    g = torch.nn.functional.logsigmoid(randn(1, t, hv, gen=gen))
    beta = torch.sigmoid(randn(1, t, hv, gen=gen)).to(fp16)
    h0, dht = huge(n_seqs, hv, dk, dk, dtype=torch.float32), huge(n_seqs, hv, dk, dk, dtype=torch.float32)
    for i in lengths:
        h0[i] = randn(hv, dk, dk, gen=gen, scale=0.1)
        dht[i] = randn(hv, dk, dk, gen=gen, scale=0.1)
    return dict(q=q, k=k, v=v, g=g, beta=beta, do=do, h0=h0, dht=dht, cu=cu)


def _gdn_run(fn, x: dict, h0, dht, cu):
    leaves = [x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    state = h0.requires_grad_(True)
    q, k, v, g, beta = leaves                    # by keyword: fla's recurrent form has gk, gv before beta
    o, final = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, cu_seqlens=cu)
    grads = torch.autograd.grad((o, final), [*leaves, state], (x["do"], dht))
    return o.detach(), final.detach(), [gr.detach() for gr in grads]


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_gated_deltanet_state_batch_past_2_31(op):
    """65,537 sequences x 2 value heads of fp32 [128, 128] states (2^31 + 32,768 elements) in and
    out, forward and backward; the four sequences at the ends are non-empty, the rest empty.  Every
    per-sequence program at both ends runs."""
    from fast.gated_deltanet import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    fn = chunk_gated_delta_rule if op == "chunk" else fused_recurrent_gated_delta_rule
    n, h, hv, dk = BIG // (2 * 128 * 128) + 1, 1, 2, 128
    # the chunk form: the last sequence spans two chunks; the recurrence steps token by token (short)
    lengths = {0: 40, 1: 24, n - 2: 30, n - 1: 74} if op == "chunk" else {0: 3, 1: 1, n - 2: 2, n - 1: 4}
    x = _gdn_batch(make_generator(45), n, lengths, h, hv, dk)
    with observe(unique=False, programs=both_ends(4)) as obs:
        o, final, grads = _gdn_run(fn, x, x["h0"], x["dht"], x["cu"])
    state_kernels = ("_chunk_h_kernel", "_chunk_dhu_kernel") if op == "chunk" else \
        ("_recurrent_kernel", "_recurrent_bwd_kernel")
    for kernel in state_kernels:
        for r in launched(obs, kernel):       # the chunk form's state pass runs again in the backward
            assert max(size for _, size in r.args.values()) > 4 * BIG and r.programs_run <= 8 * r.grid[0]
    ends = list(lengths)
    small_cu = torch.tensor([0, *torch.tensor(list(lengths.values())).cumsum(0).tolist()])
    want_o, want_final, want_grads = _gdn_run(fn, x, x["h0"][ends].clone(), x["dht"][ends].clone(), small_cu)
    assert_same("o", o, want_o)
    assert_same("final state", final[ends], want_final)
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, want_grads):
        assert_same(name, got, want)
    assert_same("d initial_state", grads[5][ends], want_grads[5])
