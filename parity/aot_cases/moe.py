"""Ahead-of-time build cases for fast/moe.py (read by parity/aot_compile.py and parity/test_compile.py).

``cases(m)`` takes the fast module ``m`` (imported with the Triton compiler, not the interpreter) and lists
its launches in aot_compile.py's case format, reading the module's tile tables (``_TILES``,
``_INVARIANT_TILES``, ``_WGRAD_TILES``) so that what is built is what the launchers launch.  The grouped
GEMMs (gate_up, down, act_bwd) are built at every distinct tile config of each (GPU family, element size),
each on its own arch (sm_80 for 80, sm_90 for 90; the batch-invariant mode's 16-bit and fp32 configs are the
default mode's prefill ones, rows filling tiles on a GPU: built once), in two variants that cover
the code paths: Qwen3-30B-A3B's layout (concatenated gate | up, SwiGLU, no biases; the backward's dx through
the down kernel) and gpt-oss-20b's (interleaved, the clamped activation, biases; the forward's down with its
bias and routing weight).  16-bit GEMMs must use the tensor cores (wgmma on sm_90 for 64-row tiles; the
16-row decode tiles are mma.sync there too); fp32 dots are IEEE on the FMA units.  The router, count,
align, combine and MXFP4 kernels have no dots.
"""
from __future__ import annotations

import torch

from aot_compile import POINTER_TYPES as _TYPES  # parity/ is on sys.path wherever cases are built
from aot_compile import int_signature as _ints

I32, I64, F32 = "*i32", "*i64", "*fp32"
# (name, H, I, E, k): the two families' shapes
QWEN3_30B = ("qwen3-30b-a3b", 2048, 768, 128, 8)
GPT_OSS_20B = ("gpt-oss-20b", 2880, 2880, 32, 4)


def _tile_configs(m, dtype, family: int) -> list[tuple]:
    """The distinct (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) a launch on ``family`` can use."""
    elt = 4 if dtype == torch.float32 else 2
    found = [m._TILES[(family, elt, small)] for small in (True, False)] + [m._INVARIANT_TILES[(family, elt)]]
    return list(dict.fromkeys(found))


