"""The batch-invariant mode's GPU builds, read without a GPU: does every phase run the same arithmetic?

A row's bits are the same in a trainer's forward, a prefill and a decode step only if the compiled
kernels compute it with the same floating-point instructions: the same MMA kind and shape (mma.sync
m16n8k16 is ``HMMA.16816``; the mode's 16-row groups keep it on sm_90 too, where a 64-row tile would take
wgmma, ``HGMMA.64xNx16``), the same FFMA / FADD / FMUL / MUFU work.  The mode sums a row through MMAs (the
row sums are a ones dot) and maxima only, so spreading the same rows over other warps (a prefill program's
SUB row groups, a warp each, against a decode program's one group over all its warps) changes no bits; the
code must still be the same.  This script builds, for sm_80 and sm_90, in bf16 (D = 64) and fp16 (D = 128),
the mode's launches through parity/aot_compile.py, disassembles each cubin with cuobjdump and counts its
floating-point instructions (``--arch 90``: sm_90's builds only), in groups whose launches must agree count
for count:
  * one row group a program: the varlen kernel's trainer (packed), prefill (paged) and one-sequence
    launches and the decode kernel's one-split launches (paged, contiguous): the same code, the same layout;
  * SUB row groups a program: the varlen kernel's trainer, prefill and one-sequence launches;
and a last group per arch and dtype whose launches must hold the same MMA instructions: all of the above
and the decode kernel's split launch (whose merge adds the fold's FP work).  Likewise the invariant matmul
at M = 1 (a constant), 37 and 64 rows, and fast/moe.py's expert GEMMs (gate_up, down) as its launcher
configures them in the mode for calls of 1, 37 and 2048 tokens; and fast/gated_deltanet.py's five
chunk-forward kernels in the mode, varlen builds (a trainer, a prefill) against dense ones (the engine's decode
step).  It prints one JSON object {group: {launch: {opcode: count}}}; a group whose name ends in "(MMA)" is
compared on its MMA opcodes only (parity/test_batch_invariant_attention.py asserts both).  Run without
``TRITON_INTERPRET`` (it needs the compiler).
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PARITY = Path(__file__).resolve().parent
sys.path.insert(0, str(PARITY))

import aot_compile as A  # noqa: E402  (pops TRITON_INTERPRET before triton is imported)
import torch  # noqa: E402

ROOT = PARITY.parent
# Floating-point and conversion opcodes: what decides a row's rounding.
# (MUFU.RCP is left out: integer division by a runtime value, such as a page size, compiles to it too.)
ARITHMETIC = re.compile(r"(FADD|FMUL|FFMA|FMNMX|MUFU\.EX2|MUFU\.LG2|HMMA|HGMMA|F2FP)[\w.]*$")


def sass_counts(case: dict, arch: int, cubins: list) -> dict:
    result = A.build(A.expand(case, True)[0], arch)
    if not result["ok"]:
        raise RuntimeError(f"{case['name']} does not build for sm_{arch}: {result}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubins[-1])
        f.flush()
        sass = subprocess.run([str(A.CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass)
    return dict(collections.Counter(op for op in ops if ARITHMETIC.match(op)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=(80, 90), action="append",
                        help="build for this arch only (repeatable; default 80 and 90)")
    archs = parser.parse_args(argv).arch or [80, 90]
    varlen = A._import(ROOT / "fast" / "paged_varlen_attention.py", "sass_varlen")
    decoding = A._import(ROOT / "fast" / "flash_decoding.py", "sass_decoding")
    model = A._import(ROOT / "fast" / "decoder_lm.py", "sass_decoder_lm")
    varlen_cases = A._import(PARITY / "aot_cases" / "paged_varlen_attention.py", "sass_varlen_cases")
    decoding_cases = A._import(PARITY / "aot_cases" / "flash_decoding.py", "sass_decoding_cases")
    model_cases = A._import(PARITY / "aot_cases" / "decoder_lm.py", "sass_decoder_lm_cases")
    gdn = A._import(ROOT / "fast" / "gated_deltanet.py", "sass_gdn")
    gdn_cases = A._import(PARITY / "aot_cases" / "gated_deltanet.py", "sass_gdn_cases")
    moe = A._import(ROOT / "fast" / "moe.py", "sass_moe")
    moe_cases = A._import(PARITY / "aot_cases" / "moe.py", "sass_moe_cases")
    A._resource_usage = lambda cubin, usage=A._resource_usage: _CUBINS.append(cubin) or usage(cubin)
    jobs = []
    for arch in archs:
        for dtype, d in ((torch.bfloat16, 64), (torch.float16, 128)):
            t = A.POINTER_TYPES[dtype]
            flags = dict(GROUP=4, HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_SINKS=False)
            packed, paged = dict(flags, IS_PAGED=False, HAS_SEQUSED=False), dict(flags, IS_PAGED=True, HAS_SEQUSED=True)
            sub = varlen._invariant_config(arch, d, 2)["SUB"]

            def varlen_launches(s):
                one = varlen_cases.invariant_case(varlen, arch, t, d, "one sequence", dict(paged, num_seqs=1), sub=s)
                return {
                    f"trainer: packed, causal (SUB={s})": varlen_cases.invariant_case(
                        varlen, arch, t, d, "packed", packed, sub=s),
                    f"prefill: paged chunks (SUB={s})": varlen_cases.invariant_case(
                        varlen, arch, t, d, "paged", paged, sub=s),
                    f"prefill: one sequence, num_seqs = 1 (SUB={s})": dict(
                        one, signature=dict(one["signature"], num_seqs="constexpr")),
                }
            group = f"attention sm_{arch} {t} D={d}"
            one_group = dict(varlen_launches(1), **{
                "decode: flash_decode, paged, one split": decoding_cases.invariant_decode_case(
                    decoding, dtype, d, 8, 2, 1, True, False, False, arch),
                "decode: flash_decode, contiguous, one split": decoding_cases.invariant_decode_case(
                    decoding, dtype, d, 8, 2, 1, False, False, False, arch)})
            jobs += [(f"{group}: one row group a program", label, case, arch) for label, case in one_group.items()]
            jobs += [(f"{group}: {sub} row groups a program", label, case, arch)
                     for label, case in varlen_launches(sub).items()]
            jobs.append((f"{group}: every launch (MMA)", "decode: flash_decode, paged, split (the fused merge)",
                         decoding_cases.invariant_decode_case(decoding, dtype, d, 8, 2, 1, True, True, False, arch),
                         arch))
        for dtype in (torch.bfloat16, torch.float32):
            launches = {f"M={rows}": model_cases._matmul_case(model, dtype, arch, rows, 512, 1536)
                        for rows in (1, 37, 64)}
            group = f"invariant matmul sm_{arch} {A.POINTER_TYPES[dtype]}"
            jobs += [(group, label, case, arch) for label, case in launches.items()]
            jobs += _moe_jobs(moe, moe_cases, dtype, arch)
        jobs += _gdn_jobs(gdn, gdn_cases, arch)
    # Two build processes (forked: the jobs are inherited, not pickled); a build is one core's work.
    _JOBS[:] = jobs
    with multiprocessing.get_context("fork").Pool(2) as pool:
        counts = pool.map(_count, range(len(jobs)))
    groups = {}
    for (group, label, _, _), ops in zip(jobs, counts):
        groups.setdefault(group, {})[label] = ops
    # The MMA group of each arch and dtype holds every attention launch of it.
    for name in [g for g in groups if g.endswith("(MMA)")]:
        prefix = name.removesuffix(": every launch (MMA)")
        for other in [g for g in groups if g.startswith(prefix + ":") and g != name]:
            groups[name].update({f"{other.removeprefix(prefix + ': ')}: {label}": ops
                                 for label, ops in groups[other].items()})
    print(json.dumps(groups))


def _moe_jobs(moe, moe_cases, dtype, arch: int) -> list:
    """The expert GEMMs in the mode as moe.py's launcher configures them for a call of T tokens (Qwen3-30B-A3B's
    layer: 128 experts, top 8), T = 1 (a decode step), 37 and 2048 (a prefill, a trainer's batch): the
    forward's gate_up (SwiGLU in the epilogue) and down (the routing weight in the epilogue)."""
    family = moe._family
    moe._family = lambda device: arch                      # the launcher's choice on a GPU of this arch
    try:
        tiles = {t: tuple(moe._tiles(torch.empty(t, 2048, dtype=dtype, device="meta"), 8 * t, 128, True))[:5]
                 for t in (1, 37, 2048)}
    finally:
        moe._family = family
    jobs = []
    for t, tile in tiles.items():
        for case in moe_cases._gemm_cases(moe, dtype, arch, tile):
            kernel = case["name"].split("[")[0]
            if (kernel, "qwen3" in case["name"]) in (("gate_up", True), ("down", False)):
                group = f"moe experts sm_{arch} {A.POINTER_TYPES[dtype]}: {kernel}"
                jobs.append((group, f"T={t}", case, arch))
    return jobs


def _gdn_jobs(gdn, gdn_cases, arch: int) -> list:
    """The Gated DeltaNet chunk forward in the mode (bf16, Qwen3.5's K = V = 128): each kernel's varlen build (a
    trainer's and a prefill's call) against its dense build (the engine's decode step: N whole chunks in one
    call, no cu_seqlens, so that a CUDA graph can capture it).  The builds differ in how a program finds its
    chunk (integer code); their floating-point work must be the same."""
    builds = {varlen: gdn_cases.invariant_forward_cases(gdn, torch.bfloat16, 128, 128, arch, varlen)
              for varlen in (True, False)}
    label = {True: "varlen (trainer, prefill)", False: "dense (decode step)"}
    return [(f"gated deltanet sm_{arch} bf16: {kernel}", label[varlen], case, arch)
            for varlen, cases in builds.items() for kernel, case in cases.items()]


_JOBS: list = []   # (group, launch label, case, arch), set before the pool forks
_CUBINS: list = []  # the cubins this process built (aot_compile's resource check hands each over)


def _count(i: int) -> dict:
    _, _, case, arch = _JOBS[i]
    return sass_counts(case, arch, _CUBINS)


if __name__ == "__main__":
    main()
