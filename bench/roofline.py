"""The kernel observatory's report (``make roofline``): memory traffic against the IO lower bound and
the sm_90 build of every kernel, ours beside the production peers (vLLM's and SGLang's Triton attention
and MoE, bench/peers.py; fla-core 0.6.0 for Gated DeltaNet), measured without a GPU.

    python bench/roofline.py            # measure and print the tables (CPU, Triton interpreter)
    python bench/roofline.py --record   # also append bench/results/roofline.csv, draw roofline.png,
                                        # rewrite bench/README.md's kernel observatory tables
    python bench/roofline.py --quick    # build only each kernel's first config for sm_90 (traffic of
                                        # every config is measured either way)
    python bench/roofline.py --only decode   # the cases whose name contains "decode" (no --record)
    python bench/roofline.py --only moe      # the MoE experts at decode (T = 16, 64)
    python bench/roofline.py --only moe --moe-prefill   # and the 2048-token MoE prefill (over an hour: a
                                             # peer's run takes up to 25 minutes in the interpreter)

What is measured (parity/observatory.py has the instrument)
    Each case runs once per autotune config in the Triton interpreter on CPU, fp16, at fixed shapes.
    Per kernel launch: issued bytes (loads and stores of active lanes: an upper bound on DRAM
    traffic, as if nothing were cached), unique bytes (distinct bytes: a lower bound, as if L2 were
    infinite) and tensor-core FLOPs (every ``tl.dot``, padding included); the PyTorch ops between
    the kernels (casts, head sums) count as kernels of their own.  Each launch is then built for
    sm_90 exactly as it ran (parity/aot_compile.py): registers, spills, shared memory, HGMMA /
    HMMA and SASS instructions; occupancy and waves on 132 SMs are modelled from H100's per-SM
    limits, not measured.  No timing: the interpreter cannot time a GPU kernel.
    A latency model prices each launch from those counts (parity/observatory.py's ``LatencyModel``,
    H100 constants): ``modeled_us`` = a fixed cost per launch + max(the busiest SM's bytes over its
    share of HBM bandwidth, unique bytes over HBM bandwidth + reread bytes over L2 bandwidth), summed
    over an op's kernels; the PyTorch ops between them are priced apart.  A model, never a measurement:
    its constants are printed beside the tables.

The IO lower bound of an op: every input it must read and every output it must write, once
(the tensors and formulas are in the Case classes below and in bench/README.md).  issued / bound >= 1 is the
re-reading a kernel does; unique / bound > 1 is traffic no cache can remove (intermediates).

The cases: Gated DeltaNet (chunk forward and backward, the trainer's forward + backward, decode), paged
attention (prefill forward and backward, decode at 1k and 8k keys, a GRPO group's cascade decode), and the
MoE experts at a Qwen3-30B-A3B layer's shape (``Moe``: 128 experts, top-8, hidden 2048, expert FFN 768,
T = 16 and 64 decode tokens, from the router logits to the combined output; the 2048-token prefill only
with ``--moe-prefill``, as its peers' runs take 20-25 minutes each in the interpreter).  The MoE bound
counts each touched expert's weights once.  The peers' compiled CUDA ops around their Triton MoE
kernels (routing top-k, align, SiLU-and-mul, the sum over k) cannot run here: bench/peers.py computes them
and their bytes (inputs read once, outputs written once) join the PyTorch ops between kernels ("other ops",
priced apart by the latency model), so issued and unique bytes count them while the kernel columns count
Triton launches only.

The runs are the GPU's launches, not the CPU tier's: shims below make our launchers take their
CUDA paths (the autotuners, the sm_90 tile configs) and make fla answer as on an H100; the one
autotuner shim then launches the r-th distinct config of each kernel in round r, where a GPU
would have benchmarked them all.  The peers' outputs are checked against ours on identical inputs.
"""
from __future__ import annotations

import argparse
import builtins
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "parity"), str(ROOT / "bench")]
BUILD_WORKER = "--build-worker" in sys.argv
if not BUILD_WORKER:
    os.environ["TRITON_INTERPRET"] = "1"            # before anything imports triton
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"    # fla's Triton kernels, not its TileLang / FlashQLA ones

import torch  # noqa: E402  (after TRITON_INTERPRET is set)

FLA_VERSION = "0.6.0"
BENCH_README = ROOT / "bench" / "README.md"
BEGIN, END = "<!-- roofline:begin -->", "<!-- roofline:end -->"
PLOT = ROOT / "bench" / "results" / "roofline.png"
MB = 1e6


# ----------------------------------------------------------------------------- shims: a GPU's launches

ROUND = [0]                   # round r: every autotuned kernel runs its r-th distinct config
SPACES: dict = {}             # kernel name -> the configs its autotuner would benchmark (after pruning)


def _distinct(configs):
    seen = []
    for c in configs:
        if c.kwargs not in seen:
            seen.append(c.kwargs)
    return seen


def _autotuner_run(self, *args, **kwargs):
    """triton's Autotuner.run without the benchmark: the configs it would time (pruned as on a GPU),
    the ROUND-th distinct one launched (configs differing only in warps or stages move the same bytes;
    the static side builds each of them)."""
    self.nargs = dict(zip(self.arg_names, args))
    space = self.prune_configs(kwargs)
    name = self.base_fn.__name__
    SPACES[name] = space
    kinds = _distinct(space)
    chosen = kinds[min(ROUND[0], len(kinds) - 1)]
    config = next(c for c in space if c.kwargs == chosen)
    if config.pre_hook is not None:
        config.pre_hook({**self.nargs, **kwargs, **config.all_kwargs()})
    try:
        return self.fn.run(*args, **kwargs, **config.all_kwargs())
    finally:
        self.nargs = None


class _LoopIndex(int):
    """A loop index with ``.to``: Triton gives a kernel's loop indices as i32 tensors, the interpreter
    as Python ints, on which fla's ``i_t.to(tl.int64)`` fails."""

    def to(self, dtype, **kwargs):
        from triton.runtime.interpreter import interpreter_semantic
        return interpreter_semantic.to_tensor(int(self), False).to(dtype, **kwargs)


def _loop_range(*args):
    return map(_LoopIndex, builtins.range(*(int(a) for a in args)))


class _ViaAutotuner:
    """Stands in for an attention kernel that the CPU path launches with small fixed tiles: the
    launch goes to the autotuner the CUDA path uses, for sm_90 and the input's element size."""

    def __init__(self, table: dict, kernel):
        self.table, self.kernel = table, kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs.get("BATCH_INVARIANT"):      # the mode's one fixed config, launched as given
                return self.kernel[grid](*args, **kwargs)
            for fixed in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"):
                kwargs.pop(fixed, None)
            return self.table[(90, kwargs["BLOCK_D"], args[0].element_size())][grid](*args, **kwargs)
        return launch


def install_shims():
    """Returns the modules: ours (fast/) and fla's, each launching what it launches on an H100."""
    from triton.runtime.autotuner import Autotuner
    Autotuner.run = _autotuner_run

    import fast.flash_decoding as fd
    import fast.gated_deltanet as gdn
    import fast.moe as moe
    import fast.paged_varlen_attention as pva
    interpreter_launch = gdn._launch
    def gdn_launch(tuned, grid, args, meta, fixed=False):   # its CUDA branch; batch_invariant's fixed launch as is
        return interpreter_launch(tuned, grid, args, meta, fixed=True) if fixed else tuned[grid](*args, **meta)
    gdn._launch = gdn_launch
    pva._attn_fwd_kernel = _ViaAutotuner(pva._TUNED, pva._attn_fwd_kernel)
    pva._attn_bwd_dkdv_kernel = _ViaAutotuner(pva._TUNED_DKDV, pva._attn_bwd_dkdv_kernel)
    pva._attn_bwd_dq_kernel = _ViaAutotuner(pva._TUNED_DQ, pva._attn_bwd_dq_kernel)
    cpu_config = fd._fwd_config
    fd._fwd_config = lambda *args: cpu_config(*args[:-1], torch.device("cuda"))      # the GPU's tiles
    # batch_invariant=True: the mode's sm_90 tiles (its CPU tier runs the interpreter's 16 x 16 tile)
    decode_invariant, varlen_invariant = fd._invariant_config, pva._invariant_config
    fd._invariant_config = lambda *args: decode_invariant(*args[:-1], 90)
    pva._invariant_config = lambda family, head_dim, elt: varlen_invariant(90, head_dim, elt)
    # MoE's batch-invariant mode: a GPU fills its fixed 128-row tiles (the interpreter gives each row a tile)
    moe._rows_per_tile = lambda device, block_m, invariant: block_m
    # SGLang launches with PDL on sm_90 (grid dependency control); the interpreter has no such sync, and the
    # two calls move no byte: no-ops here (the sm_90 builds keep them).
    import triton.language.extra.cuda as cuda
    cuda.gdc_wait = cuda.gdc_launch_dependents = lambda *args, **kwargs: None

    import fla.utils
    from fla.utils.hardware import Backend
    if fla.__version__ != FLA_VERSION:
        raise SystemExit(f"the report compares with fla-core {FLA_VERSION}, found {fla.__version__}")
    # fla reads the GPU at import (config lists) and at call time (tile sizes): answer as an H100,
    # before its op modules import these names.
    fla.utils.check_shared_mem = lambda arch="none", tensor_idx=0: Backend.HOPPER.value >= \
        Backend.get_shared_memory(arch)
    fla.utils.IS_NVIDIA_HOPPER = fla.utils.is_nvidia_hopper = True
    fla.utils.IS_TF32_SUPPORTED = True
    fla.utils.get_multiprocessor_count = lambda *a, **k: 132
    import fla.ops.attn.decoding
    import fla.ops.attn.parallel
    import fla.ops.gated_delta_rule
    for name, mod in list(sys.modules.items()):
        if name.startswith("fla.") and mod is not None:
            mod.__dict__["range"] = _loop_range
    # The production peers (bench/peers.py): their modules, or why they are missing.
    import peers
    loaded = {}
    for peer in peers.VERSIONS:
        try:
            loaded[peer] = peers.load(peer)
        except Exception as e:  # the report runs without a peer that cannot be installed, and says so
            loaded[peer] = f"not installed: {str(e)[:300]}"
    return dict(gdn=gdn, pva=pva, fd=fd, moe=moe, fla=fla, peers=loaded)


