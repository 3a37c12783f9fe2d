"""Ahead-of-time build of a fast/ file's Triton kernels for real GPUs, without a GPU.

    python parity/aot_compile.py fast/paged_varlen_attention.py [--arch 80 90] [--json out.json] [--shard I/N]
                                                                [--first-config]

What a fast file launches is listed in ``parity/aot_cases/<same name>.py``: its ``cases(m)``
reads the fast module ``m``'s private config tables (so the builds are the launches) and returns
one dict per launch shape::

    dict(kernel=<@triton.jit, or @triton.autotune / @triton.heuristics over one>,
         name="attn_fwd[fp16,D=128]",            # shown in reports
         signature={"q_ptr": "*fp16", "T": "i32", "stride": "i32:16", ...},
                                                  # the runtime (non-constexpr) arguments; ":16" marks
                                                  # an int the launch sees divisible by 16 (Triton
                                                  # specializes on that at run time, e.g. strides)
         constexprs={"HEAD_DIM": 128, ...},       # every constexpr not set by an autotune config
         num_warps=4, num_stages=2,               # only for kernels without autotune configs
         tensor_cores=True,                       # its dots must become mma (sm_80) / wgmma (sm_90)
         archs=[80, 90])                          # optional: the archs this case is launched on

An autotuned kernel is built once per config in its ``configs`` list (the configs it can
launch); a case may narrow that with ``configs=[...]``.  Pointers are assumed 16-byte
aligned, as PyTorch's allocator gives them.  Every build is checked for: it compiles;
no local memory or stack (register spills); shared memory within the arch's per-block
limit (a kernel over it compiles but cannot launch); tensor-core instructions where promised.
Registers and shared memory are reported so a reader sees what the kernel costs.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter replaces @triton.jit; we need the compiler
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# Opt-in dynamic shared memory per block: A100 (sm_80) 163 KB, H100/H200 (sm_90) 227 KB.
SMEM_LIMIT = {80: 166912, 90: 232448}


# For the case tables: Triton's names for tensor element types, and int arguments typed as a launch
# specializes them (1 becomes a constant, a multiple of 16 is marked so).
POINTER_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def int_signature(values: dict) -> tuple[dict, dict]:
    """Signature entries and constants for int arguments, specialized as a launch would be."""
    signature, constants = {}, {}
    for name, value in values.items():
        if value == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32:16" if value % 16 == 0 else "i32"
    return signature, constants


def _unwrap(kernel):
    """(JITFunction, autotune configs or None) under any autotune/heuristics wrappers."""
    configs = None
    while not isinstance(kernel, JITFunction):
        if hasattr(kernel, "configs") and configs is None:
            configs = list(kernel.configs)
        kernel = kernel.fn
    return kernel, configs


def _resource_usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    usage = {}
    for key in ("REG", "STACK", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", text)
        usage[key.lower()] = int(m.group(1)) if m else None
    return usage


def expand(case: dict, first_config_only: bool = False) -> list[dict]:
    """One build per autotune config (or the case's own launch options); with first_config_only,
    the first config of each case alone (every kernel and code path still builds, for CI)."""
    fn, configs = _unwrap(case["kernel"])
    configs = case.get("configs", configs)
    if configs and first_config_only:
        configs = configs[:1]
    if not configs:
        return [dict(fn=fn, case=case, constexprs=dict(case.get("constexprs", {})),
                     num_warps=case.get("num_warps", 4), num_stages=case.get("num_stages", 2),
                     label=case["name"])]
    builds = []
    for cfg in configs:
        constexprs = dict(case.get("constexprs", {}))
        constexprs.update(cfg.kwargs)
        label = case["name"] + "{" + ",".join(f"{k}={v}" for k, v in cfg.kwargs.items()) + \
            f",w{cfg.num_warps},s{cfg.num_stages}" + "}"
        builds.append(dict(fn=fn, case=case, constexprs=constexprs, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages, label=label))
    return builds


def build(b: dict, arch: int) -> dict:
    fn, case = b["fn"], b["case"]
    signature, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            if p.name not in b["constexprs"] and p.default is inspect.Parameter.empty:
                raise KeyError(f"constexpr {p.name!r} has no value in case {case['name']}")
            signature[p.name] = "constexpr"
        else:
            if p.name not in case["signature"]:
                raise KeyError(f"argument {p.name!r} has no type in case {case['name']}")
            ty, _, divisible = case["signature"][p.name].partition(":")
            signature[p.name] = ty
            if ty.startswith("*") or divisible == "16":
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {k: v for k, v in b["constexprs"].items() if k in signature}
    for p in fn.params:  # constexprs with defaults in the kernel signature
        if p.is_constexpr and p.name not in constexprs:
            constexprs[p.name] = p.default
    result = dict(label=b["label"], arch=arch, ok=False)
    t0 = time.time()
    try:
        src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": b["num_warps"], "num_stages": b["num_stages"]})
    except Exception as e:  # a build error is the finding
        result["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
        return result
    ptx = k.asm["ptx"]
    result.update(_resource_usage(k.asm["cubin"]))
    result["shared"] = k.metadata.shared  # dynamic shared memory the launch asks for, bytes
    result["seconds"] = round(time.time() - t0, 2)
    result["mma"] = bool(re.search(r"\bmma\.sync", ptx))
    result["wgmma"] = "wgmma.mma_async" in ptx
    problems = []
    if result.get("local") or result.get("stack"):
        problems.append(f"spills: local {result['local']} B, stack {result['stack']} B")
    if result["shared"] > SMEM_LIMIT.get(arch, SMEM_LIMIT[80]):
        problems.append(f"shared memory {result['shared']} B over the sm_{arch} limit {SMEM_LIMIT[arch]} B")
    if case.get("tensor_cores"):
        if arch >= 90 and case.get("wgmma", True) and not result["wgmma"]:
            problems.append("no wgmma on sm_90")
        elif arch < 90 and not result["mma"]:
            problems.append("no mma.sync on sm_80")
    result["problems"] = problems
    result["ok"] = not problems
    return result


CASES_DIR = Path(__file__).resolve().parent / "aot_cases"


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_cases(path: Path) -> list[dict]:
    """The build cases of fast file ``path``, from ``parity/aot_cases/<path.name>`` (none if absent)."""
    table = CASES_DIR / path.name
    if not table.exists():
        return []
    fast_module = _import(path, f"aot_{path.stem}")
    return list(_import(table, f"aot_cases_{path.stem}").cases(fast_module))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--first-config", action="store_true",
                    help="build each case with its first autotune config only (CI's quick tier)")
    ap.add_argument("--shard", default="0/1", help="I/N: build only every N-th build, starting at the I-th "
                                                    "(parallel processes split one file's builds)")
    ap.add_argument("--nice", type=int, default=0,
                    help="lower this process's priority by N (os.nice): builds that run beside the tests")
    args = ap.parse_args(argv)
    if args.nice and hasattr(os, "nice"):
        os.nice(args.nice)
    shard, num_shards = (int(x) for x in args.shard.split("/"))
    jobs = [(b, arch) for case in load_cases(Path(args.file)) for b in expand(case, args.first_config)
            for arch in [a for a in args.arch if a in case.get("archs", args.arch)]]
    results = []
    for b, arch in jobs[shard::num_shards]:
        r = build(b, arch)
        results.append(r)
        status = "ok " if r["ok"] else "BAD"
        detail = r.get("error") or "; ".join(r.get("problems", []))
        print(f"{status} sm_{arch} {r['label']}: reg {r.get('reg')} smem {r.get('shared')} "
              f"mma {r.get('mma')} wgmma {r.get('wgmma')} {detail}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------- the observatory's static side
# parity/observatory.py records a launch as the interpreter ran it (kernel, specialization, warps,
# stages, grid); build_launch builds exactly that launch and reads what the GPU would get.

# H100 SXM per-SM limits (CUDA occupancy calculator, compute capability 9.0) and its SM count.
H100 = dict(sms=132, regs=65536, reg_unit=256, smem=233472, smem_unit=128, smem_reserved=1024,
            threads=2048, blocks=32, warps=64)


def sass_counts(cubin: bytes) -> dict:
    """Instructions in the SASS (``cuobjdump -sass``, the trailing NOP padding left out), and how many
    are tensor-core MMAs: HGMMA (Hopper's warpgroup MMA, wgmma) and HMMA (mma.sync)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, flags=re.M)
    while ops and ops[-1] == "NOP":     # alignment padding after the final branch, never executed
        ops.pop()
    return dict(sass=len(ops), hgmma=sum(op.startswith("HGMMA") for op in ops),
                hmma=sum(op.startswith("HMMA") for op in ops))


def occupancy(reg: int, shared: int, num_warps: int, programs: int, gpu: dict = H100) -> dict:
    """Modelled, not measured: resident blocks per SM from the per-SM limits (registers allocated
    per warp in units of 256, shared memory in units of 128 bytes plus 1 KB reserved per block,
    threads, blocks), the fraction of warp slots filled, and the waves of ``programs`` programs."""
    regs_per_warp = -(-max(reg, 1) * 32 // gpu["reg_unit"]) * gpu["reg_unit"]
    by_regs = gpu["regs"] // regs_per_warp // num_warps
    smem_per_block = -(-(shared + gpu["smem_reserved"]) // gpu["smem_unit"]) * gpu["smem_unit"]
    by_smem = gpu["smem"] // smem_per_block
    by_threads = gpu["threads"] // (32 * num_warps)
    blocks = min(gpu["blocks"], by_regs, by_smem, by_threads)
    limits = dict(registers=by_regs, shared=by_smem, threads=by_threads, blocks=gpu["blocks"])
    return dict(blocks_per_sm=blocks, occupancy=blocks * num_warps / gpu["warps"],
                limited_by=min(limits, key=limits.get),
                waves=programs / (blocks * gpu["sms"]) if blocks else float("inf"))


def _kernel(spec: dict):
    """The @triton.jit function a recorded launch ran (importable by module name, else by file)."""
    try:
        mod = importlib.import_module(spec["module"])
    except ImportError:
        loader = importlib.util.spec_from_file_location(f"observed_{Path(spec['file']).stem}", spec["file"])
        mod = importlib.util.module_from_spec(loader)
        sys.modules[loader.name] = mod
        loader.loader.exec_module(mod)
    fn, _ = _unwrap(getattr(mod, spec["kernel"]))
    return fn


def build_launch(spec: dict, arch: int = 90) -> dict:
    """Build one recorded launch (observatory ``Launch.spec()``) for ``arch``: ``build``'s figures
    (registers, spills, shared memory, mma / wgmma in the PTX) plus SASS counts and modelled
    occupancy and waves."""
    label = spec["kernel"] + "{" + ",".join(f"{k}={v}" for k, v in spec["constexprs"].items()) + "}"
    b = dict(fn=_kernel(spec), case=dict(name=label, signature=spec["signature"]), constexprs=spec["constexprs"],
             num_warps=spec["num_warps"], num_stages=spec["num_stages"], label=label)
    compiled = []
    real_compile = triton.compile

    def keep(*args, **kwargs):          # build() compiles once; keep the kernel for its SASS
        compiled.append(real_compile(*args, **kwargs))
        return compiled[-1]
    triton.compile = keep
    try:
        result = build(b, arch)
    finally:
        triton.compile = real_compile
    if compiled and result.get("reg") is not None:
        result.update(sass_counts(compiled[-1].asm["cubin"]))
        result.update(occupancy(result["reg"], result["shared"], spec["num_warps"], spec.get("programs", 0)))
    return result
