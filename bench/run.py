"""Run the benchmarks: ``make bench`` (all) or ``make bench FEATURE=name`` (one).

Each feature's script runs in its own interpreter (a crash or an out-of-memory in one does
not take the others down) and appends its rows to ``bench/results/<feature>.csv``; then the
README tables are regenerated.  Without CUDA the scripts run what is meaningful on a CPU
(reference speed, router and offload overheads) and this prints the latest GPU tables that
were recorded, because kernel speedups need CUDA.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FEATURES = ["paged_varlen_attention", "flash_decoding", "gated_deltanet", "view_replay_offload",
            "routed_generator"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--feature", choices=FEATURES, help="run only this feature's benchmark")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the feature script")
    args = ap.parse_args(argv)
    features = [args.feature] if args.feature else FEATURES
    failed = []
    for feature in features:
        script = ROOT / "bench" / f"{feature}.py"
        if not script.exists():
            print(f"== {feature}: no benchmark script yet ({script.relative_to(ROOT)})")
            continue
        print(f"== {feature}", flush=True)
        rc = subprocess.run([sys.executable, str(script), *args.args], cwd=ROOT).returncode
        if rc != 0:
            failed.append(feature)
    subprocess.run([sys.executable, str(ROOT / "bench" / "report.py")], cwd=ROOT)
    if not torch.cuda.is_available():
        print("\nNo CUDA device here: kernel speedups need CUDA. The latest GPU results on record:\n")
        subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--print", "--gpu-only"], cwd=ROOT)
    if failed:
        print(f"\nbenchmarks that failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
