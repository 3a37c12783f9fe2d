"""Timing, device ceilings, result rows and the command line, shared by the bench scripts
(never by ref/ or fast/).

Timing
    ``time_ms(fn)`` is ``triton.testing.do_bench`` (median over repetitions after warm-up,
    the L2 cache flushed before each repetition).  ``rotating(fn, inputs)`` cycles through
    several input sets so that no repetition finds its operands still in cache.  On a CPU
    ``time_ms`` falls back to a perf_counter median.

Ceilings
    ``device_ceilings()`` measures, once per process, what this device really does: the
    device-to-device copy bandwidth (GB/s, bytes read + bytes written) and the dense bf16
    matmul rate (TFLOP/s, 8192^3).  Every kernel row reports its fraction of one of them.

Rows
    ``Recorder(feature)`` collects long-format rows (one number per row: case, impl,
    metric, value, unit) stamped with device, torch, triton, git commit and date.
    ``Recorder.time`` times one implementation on one case and records it under fixed metric
    names: ``ms``, ``TFLOP/s`` and ``frac_bf16_peak`` (given its FLOPs), ``GB/s`` and
    ``frac_copy_bw`` (given its minimum bytes); ``Recorder.speedups`` then adds
    ``speedup_vs_<impl>`` to the fast row for every other implementation timed on that case.
    ``save()`` always writes the run to ``bench/results/latest/<feature>.csv`` (untracked);
    it appends to the committed ``bench/results/<feature>.csv`` only when recording was asked
    for (``--record`` or ``RECORD=1``), so a plain ``make bench`` leaves the tree unchanged.
    ``bench/report.py`` turns the committed CSVs into bench/README.md's tables and plots.

Command line
    ``run_bench(feature, doc, gpu=..., cpu=...)`` is every script's ``main``: the same flags
    everywhere (``--quick``, ``--no-save``, ``--record``, plus a script's own), the GPU body on
    CUDA, the CPU body otherwise (saying that kernel timings need CUDA), and the save.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import functools
import importlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LATEST = RESULTS / "latest"   # untracked: every run lands here; the committed CSVs only on --record
FIELDS = ["run_id", "date", "commit", "device", "torch", "triton", "feature", "case", "impl",
          "metric", "value", "unit"]

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def device_name() -> str:
    """The GPU's name, or the CPU's: its model name and core count, then (where /proc and /sys say) its family
    and model numbers, widest vector ISA and last-level cache.  (A virtual machine may name every generation
    "AMD EPYC": a Zen 1 with AVX2 and 8 MiB of L3 and a Zen 4 with AVX-512 and 32 MiB differ by 2-3x here.)"""
    if ON_GPU:
        return torch.cuda.get_device_name()
    cpu, fields = platform.processor() or platform.machine(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not line.strip():
                break                                   # the first processor's block is enough
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = fields.get("model name", cpu)
    details = []
    if "cpu family" in fields and "model" in fields:
        details.append(f"family {fields['cpu family']} model {fields['model']}")
    flags = fields.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "NEON" if "asimd" in flags else None
    if isa:
        details.append(isa)
    try:
        l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        details.append(f"L3 {l3}")
    except OSError:
        pass
    return f"CPU {cpu} x{os.cpu_count()}" + (f" ({', '.join(details)})" if details else "")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def triton_version() -> str:
    try:
        return importlib.import_module("triton").__version__
    except ImportError:
        return "missing"


def optional_import(name: str):
    """A peer library, or None.  Callers report a missing peer as missing, never fake it."""
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or a broken install raising anything else
        return None


# ----------------------------------------------------------------------------- timing

def time_ms(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()``."""
    if ON_GPU:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return cpu_time_ms(fn)


def cpu_time_ms(fn, *, min_reps: int = 5, budget_s: float = 2.0) -> float:
    """Median wall milliseconds on the CPU: at least ``min_reps`` runs, more while under budget."""
    fn()  # warm-up
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def rotating(fn, inputs: list):
    """A zero-argument callable that runs ``fn(*inputs[i])`` with ``i`` cycling, so operands
    are not left warm in cache by the previous repetition."""
    cycle = itertools.cycle(inputs)
    return lambda: fn(*next(cycle))


