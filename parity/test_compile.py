"""Every Triton kernel in fast/ builds for real GPUs (sm_80 and sm_90), without a GPU.

The interpreter accepts code that the GPU compiler rejects (or compiles into something that
spills registers to local memory), so each fast/ file's launches, listed in
``parity/aot_cases/<same name>.py``, are built ahead of time by ``parity/aot_compile.py`` in a separate
interpreter (the Triton interpreter, switched on for the other tests, replaces ``@triton.jit`` and
cannot compile).
A case fails on a build error, on any local memory / stack (spills), and, for kernels that
promise tensor cores, on PTX without ``mma.sync`` (sm_80) or ``wgmma`` (sm_90).
"""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import BACKGROUND_NICE, background_process, job_result, start_job

ROOT = Path(__file__).resolve().parents[1]
FAST_FILES = sorted(ROOT / "fast" / p.name for p in (ROOT / "parity" / "aot_cases").glob("*.py"))


# Each file's builds are split over SHARDS processes, all run side by side on the machine's cores:
# compiling is CPU-bound and single-threaded, and one large file alone would otherwise keep a
# single core busy long after the others finished.  conftest.py starts them when the session is
# collected and moves these tests last, so the builds overlap the interpreter tests.  Each process costs ~3 CPU s
# before its first build (Python, torch and triton imported, the cases loaded): two shards a file where two cores
# run them (the 20 processes of four were ~60 CPU s of a 2-core make parity's), four on larger machines.
SHARDS = 4 if (os.cpu_count() or 1) > 2 else 2
# Every config of every case with TWOFOLD_COMPILE_ALL=1 (`make compile-check`); otherwise (CI's
# `make parity`) every case, i.e. every kernel, code path, dtype, head-dim class and arch, with its
# first config, which keeps CI within its time budget.
COMPILE_ALL = os.environ.get("TWOFOLD_COMPILE_ALL", "0") == "1"
# The builds yield to the tests: the interpreter tests are the run's critical path (one process, mostly
# one core), the builds fill what they leave idle.  Equal priority gave the tests 2/3 of a core while
# the builds lasted (a cold make parity: 12.9-14.2 min on 2 cores).  conftest.BACKGROUND_NICE.
_STARTED: list = []


ARCHS = (80, 90)


def _aot(path: Path, arch: int, shard: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, str(ROOT / "parity" / "aot_compile.py"), str(path), "--json", str(out),
               "--arch", str(arch), "--shard", f"{shard}/{SHARDS}", "--nice", str(BACKGROUND_NICE)]
        cmd += [] if COMPILE_ALL else ["--first-config"]
        run = background_process(cmd, env=env)
        results = json.loads(out.read_text()) if out.exists() else []
    return dict(returncode=run["returncode"], log=run["log"], results=results)


def _selected(items) -> list:
    """The (file, arch) builds the selected tests of this file read (every one when ``items`` is None)."""
    if items is None:
        return [(path, arch) for path in FAST_FILES for arch in ARCHS]
    return [(item.callspec.params["path"], item.callspec.params["arch"]) for item in items]


def _job(path: Path, arch: int, shard: int) -> str:
    return f"aot-{path.stem}-sm{arch}-{shard}"


def start_builds(items=None):
    """Launch the selected tests' builds as background jobs (conftest.start_job; once per run)."""
    if not _STARTED:
        _STARTED.append(True)
        for path, arch in _selected(items):
            for shard in range(SHARDS):
                start_job(_job(path, arch, shard), functools.partial(_aot, path, arch, shard))


def aot_result(path: Path, arch: int) -> dict:
    """The builds of one file for one arch, its shards merged (waiting for them: conftest.py starts them when
    the session is collected)."""
    merged = dict(returncode=0, log="", results=[])
    for shard in range(SHARDS):
        part = job_result(_job(path, arch, shard), timeout=1800)
        merged["returncode"] |= part["returncode"]
        merged["log"] += part["log"]
        merged["results"] += part.get("results", [])
    return merged


# make parity builds for sm_90 (Hopper: wgmma, the tiles the kernels are tuned for); the sm_80 builds (Ampere:
# mma.sync, narrower tiles where sm_90's spill) run in make parity-all and make compile-check (conftest.SLOW).
@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("path", FAST_FILES, ids=lambda p: p.name)
def test_kernels_build_for_gpus(path, arch):
    r = aot_result(path, arch)
    print(r["log"])
    assert r["results"], f"{path.name}: no kernel was built\n{r['log'][-3000:]}"
    bad = [x for x in r["results"] if not x["ok"]]
    report = "\n".join(f"sm_{x['arch']} {x['label']}: {x.get('error') or '; '.join(x['problems'])}"
                       for x in bad)
    assert not bad and r["returncode"] == 0, f"{path.name}: {len(bad)} failing builds\n{report}\n{r['log'][-2000:]}"
    archs = {x["arch"] for x in r["results"]}
    assert archs == {arch}, f"{path.name}: built for {archs}, not sm_{arch}"
