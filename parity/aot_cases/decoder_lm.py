"""Ahead-of-time build cases for fast/decoder_lm.py (read by parity/aot_compile.py and
parity/test_compile.py).

The model has one Triton kernel: the batch-invariant mode's fixed-tile matmul
(``_invariant_matmul_kernel``, y [M, N] = x [M, K] @ W [N, K]^T).  It is never autotuned: each
(GPU family, element size) has one config in ``_INVARIANT_MATMUL_CONFIGS``, read here so that what
is built is what ``_triton_invariant_matmul`` launches.  Each family's config is built on its own
arch (sm_80 for 80, sm_90 for 90), for the row counts a launch sees: M = 1 (Triton makes it a
constant), M divisible by 16 and not (a decode batch, a packed prefill), with K and N the shapes of
a model's projections and of the RMSNorm / log-softmax products with a ones vector (N = 1).
16-bit tiles must use the tensor cores (mma.sync on sm_80, wgmma on sm_90: 64-row tiles); fp32
dots are IEEE on the FMA units.
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
    return out