def _gemm_cases(m, dtype, family: int, tile: tuple) -> list[dict]:
    bm, bn, bk, warps, stages = tile
    t = _TYPES[dtype]
    ptr = f"*{t}"
    cfg = m._Config(bm, bn, bk, warps, stages, bm, m._prec(dtype))
    tc = dtype != torch.float32
    common = dict(archs=[family], tensor_cores=tc, wgmma=bm >= 64, num_stages=stages)
    blocks = dict(ROWS=bm, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=cfg.precision)
    tag = f"sm{family},{t},M{bm},N{bn},K{bk},w{warps},s{stages}"
    out = []
    for (name, h, i, _, k), gpt in ((QWEN3_30B, False), (GPT_OSS_20B, True)):
        # gate_up_proj seen as [E, 2I, H] in its own column order: qwen [E, 2I, H] contiguous, gpt-oss [E, H, 2I]
        w1 = (h * 2 * i, 1, 2 * i) if gpt else (2 * i * h, h, 1)
        w2 = (i * h, 1, h) if gpt else (h * i, i, 1)                              # down_proj seen as [E, H, I]
        b1, b2 = ((2 * i, 1), h) if gpt else ((0, 0), 0)
        variant = dict(ACT=int(gpt), INTERLEAVED=gpt, TOPK=k)
        sig, const = _ints(dict(FFN=i, H=h, stride_xt=h, stride_we=w1[0], stride_wc=w1[1], stride_wk=w1[2],
                                stride_be=b1[0], stride_bc=b1[1], stride_at=i))
        out.append(dict(kernel=m._gate_up_kernel, name=f"gate_up[{name},{tag}]", num_warps=warps, **common,
                        signature=dict(sig, x=ptr, w1=ptr, b1=ptr, a=ptr, sorted_pairs=I32, tile_expert=I32,
                                       tile_rows=I32, used_tiles=I32, limit="fp32", alpha="fp32"),
                        constexprs=dict(const, **blocks, **variant, HAS_BIAS=gpt)))
        act_bn, act_warps = m._act_bwd_tiles(cfg)
        sig, const = _ints(dict(FFN=i, H=h, stride_xt=h, stride_gt=h, stride_w1e=w1[0], stride_w1c=w1[1],
                                stride_w1k=w1[2], stride_b1e=b1[0], stride_b1c=b1[1], stride_w2e=w2[0],
                                stride_w2n=w2[1], stride_w2k=w2[2], stride_b2e=b2, stride_at=i, stride_dht=2 * i,
                                stride_dst=-(-i // act_bn)))
        out.append(dict(kernel=m._act_bwd_kernel, name=f"act_bwd[{name},{tag}:N{act_bn},w{act_warps}]",
                        num_warps=act_warps, **common,
                        signature=dict(sig, x=ptr, dout=ptr, w1=ptr, b1=ptr, w2=ptr, b2=ptr, scale=F32, a=ptr, dh=ptr,
                                       dscale=F32, sorted_pairs=I32, tile_expert=I32, tile_rows=I32, used_tiles=I32,
                                       limit="fp32", alpha="fp32"),
                        constexprs=dict(const, **dict(blocks, BLOCK_N=act_bn), **variant, HAS_BIAS1=gpt,
                                        HAS_BIAS2=gpt)))
        # down: gpt-oss's forward (bias, routing weight); qwen's backward dx = dh W1 (W1 seen as [E, H, 2I])
        n, kk, w, stride_at = (h, i, w2, i) if gpt else (h, 2 * i, (w1[0], w1[2], w1[1]), 2 * i)
        sig, const = _ints(dict(N=n, K=kk, stride_at=stride_at, stride_we=w[0], stride_wn=w[1], stride_wk=w[2],
                                stride_be=b2, stride_yt=h))
        out.append(dict(kernel=m._down_kernel, name=f"down[{name}{',fwd' if gpt else ',dx'},{tag}]",
                        num_warps=warps, **common,
                        signature=dict(sig, a=ptr, w=ptr, bias=ptr, scale=F32, y=ptr, sorted_pairs=I32,
                                       tile_expert=I32, tile_rows=I32, used_tiles=I32),
                        constexprs=dict(const, **blocks, HAS_BIAS=gpt, HAS_SCALE=gpt)))
    return out


def _wgrad_cases(m, dtype, family: int) -> list[dict]:
    bm, bn, bk, warps, stages = m._WGRAD_TILES[4 if dtype == torch.float32 else 2]
    t = _TYPES[dtype]
    ptr = f"*{t}"
    out = []
    for (name, h, i, _, k), gpt in ((QWEN3_30B, False), (GPT_OSS_20B, True)):
        # dW1 (qwen: [E, 2I, H]; left dh rows, right x by token) and dW2 (gpt-oss: [E, I, H] seen as [E, H, I];
        # left dout by token scaled by the routing weight, right a rows)
        n, kk, left, right, dw = (h, i, h, i, (i * h, 1, h)) if gpt else (2 * i, h, 2 * i, h, (2 * i * h, h, 1))
        sig, const = _ints(dict(N=n, K=kk, stride_lt=left, stride_rt=right, stride_we=dw[0], stride_wn=dw[1],
                                stride_wk=dw[2]))
        out.append(dict(kernel=m._wgrad_kernel, name=f"wgrad[{name},{'dW2' if gpt else 'dW1'},sm{family},{t}]",
                        archs=[family], tensor_cores=dtype != torch.float32, num_warps=warps, num_stages=stages,
                        signature=dict(sig, left=ptr, right=ptr, scale=F32, dw=ptr, db=ptr, sorted_pairs=I32,
                                       counts=I32, first_row=I32),
                        constexprs=dict(const, TOPK=k, LEFT_BY_TOKEN=gpt, HAS_SCALE=gpt, HAS_DB=gpt, BLOCK_M=bm,
                                        BLOCK_N=bn, BLOCK_K=bk, PRECISION=m._prec(dtype))))
    return out


def _small_cases(m) -> list[dict]:
    """The kernels without dots, at the block sizes their launchers pick."""
    out = []
    for e, k in ((128, 8), (32, 4), (512, 10)):
        block_e = m._pow2(e)
        block_t, block_p = m._route_rows(block_e), max(16, 8192 // block_e)
        for t in ("bf16", "fp32"):
            sig, const = _ints(dict(T=1000, E=e, stride_t=e))
            out.append(dict(kernel=m._route_kernel, name=f"route[{t},E={e},k={k}]", num_warps=4,
                            signature=dict(sig, logits=f"*{t}", weights=F32, ids=I64),
                            constexprs=dict(const, TOPK=k, OVER_CHOSEN=t == "bf16", BLOCK_T=block_t,
                                            BLOCK_E=block_e)))
        sig, const = _ints(dict(P=8 * 1000, E=e))
        out.append(dict(kernel=m._count_kernel, name=f"count[E={e}]", num_warps=4,
                        signature=dict(sig, ids=I64, chunk_counts=I32),
                        constexprs=dict(const, BLOCK_P=block_p, BLOCK_E=block_e)))
        out.append(dict(kernel=m._align_kernel, name=f"align[E={e}]", num_warps=4,
                        signature=dict(sig, ids=I64, prefix=I32, pos=I32, sorted_pairs=I32, tile_expert=I32,
                                       tile_rows=I32, first_row=I32, used_tiles=I32),
                        constexprs=dict(const, ROWS=64, BLOCK_P=block_p, BLOCK_E=block_e)))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = _TYPES[dtype]
        sig, const = _ints(dict(T=1000, H=2880, stride_yt=2880, stride_ot=2880))
        out.append(dict(kernel=m._combine_kernel, name=f"combine[{t}]", num_warps=4,
                        signature=dict(sig, y=f"*{t}", pos=I32, out=f"*{t}"),
                        constexprs=dict(const, TOPK=8, BLOCK_T=16, BLOCK_H=128)))
        sig, const = _ints(dict(R=5760, G=90))
        out.append(dict(kernel=m._mxfp4_kernel, name=f"mxfp4[{t}]", num_warps=4,
                        signature=dict(sig, blocks="*u8", scales="*u8", out=f"*{t}"),
                        constexprs=dict(const, BLOCK_R=32, BLOCK_G=4)))
    return out


def cases(m) -> list[dict]:
    """The GEMMs at every distinct tile config per (family, dtype) (fp16 compiles as bf16: its prefill
    tile only), the weight gradients, and the small kernels."""
    out = []
    for family in (80, 90):
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            tiles = _tile_configs(m, dtype, family)
            for tile in tiles if dtype != torch.float16 else tiles[-1:]:
                out += _gemm_cases(m, dtype, family, tile)
            if dtype != torch.float16:
                out += _wgrad_cases(m, dtype, family)
    return out + _small_cases(m)
