"""The GPU kit (``make gpu-evidence``): every figure owed to a GPU, in parts that fit one lent machine.

    python bench/gpu_evidence.py              # on a CUDA machine: run the next pending parts, record them
    python bench/gpu_evidence.py --dry-run    # anywhere: list the parts, their CPU-side cost measured
                                              # now and their GPU time budget (make gpu-evidence DRY_RUN=1)
    python bench/gpu_evidence.py --part bitwise-gpu      # one part (again, even if it finished)
    python bench/gpu_evidence.py --restart    # forget the finished parts
    python bench/gpu_evidence.py --workers 0  # the test parts in one process (default: xdist workers)
    python bench/gpu_evidence.py --quick      # the benchmarks' quick grids (a loan of about 15 minutes)

A GPU is lent rarely, for 15 to 45 GPU-minutes at a time and at most 10 minutes per command.  So the
work is cut into parts of at most 9 minutes each (a part that runs past its limit is stopped and
recorded as failed), and one command runs pending parts in order until the next one's budget would
not fit in what is left of ``--window`` (9.5 minutes): run the same command again to go on.  A state
file (``bench/results/latest/gpu-evidence.json``, untracked) records each finished part with its
device, exit code and wall time; a part counts as finished only on the device of the current run,
so one set of figures never mixes GPUs.  The benchmark parts append their rows to
``bench/results/<feature>.csv`` (``--record``); the last part regenerates the tables and plots
(``bench/report.py``, as ``make report``).  Commit the CSVs and the regenerated files afterwards.

The test parts run on pytest-xdist workers where it is installed (``--workers``): the GPU idles while
Triton compiles each kernel config on one host core, so workers finish the parity files several times
sooner (the first lent H200: 568 tests in 272 s on 14 workers).  The benchmarks always run alone.

The parts, in the order of what a GPU still owes (``PARTS``): the bitwise GPU tier (the ``pytest -m gpu``
tests of parity/test_batch_invariant_*.py), the engine's GPU parity (its CUDA graphs among them) and its
decode and speculative benchmarks, then GPU parity of the kernels (on CUDA the parity tests run their full
grid, bf16 included), the kernel benchmarks against PyTorch / flash-attn / fla / FlashInfer where
installed (a missing peer is recorded as missing), the offload overhead, then the report.  The GPU
budgets are plans, not measurements: the state file keeps what each part really took.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / "bench" / "results" / "latest" / "gpu-evidence.json"
PART_LIMIT_S = 540          # 9 minutes: a part never runs longer
WINDOW_S = 570              # one command of a lent machine runs at most 10 minutes: keep a margin


@dataclasses.dataclass
class Part:
    name: str
    what: str
    argv: list                  # run from the repository root with this Python
    budget_s: int               # planned GPU seconds (<= PART_LIMIT_S)
    files: tuple = ()           # the test files or scripts it runs (for the dry run's CPU-side cost)


def _pytest(*args) -> list:
    return ["-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def _bench(feature: str) -> list:
    return [f"bench/{feature}.py", "--record"]


# In the order of what a GPU still owes, so that a short loan (15 minutes, ~11 of them usable: two
# commands) records that first: the bitwise GPU tier (never passed on a GPU: the first loan found its kernels
# did not build on Triton 3.6) and the engine's CUDA graphs (written, never replayed on a GPU) with their
# benchmarks; then the kernel parity grids and benchmarks, which the first loan (an H200, 2026-11-29) ran
# once; the report last.
PARTS = [
    Part("bitwise-gpu", "the bitwise GPU tier: pytest -m gpu of parity/test_batch_invariant_*.py",
         _pytest("-m", "gpu", "parity/test_batch_invariant_attention.py", "parity/test_batch_invariant_engine.py"),
         300, ("parity/test_batch_invariant_attention.py", "parity/test_batch_invariant_engine.py")),
    Part("parity-engine-offload", "GPU parity, the generator engine (eager and its CUDA graphs: decode, a group's "
         "cascade, speculative verification, the MTP head's drafts) and the activation offload",
         _pytest("parity/test_generator_engine.py", "parity/test_engine_compile.py",
                 "parity/test_speculative.py::test_gpu_speculation_replays_cuda_graphs",
                 "parity/test_mtp.py::test_gpu_mtp_drafts_replay_cuda_graphs",
                 "parity/test_view_replay_offload.py"), 300,
         ("parity/test_generator_engine.py", "parity/test_engine_compile.py", "parity/test_view_replay_offload.py")),
    Part("bench-engine", "benchmark: the engine's decode eager against CUDA graphs, Qwen3-0.6B-shaped, B = 1..64",
         [*_bench("decoder_lm"), "--part", "engine-compiled"], 100, ("bench/decoder_lm.py",)),
    Part("bench-speculative", "benchmark: speculative decoding against plain CUDA-graph decoding, Qwen3-0.6B-shaped, "
         "B = 1 and 16", [*_bench("decoder_lm"), "--part", "speculative"], 150, ("bench/decoder_lm.py",)),
    Part("parity-attention", "GPU parity, paged varlen attention forward and backward (full grid, bf16 too)",
         _pytest("parity/test_paged_varlen_attention.py", "parity/test_paged_varlen_attention_backward.py"), 420,
         ("parity/test_paged_varlen_attention.py", "parity/test_paged_varlen_attention_backward.py")),
    Part("parity-decode", "GPU parity, FlashDecoding (full grid, bf16 too)",
         _pytest("parity/test_flash_decoding.py"), 240, ("parity/test_flash_decoding.py",)),
    Part("parity-gdn", "GPU parity, Gated DeltaNet chunk, recurrent and backward (full grid, bf16 too)",
         _pytest("parity/test_gated_deltanet.py", "parity/test_gated_deltanet_backward.py"), 420,
         ("parity/test_gated_deltanet.py", "parity/test_gated_deltanet_backward.py")),
    Part("bench-prefill", "benchmark: paged varlen attention vs PyTorch varlen_attn / SDPA, flash-attn, FlashInfer",
         _bench("paged_varlen_attention"), 300, ("bench/paged_varlen_attention.py",)),
    Part("bench-decode", "benchmark: FlashDecoding vs PyTorch, flash-attn's kvcache kernel, FlashInfer",
         [*_bench("flash_decoding"), "--programs-per-sm", "2", "3", "4"], 240, ("bench/flash_decoding.py",)),
    Part("bench-gdn", "benchmark: Gated DeltaNet vs fla-core", _bench("gated_deltanet"), 300,
         ("bench/gated_deltanet.py",)),
    Part("bench-offload", "benchmark: the activation offload's overhead and memory saved",
         _bench("view_replay_offload"), 120, ("bench/view_replay_offload.py",)),
    Part("report", "regenerate the tables and plots from bench/results/*.csv (make report)",
         ["bench/report.py"], 20, ("bench/report.py",)),
]


# ----------------------------------------------------------------------------- state

def load_state() -> dict:
    return json.loads(STATE.read_text()) if STATE.exists() else {}


def save_state(state: dict):
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(state, indent=1, sort_keys=True))


def finished(state: dict, device: str) -> set:
    return {name for name, run in state.items() if run.get("rc") == 0 and run.get("device") == device}


# ----------------------------------------------------------------------------- the dry run

def cpu_side_cost(part: Part) -> tuple[float, str]:
    """What this part costs on the CPU before its first GPU kernel, measured now: reading and parsing
    its files (the test items it will collect, or the script it runs).  Returns (seconds, what)."""
    t0 = time.perf_counter()
    tests, lines = 0, 0
    for f in part.files:
        text = (ROOT / f).read_text()
        lines += text.count("\n")
        tree = ast.parse(text)
        tests += sum(isinstance(node, ast.FunctionDef) and node.name.startswith("test")
                     for node in ast.walk(tree))
    what = f"{tests} test functions" if part.argv[:2] == ["-m", "pytest"] else f"script of {lines} lines"
    return time.perf_counter() - t0, what


def dry_run(parts) -> int:
    done = load_state()
    total = 0
    print(f"{'part':<22} {'GPU budget':>10} {'CPU-side cost (measured now)':>30}  what")
    for part in parts:
        seconds, what = cpu_side_cost(part)
        total += part.budget_s
        state = done.get(part.name)
        mark = f" [finished on {state['device']}]" if state and state.get("rc") == 0 else ""
        print(f"{part.name:<22} {part.budget_s:>8} s {seconds * 1e3:>21.1f} ms ({what}){mark}  {part.what}")
        print(f"{'':<22} $ python {' '.join(part.argv)}")
    print(f"total GPU budget {total} s ({total / 60:.1f} min) in {len(parts)} parts of at most "
          f"{PART_LIMIT_S} s; one command runs parts for at most {WINDOW_S} s (run it again to go on)")
    return 0


# ----------------------------------------------------------------------------- the GPU run

def default_workers() -> int:
    """pytest-xdist workers for the test parts: Triton compiles each kernel config on the host, one core each,
    while the GPU idles; on the first lent H200 (16 cores) 14 workers ran 568 GPU parity tests in 272 s.  0
    without pytest-xdist or with fewer than 8 cores."""
    import importlib.util
    cores = os.cpu_count() or 1
    return min(14, cores - 2) if importlib.util.find_spec("xdist") and cores >= 8 else 0


def with_workers(argv: list, workers: int) -> list:
    """A test part's pytest command on ``workers`` xdist workers (benchmarks run alone: they time the GPU)."""
    return [*argv[:2], "-n", str(workers), *argv[2:]] if workers > 1 and argv[:2] == ["-m", "pytest"] else argv


