"""OpenBLAS's SkylakeX (AVX-512) sgemm, emulated bit for bit for the Triton interpreter's ``tl.dot``.

Why
    Under ``TRITON_INTERPRET=1`` every ``tl.dot`` is ``np.matmul``, i.e. numpy's OpenBLAS, and which
    kernel family OpenBLAS runs (``OPENBLAS_CORETYPE``) decides how each dot is rounded.  A tolerance
    that holds under this machine's family may not hold under another (issue 38: a Gated DeltaNet
    gradient passed on AMD machines, Haswell / Zen kernels, and failed on an AVX-512 Xeon).  A CPU
    without AVX-512 cannot run the SkylakeX kernels (``OPENBLAS_CORETYPE=SkylakeX`` dies on an illegal
    instruction), so this module computes what they compute, for the dots the kernels issue:
    ``TWOFOLD_EMULATE_OPENBLAS=SkylakeX`` (read by conftest.py) replaces the interpreter's dot with it.

What numpy 2.x and OpenBLAS 0.3.2x-0.3.3x do with a small fp32 ``A [M, K] @ B [K, N]``
    numpy (``umath/matmul.c.src``): an operand whose last axis is contiguous is passed as it is
    (``NoTrans``), one whose first axis is contiguous as its transpose (``Trans``), anything else is
    copied first; ``A @ A.T`` on the same memory becomes ``cblas_ssyrk``; the rest is
    ``cblas_sgemm(RowMajor, trans_a, trans_b, M, N, K, 1, A, B, 0, C)``.
    OpenBLAS (``interface/gemm.c``, ``kernel/x86_64/*skylakex*``):
      * NoTrans x NoTrans: the "direct" AVX-512 kernel (``sgemm_direct_skylakex.c``);
      * otherwise the row-major call is the column-major product C^T = B^T A^T; the small-matrix
        kernels take it when ``sgemm_small_kernel_permit_skylakex.c`` allows (M N K <= 10^6; for the
        "TN" kernel also M N <= 1200 and K >= 32; for "TT" K >= 4), else the packed 16x4 kernel;
      * syrk runs the packed kernel.
    Every one of them but one accumulates each output as a chain of fused multiply-adds over k from
    0 (``seq_fma``).  The exception, the small "TN" kernel (numpy's ``A @ B`` with B transposed in
    memory), keeps 16 partial sums (lane l takes k = l, l + 16, ...) and adds the lanes at the end
    in REDUCE_4's fixed tree: ((x0 + x1) + (x2 + x3)) per quarter, then (q0 + q1) + (q2 + q3).

Checked against
    The issue's figure: with the gate sums of 304c3aa, ``OPENBLAS_CORETYPE=SkylakeX`` gave the chunk
    backward's dv a max error of 3.345e-05 on the AVX-512 Xeon; this emulation gives 3.345e-05 on an
    AMD EPYC (parity/test_numerics_blas.py keeps that case).  On a CPU with AVX-512,
    ``test_emulation_equals_native_skylakex`` compares it with the real kernels on every path above.

Scope
    fp32 operands and accumulator, 2-D or batched 3-D dots, M, N, K >= 16 (``tl.dot``'s minimum);
    16-bit operands are cast to fp32 first (C order), as numpy's casting copy is.  Anything else
    raises NotImplementedError rather than guess.
"""
from __future__ import annotations

import numpy as np

F32, F64 = np.float32, np.float64


