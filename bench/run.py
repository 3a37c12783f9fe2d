"""Run the benchmarks: ``make bench`` (all) or ``make bench FEATURE=name`` (one).

Each feature's script runs in its own interpreter (a crash or an out-of-memory in one does not
take the others down) and writes its rows to the untracked ``bench/results/latest/``; then this
prints the tables of the run.  Nothing tracked changes unless recording is asked for
(``make bench RECORD=1``): then the rows are appended to the committed
``bench/results/<feature>.csv`` and bench/README.md's tables and plots are regenerated.  Without CUDA
the scripts run what is meaningful on a CPU (reference speed, router and offload overheads) and
this also prints the latest GPU tables on record, because kernel speedups need CUDA.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FEATURES = ["paged_varlen_attention", "flash_decoding", "gated_deltanet", "view_replay_offload",
            "routed_generator", "decoder_lm", "moe", "weight_sync"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--feature", choices=FEATURES, help="run only this feature's benchmark")
    ap.add_argument("--record", action="store_true", help="append to the committed CSVs, regenerate bench/README.md")
    ap.add_argument("--quick", action="store_true", help="a few representative cases per feature")
    args, passed_on = ap.parse_known_args(argv)   # anything else goes to the feature scripts
    passed_on += ["--quick"] if args.quick else []
    record = args.record or os.environ.get("RECORD", "0") == "1"
    features = [args.feature] if args.feature else FEATURES
    failed = []
    for feature in features:
        print(f"== {feature}", flush=True)
        cmd = [sys.executable, str(ROOT / "bench" / f"{feature}.py"), *passed_on] + (["--record"] if record else [])
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failed.append(feature)
    report = [sys.executable, str(ROOT / "bench" / "report.py")]
    print("\n== this run's tables (bench/results/latest/)\n", flush=True)
    subprocess.run(report + ["--print", "--latest"] + [f"--feature={f}" for f in features], cwd=ROOT)
    if record:
        subprocess.run(report, cwd=ROOT)
    if not torch.cuda.is_available():
        print("\nNo CUDA device here: kernel speedups need CUDA. The latest GPU results on record:\n", flush=True)
        subprocess.run(report + ["--print", "--gpu-only"], cwd=ROOT)
    if failed:
        print(f"\nbenchmarks that failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
