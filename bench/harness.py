"""Timing, device ceilings and result rows, shared by the bench scripts (never by ref/ or fast/).

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
    metric, value, unit) stamped with device, torch, triton, git commit and date, and
    appends them to ``bench/results/<feature>.csv``.  ``bench/report.py`` turns the CSVs
    into the README tables.
"""
from __future__ import annotations

import csv
import datetime as _dt
import functools
import importlib
import itertools
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FIELDS = ["run_id", "date", "commit", "device", "torch", "triton", "feature", "case", "impl",
          "metric", "value", "unit"]

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def device_name() -> str:
    if ON_GPU:
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu} x{os.cpu_count()}"


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
    del src, dst
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
    """Collects result rows for one feature and appends them to its CSV."""

    def __init__(self, feature: str):
        self.feature = feature
        self.stamp = dict(
            run_id=_dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S"),
            date=_dt.date.today().isoformat(), commit=git_commit(), device=device_name(),
            torch=torch.__version__, triton=triton_version(), feature=feature)
        self.rows: list[dict] = []

    def add(self, case: str, impl: str, metric: str, value, unit: str = ""):
        value = float(value) if value is not None else float("nan")
        self.rows.append(dict(self.stamp, case=case, impl=impl, metric=metric, value=f"{value:.6g}", unit=unit))
        print(f"  {case:<40} {impl:<24} {metric:<18} {value:>12.4g} {unit}", flush=True)

    def missing(self, case: str, impl: str, why: str):
        """A peer that is not installed: a row that says so, with no number."""
        self.rows.append(dict(self.stamp, case=case, impl=impl, metric="missing", value="nan", unit=why))
        print(f"  {case:<40} {impl:<24} missing: {why}", flush=True)

    def save(self) -> Path:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{self.feature}.csv"
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(self.rows)
        print(f"appended {len(self.rows)} rows to {path.relative_to(ROOT)}")
        return path
