"""Ahead-of-time build cases for fast/flash_decoding.py (read by parity/aot_compile.py and
parity/test_compile.py).

``cases(m)`` takes the fast module ``m`` (imported with the Triton compiler, not the interpreter)
and lists its launches in aot_compile.py's case format, reading the module's private config table
(``_fwd_config``) so that what is built is what the launcher launches.  The decode kernel is built
with the specialization a real launch gets: Triton turns an int argument equal to 1 into a
constant and marks one divisible by 16 as such, so each case derives its argument types from the
strides and sizes of an example launch (the same arithmetic as ``_flash_decode``).  Every case is
one build (the decode kernel is not autotuned).
"""
from __future__ import annotations

import torch

from aot_compile import POINTER_TYPES as _TYPES  # parity/ is on sys.path wherever cases are built
from aot_compile import int_signature as _int_types


def _example_strides(d, h_q, h_kv, s_q, paged, split, parts, kv_align, seq, page):
    """An example decode launch's block-table width and strides: q [B, S_q, H_q, D]; the cache, a pool of
    ``page``-key pages or ``seq`` contiguous slots, rows padded to ``kv_align``; the partials
    [B, S_q, H_q, parts, D] and their lse [B, S_q, H_q, parts] of a split launch, else views of out and of the
    lse [B, H_q, S_q] (read as (b, i, h))."""
    row = -(-d // kv_align) * kv_align                       # the cache's row stride in elements
    if paged:
        pages_per_seq = seq // page + 1
        k_strides = (page * h_kv * row, h_kv * row, row)     # [num_pages, page_size, H_kv, D]
    else:
        pages_per_seq = 0
        k_strides = (seq * h_kv * row, h_kv * row, row)      # [B, S_max, H_kv, D]
    q_strides = (s_q * h_q * d, h_q * d, d)
    if split:
        part_strides = (s_q * h_q * parts * d, h_q * parts * d, parts * d, d)
        l_strides = (s_q * h_q * parts, h_q * parts, parts, 1)
    else:
        part_strides = (*q_strides, 0)
        l_strides = (h_q * s_q, 1, s_q, 0)
    return pages_per_seq, q_strides, k_strides, part_strides, l_strides


def _decode_case(m, dtype, d, h_q, h_kv, s_q, paged, split, extras, kv_align=16, batch=4, seq=8192, page=16,
                 num_splits=7, invariant_family=None, leftpad=False, fused=None, window=None):
    """The decode kernel's build for one example launch: q [B, S_q, H_q, D], a paged pool of ``page``-key
    pages (or a contiguous cache of ``seq`` slots), ``num_splits`` partials or the output directly.
    ``kv_align`` < 16 pads the cache rows to a multiple of it (head dims like 100 or 63).
    ``invariant_family`` (80 or 90): the batch-invariant launch on that family (its tile, one split).
    ``leftpad``: keys from cache_leftpad on (the mode's second segment).
    ``fused``: the split launch merges its partials itself (flash_decode's); default: split.
    ``window``: a sliding window's left (window_size=(window, 0): each row's first keys masked)."""
    if fused is None:
        fused = split
    if invariant_family is None:
        cfg = m._fwd_config(d, dtype, s_q * (h_q // h_kv), paged, kv_align, torch.device("cuda"))
    else:
        cfg = m._invariant_config(d, dtype, s_q * (h_q // h_kv), h_q // h_kv, kv_align, invariant_family)
    warps = cfg["fused_warps"] if fused else cfg["num_warps"]      # a fused split launch runs more warps
    pages_per_seq, q_strides, k_strides, o_strides, l_strides = _example_strides(
        d, h_q, h_kv, s_q, paged, split, num_splits, kv_align, seq, page)
    names = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
             "stride_vt", "stride_vh", "stride_ob", "stride_os", "stride_oh", "stride_osplit", "stride_lb",
             "stride_ls", "stride_lh", "stride_lsplit", "stride_btb", "H_kv", "GROUP", "S_q", "PAGE_SIZE",
             "NUM_SPLITS", "stride_fb", "stride_fs", "stride_fh", "window_left")
    values = (*q_strides, *k_strides, *k_strides, *o_strides, *l_strides, pages_per_seq, h_kv, h_q // h_kv, s_q,
              page if paged else 1, num_splits if split else 1, *(q_strides if fused else (0, 0, 0)),
              window if window is not None else 0)
    signature, constants = _int_types(dict(zip(names, values)))
    t = _TYPES[dtype]
    signature.update(q_ptr=f"*{t}", k_ptr=f"*{t}", v_ptr=f"*{t}", o_ptr=f"*{t}",
                     seqused_ptr="*i32", bt_ptr="*i32", sinks_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32",
                     softcap="fp32", leftpad_ptr="*i32", out_ptr=f"*{t}", out_lse_ptr="*fp32", count_ptr="*i32")
    layout = ("paged" if paged else "dense") + (",leftpad" if leftpad else "") + (",window" if window else "")
    mode = "" if invariant_family is None else f"invariant sm{invariant_family},"
    return dict(
        kernel=m._decode_fwd_kernel, archs=[80, 90] if invariant_family is None else [invariant_family],
        name=f"decode_fwd[{mode}{t},D={d},S_q={s_q},G={h_q // h_kv},{layout},{'split' if split else 'one'}"
             f"{',fused' if fused else ''}{',sinks+softcap' if extras else ''}"
             f"{f',align{kv_align}' if kv_align < 16 else ''}:"
             f"M={cfg['BLOCK_M']},N={cfg['BLOCK_N']},w{warps},s{cfg['num_stages']}]",
        signature=signature,
        constexprs=dict(constants, HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"],
                        BLOCK_N=cfg["BLOCK_N"], IS_PAGED=paged, IS_SPLIT=split, HAS_SINKS=extras,
                        HAS_SOFTCAP=extras, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                        KV_ALIGN=cfg["KV_ALIGN"], BATCH_INVARIANT=invariant_family is not None,
                        BLOCK_IN_PAGE=paged and page % cfg["BLOCK_N"] == 0 and not leftpad and window is None,
                        HAS_LEFTPAD=leftpad, FUSED_MERGE=fused, HAS_WINDOW=window is not None),
        num_warps=warps, num_stages=cfg["num_stages"],
        # fp32 dots are IEEE (FMA units); wgmma needs a 64-row tile, smaller tiles use mma.sync.
        tensor_cores=dtype != torch.float32, wgmma=cfg["BLOCK_M"] >= 64)


def invariant_decode_case(m, dtype, d, h_q, h_kv, s_q, paged, split, extras, family, kv_align=16, batch=4,
                          seq=8192, page=16, num_splits=9, leftpad=False):
    """``_decode_invariant_kernel``'s build for one example launch on ``family`` (80 or 90): q [B, S_q, H_q, D],
    a paged pool of ``page``-key pages (or a contiguous cache of ``seq`` slots), ``num_splits`` splits over
    the segments of ``seq`` keys (their partials [B, S_q, H_q, segments, D]) or one split; ``leftpad``: keys
    from cache_leftpad on (the engine's second segment)."""
    cfg = m._invariant_config(d, dtype, s_q * (h_q // h_kv), h_q // h_kv, kv_align, family)
    n_seg = -(-seq // cfg["SPLIT"])
    pages_per_seq, q_strides, k_strides, p_strides, l_strides = _example_strides(
        d, h_q, h_kv, s_q, paged, split, n_seg, kv_align, seq, page)
    names = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
             "stride_vt", "stride_vh", "stride_ob", "stride_os", "stride_oh", "stride_pb", "stride_ps", "stride_ph",
             "stride_pseg", "stride_lb", "stride_ls", "stride_lh", "stride_lseg", "stride_btb", "H_kv", "GROUP",
             "S_q", "PAGE_SIZE", "NUM_SPLITS")
    values = (*q_strides, *k_strides, *k_strides, *q_strides, *p_strides, *l_strides, pages_per_seq, h_kv,
              h_q // h_kv, s_q, page if paged else 1, num_splits if split else 1)
    signature, constants = _int_types(dict(zip(names, values)))
    t = _TYPES[dtype]
    signature.update(q_ptr=f"*{t}", k_ptr=f"*{t}", v_ptr=f"*{t}", seqused_ptr="*i32", bt_ptr="*i32",
                     sinks_ptr="*fp32", leftpad_ptr="*i32", out_ptr=f"*{t}", lse_ptr="*fp32", po_ptr=f"*{t}",
                     plse_ptr="*fp32", count_ptr="*i32", qk_scale="fp32", softcap="fp32")
    layout = ("paged" if paged else "dense") + (",leftpad" if leftpad else "")
    stages = 2 * cfg["buffers"] + 1 if paged else cfg["buffers"] + 1
    return dict(
        kernel=m._decode_invariant_kernel, archs=[family],
        name=f"decode_invariant[sm{family},{t},D={d},S_q={s_q},G={h_q // h_kv},{layout},"
             f"{'split' if split else 'one'}{',sinks+softcap' if extras else ''}"
             f"{f',align{kv_align}' if kv_align < 16 else ''}:N={cfg['BLOCK_N']},SPLIT={cfg['SPLIT']},"
             f"w{cfg['num_warps']},s{stages}]",
        signature=signature,
        constexprs=dict(constants, HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_N=cfg["BLOCK_N"], SPLIT=cfg["SPLIT"],
                        IS_PAGED=paged, IS_SPLIT=split, HAS_SINKS=extras, HAS_SOFTCAP=extras,
                        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", KV_ALIGN=cfg["KV_ALIGN"],
                        BLOCK_IN_PAGE=paged and page % cfg["BLOCK_N"] == 0 and not leftpad, HAS_LEFTPAD=leftpad),
        num_warps=cfg["num_warps"], num_stages=stages,
        tensor_cores=dtype != torch.float32, wgmma=False)     # 16-row groups: mma.sync on sm_90 too


def _cascade_case(m, dtype, d, h_q, h_kv, s_q, n, extras=False, page=16, kv_align=16, aligned=True):
    """cascade_decode's one kernel for groups of up to n sequences (n * S_q * G rows in the prefix's row
    tiles, the suffix's rows in the same tile shape), as ``_cascade_decode`` launches it: ``_cascade_config``
    of the prefix's rows and its warps, BLOCK_IN_PAGE when every prefix is
    page-aligned (``aligned``) and BLOCK_N divides the page size.  ``extras``: sinks and softcap."""
    group = h_q // h_kv
    cfg = m._cascade_config(d, dtype, n * s_q * group, kv_align, torch.device("cuda"))
    row = -(-d // kv_align) * kv_align
    k_strides = (page * h_kv * row, h_kv * row, row)
    q_strides = (s_q * h_q * d, h_q * d, d)
    slots = 7 + 3                                                     # the partials [B, S_q, H_q, 7 + 3, D]
    p_strides = (s_q * h_q * slots * d, h_q * slots * d, slots * d, d)
    l_strides = (s_q * h_q * slots, h_q * slots, slots, 1)
    names = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
             "stride_vh", "stride_pb", "stride_ps", "stride_ph", "stride_pj", "stride_lb", "stride_ls", "stride_lh",
             "stride_lj", "stride_ob", "stride_os", "stride_oh", "stride_btb", "H_kv", "GROUP", "S_q", "PAGE_SIZE",
             "N_GROUPS", "P_TILES", "P_SPLITS", "S_TILES", "S_SPLITS", "N_PREFIX", "N_ITEMS")
    batch, n_groups = 4 * n, 4
    p_tiles, s_tiles = -(-n * s_q * group // cfg["BLOCK_M"]), -(-s_q * group // cfg["BLOCK_M"])
    values = (*q_strides, *k_strides, *k_strides, *p_strides, *l_strides, *q_strides, 8192 // page + 1, h_kv, group,
              s_q, page, n_groups, p_tiles, 7, s_tiles, 3, n_groups * p_tiles * 7,
              n_groups * p_tiles * 7 + batch * s_tiles * 3)
    signature, constants = _int_types(dict(zip(names, values)))
    t = _TYPES[dtype]
    signature.update(q_ptr=f"*{t}", k_ptr=f"*{t}", v_ptr=f"*{t}", seqused_ptr="*i32", bt_ptr="*i32",
                     cu_groups_ptr="*i32", prefix_ptr="*i32", sinks_ptr="*fp32", po_ptr=f"*{t}", plse_ptr="*fp32",
                     out_ptr=f"*{t}", lse_ptr="*fp32", count_ptr="*i32", qk_scale="fp32", softcap="fp32")
    in_page = aligned and page % cfg["BLOCK_N"] == 0
    return dict(
        kernel=m._cascade_fwd_kernel, archs=[80, 90],
        name=f"cascade_fwd[{t},D={d},n={n},S_q={s_q},G={group},page{page}{',in_page' if in_page else ''}"
             f"{',sinks+softcap' if extras else ''}{f',align{kv_align}' if kv_align < 16 else ''}:"
             f"M={cfg['BLOCK_M']},N={cfg['BLOCK_N']},w{cfg['warps']},s{cfg['num_stages']}]",
        signature=signature,
        constexprs=dict(constants, HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                        HAS_SINKS=extras, HAS_SOFTCAP=extras, KV_ALIGN=kv_align, BLOCK_IN_PAGE=in_page,
                        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32"),
        num_warps=cfg["warps"], num_stages=cfg["num_stages"],
        tensor_cores=dtype != torch.float32, wgmma=cfg["BLOCK_M"] >= 64)


def cases(m) -> list[dict]:
    """The decode kernel at every tile class _fwd_config returns, plus the merge and append kernels.

    16-bit: head dims 64 / 128 / 256; decode (S_q = 1, G = 4 / 8 / 16: 16-row tiles) and speculative
    verification (S_q = 4 and 16: 32- and 64-row tiles), paged and contiguous, split and not, with and
    without sinks + softcap; bf16 throughout, fp16 where the roofline report measures (D = 128).
    fp32: 16 x 16 tiles, both layouts.  Head dims 32 / 60 / 63 / 100 cover the small and unaligned rows.
    """
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    launches = [
        # dtype, D, H_q, H_kv, S_q, paged, split, sinks + softcap
        (fp16, 128, 8, 2, 1, True, True, False),       # the roofline shape: B = 4, page 16, GQA 8/2
        (fp16, 128, 8, 2, 1, False, True, False),
        (bf16, 128, 32, 8, 1, True, False, True),
        (bf16, 128, 32, 8, 1, False, False, False),
        (bf16, 128, 64, 4, 1, True, True, True),       # G = 16
        (bf16, 128, 16, 2, 4, True, True, False),      # 32 rows
        (bf16, 128, 16, 2, 4, False, False, True),
        (bf16, 128, 8, 2, 16, True, False, True),      # 64 rows (wgmma)
        (fp16, 128, 8, 2, 16, False, True, False),
        (bf16, 64, 8, 2, 1, True, True, True),
        (bf16, 64, 8, 2, 1, False, False, False),
        (bf16, 64, 8, 2, 16, True, False, False),
        (bf16, 256, 8, 2, 1, True, False, True),
        (bf16, 256, 8, 2, 1, False, True, False),
        (bf16, 256, 16, 2, 4, True, True, True),
        (fp32, 64, 8, 2, 1, True, False, True),
        (fp32, 128, 8, 2, 1, True, True, False),
        (fp32, 128, 8, 2, 2, False, False, True),
        (fp32, 256, 8, 2, 1, False, True, False),
        (bf16, 32, 16, 2, 1, True, True, False),
        (fp32, 32, 8, 2, 1, False, False, True),
    ]
    cases = [_decode_case(m, *launch) for launch in launches]
    # batch_invariant=True: _decode_invariant_kernel on each family, split (the fused merge over segment
    # partials) and not.  Decoding (G = 4 / 8, paged and contiguous, D = 64 / 128 / 256, sinks + softcap),
    # speculative rows, fp16, fp32, and rows aligned to 4 elements.
    for family in (80, 90):
        cases += [invariant_decode_case(m, *launch, family) for launch in [
            (fp16, 128, 8, 2, 1, True, True, False),       # the roofline shape
            (fp16, 128, 8, 2, 1, False, True, False),
            (bf16, 128, 32, 8, 1, True, False, True),
            (bf16, 128, 32, 8, 1, True, True, True),
            (bf16, 128, 64, 8, 1, False, False, False),
            (bf16, 64, 8, 2, 1, True, True, True),
            (bf16, 256, 8, 2, 1, True, False, True),
            (bf16, 256, 8, 2, 1, True, True, False),
            (fp16, 128, 16, 2, 4, True, False, False),
            (fp32, 128, 8, 2, 1, True, True, True),
            (fp32, 64, 8, 2, 1, False, False, False)]]
        cases.append(invariant_decode_case(m, bf16, 100, 8, 2, 1, True, True, True, family, kv_align=4))
        # The engine's second segment (keys from the prompt's end: cache_leftpad), decoding and recomputing.
        cases += [invariant_decode_case(m, bf16, 128, 32, 8, 1, True, True, False, family, leftpad=True),
                  invariant_decode_case(m, fp32, 64, 8, 2, 3, True, False, False, family, leftpad=True)]
    # cascade_decode's one kernel: the GRPO shape (8 samples x GQA 8/2 = 32 rows per prefix tile, fp16, the
    # roofline case), a group of 16 verifying 4 rows (256 rows: 4 prefix tiles, 2 query tiles a row), head
    # dims 64 / 256 / 100 (rows aligned to 4), fp32, sinks + softcap, a page size that BLOCK_N does not divide.
    for dtype, d, h_q, h_kv, s_q, n, extras, page, align in (
            (fp16, 128, 8, 2, 1, 8, False, 16, 16), (bf16, 128, 32, 8, 4, 16, True, 16, 16),
            (bf16, 64, 8, 2, 1, 4, True, 16, 16), (bf16, 256, 8, 2, 1, 8, False, 16, 16),
            (fp32, 128, 8, 2, 1, 8, True, 16, 16), (bf16, 100, 8, 2, 1, 8, False, 16, 4),
            (fp16, 128, 8, 2, 1, 8, True, 3, 16), (bf16, 128, 16, 2, 1, 1, False, 16, 16)):
        cases.append(_cascade_case(m, dtype, d, h_q, h_kv, s_q, n, extras, page=page, kv_align=align))
    # flash_decode with cache_leftpad, split: its fused merge.
    cases.append(_decode_case(m, bf16, 128, 8, 2, 1, True, True, True, leftpad=True, fused=True))
    # A sliding layer's verification (window_size=(127, 0)): gpt-oss's shape, D = 64, GQA 64/8, 4 rows, sinks.
    cases.append(_decode_case(m, bf16, 64, 64, 8, 4, True, True, True, window=127))
    # Rows aligned to 4 or 1 elements only (8 warps, narrower vectors).
    cases += [_decode_case(m, bf16, 100, 8, 2, 3, True, True, True, kv_align=4),
              _decode_case(m, fp32, 100, 8, 2, 1, True, False, False, kv_align=4),
              _decode_case(m, fp16, 60, 8, 2, 2, False, True, False, kv_align=4),
              _decode_case(m, bf16, 63, 8, 2, 2, True, False, True, kv_align=1)]
    i32 = "i32"
    for dt in (fp16, bf16, fp32):
        t = _TYPES[dt]
        for d in (64, 256):
            cases.append(dict(
                kernel=m._merge_splits_kernel, name=f"merge_splits[{t},D={d}]",
                signature=dict(po_ptr=f"*{t}", plse_ptr="*fp32", sinks_ptr="*fp32", o_ptr=f"*{t}",
                               lse_ptr="*fp32", stride_ob=i32, stride_os=i32, stride_oh=i32, S_q=i32, H_q=i32,
                               NUM_SPLITS=i32),
                constexprs=dict(HEAD_DIM=d, BLOCK_D=d, HAS_SINKS=d == 64), num_warps=4, num_stages=1))
            cases.append(dict(
                kernel=m._merge_states_kernel, name=f"merge_states[{t},D={d}]",
                signature=dict(oa_ptr=f"*{t}", la_ptr="*fp32", ob_ptr=f"*{t}", lb_ptr="*fp32",
                               o_ptr=f"*{t}", lse_ptr="*fp32", T=i32, H=i32),
                constexprs=dict(HEAD_DIM=d, BLOCK_D=d), num_warps=1 if d <= 128 else 2, num_stages=1))
            cases.append(dict(
                kernel=m._append_kv_kernel, name=f"append_kv[{t},D={d}]",
                signature=dict({n: i32 for n in (
                    "stride_knb", "stride_kns", "stride_knh", "stride_vnb", "stride_vns", "stride_vnh", "stride_kb",
                    "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh", "stride_btb", "S_q",
                    "PAGE_SIZE")}, kn_ptr=f"*{t}", vn_ptr=f"*{t}", k_ptr=f"*{t}",
                    v_ptr=f"*{t}", seqused_ptr="*i32", bt_ptr="*i32"),
                constexprs=dict(HEAD_DIM=d, BLOCK_D=d, IS_PAGED=d == 64), num_warps=1, num_stages=1))
    return cases