def quick_argv(argv: list) -> list:
    """A benchmark part's command with its script's quick grid (``--quick``); a test part's as it is."""
    return [*argv, "--quick"] if argv[:2] != ["-m", "pytest"] and "--record" in argv else argv


def run(parts, *, window_s: int, force: bool, workers: int, quick: bool = False) -> int:
    import torch
    if not torch.cuda.is_available():
        print("make gpu-evidence needs a CUDA device (this machine has none); "
              "make gpu-evidence DRY_RUN=1 lists the parts and their budgets")
        return 2
    device = torch.cuda.get_device_name(0)
    state = load_state()
    done = set() if force else finished(state, device)
    pending = [p for p in parts if p.name not in done]
    if not pending:
        print(f"every part is finished on {device}: {STATE.relative_to(ROOT)} (--restart to run them again)")
        return 0
    start, failed = time.perf_counter(), []
    env = dict(os.environ, RECORD="1")
    for part in pending:
        left = window_s - (time.perf_counter() - start)
        if part.budget_s > left and part is not pending[0]:
            print(f"stopping before {part.name} (budget {part.budget_s} s, {left:.0f} s left in this command): "
                  f"run make gpu-evidence again to go on")
            break
        print(f"== {part.name}: {part.what} (budget {part.budget_s} s)", flush=True)
        t0 = time.perf_counter()
        argv = with_workers(quick_argv(part.argv) if quick else part.argv, workers)
        try:
            rc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, timeout=PART_LIMIT_S).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        wall = time.perf_counter() - t0
        state[part.name] = dict(device=device, rc=rc, wall_s=round(wall, 1), budget_s=part.budget_s,
                                date=time.strftime("%Y-%m-%dT%H:%M:%S"))
        save_state(state)
        print(f"== {part.name}: rc {rc} in {wall:.0f} s", flush=True)
        if rc != 0:
            failed.append(part.name)
    left = [p.name for p in parts if p.name not in finished(load_state(), device)]
    print(f"finished on {device}: {len(parts) - len(left)} of {len(parts)} parts"
          + (f"; pending or failed: {', '.join(left)}" if left else "; commit bench/results/ and the tables"))
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="list the parts, their CPU-side cost and GPU budget")
    ap.add_argument("--part", action="append", choices=[p.name for p in PARTS], help="run only this part")
    ap.add_argument("--restart", action="store_true", help="forget the finished parts")
    ap.add_argument("--window", type=int, default=WINDOW_S, help="seconds one command may run parts for")
    ap.add_argument("--quick", action="store_true",
                    help="the benchmarks' quick grids (--quick): for a loan of about 15 minutes")
    ap.add_argument("--workers", type=int, default=None,
                    help="pytest-xdist workers for the test parts (default: cores - 2, at most 14, where xdist is "
                         "installed; 0: one process)")
    args = ap.parse_args(argv)
    parts = [p for p in PARTS if not args.part or p.name in args.part]
    if args.dry_run:
        return dry_run(parts)
    if args.restart and STATE.exists():
        STATE.unlink()
    workers = default_workers() if args.workers is None else args.workers
    return run(parts, window_s=args.window, force=bool(args.part), workers=workers, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