def fma32(acc: np.ndarray, prod: np.ndarray) -> np.ndarray:
    """round_fp32(acc + prod) with one rounding (a fused multiply-add), for fp32 ``acc`` and an exact
    fp64 product ``prod`` of two fp32 numbers.  The fp64 sum is rounded to odd (its error, from
    TwoSum, sets the last bit), which makes the final rounding to fp32 the correct one (53 >= 24 + 2)."""
    a = acc.astype(F64)
    s = a + prod
    bb = s - a
    err = (a - (s - bb)) + (prod - bb)
    inexact_even = (err != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(inexact_even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def seq_fma(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C_ij = fma(a_i,K-1, b_K-1,j, ... fma(a_i1, b_1j, fma(a_i0, b_0j, 0)))."""
    a64, b64 = a.astype(F64), b.astype(F64)
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=F32)
    for k in range(a.shape[1]):
        acc = fma32(acc, np.outer(a64[:, k], b64[k]))
    return acc


def lanes16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The small TN kernel: 16 fma chains (lane l over k = l, l + 16, ...), then REDUCE_4's tree."""
    a64, b64 = a.astype(F64), b.astype(F64)
    lanes = np.zeros((16, a.shape[0], b.shape[1]), dtype=F32)
    for k in range(a.shape[1]):
        lanes[k % 16] = fma32(lanes[k % 16], np.outer(a64[:, k], b64[k]))
    quarters = [(lanes[4 * q] + lanes[4 * q + 1]) + (lanes[4 * q + 2] + lanes[4 * q + 3]) for q in range(4)]
    return (quarters[0] + quarters[1]) + (quarters[2] + quarters[3])


def _blasable(stride_slow: int, stride_fast: int, n_fast: int, itemsize: int = 4) -> bool:
    """numpy's is_blasable2d: the fast axis contiguous, the slow one a whole row or more apart."""
    return stride_fast == itemsize and stride_slow % itemsize == 0 and stride_slow // itemsize >= n_fast


def _path(a: np.ndarray, b: np.ndarray) -> tuple[str, np.ndarray, np.ndarray]:
    """Which SkylakeX kernel numpy's ``a @ b`` reaches, and the operands as that call sees them."""
    m, k = a.shape
    n = b.shape[1]
    if min(m, n, k) < 2:
        raise NotImplementedError(f"emulated OpenBLAS: a vector product {a.shape} @ {b.shape} (gemv/dot)")

    def as_blas(x, rows, cols):
        if _blasable(x.strides[0], x.strides[1], cols):
            return x, False
        if _blasable(x.strides[1], x.strides[0], rows):
            return x, True
        transposed = abs(x.strides[0]) < abs(x.strides[1])          # numpy copies in the nearer layout
        return (np.asfortranarray(x) if transposed else np.ascontiguousarray(x)), transposed

    a, trans_a = as_blas(a, m, k)
    b, trans_b = as_blas(b, k, n)
    same = a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    if same and m == n and a.strides == b.strides[::-1] and trans_a != trans_b:
        return "syrk", a, b
    if not trans_a and not trans_b:
        return "direct", a, b
    # column-major C^T = B^T A^T: OpenBLAS's transa is numpy's trans_b, its m is numpy's n
    if m * n * k > 1e6:
        return "packed", a, b
    if trans_b and not trans_a:
        return ("small_tn", a, b) if n * m <= 1200 and k >= 32 else ("packed", a, b)
    if trans_a and not trans_b:
        return "small_nt", a, b
    return ("small_tt", a, b) if k >= 4 else ("packed", a, b)


def skylakex_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in fp32 as numpy's OpenBLAS computes it under ``OPENBLAS_CORETYPE=SkylakeX``."""
    if a.ndim == 3:
        return np.stack([skylakex_matmul(x, y) for x, y in zip(a, b)])
    if a.ndim != 2 or b.ndim != 2:
        raise NotImplementedError(f"emulated OpenBLAS: operands of shapes {a.shape} and {b.shape}")
    if a.dtype != F32 or b.dtype != F32:
        if {a.dtype, b.dtype} <= {np.dtype(np.float16), np.dtype(F32)}:
            a, b = np.ascontiguousarray(a, dtype=F32), np.ascontiguousarray(b, dtype=F32)
        else:
            raise NotImplementedError(f"emulated OpenBLAS: operand dtypes {a.dtype}, {b.dtype}")
    kind, a, b = _path(a, b)
    if kind == "small_tn":
        if a.shape[0] % 4 or b.shape[1] % 4:
            raise NotImplementedError("emulated OpenBLAS: the TN kernel's row tails (M, N not multiples of 4)")
        return lanes16(a, b)
    return seq_fma(a, b)


FAMILIES = {"SkylakeX": skylakex_matmul}


def install(family: str):
    """Replace the Triton interpreter's dot by the emulated kernel family (fp32 accumulators only)."""
    if family not in FAMILIES:
        raise ValueError(f"TWOFOLD_EMULATE_OPENBLAS={family!r}: emulated families are {sorted(FAMILIES)}")
    from triton.runtime import interpreter

    matmul = FAMILIES[family]
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype != F32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        return interpreter.TensorHandle(matmul(a.data, b.data) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
