"""conftest.py's background jobs (what test_compile.py, test_bitwise_blas.py and test_numerics_blas.py start at
collection and read later) start under any test's memory use, the costliest first."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import BACKGROUND_NICE, background_process


def test_a_background_job_starts_beside_a_large_address_space():
    """What failed a CI run: a job started while the process held more untouched address space than the machine
    has memory (test_large_index.py's lazily backed tensors, 4-9 GB each) could not start its child: a fork()
    charges the child a copy of every private writable mapping, and the kernel's heuristic overcommit refuses
    one larger than memory and swap (ENOMEM).  conftest.background_process starts the child with vfork (no
    preexec_fn: its priority from nice(1)), which copies nothing."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2":
        pytest.skip("strict overcommit: the address space below cannot be reserved")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    swap = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("SwapTotal:"))
    held = []
    while sum(t.numel() for t in held) <= ram + swap:        # untouched: address space, no memory
        held.append(torch.empty(ram // 2, dtype=torch.uint8))
    try:
        result = background_process([sys.executable, "-c", "import os; print('started at nice', os.nice(0))"],
                                    timeout=60)
    finally:
        del held
    assert result["returncode"] == 0 and f"started at nice {BACKGROUND_NICE}" in result["log"], result


def test_queued_jobs_start_costliest_first(tmp_path, monkeypatch):
    """start_job queues; start_queued_jobs starts the queue by decreasing cost (equal costs in the order queued),
    each job's result in <dir>/<name>.json, a job that raised reported, not lost."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import conftest
    monkeypatch.setenv("TWOFOLD_BACKGROUND_DIR", str(tmp_path))
    pool = ThreadPoolExecutor(max_workers=1)                 # one at a time: the start order is the run order
    monkeypatch.setitem(conftest._BACKGROUND, "pool", pool)
    monkeypatch.setitem(conftest._BACKGROUND, "jobs", [])
    monkeypatch.setitem(conftest._BACKGROUND, "queued", [])
    started = []

    def job(name):
        started.append(name)
        if name == "raises":
            raise ValueError("no result")
        return dict(returncode=0, log=name)
    for name, cost in (("short", 1), ("raises", 50), ("long", 100), ("also-short", 1), ("free", 0)):
        conftest.start_job(name, lambda name=name: job(name), cost=cost)
    assert started == [] and not any(tmp_path.iterdir())     # queued only
    conftest.start_queued_jobs()
    for future in conftest._BACKGROUND["jobs"]:
        future.result(timeout=60)
    pool.shutdown()
    assert started == ["long", "raises", "short", "also-short", "free"]
    assert conftest.job_result("long", timeout=1) == dict(returncode=0, log="long")
    failed = json.loads((tmp_path / "raises.json").read_text())
    assert failed["returncode"] == -1 and "ValueError: no result" in failed["log"]
    assert conftest._BACKGROUND["queued"] == []