# ----------------------------------------------------------------------------- the cases

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, dtype=torch.float16, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Case:
    """One op at fixed shapes: ``run(impl, observed)`` runs it with ``impl`` ("ours", or a peer of
    ``impls``, each a method of that name) and returns its outputs; ``bound`` is the IO lower bound in
    bytes with its ``formula``, ``useful`` the FLOPs the math needs; ``kernels[impl]`` names what a peer
    row ran."""
    name: str
    op: str
    formula: str
    useful_formula: str
    impls: tuple = ("ours", "fla")
    kernels: dict = {}

    def run(self, impl: str, observed):
        return getattr(self, impl)(observed)

    def label(self, impl: str) -> str:
        return f"{IMPLS[impl]}: {self.kernels[impl]}" if impl in self.kernels else IMPLS[impl]

    def outputs_match(self, ours, theirs, impl: str) -> str:
        """A one-line comparison; raises when the outputs differ by more than fp16 noise."""
        lines = []
        for name, a, b in zip(self.output_names, ours, theirs):
            a, b = a.detach().double(), b.detach().double()
            err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            lines.append(f"{name} {err:.1e}")
            if not err <= self.rtol:
                raise AssertionError(f"{self.name} {self.op}: {name} differs from {IMPLS[impl]}'s: relative error "
                                     f"{err:.2e} > {self.rtol}")
        return ", ".join(lines)


