"""Ahead-of-time build cases for fast/decoder_lm.py (read by parity/aot_compile.py and
parity/test_compile.py).

The model's Triton kernels: the batch-invariant mode's fixed-tile matmul
(``_invariant_matmul_kernel``, y [M, N] = x [M, K] @ W [N, K]^T).  It is never autotuned: each
(GPU family, element size) has one config in ``_INVARIANT_MATMUL_CONFIGS``, read here so that what
is built is what ``_triton_invariant_matmul`` launches.  Each family's config is built on its own
arch (sm_80 for 80, sm_90 for 90), for the row counts a launch sees: M = 1 (Triton makes it a
constant), M divisible by 16 and not (a decode batch, a packed prefill), with K and N the shapes of
a model's projections and of the RMSNorm / log-softmax products with a ones vector (N = 1).
16-bit tiles must use the tensor cores (mma.sync on sm_80, wgmma on sm_90: 64-row tiles); fp32
dots are IEEE on the FMA units.  And the default mode's fused elementwise kernels (``_fused_cases``), built for
both archs.
"""
from __future__ import annotations

import torch

from aot_compile import POINTER_TYPES as _TYPES  # parity/ is on sys.path wherever cases are built
from aot_compile import int_signature as _int_types


def _matmul_case(m, dtype, family, rows, k, n):
    block_m, block_n, block_k, warps, stages = m._invariant_matmul_config(dtype, family)
    signature, constants = _int_types(dict(M=rows, N=n, K=k, stride_xm=k, stride_wn=k, stride_ym=n))
    t = _TYPES[dtype]
    signature.update(x=f"*{t}", w=f"*{t}", y=f"*{t}")
    return dict(
        kernel=m._invariant_matmul_kernel, archs=[family],
        name=f"invariant_matmul[sm{family},{t},M={rows},K={k},N={n}:M{block_m},N{block_n},K{block_k},w{warps},"
             f"s{stages}]",
        signature=signature,
        constexprs=dict(constants, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ROWS_PER_TILE=block_m,
                        PRECISION="ieee" if dtype == torch.float32 else "tf32"),
        num_warps=warps, num_stages=stages,
        tensor_cores=dtype != torch.float32, wgmma=block_m >= 64)


def cases(m) -> list[dict]:
    """Every (family, element size) config, at a decode batch, a packed prefill and one row; bf16 and
    fp16 share the 16-bit config (both built), fp32 its own."""
    shapes = [
        # rows, K, N
        (64, 512, 1536),      # a decode batch through a qkv projection
        (1000, 1408, 512),    # a packed prefill through down_proj (M, K not multiples of the tiles)
        (1, 512, 4096),       # one request's logits
        (37, 64, 1),          # an RMSNorm's mean of squares: a product with a ones vector
    ]
    out = []
    for family in (80, 90):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            out += [_matmul_case(m, dtype, family, *shape) for shape in shapes]
    return out + _fused_cases(m)


def _fused_cases(m) -> list[dict]:
    """The default mode's fused elementwise kernels (``fused_add_rms_norm``, ``fused_norm_rope``,
    ``fused_swiglu``) at Qwen3-0.6B's and Qwen3-8B's widths (hidden 1024 / 4096, head dim 128, FFN 3072 /
    12288) and Qwen3.5's partial rotary (64 of 256 dims), bf16 and fp16, with and without the residual add
    and the zero-centred norm, as the wrappers launch them (num_warps 4, or 8 past 2048 columns)."""
    out = []
    for t in ("bf16", "fp16"):
        for n, res, zero in ((1024, True, False), (1024, False, False), (4096, True, True), (4096, False, False)):
            signature, constants = _int_types(dict(N=n, stride_x=n, stride_r=n, stride_h=n))
            signature.update(x=f"*{t}", res=f"*{t}", h=f"*{t}", y=f"*{t}", w=f"*{t}", eps="fp32")
            out.append(dict(kernel=m._norm_kernel, name=f"norm[{t},N={n},res={res},zero={zero}]",
                            signature=signature, num_warps=4 if n <= 2048 else 8, num_stages=1,
                            constexprs=dict(constants, HAS_RES=res, ZERO_CENTERED=zero,
                                            BLOCK_N=1 << (n - 1).bit_length())))
        # one head kind (q or k: H1 = H), and q's 16 and k's 8 heads of Qwen3-0.6B in one launch (H1 = 16), also
        # writing k's rows and v's into the KV pool (an engine's step: TO_CACHE)
        for d, half, heads, first, zero, to_cache in ((128, 64, 16, 16, False, False), (256, 32, 8, 8, True, False),
                                                      (128, 64, 24, 16, False, False), (128, 64, 24, 16, False, True)):
            signature, constants = _int_types(dict(H=heads, H1=first, stride_t=heads * d * 3, stride_h=d,
                                                   stride_vt=heads * d * 3, stride_vh=d, D=d, HALF=half))
            signature.update(x=f"*{t}", w=f"*{t}", w2=f"*{t}", cos="*fp32", sin="*fp32", out=f"*{t}",
                             out2=f"*{t}", v=f"*{t}", v_out=f"*{t}", slots="*i64", eps="fp32")
            both = f",q+k={first}+{heads - first}" if first < heads else ""
            both += ",to_cache" if to_cache else ""
            out.append(dict(kernel=m._norm_rope_kernel, name=f"norm_rope[{t},D={d},R={2 * half},zero={zero}{both}]",
                            signature=signature, num_warps=4, num_stages=1,
                            constexprs=dict(constants, HAS_NORM=True, ZERO_CENTERED=zero, TO_CACHE=to_cache,
                                            BLOCK_D=d)))
        for n in (3072, 12288):
            signature, constants = _int_types(dict(N=n, stride_g=2 * n, stride_u=2 * n))
            signature.update(gate=f"*{t}", up=f"*{t}", out=f"*{t}")
            out.append(dict(kernel=m._swiglu_kernel, name=f"swiglu[{t},N={n}]", signature=signature, num_warps=4,
                            num_stages=1, constexprs=dict(constants, BLOCK=1024)))
    return out
