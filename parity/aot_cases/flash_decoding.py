"""Ahead-of-time build cases for fast/flash_decoding.py (read by parity/aot_compile.py and parity/test_compile.py).

``cases(m)`` takes the fast module ``m`` (imported with the Triton compiler, not the interpreter)
and lists its launches in aot_compile.py's case format, reading the module's private config tables
so that what is built is what the launcher launches.  CI builds each case with its first config;
``make compile-check`` builds every config.
"""
from __future__ import annotations

import torch


def cases(m) -> list[dict]:
    """The decode kernel's distinct launch configs, plus the merge and append kernels."""
    tt = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    cuda = torch.device("cuda")
    i32 = "i32"
    fwd_sig = {name: i32 for name in (
        "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
        "stride_vh", "stride_ob", "stride_os", "stride_oh", "stride_osplit", "stride_lb", "stride_ls", "stride_lh",
        "stride_lsplit", "stride_btb", "H_kv", "GROUP", "S_q", "PAGE_SIZE", "NUM_SPLITS")}
    fwd_sig.update(seqused_ptr="*i32", bt_ptr="*i32", sinks_ptr="*fp32", lse_ptr="*fp32", scale="fp32",
                   softcap="fp32")
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    # (dtype, D, rows = S_q * G, paged, KV alignment).  16-bit: every (BLOCK_M, BLOCK_N, warps, stages)
    # that _fwd_config returns for D = 64 / 128 / 256 (the largest tiles of each BLOCK_D), in bf16, with
    # two fp16 spot checks (same configs); D = 32 for the small head dims.  fp32: BLOCK_M = BLOCK_N = 16,
    # both layouts.  D = 100 / 60 / 63 cover rows aligned to 4 or 1 elements only (8 warps).
    shapes = [(bf16, d, rows, paged, 16) for d in (64, 128, 256) for rows in (8, 32, 64) for paged in (True, False)
              if not (d == 256 and rows == 64)]
    shapes += [(fp16, 128, 8, True, 16), (fp16, 128, 64, False, 16)]
    shapes += [(fp32, d, 8, paged, 16) for d in (64, 128, 256) for paged in (True, False)]
    shapes += [(bf16, 32, 64, True, 16), (fp32, 32, 8, False, 16)]
    shapes += [(bf16, 100, 24, True, 4), (fp32, 100, 8, True, 4), (fp16, 60, 16, False, 4), (bf16, 63, 16, True, 1)]
    cases = []
    for i, (dt, d, rows, paged, align) in enumerate(shapes):
        cfg = m._fwd_config(d, dt, rows, paged, align, cuda)
        split = i % 4 in (0, 3)
        extras = i % 3 != 0
        sig = dict(fwd_sig, q_ptr=f"*{tt[dt]}", k_ptr=f"*{tt[dt]}", v_ptr=f"*{tt[dt]}",
                   o_ptr="*fp32" if split else f"*{tt[dt]}")
        cases.append(dict(
            kernel=m._decode_fwd_kernel,
            name=f"decode_fwd[{tt[dt]},D={d},M={cfg['BLOCK_M']},N={cfg['BLOCK_N']},w{cfg['num_warps']},"
                 f"s{cfg['num_stages']},{'paged' if paged else 'dense'},{'split' if split else 'one'}]",
            signature=sig,
            constexprs=dict(HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                            IS_PAGED=paged, IS_SPLIT=split, HAS_SINKS=extras, HAS_SOFTCAP=extras,
                            DOT_PRECISION="ieee" if dt == fp32 else "tf32", KV_ALIGN=cfg["KV_ALIGN"]),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            # fp32 dots are IEEE (FMA units); wgmma needs a 64-row tile, smaller tiles use mma.sync.
            tensor_cores=dt != fp32, wgmma=cfg["BLOCK_M"] >= 64))
    for dt in (fp16, bf16, fp32):
        for d in (64, 256):
            cases.append(dict(
                kernel=m._merge_splits_kernel, name=f"merge_splits[{tt[dt]},D={d}]",
                signature=dict(po_ptr="*fp32", plse_ptr="*fp32", sinks_ptr="*fp32", o_ptr=f"*{tt[dt]}",
                               lse_ptr="*fp32", stride_ob=i32, stride_os=i32, stride_oh=i32, S_q=i32, H_q=i32,
                               NUM_SPLITS=i32),
                constexprs=dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_S=16, HAS_SINKS=d == 64), num_warps=4, num_stages=1))
            cases.append(dict(
                kernel=m._merge_states_kernel, name=f"merge_states[{tt[dt]},D={d}]",
                signature=dict(oa_ptr=f"*{tt[dt]}", la_ptr="*fp32", ob_ptr=f"*{tt[dt]}", lb_ptr="*fp32",
                               o_ptr=f"*{tt[dt]}", lse_ptr="*fp32", T=i32, H=i32),
                constexprs=dict(HEAD_DIM=d, BLOCK_D=d), num_warps=1 if d <= 128 else 2, num_stages=1))
            cases.append(dict(
                kernel=m._append_kv_kernel, name=f"append_kv[{tt[dt]},D={d}]",
                signature=dict({n: i32 for n in (
                    "stride_knb", "stride_kns", "stride_knh", "stride_vnb", "stride_vns", "stride_vnh", "stride_kb",
                    "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh", "stride_btb", "S_q",
                    "PAGE_SIZE")}, kn_ptr=f"*{tt[dt]}", vn_ptr=f"*{tt[dt]}", k_ptr=f"*{tt[dt]}",
                    v_ptr=f"*{tt[dt]}", seqused_ptr="*i32", bt_ptr="*i32"),
                constexprs=dict(HEAD_DIM=d, BLOCK_D=d, IS_PAGED=d == 64), num_warps=1, num_stages=1))
    return cases