def copies_for_rotation(bytes_per_set: int, *, cache_bytes: int = 256 << 20, max_sets: int = 8) -> int:
    """How many input sets make the rotation exceed the cache (L2 is 50-60 MB on H100/H200)."""
    return max(1, min(max_sets, -(-cache_bytes // max(bytes_per_set, 1))))


@functools.lru_cache(maxsize=1)
def device_ceilings() -> dict:
    """Measured copy bandwidth (GB/s) and bf16 matmul rate (TFLOP/s) of this device."""
    if not ON_GPU:
        return {"copy_gbps": float("nan"), "bf16_tflops": float("nan")}
    n = 1 << 28  # 512 MiB of bf16 per side: far beyond L2
    src = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    copy_gbps = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    src = dst = None  # free 1 GiB before the matmul
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE)
    ms = time_ms(lambda: a @ b)
    tflops = 2 * m ** 3 / (ms * 1e-3) / 1e12
    return {"copy_gbps": copy_gbps, "bf16_tflops": tflops}


def peak_memory_mb(fn) -> float:
    """Peak allocated device memory during ``fn()``, in MiB (GPU only)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


# ----------------------------------------------------------------------------- rows

class Recorder:
    """Collects result rows for one feature; see the module docstring."""

    def __init__(self, feature: str, *, record: bool | None = None):
        self.feature = feature
        self.record = os.environ.get("RECORD", "0") == "1" if record is None else record
        self.stamp = dict(
            run_id=_dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S"),
            date=_dt.date.today().isoformat(), commit=git_commit(), device=device_name(),
            torch=torch.__version__, triton=triton_version(), feature=feature)
        self.rows: list[dict] = []
        self.timed: dict[tuple[str, str], float] = {}   # (case, impl) -> ms, for speedups and ratios

    def add(self, case: str, impl: str, metric: str, value, unit: str = ""):
        value = float(value) if value is not None else float("nan")
        self.rows.append(dict(self.stamp, case=case, impl=impl, metric=metric, value=f"{value:.6g}", unit=unit))
        print(f"  {case:<40} {impl:<24} {metric:<18} {value:>12.4g} {unit}", flush=True)

    def missing(self, case: str, impl: str, why: str):
        """A peer that is not installed: a row that says so, with no number."""
        self.rows.append(dict(self.stamp, case=case, impl=impl, metric="missing", value="nan", unit=why))
        print(f"  {case:<40} {impl:<24} missing: {why}", flush=True)

    def time(self, case: str, impl: str, fn, *, flops: float | None = None, nbytes: float | None = None,
             ceilings: dict | None = None, ms: float | None = None, **timing) -> float:
        """Time ``fn()`` (or take a measured ``ms``) and record ``ms`` plus the rates it implies:
        ``TFLOP/s`` (and ``frac_bf16_peak``) from ``flops``, ``GB/s`` (and ``frac_copy_bw``) from
        the minimum ``nbytes``.  ``timing`` goes to ``time_ms`` (warmup, rep)."""
        ms = time_ms(fn, **timing) if ms is None else ms
        self.timed[(case, impl)] = ms
        self.add(case, impl, "ms", ms, "ms")
        if flops is not None:
            tflops = flops / (ms * 1e-3) / 1e12
            self.add(case, impl, "TFLOP/s", tflops, "TFLOP/s")
            if ceilings:
                self.add(case, impl, "frac_bf16_peak", tflops / ceilings["bf16_tflops"], "fraction")
        if nbytes is not None:
            gbps = nbytes / (ms * 1e-3) / 1e9
            self.add(case, impl, "GB/s", gbps, "GB/s")
            if ceilings:
                self.add(case, impl, "frac_copy_bw", gbps / ceilings["copy_gbps"], "fraction")
        return ms

    def speedups(self, case: str, of: str = "fast"):
        """``speedup_vs_<impl>`` on ``of``'s row for every other implementation timed on ``case``."""
        mine = self.timed.get((case, of))
        if mine is None:
            return
        for (c, impl), ms in list(self.timed.items()):
            if c == case and impl != of:
                label = impl.split(" (")[0].replace(" ", "_")      # "fla 0.6.0 (q/k repeated)" -> fla_0.6.0
                self.add(case, of, "speedup_vs_" + label, ms / mine, "x")

    def save(self) -> Path:
        """The run to bench/results/latest/ always; appended to the committed CSV when recording."""
        LATEST.mkdir(parents=True, exist_ok=True)
        latest = LATEST / f"{self.feature}.csv"
        _write_rows(latest, self.rows, mode="w")
        print(f"wrote {len(self.rows)} rows to {latest.relative_to(ROOT)}")
        if not self.record:
            return latest
        path = RESULTS / f"{self.feature}.csv"
        _write_rows(path, self.rows, mode="a")
        print(f"recorded: appended {len(self.rows)} rows to {path.relative_to(ROOT)}")
        return path


def _write_rows(path: Path, rows: list[dict], mode: str):
    header = mode == "w" or not path.exists()
    with path.open(mode, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if header:
            writer.writeheader()
        writer.writerows(rows)


# ----------------------------------------------------------------------------- command line

def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every bench script takes."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few representative cases only")
    ap.add_argument("--no-save", action="store_true", help="print only; write no CSV at all")
    ap.add_argument("--record", action="store_true",
                    help="also append the rows to the committed bench/results/<feature>.csv (RECORD=1 does too)")
    return ap


def child_facts(proc, what: str) -> dict:
    """The facts a bench's child process printed (its last ``FACTS {json}`` line); a failed run raises with its
    output."""
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("FACTS ")]
    if proc.returncode or not line:
        raise RuntimeError(f"{what} failed:\n{proc.stdout[-3000:]}{(proc.stderr or '')[-3000:]}")
    return json.loads(line[-1][6:])


def run_bench(feature: str, doc: str, *, gpu, cpu, configure=None, argv=None) -> int:
    """A bench script's ``main``: parse the common flags (and ``configure(parser)``'s own), run
    ``gpu(rec, args)`` on CUDA or ``cpu(rec, args)`` elsewhere, save the rows (also when a case
    raised, so the rows before it are kept)."""
    ap = bench_parser(doc)
    if configure is not None:
        configure(ap)
    args = ap.parse_args(argv)
    rec = Recorder(feature, record=args.record or None)
    try:
        if ON_GPU:
            gpu(rec, args)
        else:
            print(f"No CUDA device: {feature}'s kernel timings need CUDA; running what a CPU can measure.")
            cpu(rec, args)
    finally:
        if not args.no_save and rec.rows:
            rec.save()
    return 0