class GdnChunk(Case):
    T, H, K, V, C = 512, 2, 128, 128, 64
    kernels = {"fla": "chunk_gated_delta_rule"}

    def __init__(self, mods, op):
        self.mods, self.op = mods, op
        self.name = f"gdn_chunk T={self.T} H={self.H} K=V={self.K}"
        g = _gen(1)
        t, h, k, v = self.T, self.H, self.K, self.V
        self.q = _randn(1, t, h, k, gen=g)
        self.k = torch.nn.functional.normalize(_randn(1, t, h, k, gen=g, dtype=torch.float32), dim=-1).half()
        self.v = _randn(1, t, h, v, gen=g)
        self.g = torch.nn.functional.logsigmoid(_randn(1, t, h, gen=g, dtype=torch.float32))
        self.beta = torch.sigmoid(_randn(1, t, h, gen=g, dtype=torch.float32)).half()
        self.do = _randn(1, t, h, v, gen=g)
        inputs = (self.q, self.k, self.v, self.g, self.beta)
        nc = t // self.C
        if op == "fwd":
            self.bound = nbytes(*inputs) + nbytes(self.v)             # o has v's shape and dtype
            self.formula = ("read q, k, v, g, beta, write o: (2 T H K + 2 T HV V) e + T HV (4 + e) bytes "
                            "(g in fp32)")
            self.short = "GDN chunk\nfwd"
            self.useful = nc * h * (6 * self.C ** 2 * k + 4 * self.C ** 2 * v + 6 * self.C * k * v + self.C ** 3 // 3)
            self.useful_formula = "per 64-token chunk and head 6C^2K + 4C^2V + 6CKV + C^3/3"
            self.output_names = ["o"]
        else:
            self.bound = 2 * nbytes(*inputs) + nbytes(self.do)
            self.formula = ("read q, k, v, g, beta, dO, write dq, dk, dv, dg, dbeta: "
                            "(4 T H K + 3 T HV V) e + 2 T HV (4 + e)")
            self.short = "GDN chunk\nbwd"
            self.useful = nc * h * (20 * self.C ** 2 * k + 10 * self.C ** 2 * v + 16 * self.C * k * v)
            self.useful_formula = "per chunk and head 20C^2K + 10C^2V + 16CKV (recomputation included)"
            self.output_names = ["dq", "dk", "dv", "dg", "dbeta"]
        self.rtol = 2e-2

    def _run(self, fn, observed):
        leaves = [x.clone().requires_grad_(True) for x in (self.q, self.k, self.v, self.g, self.beta)]
        if self.op == "fwd":
            with observed():
                o, _ = fn(*leaves)
            return [o]
        o, _ = fn(*leaves)
        with observed():
            grads = torch.autograd.grad(o, leaves, self.do)
        return list(grads)

    def ours(self, observed):
        return self._run(self.mods["gdn"].chunk_gated_delta_rule, observed)

    def fla(self, observed):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return self._run(chunk_gated_delta_rule, observed)


class GdnTrainer(Case):
    """A trainer's Gated DeltaNet op as the Qwen3.5 layer calls it (q / k l2-normalized in the kernels, the
    document as cu_seqlens), forward and backward in one region: the default chunk path, the batch-invariant
    mode's (the chunk form with batch_invariant=True: fixed launches, gate sums in token order), and the
    recurrent form (what the mode ran before issue 34)."""
    T, H, K, V, C = 512, 2, 128, 128, 64

    def __init__(self, mods):
        self.mods, self.op = mods, "fwd+bwd"
        self.impls = ("ours", "ours_invariant", "ours_recurrent")
        self.name = f"gdn_trainer T={self.T} H={self.H} K=V={self.K}"
        g = _gen(3)
        t, h, k, v = self.T, self.H, self.K, self.V
        self.q = _randn(1, t, h, k, gen=g)
        self.k = _randn(1, t, h, k, gen=g)
        self.v = _randn(1, t, h, v, gen=g)
        self.g = torch.nn.functional.logsigmoid(_randn(1, t, h, gen=g, dtype=torch.float32))
        self.beta = torch.sigmoid(_randn(1, t, h, gen=g, dtype=torch.float32)).half()
        self.do = _randn(1, t, h, v, gen=g)
        self.cu = torch.tensor([0, t], dtype=torch.int32)
        inputs = (self.q, self.k, self.v, self.g, self.beta)
        self.bound = 3 * nbytes(*inputs) + nbytes(self.v) + nbytes(self.do)
        self.formula = ("read q, k, v, g, beta (twice), dO, write o, dq, dk, dv, dg, dbeta: "
                        "(6 T H K + 5 T HV V) e + 3 T HV (4 + e)")
        self.short = "GDN trainer\nfwd+bwd"
        nc = t // self.C
        self.useful = nc * h * (26 * self.C ** 2 * k + 14 * self.C ** 2 * v + 22 * self.C * k * v + self.C ** 3 // 3)
        self.useful_formula = ("the chunk form's, per 64-token chunk and head 26C^2K + 14C^2V + 22CKV + C^3/3 "
                               "(forward and backward, recomputation included)")
        self.output_names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
        self.kernels = {"ours_invariant": "chunk_gated_delta_rule(batch_invariant=True)",
                        "ours_recurrent": "fused_recurrent_gated_delta_rule"}
        self.rtol = 2e-2

    def _run(self, fn, observed, **kw):
        leaves = [x.clone().requires_grad_(True) for x in (self.q, self.k, self.v, self.g, self.beta)]
        with observed():
            o, _ = fn(*leaves[:3], g=leaves[3], beta=leaves[4], cu_seqlens=self.cu, cu_seqlens_cpu=self.cu,
                      use_qk_l2norm_in_kernel=True, **kw)
            grads = torch.autograd.grad(o, leaves, self.do)
        return [o, *grads]

    def ours(self, observed):
        return self._run(self.mods["gdn"].chunk_gated_delta_rule, observed)

    def ours_invariant(self, observed):
        """As the layer calls it in the mode: a start state (zeros) in, the end state out, in every phase."""
        h0 = torch.zeros(1, self.H, self.K, self.V)
        return self._run(self.mods["gdn"].chunk_gated_delta_rule, observed, batch_invariant=True, initial_state=h0,
                         output_final_state=True)

    def ours_recurrent(self, observed):
        return self._run(self.mods["gdn"].fused_recurrent_gated_delta_rule, observed)


class GdnDecode(Case):
    N, H, K, V = 8, 2, 128, 128
    kernels = {"fla": "fused_recurrent_gated_delta_rule",
               "ours_invariant": "chunk_gated_delta_rule(batch_invariant=True) over each sequence's chunk so far"}

    def __init__(self, mods):
        self.mods, self.op = mods, "fwd"
        self.impls = ("ours", "ours_invariant", "fla")
        self.name = f"gdn_decode N={self.N} H={self.H} K=V={self.K}"
        g = _gen(2)
        n, h, k, v = self.N, self.H, self.K, self.V
        self.q = _randn(n, 1, h, k, gen=g)
        self.k = torch.nn.functional.normalize(_randn(n, 1, h, k, gen=g, dtype=torch.float32), dim=-1).half()
        self.v = _randn(n, 1, h, v, gen=g)
        self.g = torch.nn.functional.logsigmoid(_randn(n, 1, h, gen=g, dtype=torch.float32))
        self.beta = torch.sigmoid(_randn(n, 1, h, gen=g, dtype=torch.float32)).half()
        self.h0 = _randn(n, h, k, v, gen=g, dtype=torch.float32, scale=0.1)
        self.bound = nbytes(self.q, self.k, self.v, self.g, self.beta, self.h0) + nbytes(self.v, self.h0)
        self.formula = ("read q, k, v, g, beta and the fp32 state, write o and the state: "
                        "(2 N H K + 2 N HV V) e + N HV (4 + e) + 2 N HV K V 4")
        self.short = "GDN decode\nN=8"
        self.useful = n * h * 7 * k * v
        self.useful_formula = "7KV per token and head (decay, h^T k, k u^T, h^T q), none of it a matmul"
        self.output_names = ["o", "final_state"]
        self.rtol = 1e-2

    def _run(self, fn, observed):
        with observed():
            o, ht = fn(self.q, self.k, self.v, g=self.g, beta=self.beta, initial_state=self.h0,
                       output_final_state=True)   # keywords: fla's 4th to 6th positionals are g, gk, gv
        return [o, ht]

    def ours(self, observed):
        return self._run(self.mods["gdn"].fused_recurrent_gated_delta_rule, observed)

    def ours_invariant(self, observed):
        """The batch-invariant mode's decode step (ref/gated_deltanet.py's _aligned_decode_step): the chunk form
        over each sequence's current chunk laid out whole, 64 rows from the state at its start.  Here the
        token ends its chunk, the 63 rows before it zero tokens (no-ops on the state: the same o and state as
        the recurrent step; the kernels read and write all 64 rows whatever they hold)."""
        n, c = self.N, GdnChunk.C

        def chunk(x):                                   # [N, 1, ...] -> [1, N 64, ...]: zeros, then the token
            return torch.cat([x.new_zeros(n, c - 1, *x.shape[2:]), x], 1).flatten(0, 1)[None]
        cu = torch.arange(n + 1, dtype=torch.int32) * c
        inputs = [chunk(x) for x in (self.q, self.k, self.v, self.g, self.beta)]   # (the layer's layout: not counted)
        with observed():
            o, ht = self.mods["gdn"].chunk_gated_delta_rule(*inputs, initial_state=self.h0, output_final_state=True,
                                                            cu_seqlens=cu, cu_seqlens_cpu=cu, batch_invariant=True)
        return [o[0].unflatten(0, (n, c))[:, c - 1:], ht]

    def fla(self, observed):
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        return self._run(fused_recurrent_gated_delta_rule, observed)


def _paged(tensors, lengths, page, gen):
    """Packed per-sequence [T, H, D] tensors -> (pools [pages, page, H, D] sharing one block table,
    block table [N, pages per sequence] int32), pages in a random order."""
    per_seq = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(per_seq), generator=gen).to(torch.int32)
    table = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    pools = [torch.zeros(sum(per_seq), page, *t.shape[1:], dtype=t.dtype) for t in tensors]
    start, used = 0, 0
    for i, (n, p) in enumerate(zip(lengths, per_seq)):
        table[i, :p] = order[used:used + p]
        for j in range(p):
            rows = slice(start + j * page, start + min(n, (j + 1) * page))
            for pool, t in zip(pools, tensors):
                pool[int(table[i, j]), :rows.stop - rows.start] = t[rows]
        start, used = start + n, used + p
    return pools, table


class Prefill(Case):
    N, L, HQ, HKV, D, PAGE = 2, 512, 8, 2, 128, 16

    def __init__(self, mods, op):
        self.mods, self.op = mods, op
        if op == "fwd":
            self.impls = ("ours", "ours_invariant", "fla", "vllm_2d", "sglang_extend")
            self.kernels = {"fla": "parallel_attn", "vllm_2d": "unified_attention, 2D (kernel_unified_attention)",
                            "sglang_extend": "extend_attention_fwd (_fwd_kernel)"}
        else:
            self.kernels = {"fla": "parallel_attn backward"}
        layout = f"paged, page {self.PAGE}" if op == "fwd" else "packed (our backward takes packed keys)"
        self.name = f"prefill causal {self.N}x{self.L} GQA {self.HQ}/{self.HKV} D={self.D} {layout}"
        g = _gen(3)
        t = self.N * self.L
        self.q = _randn(t, self.HQ, self.D, gen=g)
        self.k = _randn(t, self.HKV, self.D, gen=g)
        self.v = _randn(t, self.HKV, self.D, gen=g)
        self.do = _randn(t, self.HQ, self.D, gen=g)
        self.cu = torch.arange(0, t + 1, self.L, dtype=torch.int32)
        (self.k_pool, self.v_pool), self.table = _paged([self.k, self.v], [self.L] * self.N, self.PAGE, g)
        causal_pairs = self.N * self.L * (self.L + 1) // 2
        lse = self.HQ * t * 4
        if op == "fwd":
            self.bound = nbytes(self.q, self.k, self.v, self.q) + lse
            self.formula = "read Q, K, V, write O and the fp32 LSE: T (2 H_q + 2 H_kv) D e + 4 H_q T"
            self.short = "prefill\nfwd (paged)"
            self.useful = 4 * self.D * self.HQ * causal_pairs
            self.useful_formula = "4 D H_q per visible (query, key) pair: QK^T and PV, causal"
            self.output_names = ["o"]
        else:
            self.bound = nbytes(self.q, self.k, self.v, self.q, self.do) + lse + nbytes(self.q, self.k, self.v)
            self.formula = ("read Q, K, V, O, dO and the LSE, write dQ, dK, dV: "
                            "T (4 H_q + 4 H_kv) D e + 4 H_q T")
            self.short = "prefill\nbwd"
            self.useful = 10 * self.D * self.HQ * causal_pairs
            self.useful_formula = "10 D H_q per visible pair: the five matmuls of the FlashAttention-2 backward"
            self.output_names = ["dq", "dk", "dv"]
        self.rtol = 2e-2

    def ours(self, observed):
        pva = self.mods["pva"]
        used = torch.full((self.N,), self.L, dtype=torch.int32)
        if self.op == "fwd":
            with observed():
                o = pva.varlen_attn(self.q, self.k_pool, self.v_pool, self.cu, None, self.L, self.L,
                                    window_size=(-1, 0), enable_gqa=True, seqused_k=used, block_table=self.table)
            return [o]
        leaves = [x.clone().requires_grad_(True) for x in (self.q, self.k, self.v)]
        o = pva.varlen_attn(*leaves, self.cu, self.cu, self.L, self.L, window_size=(-1, 0), enable_gqa=True)
        with observed():
            return list(torch.autograd.grad(o, leaves, self.do))

    def fla(self, observed):
        from fla.ops.attn.parallel import parallel_attn
        cu = self.cu.long()
        leaves = [x.clone().requires_grad_(self.op == "bwd") for x in (self.q, self.k, self.v)]
        if self.op == "fwd":
            with observed():
                o = parallel_attn(*(x[None] for x in leaves), cu_seqlens=cu)
            return [o[0]]
        o = parallel_attn(*(x[None] for x in leaves), cu_seqlens=cu)
        with observed():
            return list(torch.autograd.grad(o, leaves, self.do[None]))

    def ours_invariant(self, observed):
        pva = self.mods["pva"]
        used = torch.full((self.N,), self.L, dtype=torch.int32)
        with observed():
            o = pva.varlen_attn(self.q, self.k_pool, self.v_pool, self.cu, None, self.L, self.L,
                                window_size=(-1, 0), enable_gqa=True, seqused_k=used, block_table=self.table,
                                batch_invariant=True)
        return [o]

    def vllm_2d(self, observed):
        uni = self.mods["peers"]["vllm"]["vllm.v1.attention.ops.triton_unified_attention"]
        out = torch.empty_like(self.q)
        used = torch.full((self.N,), self.L, dtype=torch.int32)
        with observed():
            uni.unified_attention(self.q, self.k_pool, self.v_pool, out, self.cu, self.L, used, self.L,
                                  self.D ** -0.5, True, (-1, -1), self.table, 0.0, None, None, None)
        return [out]

    def sglang_extend(self, observed):
        ext = self.mods["peers"]["sglang"]["sglang.kernels.ops.attention.extend_attention"]
        out = torch.empty_like(self.q)
        # A fresh prefill: no prefix in the pool, the chunk's K and V in the packed extend tensors.
        no_prefix = torch.zeros(self.N + 1, dtype=torch.int32)
        with observed():
            ext.extend_attention_fwd(self.q, self.k, self.v, out, self.k_pool.view(-1, self.HKV, self.D),
                                     self.v_pool.view(-1, self.HKV, self.D), self.cu, no_prefix,
                                     torch.zeros(0, dtype=torch.int32), None, True, None, self.L, 1.0, 1.0,
                                     page_size=self.PAGE)
        return [out]


class Decode(Case):
    B, HQ, HKV, D, PAGE = 4, 8, 2, 128, 16

    def __init__(self, mods, length: int, paged: bool = True):
        self.mods, self.op, self.L, self.paged = mods, "fwd", length, paged
        self.impls = ("ours", "ours_invariant", "fla", "vllm_3d", "vllm_2d", "vllm_2stage", "sglang_2stage")
        self.vllm_splits = min(1 << max(0, (length // 512 - 1).bit_length()), 2 * 132)   # vLLM's rule
        self.kernels = {
            "fla": "attn_decoding_one_step (its naive decoding kernel: K and V read once per query head)",
            "vllm_3d": "unified_attention, 3D (kernel_unified_attention, 16 segments, + reduce_segments)",
            "vllm_2d": "unified_attention, 2D (kernel_unified_attention)",
            "vllm_2stage": f"decode_attention_fwd, 2-stage ({self.vllm_splits} splits)",
            "sglang_2stage": "decode_attention_fwd, 2-stage (get_num_kv_splits_triton's splits, at most 8)"}
        layout = f"paged, page {self.PAGE}" if paged else "contiguous cache"
        self.name = f"decode B={self.B} L={length // 1024}k GQA {self.HQ}/{self.HKV} D={self.D} {layout}"
        g = _gen(4)
        t = self.B * length
        self.q = _randn(self.B, 1, self.HQ, self.D, gen=g)
        self.k = _randn(t, self.HKV, self.D, gen=g)
        self.v = _randn(t, self.HKV, self.D, gen=g)
        if paged:
            (self.k_cache, self.v_cache), self.table = _paged([self.k, self.v], [length] * self.B, self.PAGE, g)
        else:
            self.k_cache = self.k.view(self.B, length, self.HKV, self.D)
            self.v_cache = self.v.view(self.B, length, self.HKV, self.D)
            self.table = None
        self.bound = nbytes(self.q, self.k, self.v, self.q)
        self.formula = "read q and the cache's K, V once, write o: 2 B H_q D e + 2 B L H_kv D e"
        self.short = f"decode {length // 1024}k\n{'paged' if paged else 'contiguous'}"
        self.useful = 4 * self.B * self.HQ * length * self.D
        self.useful_formula = "4 B H_q L D: q K^T and P V"
        self.output_names = ["o"]
        self.rtol = 1e-2

    def ours(self, observed):
        used = torch.full((self.B,), self.L, dtype=torch.int32)
        with observed():
            o = self.mods["fd"].flash_decode(self.q, self.k_cache, self.v_cache, used, block_table=self.table)
        return [o]

    def fla(self, observed):
        from fla.ops.attn.decoding import attn_decoding_one_step
        cu = torch.arange(0, self.B * self.L + 1, self.L, dtype=torch.long)
        with observed():
            o = attn_decoding_one_step(self.q.view(1, self.B, self.HQ, self.D), self.k[None], self.v[None],
                                       cu_seqlens=cu)
        return [o.view(self.B, 1, self.HQ, self.D)]

    def ours_invariant(self, observed):
        used = torch.full((self.B,), self.L, dtype=torch.int32)
        with observed():
            o = self.mods["fd"].flash_decode(self.q, self.k_cache, self.v_cache, used, block_table=self.table,
                                             batch_invariant=True)
        return [o]

    def _pages(self):
        """(K pool, V pool, block table, page size) as the vLLM kernels take them: the contiguous cache is
        one page per sequence."""
        if self.paged:
            return self.k_cache, self.v_cache, self.table, self.PAGE
        return self.k_cache, self.v_cache, torch.arange(self.B, dtype=torch.int32)[:, None], self.L

    def _vllm_unified(self, observed, three_d: bool):
        uni = self.mods["peers"]["vllm"]["vllm.v1.attention.ops.triton_unified_attention"]
        k, v, table, _ = self._pages()
        q = self.q.view(self.B, self.HQ, self.D)
        out = torch.empty_like(q)
        cu = torch.arange(self.B + 1, dtype=torch.int32)
        used = torch.full((self.B,), self.L, dtype=torch.int32)
        split = {}
        if three_d:   # vLLM's Triton backend: 3D below 128 / H_kv sequences, 16 segments, fp32 scratch
            segs = 16
            split = dict(seq_threshold_3D=128 // self.HKV, num_par_softmax_segments=segs,
                         softmax_segm_output=torch.empty(self.B, self.HQ, segs, self.D),
                         softmax_segm_max=torch.empty(self.B, self.HQ, segs),
                         softmax_segm_expsum=torch.empty(self.B, self.HQ, segs))
        with observed():
            uni.unified_attention(q, k, v, out, cu, 1, used, self.L, self.D ** -0.5, True, (-1, -1), table, 0.0,
                                  None, None, None, **split)
        return [out.view(self.B, 1, self.HQ, self.D)]

    def vllm_3d(self, observed):
        return self._vllm_unified(observed, True)

    def vllm_2d(self, observed):
        return self._vllm_unified(observed, False)

    def vllm_2stage(self, observed):
        dec = self.mods["peers"]["vllm"]["vllm.v1.attention.ops.triton_decode_attention"]
        k, v, table, page = self._pages()
        q = self.q.view(self.B, self.HQ, self.D)
        out, lse = torch.empty_like(q), torch.empty(self.B, self.HQ)
        logits = torch.empty(self.B, self.HQ, self.vllm_splits, self.D + 1)
        used = torch.full((self.B,), self.L, dtype=torch.int32)
        with observed():
            dec.decode_attention_fwd(q, k, v, out, lse, table, used, logits, self.vllm_splits, self.D ** -0.5,
                                     page_size=page)
        return [out.view(self.B, 1, self.HQ, self.D)]

    def sglang_2stage(self, observed):
        mods = self.mods["peers"]["sglang"]
        dec = mods["sglang.kernels.ops.attention.decode_attention"]
        k, v, table, page = self._pages()
        j = torch.arange(self.L)
        if self.paged:        # the slot of each key in SGLang's token pool [pages * page, H_kv, D]: [B, L]
            slots = (table[:, j // page].long() * page + j % page).to(torch.int32)
        else:                 # the contiguous cache as a pool of one-key pages
            slots, page = (torch.arange(self.B)[:, None] * self.L + j).to(torch.int32), 1
        q = self.q.view(self.B, self.HQ, self.D)
        indptr = torch.arange(self.B + 1, dtype=torch.int32) * self.L
        used = torch.full((self.B,), self.L, dtype=torch.int32)
        max_splits, splits = 8, torch.empty(self.B, dtype=torch.int32)      # SGLang's default cap
        mods["sglang.kernels.ops.attention.metadata"].get_num_kv_splits_triton[(1,)](
            splits, used, self.B, 1, self.HQ, self.HKV, max_splits, 132, MAX_NUM_SEQ=256)
        out = torch.empty_like(q)
        logits = torch.empty(self.B, self.HQ, max_splits, self.D)
        lse = torch.empty(self.B, self.HQ, max_splits)
        with observed():
            dec.decode_attention_fwd(q, k.view(-1, self.HKV, self.D), v.view(-1, self.HKV, self.D), out, indptr,
                                     slots.reshape(-1), logits, lse, splits, max_splits, self.D ** -0.5, 1.0, 1.0,
                                     page_size=page)
        return [out.view(self.B, 1, self.HQ, self.D)]


class GrpoDecode(Decode):
    """A GRPO group's decode step: n samples of one prompt, each with its own suffix of generated keys,
    through ``cascade_decode`` (the prompt's pages read once for the group) and as n plain paged decodes
    (``flash_decode`` over each sample's whole sequence: the prompt read n times).  The production peers
    run as a prefix-caching server runs them: n paged sequences whose block tables share the prompt's
    pages (Decode's peer methods, unchanged: B = n sequences of L = P + S keys)."""
    N, PROMPT, SUFFIX, HQ, HKV, D, PAGE = 8, 2048, 256, 8, 2, 128, 16
    CAPTURED_KEYS = 8192                         # ours_captured: the block table's width, in keys

    def __init__(self, mods):
        self.mods, self.op, self.paged = mods, "fwd", True
        self.B, self.L = self.N, self.PROMPT + self.SUFFIX
        self.impls = ("ours", "ours_captured", "ours_plain", "vllm_2d", "vllm_2stage", "sglang_2stage")
        self.vllm_splits = min(1 << max(0, (self.L // 512 - 1).bit_length()), 2 * 132)   # vLLM's rule
        shared = "n sequences over the shared prompt pages"
        self.kernels = {
            "vllm_2d": f"unified_attention, 2D (kernel_unified_attention; {shared})",
            "vllm_2stage": f"decode_attention_fwd, 2-stage ({self.vllm_splits} splits; {shared})",
            "sglang_2stage": f"decode_attention_fwd, 2-stage (get_num_kv_splits_triton's splits, at most 8; {shared})"}
        self.name = (f"grpo decode n={self.N} prompt {self.PROMPT // 1024}k + suffix {self.SUFFIX} "
                     f"GQA {self.HQ}/{self.HKV} D={self.D} page {self.PAGE}")
        g = _gen(5)
        n, p, s_len = self.N, self.PROMPT, self.SUFFIX
        self.q = _randn(n, 1, self.HQ, self.D, gen=g)
        prompt = [_randn(p, self.HKV, self.D, gen=g) for _ in range(2)]                       # K, V
        suffixes = [[_randn(s_len, self.HKV, self.D, gen=g) for _ in range(2)] for _ in range(n)]
        # The pool: the prompt's pages once (shared by every sample's block table), then each suffix's.
        (k_pool, v_pool), table = _paged([torch.cat([prompt[0]] + [sk for sk, _ in suffixes]),
                                          torch.cat([prompt[1]] + [sv for _, sv in suffixes])],
                                         [p] + [s_len] * n, self.PAGE, g)
        self.k_cache, self.v_cache = k_pool, v_pool
        shared, own = table[0, :p // self.PAGE], table[1:, :s_len // self.PAGE]
        self.table = torch.cat([shared.expand(n, -1), own], dim=1).contiguous()               # [n, pages]
        self.used = torch.full((n,), p + s_len, dtype=torch.int32)
        self.cu_groups = torch.tensor([0, n], dtype=torch.int32)
        self.prefix = torch.tensor([p], dtype=torch.int32)
        self.bound = nbytes(prompt[0], prompt[1], *[t for pair in suffixes for t in pair], self.q, self.q)
        self.formula = ("read the prompt's K, V once, each sample's suffix K, V and q, write o: "
                        "2 P H_kv D e + 2 n S H_kv D e + 2 n H_q D e")
        self.short = f"GRPO decode\nn={n}, {p // 1024}k + {s_len}"
        self.useful = 4 * n * self.HQ * (p + s_len) * self.D
        self.useful_formula = "4 n H_q (P + S) D: q K^T and P V"
        self.output_names = ["o"]
        self.rtol = 1e-2

    def ours(self, observed):
        with observed():
            o = self.mods["fd"].cascade_decode(self.q, self.k_cache, self.v_cache, self.used, block_table=self.table,
                                               cu_groups=self.cu_groups, prefix_lens=self.prefix)
        return [o]

    def ours_plain(self, observed):
        with observed():
            o = self.mods["fd"].flash_decode(self.q, self.k_cache, self.v_cache, self.used, block_table=self.table)
        return [o]

    def ours_captured(self, observed):
        """The call the engine's CUDA graph captures at padded batch 8 (fast/generator_engine.py's static step):
        ``capturable=True``, the block table at the full width of an 8k-key max_seq_len (its spare columns
        the padding page), the group's bounds padded to one group a row (the 7 after it empty)."""
        n, width = self.N, self.CAPTURED_KEYS // self.PAGE
        table = torch.cat([self.table, self.table[:, -1:].expand(n, width - self.table.shape[1])], 1).contiguous()
        cu_groups = torch.tensor([0] + [n] * n, dtype=torch.int32)
        prefix = torch.tensor([self.PROMPT] + [0] * (n - 1), dtype=torch.int32)
        with observed():
            o = self.mods["fd"].cascade_decode(self.q, self.k_cache, self.v_cache, self.used, block_table=table,
                                               cu_groups=cu_groups, prefix_lens=prefix, capturable=True)
        return [o]


@functools.lru_cache(maxsize=1)
def _expert_weights(e: int, h: int, i: int):
    """(gate_up_proj [E, 2I, H], down_proj [E, H, I]) fp16, N(0, 1 / fan-in), made once per shape (1.2 GB at
    Qwen3-30B-A3B's) and shared by the MoE cases; expert by expert, without a float64 copy."""
    g = _gen(8)
    w1, w2 = torch.empty(e, 2 * i, h, dtype=torch.float16), torch.empty(e, h, i, dtype=torch.float16)
    for j in range(e):
        w1[j] = torch.randn(2 * i, h, generator=g) * h ** -0.5
        w2[j] = torch.randn(h, i, generator=g) * i ** -0.5
    return w1, w2


def _tiles(config: dict) -> str:
    short = {"BLOCK_SIZE_M": "BM", "BLOCK_SIZE_N": "BN", "BLOCK_SIZE_K": "BK", "GROUP_SIZE_M": "G",
             "num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short[k]}{v}" for k, v in config.items() if k in short)


class Moe(Case):
    """A Qwen3-30B-A3B MoE layer's experts from the router logits on (E = 128 experts, top-8, hidden 2048,
    expert FFN 768; fp16, since the interpreter computes no bf16): routing, the grouped gate/up and down
    GEMMs, the combine, at T = 16 and 64 tokens (decode) and, with ``--moe-prefill``, 2048 (prefill: 6
    minutes for each of ours in the interpreter on a busy 2-core machine, 25 for vLLM's run).  Ours:
    ``route`` + ``moe_experts`` (fast/moe.py: _route, _count, _align, _gate_up with the SwiGLU fused, _down
    with the routing weights fused, _combine), in the default mode and with ``batch_invariant=True`` (one
    128 x 128 x 64 tile per phase, 128 rows per tile as on a GPU).  The
    peers (bench/peers.py), on the same x, logits and weights: vLLM's ``fused_experts_impl`` and SGLang's
    ``_fused_moe_kernel_sequence`` steps, with their routers' ``topk_softmax`` (renormalized, as
    Qwen3's norm_topk_prob) and tile configs, their CUDA ops emulated with their bytes.

    Routing: each token's logits are a random permutation of 128 evenly spaced values (1/16 apart, exact in
    fp16: no ties, so every implementation picks the same experts), a token's 8 experts uniform over the
    128: at T = 16 its 128 pairs touch about 82 experts (77 here), at T = 64 all but about 2, at T = 2048 all.  The
    IO bound reads every touched expert's weights once, whatever the batch."""

    def __init__(self, mods, tokens: int, *, experts: int = 128, top_k: int = 8, hidden: int = 2048, ffn: int = 768):
        self.mods, self.op, self.T = mods, "fwd", tokens
        self.E, self.K, self.H, self.I = experts, top_k, hidden, ffn
        self.impls = ("ours", "ours_invariant", "vllm_moe", "sglang_moe")
        self.name = f"moe T={tokens} E={experts} top-{top_k} H={hidden} I={ffn}"
        self.short = f"MoE {'decode' if tokens <= 64 else 'prefill'}\nT={tokens}"
        g = _gen(9)
        self.x = _randn(tokens, hidden, gen=g)
        spaced = (torch.arange(experts, dtype=torch.float32) - experts // 2) / 16                  # [E]
        self.logits = spaced[torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)].half()  # [T, E]
        self.touched = torch.topk(self.logits.float(), top_k, dim=1).indices.unique().numel()
        e = self.x.element_size()
        self.bound = (self.touched * 3 * ffn * hidden * e + 2 * tokens * hidden * e + tokens * experts * e
                      + tokens * top_k * (4 + 4))
        self.formula = (f"read x, the router logits and every touched expert's W1 [2I, H] and W2 [H, I] once, write "
                        f"out and the routing (int32 ids, fp32 weights) once: n_touched 3 I H e + 2 T H e + T E e + "
                        f"8 T k (n_touched the experts chosen at least once: {self.touched} of {experts} here)")
        self.useful = 6 * tokens * top_k * hidden * ffn
        self.useful_formula = "6 T k H I: x W1^T (2I columns) and a W2^T for each (token, expert) pair"
        self.output_names = ["out"]
        self.rtol = 1e-2
        self.kernels = {"ours": "route + moe_experts (_route, _count, _align, _gate_up + SwiGLU, _down + weights, "
                                "_combine)",
                        "ours_invariant": "route + moe_experts(batch_invariant=True) (128 x 128 x 64 tiles)",
                        "vllm_moe": "fused_experts_impl (fused_moe_kernel x 2)",
                        "sglang_moe": "invoke_fused_moe_kernel x 2"}

    @property
    def weights(self):
        return _expert_weights(self.E, self.H, self.I)

    def _ours(self, observed, invariant: bool):
        moe = self.mods["moe"]
        w1, w2 = self.weights
        with observed():
            weights, ids = moe.route(self.logits, self.K)
            out = moe.moe_experts(self.x, weights, ids, w1, w2, batch_invariant=invariant)
        return [out]

    def ours(self, observed):
        return self._ours(observed, False)

    def ours_invariant(self, observed):
        return self._ours(observed, True)

    def vllm_moe(self, observed):
        """vLLM's Triton fused MoE as its unquantized layer calls it (fused_experts_impl, SiLU)."""
        import peers
        fm = self.mods["peers"]["vllm"]["vllm.model_executor.layers.fused_moe.fused_moe"]
        w1, w2 = self.weights
        config = fm.try_get_optimal_moe_config(w1.shape, w2.shape, self.K, None, self.T)   # what it will take
        source = ("its H100 JSON" if fm.get_moe_configs(self.E, self.I, None) else
                  f"get_default_config: the wheel has no H100 JSON for E={self.E},N={self.I}")
        self.kernels["vllm_moe"] = f"fused_experts_impl, fused_moe_kernel x 2 ({_tiles(config)}; {source})"
        with observed():
            weights, ids = peers.topk_softmax("vLLM", self.logits, self.K, expert_indices=True)
            out = fm.fused_experts_impl(self.x, w1, w2, weights, ids, activation="silu")
        return [out]

    def sglang_moe(self, observed):
        """SGLang's Triton MoE: the steps of its _fused_moe_kernel_sequence on CUDA, not in place, no hooks, no
        TMA (its H100 configs ask for none): align, gate/up GEMM, silu_and_mul (reading the pairs' expert ids,
        its row filter), down GEMM with the routing weights, combine (moe_sum_reduce_triton at <= 32 tokens
        with PDL, sgl_kernel's moe_sum_reduce above)."""
        import triton.language as tl

        import peers
        mods = self.mods["peers"]["sglang"]
        kern = mods["sglang.kernels.ops.moe.fused_moe_triton_kernels"]
        utils = "sglang.srt.layers.moe.moe_runner.triton_utils"
        align, tuned = mods[f"{utils}.moe_align_block_size"], mods[f"{utils}.fused_moe_triton_config"]
        w1, w2 = self.weights
        t, k, h, i = self.T, self.K, self.H, self.I
        up, (down, _) = tuned.try_get_optimal_moe_config(w1.shape, w2.shape, k, None, t, return_down_config=True)
        up, down = dict(up), dict(down or up)
        if up.pop("USE_TMA", False) or down.pop("USE_TMA", False):
            raise NotImplementedError("SGLang's TMA MoE path (an fp8 one) is not in the report")
        files = sorted(Path(tuned.__file__).parent.glob(
            f"configs/triton_*/E={self.E},N={i},device_name={peers.H100_NAME.replace(' ', '_')}.json"))
        source = f"its {files[-1].parent.name} H100 JSONs" if files else "get_default_config"
        combine = "moe_sum_reduce_triton" if t <= 32 else "sgl_kernel moe_sum_reduce (emulated)"
        self.kernels["sglang_moe"] = (f"invoke_fused_moe_kernel x 2 (up {_tiles(up)}, down {_tiles(down)}; {source}) "
                                      f"+ {combine}")
        flags = dict(compute_type=tl.float16, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                     use_int4_w4a16=False, per_channel_quant=False)
        out = torch.empty_like(self.x)
        with observed():
            weights, ids = peers.topk_softmax("SGLang", self.logits, k)
            sorted_ids, expert_ids, post_pad = align.moe_align_block_size(ids, up["BLOCK_SIZE_M"], self.E)
            gate_up = torch.empty(t * k, 2 * i, dtype=self.x.dtype)                              # [T k, 2I]
            kern.invoke_fused_moe_kernel(self.x, w1, None, gate_up, None, None, None, weights, ids, sorted_ids,
                                         expert_ids, post_pad, False, k, up, **flags)
            act = torch.empty(t * k, i, dtype=self.x.dtype)                                      # [T k, I]
            peers.silu_and_mul("SGLang", act, gate_up, extra_reads=[ids])
            rows = torch.empty(t, k, h, dtype=self.x.dtype)                                      # [T, k, H]
            kern.invoke_fused_moe_kernel(act, w2, None, rows, None, None, None, weights, ids, sorted_ids,
                                         expert_ids, post_pad, True, 1, down, router_topk=k, **flags)
            if t <= 32:
                kern.moe_sum_reduce_triton(rows, out, 1.0)
            else:
                peers.moe_sum("SGLang", rows, out)
        return [out]


def make_cases(mods, quick: bool, moe_prefill: bool = False) -> list[Case]:
    cases = [GdnChunk(mods, "fwd"), GdnChunk(mods, "bwd"), GdnTrainer(mods), GdnDecode(mods),
             Prefill(mods, "fwd"), Prefill(mods, "bwd"), Decode(mods, 1024), Decode(mods, 8192), GrpoDecode(mods),
             Moe(mods, 16), Moe(mods, 64)]
    if moe_prefill:
        cases.append(Moe(mods, 2048))
    if not quick:
        cases.append(Decode(mods, 8192, paged=False))
    return cases


# ----------------------------------------------------------------------------- measuring

IMPLS = {"ours": "twofold", "ours_invariant": "twofold, batch_invariant=True", "ours_plain": "twofold, plain",
         "ours_recurrent": "twofold, recurrent form", "ours_captured": "twofold, capturable",
         "fla": f"fla-core {FLA_VERSION}",
         "vllm_3d": "vLLM 0.33.0", "vllm_2d": "vLLM 0.33.0", "vllm_2stage": "vLLM 0.33.0",
         "sglang_2stage": "SGLang 0.5.23", "sglang_extend": "SGLang 0.5.23",
         "vllm_moe": "vLLM 0.33.0", "sglang_moe": "SGLang 0.5.23"}
SHORT = {"ours": "twofold", "ours_invariant": "twofold, batch_invariant=True", "ours_plain": "twofold, plain",
         "ours_recurrent": "twofold, recurrent form", "ours_captured": "twofold, capturable",
         "vllm_3d": "vLLM unified_attention 3D", "vllm_2d": "vLLM unified_attention 2D",
         "vllm_2stage": "vLLM decode_attention_fwd 2-stage", "sglang_2stage": "SGLang decode_attention_fwd 2-stage",
         "sglang_extend": "SGLang extend_attention_fwd", "vllm_moe": "vLLM fused_moe (Triton)",
         "sglang_moe": "SGLang fused_moe_triton"}
PEER_OF = {"vllm_3d": "vllm", "vllm_2d": "vllm", "vllm_2stage": "vllm", "sglang_2stage": "sglang",
           "sglang_extend": "sglang", "vllm_moe": "vllm", "sglang_moe": "sglang"}


class Measured:
    """One case run by one implementation: its launches in order at the first config of every
    kernel (``first``), every distinct config's launch (``by_config``) and the configs each kernel's
    autotuner offers (``spaces``)."""

    def __init__(self):
        self.first: list = []
        self.by_config: OrderedDict = OrderedDict()    # (kernel, occurrence, config kwargs) -> Launch
        self.spaces: dict = {}
        self.outputs = None
        self.seconds = 0.0


def _config_of(record, space) -> tuple:
    if not space:
        return ()
    return tuple((k, record.constexprs.get(k)) for k in space[0].kwargs)


def measure(case: Case, impl: str) -> Measured:
    """Runs the case once per round (round r: each kernel's r-th distinct config) under the observatory."""
    import contextlib

    import peers
    from observatory import Launch, observe
    def run(observed):
        return case.run(impl, observed)
    m = Measured()
    t0 = time.perf_counter()
    rounds, r = 1, 0
    seen = []

    @contextlib.contextmanager
    def observed():                      # the case wraps the op it measures in this
        with observe(torch_ops=True) as obs:
            def compiled(name, read, write):    # a peer's CUDA op, emulated (bench/peers.py): a torch op row
                obs.launches.append(Launch(kernel=f"torch.{name}", module="torch", file="", read_bytes=read,
                                           write_bytes=write, unique_read_bytes=read, unique_write_bytes=write))
            peers.COMPILED_OP_HOOKS.append(compiled)
            try:
                yield obs
            finally:
                peers.COMPILED_OP_HOOKS.remove(compiled)
        seen.append(obs)
    while r < rounds:
        ROUND[0] = r
        SPACES.clear()
        seen.clear()
        outputs = run(observed)
        [obs] = seen
        m.spaces.update(SPACES)
        occurrence: dict = {}
        for rec in obs.launches:
            i = occurrence[rec.kernel] = occurrence.get(rec.kernel, -1) + 1
            key = (rec.kernel, i, _config_of(rec, SPACES.get(rec.kernel)))
            m.by_config.setdefault(key, rec)
            if r == 0:
                m.first.append(rec)
        if r == 0:
            m.outputs = outputs
            rounds = max([len(_distinct(space)) for space in SPACES.values()] + [1])
        r += 1
    m.seconds = time.perf_counter() - t0
    return m


# ----------------------------------------------------------------------------- the sm_90 builds

def _spec_key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


def variants(m: Measured):
    """Every kernel launch as it ran, in each warps / stages variant its autotuner offers for that
    config: (label, record, config or None, first, build spec); ``first`` marks the first config of
    the autotune space (the one the headline totals use)."""
    import triton.language as tl
    for (kernel, occurrence, config), rec in m.by_config.items():
        if rec.module == "torch":
            continue
        space = m.spaces.get(kernel) or []
        offered = [c for c in space if c.kwargs == dict(config)] or [None]
        first_kind = not space or space[0].kwargs == dict(config)
        dtypes = [k for k, v in rec.constexprs.items() if isinstance(v, tl.dtype)]    # the peers' compute_type
        for j, c in enumerate(offered):
            spec = rec.spec()
            if dtypes:                   # spec() writes a dtype's name; the build worker makes it a dtype again
                spec["dtype_constexprs"] = dtypes
            if c is not None:
                spec.update(num_warps=c.num_warps, num_stages=c.num_stages)
            label = kernel + (f"#{occurrence + 1}" if occurrence else "")
            yield label, rec, c, first_kind and j == 0, spec


def build_specs(measured: list[Measured], quick: bool) -> dict:
    """The sm_90 builds to make, by key (quick: each launch at its first config only)."""
    return {_spec_key(spec): spec for m in measured for _, _, _, first, spec in variants(m) if first or not quick}


def build_all(specs: dict, workers: int) -> dict:
    """Builds in ``workers`` processes without the interpreter; returns spec key -> aot result."""
    keys = list(specs)
    if not keys:
        return {}
    shards = [keys[i::workers] for i in range(workers)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def run(shard):
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "specs.json", Path(tmp) / "built.json"
            src.write_text(json.dumps([specs[k] for k in shard]))
            proc = subprocess.run([sys.executable, __file__, "--build-worker", str(src), str(dst)], env=env,
                                  capture_output=True, text=True, timeout=3000, cwd=ROOT)
            if proc.returncode != 0 or not dst.exists():
                raise RuntimeError(f"sm_90 build worker failed:\n{proc.stderr[-3000:]}")
            return dict(zip(shard, json.loads(dst.read_text())))
    with ThreadPoolExecutor(workers) as pool:
        results = {}
        for part in pool.map(run, [s for s in shards if s]):
            results.update(part)
    return results


def build_worker(src: str, dst: str):
    import triton.language as tl

    import aot_compile
    specs = json.loads(Path(src).read_text())
    for spec in specs:
        for name in spec.pop("dtype_constexprs", []):
            spec["constexprs"][name] = tl.dtype(spec["constexprs"][name])
    if any(spec["module"].split(".")[0] in ("vllm", "sglang") for spec in specs):
        import peers
        peers.install_shims()             # their kernel modules import by package name
    out = []
    for spec in specs:
        try:
            out.append(aot_compile.build_launch(spec))
        except Exception as e:  # a kernel that cannot be imported or built is reported, not fatal
            out.append(dict(ok=False, error=f"{type(e).__name__}: {str(e)[-500:]}"))
    Path(dst).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- rows and tables

def _config_label(rec, space, variant=None) -> str:
    parts = [f"{k}={v}" for k, v in _config_of(rec, space)]
    w, s = (variant.num_warps, variant.num_stages) if variant is not None else (rec.num_warps, rec.num_stages)
    return ",".join(parts + [f"w{w}", f"s{s}"])


def summarize(case: Case, m: Measured) -> dict:
    from observatory import H100
    issued = sum(r.issued_bytes for r in m.first)
    unique = sum(r.unique_bytes for r in m.first)
    flops = sum(r.dot_flops for r in m.first)
    glue = sum(r.issued_bytes for r in m.first if r.module == "torch")
    kernels = sum(r.module != "torch" for r in m.first)
    model = H100.total(m.first)
    return dict(issued=issued, unique=unique, bound=case.bound, flops=flops, useful=case.useful, glue=glue,
                launches=kernels, issued_over_bound=issued / case.bound, unique_over_bound=unique / case.bound,
                dot_over_useful=flops / case.useful, modeled_us=model["us"],
                modeled_us_torch_ops=model["torch_ops_us"], torch_ops=model["torch_ops"])


def kernel_rows(m: Measured, built: dict) -> list[dict]:
    """A row per (launch, config variant): traffic, FLOPs and the sm_90 build; the PyTorch ops between
    the kernels summed into one row."""
    from observatory import H100, Launch
    rows = []
    glue = [rec for rec in m.first if rec.module == "torch"]
    if glue:
        total = Launch(kernel=f"torch ops ({len(glue)})", module="torch", file="",
                       read_bytes=sum(r.read_bytes for r in glue), write_bytes=sum(r.write_bytes for r in glue),
                       unique_read_bytes=sum(r.unique_read_bytes for r in glue),
                       unique_write_bytes=sum(r.unique_write_bytes for r in glue))
        rows.append(dict(kernel=total.kernel, config=", ".join(sorted({r.kernel[6:] for r in glue})), first=True,
                         record=total, static=None, modeled=sum(H100.torch_op_us(r) for r in glue)))
    for label, rec, config, first, spec in variants(m):
        space = m.spaces.get(rec.kernel) or []
        rows.append(dict(kernel=label, config=_config_label(rec, space, config), first=first, record=rec,
                         static=built.get(_spec_key(spec)), modeled=H100.launch(rec)["us"]))
    return rows


def _mb(x) -> str:
    return f"{x / MB:.2f}"


def _static_cells(st) -> list[str]:
    if st is None:
        return ["", "", "", "", "", ""]
    if not st.get("ok") and st.get("reg") is None:
        return ["build failed", "", "", "", "", ""]
    spill = (st.get("local") or 0) + (st.get("stack") or 0)
    return [f"{st['reg']}" + (f" +{spill} B spill" if spill else ""), f"{st['shared'] / 1024:.1f}",
            f"{st.get('hgmma', 0)}/{st.get('hmma', 0)}", f"{st.get('sass', '')}",
            f"{st.get('blocks_per_sm', '')} ({st.get('limited_by', '')}) {st.get('occupancy', 0):.2f}",
            f"{st.get('waves', 0):.2f}"]


def summary_table(results) -> str:
    lines = ["| case | op | impl: what it ran | kernels | issued MB | of which torch ops | unique MB | IO bound MB | "
             "issued / bound | unique / bound | twofold's issued / this row's (kernels only) | dot / useful FLOPs | "
             "modeled us: kernels | torch ops: count, modeled us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, per_impl in results:
        ours = per_impl["ours"]["summary"]
        for impl, res in per_impl.items():
            if "missing" in res:
                lines.append(f"| {case.name} | {case.op} | {case.label(impl)} | {res['missing']} |" + " |" * 10)
                continue
            s = res["summary"]
            versus = "" if impl == "ours" else (f"{ours['issued'] / s['issued']:.2f}x "
                                                f"({(ours['issued'] - ours['glue']) / (s['issued'] - s['glue']):.2f}x)")
            dot = f"{s['dot_over_useful']:.2f}" if s["flops"] else "no dots"
            lines.append(f"| {case.name} | {case.op} | {case.label(impl)} | {s['launches']} | {_mb(s['issued'])} | "
                         f"{_mb(s['glue'])} | {_mb(s['unique'])} | {_mb(s['bound'])} | {s['issued_over_bound']:.2f} | "
                         f"{s['unique_over_bound']:.2f} | {versus} | {dot} | {s['modeled_us']:.2f} | "
                         f"{s['torch_ops']}, {s['modeled_us_torch_ops']:.1f} |")
    return "\n".join(lines)


def _main_launch(res):
    """The launch that does the attention (the first kernel; the merge / reduce kernels come after)."""
    return next(row for row in res["kernels"] if row["first"] and row["record"].module != "torch")


def peer_table(results) -> str:
    """The attention cases side by side: issued / IO bound of every implementation, and the sm_90 build
    of its main kernel (the first it launches) with its programs and modelled waves."""
    attention = [(c, p) for c, p in results if isinstance(c, (Decode, Prefill)) and c.op == "fwd"]
    impls = [i for i in IMPLS if i != "fla" and any(i in p for _, p in attention)]
    labels = {i: SHORT[i] for i in impls}
    lines = ["| case | " + " | ".join(labels[i] for i in impls) + " |", "|---|" + "---|" * len(impls)]
    for case, per_impl in attention:
        traffic, build, modeled = [], [], []
        for i in impls:
            res = per_impl.get(i)
            if res is None:
                traffic.append("–")
                build.append("–")
                modeled.append("–")
            elif "missing" in res:
                traffic.append("not installed")
                build.append("")
                modeled.append("")
            else:
                traffic.append(f"{res['summary']['issued_over_bound']:.3f}")
                modeled.append(f"{res['summary']['modeled_us']:.2f} ({res['summary']['launches']})")
                row = _main_launch(res)
                st, rec = row["static"] or {}, row["record"]
                programs = rec.programs_run or 0
                build.append(f"{st.get('reg', '?')} / {st.get('shared', 0) / 1024:.1f} / {st.get('sass', '?')} / "
                             f"{programs} ({programs / 132:.2f}; {st.get('waves', 0):.2f})" if st else "build failed")
        lines.append(f"| {case.name}: issued / IO bound | " + " | ".join(traffic) + " |")
        lines.append(f"| {case.name}: modeled us, kernels (launches) | " + " | ".join(modeled) + " |")
        lines.append(f"| {case.name}: {_main_launch(per_impl['ours'])['kernel']} and peers' main kernel, regs / "
                     f"smem KB / SASS / programs (per 132 SMs; modelled waves) | " + " | ".join(build) + " |")
    return "\n".join(lines)


def moe_table(results) -> str:
    """The MoE cases side by side: each implementation's bytes against the IO bound, its modelled time (its
    Triton kernels, then its other ops: PyTorch's and the peers' emulated CUDA ops) and the sm_90 builds of
    its two GEMMs (the launches with dots, in order: gate/up, then down)."""
    lines = ["| case | impl: what it ran | issued MB | unique MB | IO bound MB | issued / bound | unique / bound | "
             "issued / twofold's | modeled us: Triton kernels (launches) + other ops (count) | gate/up GEMM: regs, "
             "spill B, smem KB, programs | down GEMM: the same |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, per_impl in results:
        if not isinstance(case, Moe):
            continue
        ours = per_impl["ours"]["summary"]["issued"]
        for impl, res in per_impl.items():
            if "missing" in res:
                lines.append(f"| {case.name} | {case.label(impl)} | {res['missing']} |" + " |" * 8)
                continue
            s = res["summary"]
            gemms = [row for row in res["kernels"] if row["first"] and row["record"].module != "torch"
                     and row["record"].dot_flops]
            builds = []
            for row in gemms[:2]:
                st = row["static"] or {}
                spill = (st.get("local") or 0) + (st.get("stack") or 0)
                builds.append(f"{row['kernel']}: {st.get('reg', '?')}, {spill}, {st.get('shared', 0) / 1024:.1f}, "
                              f"{row['record'].programs_run}" if st.get("reg") is not None else "build failed")
            builds += [""] * (2 - len(builds))
            lines.append(f"| {case.name} | {case.label(impl)} | {_mb(s['issued'])} | {_mb(s['unique'])} | "
                         f"{_mb(s['bound'])} | {s['issued_over_bound']:.3f} | {s['unique_over_bound']:.3f} | "
                         f"{s['issued'] / ours:.3f} | {s['modeled_us']:.1f} ({s['launches']}) + "
                         f"{s['modeled_us_torch_ops']:.1f} ({s['torch_ops']}) | {builds[0]} | {builds[1]} |")
    return "\n".join(lines)


def kernel_table(results, *, first_only: bool) -> str:
    lines = ["| case | op | impl | kernel | config | programs | issued MB | unique MB | busiest program KB | "
             "modeled us | dot GFLOP | regs | smem KB | HGMMA/HMMA | SASS | blocks/SM (limit) occupancy | waves |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, per_impl in results:
        for impl, res in per_impl.items():
            for row in res.get("kernels", []):
                if first_only and not row["first"]:
                    continue
                rec = row["record"]
                torch_row = rec.module == "torch"
                cells = [case.name, case.op, IMPLS[impl], row["kernel"], row["config"],
                         "" if torch_row else f"{rec.programs_run}", _mb(rec.issued_bytes), _mb(rec.unique_bytes),
                         "" if torch_row else f"{max(rec.program_bytes.values(), default=0) / 1e3:.1f}",
                         f"{row['modeled']:.2f}", f"{rec.dot_flops / 1e9:.3f}", *_static_cells(row["static"])]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def record_rows(results, wall_s: float):
    import triton
    from harness import Recorder
    rec = Recorder("roofline")
    rec.stamp["device"] = "cpu-interpreter"
    import peers
    rec.stamp["triton"] = (f"{triton.__version__}; fla-core {FLA_VERSION}; "
                           + "; ".join(f"{p} {v}" for p, v in peers.VERSIONS.items()))
    for case, per_impl in results:
        label = f"{case.name} {case.op}"
        for impl, res in per_impl.items():
            if "missing" in res:
                rec.missing(label, case.label(impl), res["missing"])
                continue
            s = res["summary"]
            for metric, unit in (("issued", "B"), ("unique", "B"), ("bound", "B"), ("issued_over_bound", "x"),
                                 ("unique_over_bound", "x"), ("flops", "FLOP"), ("useful", "FLOP"),
                                 ("dot_over_useful", "x"), ("glue", "B"), ("launches", "count"),
                                 ("modeled_us", "us"), ("modeled_us_torch_ops", "us"), ("torch_ops", "count")):
                rec.add(label, case.label(impl), metric if metric not in ("flops", "glue") else
                        {"flops": "dot_flops", "glue": "torch_op_bytes"}[metric], s[metric], unit)
            for row in res["kernels"]:
                r = row["record"]
                name = f"{IMPLS[impl]}: {row['kernel']}" + (f" {{{row['config']}}}" if row["config"] else "")
                if row["first"] and r.module != "torch":
                    rec.add(label, name, "programs", r.programs_run, "count")
                for metric, value, unit in (("issued", r.issued_bytes, "B"), ("unique", r.unique_bytes, "B"),
                                            ("dot_flops", r.dot_flops, "FLOP"), ("modeled_us", row["modeled"], "us")):
                    rec.add(label, name, metric, value, unit)
                st = row["static"]
                if st and st.get("reg") is not None:
                    for metric in ("reg", "shared", "local", "hgmma", "hmma", "sass", "blocks_per_sm", "occupancy",
                                   "waves"):
                        rec.add(label, name, f"sm90_{metric}", st.get(metric), "")
    rec.add("make roofline", "all", "wall_time", wall_s, "s")
    return rec.save()


LEGEND = {
    "ours": "twofold",
    "ours_invariant": "twofold, batch_invariant=True",
    "ours_plain": "twofold, plain: n flash_decode rows where the cascade shares the prompt (GRPO decode)",
    "ours_recurrent": "twofold, recurrent form: fused_recurrent fwd + bwd (GDN trainer)",
    "ours_captured": "twofold, capturable: cascade_decode(capturable=True) as the engine's CUDA graph captures it "
                     "(GRPO decode: padded groups, an 8k-key table)",
    "fla": f"fla-core {FLA_VERSION}: chunk / fused_recurrent (GDN), parallel_attn (prefill), "
           "its naive decoding kernel (decode)",
    "vllm_3d": "vLLM 0.33.0 unified_attention, 3D path (16 segments)",
    "vllm_2d": "vLLM 0.33.0 unified_attention, 2D path",
    "vllm_2stage": "vLLM 0.33.0 decode_attention_fwd (2-stage decode)",
    "sglang_2stage": "SGLang 0.5.23 decode_attention_fwd (2-stage decode)",
    "sglang_extend": "SGLang 0.5.23 extend_attention_fwd (prefill)",
    "vllm_moe": "vLLM 0.33.0 fused_experts_impl (Triton fused_moe_kernel; MoE)",
    "sglang_moe": "SGLang 0.5.23 invoke_fused_moe_kernel (Triton; MoE)",
}


def plot(results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter
    impls = [i for i in IMPLS if any("summary" in p.get(i, {}) for _, p in results)]
    colors = dict(zip(impls, plt.get_cmap("tab20").colors))       # (11 implementations with the MoE peers)
    most = max(sum("summary" in r for r in p.values()) for _, p in results)
    width = 0.84 / most
    fig, ax = plt.subplots(figsize=(max(10, 1.7 * len(results)), 6.5))
    drawn = set()
    for i, (_, per_impl) in enumerate(results):
        present = [impl for impl in impls if "summary" in per_impl.get(impl, {})]
        for k, impl in enumerate(present):     # the case's bars side by side, centred on its tick
            x = i + width * (k - (len(present) - 1) / 2)
            y = per_impl[impl]["summary"]["issued_over_bound"]
            ax.bar(x, y, width, color=colors[impl], label=None if impl in drawn else LEGEND[impl])
            drawn.add(impl)
            ax.text(x, y * 1.03, f"{y:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([case.short for case, _ in results], fontsize=8)
    ax.set_xlabel("op at fixed shapes (fp16; GQA 8/2, D = 128, page 16 for attention; E = 128, top-8, H = 2048, "
                  "I = 768 for MoE)")
    ax.set_yscale("log")
    ticks = [1, 1.5, 2, 3, 5, 10, 20]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    top = max(r["summary"]["issued_over_bound"] for _, p in results for r in p.values() if "summary" in r)
    ax.set_ylim(0.9, top * 1.5)
    ax.set_ylabel("issued bytes / IO lower bound (log scale; lower is better)")
    ax.set_title("Bytes each op's kernels issue over the bytes it must move, lower is better "
                 "(Triton interpreter count; 1 = every byte once)", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda j: list(LEGEND.values()).index(labels[j]))
    ax.legend([handles[j] for j in order], [labels[j] for j in order], fontsize=7, ncol=2,
              loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)


def model_note() -> str:
    """The latency model and its constants, printed beside the tables."""
    from observatory import H100
    return ("modeled us: a latency model, not a measurement (parity/observatory.py): per kernel launch "
            f"{H100.launch_us:g} us + max(busiest SM's bytes / (HBM / SMs), unique / HBM + reread / L2), summed over "
            f"an op's kernels; the PyTorch ops between them priced apart ({H100.launch_us:g} us + bytes / HBM "
            f"each). Constants: {H100.describe()}; SMs, HBM and L2 size from NVIDIA's H100 SXM5 data sheet, "
            "L2 bandwidth and launch cost assumed.")


def readme_block(results, wall_s: float, quick: bool) -> str:
    import triton

    import peers
    formulas = OrderedDict()
    for case, _ in results:
        formulas.setdefault((case.name.split(" ")[0], case.op), (case.formula, case.useful_formula))
    versions = ", ".join(f"{p} {v}" for p, v in peers.VERSIONS.items())
    lines = [f"*Triton {triton.__version__} interpreter on CPU, fp16, sm_90 builds; fla-core {FLA_VERSION}, "
             f"{versions}; `make roofline` took {wall_s / 60:.1f} min{' (--quick)' if quick else ''}.*", "",
             "The attention ops beside the production Triton kernels (issued / IO bound, lower is better; then "
             "the main kernel's sm_90 build: registers / shared memory KB / SASS instructions / programs "
             "launched, as a fraction of 132 SMs and as modelled waves):", "",
             "*" + model_note() + "*", "",
             peer_table(results), "",
             "The MoE experts at a Qwen3-30B-A3B layer's shape (routing to combine, fp16; the 2048-token prefill "
             "only with --moe-prefill) beside vLLM's and SGLang's "
             "Triton MoE; their CUDA ops (routing top-k, align, SiLU-and-mul, the sum over k) are emulated and "
             "counted with the other ops (bench/peers.py):", "",
             moe_table(results), "",
             "Every op, every implementation (the impl column names the kernel it ran):", "",
             summary_table(results), "",
             "IO lower bounds (e bytes per element, 2 in fp16; T tokens, H / HV query-key / value heads, "
             "K / V their head dims, N sequences, B batch, L keys per sequence, D head dim, H_q / H_kv "
             "query / KV heads) and useful FLOPs:", ""]
    for (family, op), (formula, useful) in formulas.items():
        lines.append(f"- {family} {op}: {formula}; useful FLOPs: {useful}.")
    lines += ["", "![issued bytes over the IO bound, every implementation](results/roofline.png)", "",
              "<details><summary>Every kernel launch at its first config, with its sm_90 build "
              "(occupancy and waves modelled)</summary>", "", kernel_table(results, first_only=True), "",
              "</details>", "",
              "<details><summary>Every config of every autotuned kernel</summary>", "",
              kernel_table(results, first_only=False), "", "</details>"]
    return "\n".join(lines)


def update_readme(block: str):
    text = BENCH_README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"bench/README.md lacks the markers {BEGIN} ... {END}")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    BENCH_README.write_text(before + BEGIN + "\n" + block + "\n" + END + after)


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="append the CSV rows, draw the plot, update the README")
    ap.add_argument("--quick", action="store_true", help="build only each kernel's first config for sm_90")
    ap.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                    help="processes building for sm_90")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this (not with --record)")
    ap.add_argument("--moe-prefill", action="store_true",
                    help="add the 2048-token MoE prefill case (over an hour in the interpreter)")
    args = ap.parse_args(argv)
    if args.only and args.record:
        ap.error("--record writes the full report: run every case")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    mods = install_shims()
    cases = [c for c in make_cases(mods, args.quick, args.moe_prefill) if args.only in f"{c.name} {c.op}"]
    measured = []
    for case in cases:
        per_impl = OrderedDict()
        for impl in case.impls:
            peer = PEER_OF.get(impl)
            if peer is not None and isinstance(mods["peers"][peer], str):
                per_impl[impl] = dict(missing=mods["peers"][peer])
                print(f"{case.name} {case.op}: {case.label(impl)}: {mods['peers'][peer]}", flush=True)
                continue
            m = measure(case, impl)
            per_impl[impl] = dict(measured=m)
            measured.append(m)
            check = "" if impl == "ours" else "; rel. err. vs twofold: " + case.outputs_match(
                per_impl["ours"]["measured"].outputs, m.outputs, impl)
            print(f"{case.name} {case.op}: {case.label(impl)}: {m.seconds:.0f} s{check}", flush=True)
        case.per_impl = per_impl
    specs = build_specs(measured, args.quick)
    t1 = time.perf_counter()
    built = build_all(specs, args.workers)
    print(f"{len(specs)} sm_90 builds in {time.perf_counter() - t1:.0f} s", flush=True)
    results = []
    for case in cases:
        for res in case.per_impl.values():
            if "measured" in res:
                res["summary"] = summarize(case, res["measured"])
                res["kernels"] = kernel_rows(res["measured"], built)
        results.append((case, case.per_impl))
    wall = time.perf_counter() - t0
    print()
    print(model_note())
    print()
    print(peer_table(results))
    print()
    print(moe_table(results))
    print()
    print(summary_table(results))
    print()
    print(kernel_table(results, first_only=False))
    print(f"\nmake roofline: {wall:.0f} s")
    if args.record:
        record_rows(results, wall)
        plot(results)
        update_readme(readme_block(results, wall, args.quick))
        print(f"wrote {PLOT.relative_to(ROOT)} and the kernel observatory tables of {BENCH_README.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    if BUILD_WORKER:
        build_worker(*sys.argv[sys.argv.index("--build-worker") + 1:][:2])
    else:
        sys.exit(main())
