"""Measure how long `make TARGET` takes here and record it for `make help`'s figures.

    python parity/make_durations.py [--runs N] install lint demo report compile-check bench

Each target runs N times (default 1; the median is recorded, with every sample), as a user runs
it, from the repository root: ``install`` in a fresh virtual environment (``python3 -m venv DIR &&
. DIR/bin/activate && make install``), the others with the Python that runs this script.  The wall
times go to parity/make_durations.json with the date, the commit and the machine;
parity/test_make_help.py checks that every figure in `make help` is within 2x of them.  Measure on
the CI machine class (2 cores, no GPU), with nothing else of yours running.  `make parity` and
`make roofline` are not measured here (their figures are kept by hand).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "parity" / "make_durations.json"
TARGETS = ("install", "lint", "demo", "report", "compile-check", "bench")


def machine() -> str:
    """'2 cores, <CPU model>, no GPU': what the figures were measured on."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                 platform.processor())
    return f"{os.cpu_count()} cores, {model}, {'a GPU' if _has_gpu() else 'no GPU'}"


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def measure(target: str) -> float:
    """Wall seconds of one `make TARGET`; raises if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        if target == "install":
            cmd = ["bash", "-c", f"python3 -m venv {tmp}/venv && . {tmp}/venv/bin/activate && make install"]
            env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        else:
            cmd = ["make", target, f"PYTHON={sys.executable}"]
            env = dict(os.environ)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"make {target} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return seconds


def main(argv: list[str]) -> int:
    runs = 1
    if argv[:1] == ["--runs"]:
        runs, argv = int(argv[1]), argv[2:]
    targets = argv or list(TARGETS)
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise SystemExit(f"not measured here: {sorted(unknown)} (choose from {TARGETS})")
    table = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    for target in targets:
        samples = sorted(measure(target) for _ in range(runs))
        seconds = samples[len(samples) // 2]
        table[target] = dict(seconds=round(seconds, 1), samples=[round(x, 1) for x in samples],
                             date=datetime.date.today().isoformat(), commit=commit, machine=machine())
        print(f"make {target}: {seconds:.0f} s (samples {', '.join(f'{x:.0f}' for x in samples)})", flush=True)
        TABLE.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
