"""Ahead-of-time build cases for fast/paged_varlen_attention.py (read by parity/aot_compile.py and
parity/test_compile.py).

``cases(m)`` takes the fast module ``m`` (imported with the Triton compiler, not the interpreter)
and lists its launches in aot_compile.py's case format, reading the module's private config tables
so that what is built is what the launcher launches.  CI builds each case with its first config;
``make compile-check`` builds every config.
"""
from __future__ import annotations


def cases(m) -> list[dict]:
    """Every launch shape, for parity/test_compile.py.  Per GPU family, element type and head-dim
    class: the leanest code path (packed, causal) and the fullest (paged, two-sided window,
    softcap, sinks), with 16-byte-aligned rows and every config; and the fullest path with rows
    aligned to 4 elements (head dims 60, 100, 196) and the configs that alignment keeps.  fp16
    builds the lean path with each class's first config only: its code matches bf16's but for
    the conversions (this keeps the CI build time down)."""
    cases = []
    lean = dict(GROUP=4, IS_PAGED=False, HAS_SEQUSED=False, HAS_LEFT=False, HAS_RIGHT=True,
                HAS_SOFTCAP=False, HAS_SINKS=False)
    full = dict(GROUP=3, IS_PAGED=True, HAS_SEQUSED=True, HAS_LEFT=True, HAS_RIGHT=True,
                HAS_SOFTCAP=True, HAS_SINKS=True)
    for family in (80, 90):
        for dtype, elt in (("fp16", 2), ("bf16", 2), ("fp32", 4)):
            for head_dim in (64, 128, 256, 60, 100, 196):
                align = m._pow2_divisor(head_dim)
                variants = [("lean", lean)] if dtype == "fp16" else [("lean", lean), ("full", full)]
                if align < 16:
                    variants = [] if dtype == "fp16" else [("full", full)]
                block_d = m._block_d(head_dim)
                sig = _fwd_signature(dtype, align)
                tuned = m._TUNED[(family, block_d, elt)]
                for label, flags in variants:
                    configs = m._prune_by_alignment(tuned.configs, {}, ALIGN=align)
                    cases.append(dict(
                        kernel=tuned, archs=[family], configs=configs[:1] if dtype == "fp16" else configs,
                        name=f"attn_fwd[sm{family},{dtype},D={head_dim},{label}]", signature=sig,
                        constexprs=dict(flags, DOT_PRECISION="ieee" if elt == 4 else None, HEAD_DIM=head_dim,
                                        BLOCK_D=block_d, ALIGN=align),
                        tensor_cores=elt == 2))
    return cases + _invariant_cases(m, lean, full) + _bwd_cases(m)


def _fwd_signature(dtype: str, align: int) -> dict:
    """The forward kernel's argument types for rows aligned to ``align`` elements."""
    sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "o_ptr": f"*{dtype}",
           "lse_ptr": "*fp32", "sinks_ptr": "*fp32", "cu_seq_q_ptr": "*i32", "cu_seq_k_ptr": "*i32",
           "seqused_k_ptr": "*i32", "block_table_ptr": "*i32", "qk_scale": "fp32", "softcap": "fp32"}
    # Strides of [.., H, D] tensors are multiples of 16 when D is (Triton specializes on
    # that at run time); otherwise the ALIGN constexpr carries the alignment.
    for name in ("stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_k_page",
                 "stride_k_tok", "stride_k_head", "stride_v_page", "stride_v_tok", "stride_v_head"):
        sig[name] = "i32:16" if align == 16 else "i32"
    sig["rows_bucket"] = "i32:16"
    for name in ("stride_lse_head", "stride_bt", "page_size", "num_seqs", "window_left", "window_right"):
        sig[name] = "i32"
    return sig


def _invariant_cases(m, lean: dict, full: dict) -> list[dict]:
    """The batch-invariant forward (``_attn_fwd_invariant_kernel``) with the one config per family, element
    size and head-dim class that ``_invariant_config`` gives, in both shapes a launch takes: SUB row groups a
    program (a prefill, a trainer's forward) and one (a decode step through varlen_attn).  The fullest
    path (paged, two-sided window, softcap, sinks) at head dims 64 / 128 / 256 and 100 (rows aligned to 4)
    in bf16 and 64 / 128 / 256 in fp32; the leanest (packed causal, a trainer's forward) at D = 128 in
    bf16 and fp16."""
    builds = [("bf16", 2, d, "full") for d in (64, 128, 256, 100)] + [("fp32", 4, d, "full") for d in (64, 128, 256)]
    builds += [("bf16", 2, 128, "lean"), ("fp16", 2, 128, "lean")]
    cases = []
    for family in (80, 90):
        for dtype, elt, head_dim, label in builds:
            sub = m._invariant_sub(m._invariant_config(family, head_dim, elt), m._pow2_divisor(head_dim))
            for s in sorted({sub, 1}, reverse=True):
                cases.append(invariant_case(m, family, dtype, head_dim, label, lean if label == "lean" else full,
                                            sub=s))
    return cases


def invariant_case(m, family: int, dtype: str, head_dim: int, label: str, flags: dict, sub=None) -> dict:
    """The batch-invariant forward's launch on ``family`` (its one config) with the code-path ``flags``, with
    ``sub`` row groups a program (default: the config's most, a prefill's)."""
    elt = 4 if dtype == "fp32" else 2
    align = m._pow2_divisor(head_dim)
    cfg = m._invariant_config(family, head_dim, elt)
    sub = m._invariant_sub(cfg, align) if sub is None else sub
    sig = {k: v for k, v in _fwd_signature(dtype, align).items() if k != "rows_bucket"}
    return dict(
        kernel=m._attn_fwd_invariant_kernel, archs=[family],
        name=f"attn_fwd_invariant[sm{family},{dtype},D={head_dim},{label},SUB={sub}]",
        signature=sig,
        constexprs=dict(flags, DOT_PRECISION="ieee" if elt == 4 else None, HEAD_DIM=head_dim,
                        BLOCK_D=m._block_d(head_dim), ALIGN=align, BLOCK_N=cfg["BLOCK_N"], SPLIT=cfg["SPLIT"],
                        SUB=sub),
        num_warps=sub if sub > 1 else cfg["group_warps"],
        num_stages=cfg["num_stages"] if sub > 1 else cfg["group_stages"],
        tensor_cores=elt == 2, wgmma=False)     # the mode's row groups run mma.sync on sm_90 too


def _bwd_signature(kernel, dtype: str) -> dict:
    """Argument types of a backward kernel: pointers by name, row strides divisible by 16 (the
    launcher guarantees it: rows are a power of two >= 16 wide, padded otherwise), ints, floats."""
    fn = kernel
    while not hasattr(fn, "params"):          # under the autotuner: the JITFunction
        fn = fn.fn
    sig = {}
    for name, param in zip(fn.arg_names, fn.params):
        if param.is_constexpr:
            continue
        if name.endswith("_ptr"):
            if name.startswith(("lse", "dlse", "delta", "dsink", "sinks")):
                sig[name] = "*fp32"
            elif name.startswith(("cu_seq", "seqused")):
                sig[name] = "*i32"
            else:
                sig[name] = f"*{dtype}"
        elif name in ("qk_scale", "softcap", "scale"):
            sig[name] = "fp32"
        elif name.endswith(("_tok", "_head", "_bucket")) and "lse" not in name:
            sig[name] = "i32:16"
        else:
            sig[name] = "i32"
    return sig


def _bwd_cases(m) -> list[dict]:
    """The backward's launches.  It runs only on rows a power of two wide (other head dims are
    zero-padded), so per GPU family, element type and head dim 64 / 128 / 256: dK/dV and dQ with
    the fullest code path (GQA 3, two-sided window, softcap, seqused_k) and every config, and the
    leanest (causal, GQA 4) with the first config; fp16 builds like bf16 (one config each).  Head
    dim 256 on sm_90: dK/dV's tiles are too small for wgmma (see _BWD_CONFIG_TABLE), mma.sync is
    checked instead.  Plus the preprocessing kernel."""
    cases = []
    lean = dict(GROUP=4, HAS_SEQUSED=False, HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False)
    full = dict(GROUP=3, HAS_SEQUSED=True, HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=True)
    for family in (80, 90):
        for dtype, elt in (("fp16", 2), ("bf16", 2), ("fp32", 4)):
            for head_dim in (64, 128, 256):
                for tuned, name in ((m._TUNED_DKDV, "dkdv"), (m._TUNED_DQ, "dq")):
                    kernel = tuned[(family, head_dim, elt)]
                    variants = [("full", full, kernel.configs), ("lean", lean, kernel.configs[:1])]
                    if dtype == "fp16":
                        variants = [("full", full, kernel.configs[:1])]
                    for label, flags, configs in variants:
                        cases.append(dict(
                            kernel=kernel, archs=[family], configs=configs,
                            name=f"attn_bwd_{name}[sm{family},{dtype},D={head_dim},{label}]",
                            signature=_bwd_signature(kernel, dtype),
                            constexprs=dict(flags, DOT_PRECISION="ieee" if elt == 4 else None, BLOCK_D=head_dim),
                            tensor_cores=elt == 2, wgmma=not (name == "dkdv" and head_dim == 256)))
    for dtype in ("bf16", "fp32"):
        for head_dim in (64, 256):
            cases.append(dict(
                kernel=m._attn_bwd_preprocess_kernel, name=f"attn_bwd_preprocess[{dtype},D={head_dim}]",
                signature=_bwd_signature(m._attn_bwd_preprocess_kernel, dtype),
                constexprs=dict(HAS_DLSE=True, HAS_SINKS=True, BLOCK_D=head_dim, BLOCK_T=max(16, 4096 // head_dim)),
                num_warps=4))
    # The padding rows of padded buffers: lse only and out (the forward), dq, dk + dv (the backward).
    for dtype, num_zeros, has_lse, head_dim in (("bf16", 1, True, 128), ("fp32", 0, True, 64), ("fp16", 2, False, 100),
                                                ("fp32", 1, False, 256)):
        cases.append(dict(
            kernel=m._padding_rows_kernel, name=f"padding_rows[{dtype},D={head_dim},zeros={num_zeros},lse={has_lse}]",
            signature=dict(_bwd_signature(m._padding_rows_kernel, dtype), lse_ptr="*fp32", cu_ptr="*i32",
                           stride_x_tok="i32", stride_x_head="i32", stride_y_tok="i32", stride_y_head="i32"),
            constexprs=dict(HEAD_DIM=head_dim, NUM_ZEROS=num_zeros, HAS_LSE=has_lse, BLOCK_T=16,
                            BLOCK_D=m._block_d(head_dim)),
            num_warps=1))
    return cases
